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
