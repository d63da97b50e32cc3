"""``match.http.hosts`` and ``paths``: a glob the middleware's host or canonical path can never match (a
port, a trailing dot; ``//``, a dot segment, a percent-escape, a query) is a load error."""

from __future__ import annotations

import pytest

from guard.asgi._target import canonical_path
from guard.errors import PolicyError
from guard.policy import load_text

POLICY = """\
policies:
  - id: p
    version: 1
    match:
      http:
        hosts: [api.example.com, {glob}]
    rules:
      - {{id: r, when: 'true', action: block}}
"""


@pytest.mark.parametrize(
    ("glob", "reason"),
    [
        ('"admin.example.com:8443"', "host glob 'admin.example.com:8443' holds a port"),
        ('"*.example.com:*"', "holds a port"),
        ('"[::1]:8080"', "holds a port"),
        ("admin.example.com.", "ends in a dot; hosts are matched without the trailing dot of a fully qualified name"),
        ('"https://api.example.com"', "is a URL; write its host alone: 'api.example.com'"),
        ('"exa mple.com"', "host glob 'exa mple.com' holds ' ', which no Host header holds"),
        ('"bücher.example"', "holds 'ü', which no Host header holds"),  # the xn-- form is what arrives
        ('"api.example.com/v1"', "holds '/'"),
    ],
)
def test_a_host_glob_that_can_never_match_is_refused(glob: str, reason: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_text(POLICY.format(glob=glob), "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", 6, "policies[0].match.http.hosts[1]")
    assert reason in caught.value.reason


@pytest.mark.parametrize("glob", ["'*.example.com'", "'[::1]'", "'::1'", "'10.0.0.1'", "'API.example.com'",
                                  "'xn--bcher-kva.example'", "'api-?.example.com'"])
def test_host_globs_without_port_load(glob: str) -> None:
    assert load_text(POLICY.format(glob=glob), "p.yaml")[0].http is not None


PATHS = """\
policies:
  - id: p
    version: 1
    match:
      http:
        paths: ["/v1/**", {glob}]
    rules:
      - {{id: r, when: 'true', action: block}}
"""


@pytest.mark.parametrize(
    ("glob", "reason"),
    [
        ('"/api//admin/**"', ("path glob '/api//admin/**' holds '//'; requests are matched with empty segments merged "
         "(/api//admin is judged as /api/admin), so it would never match: write '/api/admin/**'")),
        ('"//x"', "write '/x'"),
        ('"/files/./secret/**"', "holds the dot segment '.'; requests are matched with dot segments removed"),
        ('"/a/b/.."', "holds the dot segment '..'"),
        ('"/shop/caf%C3%A9/**"', "holds the percent-escape '%C3'; requests are matched on their decoded path"),
        ('"/shop/caf%c3%a9/**"', "write the character itself: '/shop/caf\u00e9/**'"),
        ('"/v1/items?op=delete"', "holds a query string ('?op'); a path glob matches the path only"),
        ('"/v1/*?q=*"', "holds a query string ('?q')"),
        ('"/search?q"', "holds a query string ('?q')"),  # matched /searchXq, never the query
        ('"/export?all"', "holds a query string ('?all')"),
        ('"/a?x&y=1"', "holds a query string ('?x')"),
        ('"/files/a%2Fb"', ("path glob '/files/a%2Fb' holds '%2F', an encoded slash; a request whose path holds it is "
                            "refused (400 invalid_target), so it would never match")),  # said: write '/files/a/b'
        ('"/a%5cb"', "holds '%5c', an encoded backslash; a request whose path holds it is refused"),
        ('"/caf%C3%A9/%00"', "holds '%00', an encoded control character"),
        ('"/a%3Fb"', "write the character itself: '/a?b' ('?' and '*' stay wildcards"),
        ("'/a\\b'", "holds '\\\\'; a request whose path holds it is refused (400 invalid_target)"),
        ('"/a\\tb"', "holds '\\t'"),
        ('"/a\\x7fb"', "holds '\\x7f'; a request whose path holds it is refused"),  # DEL
    ],
)
def test_a_path_glob_that_can_never_match_is_refused(glob: str, reason: str) -> None:
    """``check`` said ok for these, though the middleware matches the canonical path (decoded, ``//`` merged, dot
    segments removed: ``guard/asgi/_target.py``) and the query is no part of it."""
    with pytest.raises(PolicyError) as caught:
        load_text(PATHS.format(glob=glob), "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", 6, "policies[0].match.http.paths[1]")
    assert reason in caught.value.reason


@pytest.mark.parametrize(
    ("glob", "request_path"),
    [
        ("/files/?.txt", "/files/a.txt"),  # ? is one character
        ("/a/?=1", "/a/x=1"),  # ? followed by no name is no query
        ("/kv/*?=*", "/kv/ab=c"),
        ("/v?/chat", "/v1/chat"),
        ("/a?", "/a%3F"),  # a literal ? arrives as %3F and is matched decoded, by the wildcard
        ("/a;b/*", "/a%3Bb/x"),  # a literal ';' arrives as %3B and is matched decoded
        ("/page#top", "/page%23top"),
        ("/.well-known/*", "/.well-known/x"),
        ("/a/..b/**", "/a/..b/c"),
        ("/caf\u00e9/**", "/caf%C3%A9/x"),
        ("/100%", "/100%25"),
        ("/v1/chat/", "/v1/chat/"),
    ],
)
def test_path_globs_a_canonical_path_can_match_load(glob: str, request_path: str) -> None:
    (policy,) = load_text(PATHS.format(glob=f"'{glob}'"), "p.yaml")
    assert policy.http is not None and policy.http.paths is not None
    assert policy.http.paths.fullmatch(canonical_path(request_path).path)
