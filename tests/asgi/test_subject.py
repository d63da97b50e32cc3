"""The body-less subject policies match: the host a ``hosts:`` glob sees."""

from __future__ import annotations

import pytest

from guard.asgi._subject import head_subject, header_map


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("api.example.com", "api.example.com"),
        ("API.Example.com:8443", "api.example.com"),
        ("api.example.com.", "api.example.com"),  # the fully qualified form names the same host
        ("api.example.com.:443", "api.example.com"),
        ("[::1]:8080", "[::1]"),
        (None, "testserver"),
    ],
)
def test_host_is_the_header_without_port_or_trailing_dot(host: str | None, expected: str) -> None:
    headers = [(b"host", host.encode())] if host is not None else []
    scope = {"type": "http", "method": "post", "path": "/v1", "headers": headers, "server": ("TestServer", 80)}
    subject = head_subject(scope, header_map(scope), None)
    assert subject.host == expected and subject.method == "POST"


def test_header_map_lower_cases_names_and_joins_repeats() -> None:
    scope = {"headers": [(b"Host", b"api"), (b"X-Tag", b"a"), (b"x-tag", b"b"), (bytearray(b"X-Raw"), b"\xe9")]}
    expected = {"host": "api", "x-tag": "a, b", "x-raw": "\xe9"}  # latin-1, as ASGI defines
    assert header_map(scope) == expected and header_map(scope) == expected
    assert header_map({"headers": [(b"Host", b"api"), (b"X-Tag", b"a")]}) == {"host": "api", "x-tag": "a"}


def test_with_body_makes_a_new_subject_and_leaves_the_head_as_it_was() -> None:
    from guard.asgi._subject import with_body

    scope = {"type": "http", "method": "POST", "path": "/v1", "headers": [(b"host", b"api")], "server": ("api", 80)}
    head = head_subject(scope, header_map(scope), None)
    full = with_body(head, {"q": ["1"]}, {"prompt": "hi"}, "hi")
    assert (full.query, full.body, full.body_text) == ({"q": ["1"]}, {"prompt": "hi"}, "hi")
    assert (head.query, head.body, head.body_text) == ({}, None, "") and full is not head
