"""The body-less subject policies match: the host a ``hosts:`` glob sees."""

from __future__ import annotations

import pytest

from guard.asgi import _subject
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


def test_header_map_lower_cases_names_joins_repeats_and_bounds_its_name_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_subject, "_header_names", {})
    scope = {"headers": [(b"Host", b"api"), (b"X-Tag", b"a"), (b"x-tag", b"b"), (bytearray(b"X-Raw"), b"\xe9")]}
    expected = {"host": "api", "x-tag": "a, b", "x-raw": "\xe9"}  # latin-1, as ASGI defines
    assert header_map(scope) == expected and header_map(scope) == expected
    assert header_map({"headers": [(b"Host", b"api"), (b"X-Tag", b"a")]}) == {"host": "api", "x-tag": "a"}
    for n in range(3 * _subject.HEADER_NAMES_KEPT):  # made-up names: decoded all the same, never kept past the cap
        assert header_map({"headers": [(f"X-Made-Up-{n}".encode(), b"1")]}) == {f"x-made-up-{n}": "1"}
    assert len(_subject._header_names) == _subject.HEADER_NAMES_KEPT
