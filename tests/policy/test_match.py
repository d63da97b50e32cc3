"""Matching: globs on method, path, host, headers and content type; events and tool names. Never the body."""

from __future__ import annotations

import re

import pytest

from guard.errors import PolicyError
from guard.policy import PolicySet, load_text
from guard.policy._match import _fullmatch, compile_glob
from guard.policy.loader import policy_subjects
from guard.subject import AgentSubject, HttpSubject

TEXT = """
policies:
  - id: api
    version: 1
    match:
      http:
        methods: [post, PUT]
        paths: ["/v1/*/chat", "/api/**"]
        hosts: ["*.example.com"]
        headers: {x-api-version: "2*", authorization: "*"}
        content_types: [application/json]
    questions: {q: {type: noul, instructions: q}}
  - id: agent
    version: 1
    match: {agent: {events: [tool_call], tools: ["fs_*", shell]}}
    questions: {q: {type: noul, instructions: q}}
  - id: any-model-output
    version: 1
    match: {agent: {events: [model_output]}}
    questions: {q: {type: noul, instructions: q}}
"""

OK_HEADERS = {"x-api-version": "2024-01", "authorization": "Bearer x"}


def http(**overrides: object) -> HttpSubject:
    fields: dict[str, object] = {"method": "POST", "path": "/v1/abc/chat", "host": "api.example.com",
                                 "headers": OK_HEADERS, "content_type": "application/json"}
    return HttpSubject(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def policies():  # type: ignore[no-untyped-def]
    from guard.policy import PolicySet

    return PolicySet(load_text(TEXT))


@pytest.mark.parametrize(
    ("overrides", "matched"),
    [
        ({}, True),
        ({"method": "GET"}, False),
        ({"path": "/v1/a/b/chat"}, False),  # * stays within one segment
        ({"path": "/api/a/b/c"}, True),  # ** crosses segments
        ({"host": "example.com"}, False),
        ({"host": "a.b.example.com"}, False),  # * stays within one label
        ({"headers": {"authorization": "x"}}, False),  # a required header is missing
        ({"headers": {**OK_HEADERS, "x-api-version": "1"}}, False),
        ({"content_type": "text/plain"}, False),
        ({"body": "anything at all"}, True),
    ],
)
def test_http_match(policies, overrides: dict[str, object], matched: bool) -> None:  # type: ignore[no-untyped-def]
    assert (policies.match(http(**overrides)) is not None) == matched


@pytest.mark.parametrize(
    ("content_types", "matched", "unmatched"),
    [
        ("[application/*]", ["application/json", "application/xml", "application/x-www-form-urlencoded"],
         ["text/plain", "multipart/form-data", ""]),
        ("['*/*']", ["application/json", "text/plain", "image/png", ""], []),  # "": no Content-Type, judged too
        ("[text/*, application/json]", ["text/plain", "text/csv", "application/json", "application/problem+json"],
         ["application/xml", "textual/x"]),
    ],
)  # fmt: skip
def test_a_media_range_matches_every_type_it_holds(content_types: str, matched: list[str],
                                                   unmatched: list[str]) -> None:
    """``application/*`` was accepted and matched no request: the media type was compared whole. ``*/*`` is ``[]``:
    it skipped a body sent without a ``Content-Type`` (a browser sniffs one; FastAPI parses it as JSON)."""
    text = ("policies:\n  - id: p\n    version: 1\n"
            f"    match: {{http: {{content_types: {content_types}, response: {{content_types: {content_types}}}}}}}\n"
            "    rules: [{id: r, when: 'true', action: block}]\n"
            "  - id: q\n    version: 1\n"
            f"    match: {{http: {{content_types: {content_types}}}}}\n"
            "    rules: [{id: r, when: 'true', action: block}]\n")
    response_policy, request_policy = load_text(text)
    assert request_policy.http is not None and response_policy.http is not None
    for media in matched:
        assert request_policy.http.matches(http(content_type=media)), media
        assert response_policy.http.matches(http(content_type=media, phase="response", status=200)), media
    for media in unmatched:
        assert not request_policy.http.matches(http(content_type=media)), media
        assert not response_policy.http.matches(http(content_type=media, phase="response", status=200)), media


@pytest.mark.parametrize("media", ["*/json", "app*/json", "application/*+json", "*", "application/json; q=1"])
def test_a_media_type_with_a_star_elsewhere_is_refused(media: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(f"policies:\n  - id: p\n    version: 1\n    match: {{http: {{content_types: ['{media}']}}}}\n"
                  "    rules: [{id: r, when: 'true', action: block}]\n", "p.yaml")
    assert (info.value.line, info.value.key) == (4, "policies[0].match.http.content_types[0]")
    assert info.value.reason == ("a media type is type/subtype without parameters (e.g. application/json), or a "
                                 f"range: type/* (e.g. text/*) or */*, got {media!r}")


def test_agent_match(policies) -> None:  # type: ignore[no-untyped-def]
    assert policies.match(AgentSubject(event="tool_call", tool_name="fs_write")).id == "agent"
    assert policies.match(AgentSubject(event="tool_call", tool_name="shell")).id == "agent"
    assert policies.match(AgentSubject(event="tool_call", tool_name="browser")) is None
    assert policies.match(AgentSubject(event="tool_call")) is None
    assert policies.match(AgentSubject(event="tool_result", tool_name="shell")) is None
    assert policies.match(AgentSubject(event="model_output", text="hi")).id == "any-model-output"


def test_glob() -> None:
    assert compile_glob("/a/*.json", "/").fullmatch("/a/x.json")
    assert not compile_glob("/a/?", "/").fullmatch("/a/xy")
    assert compile_glob("a.b+c", None).fullmatch("a.b+c") and not compile_glob("a.b+c", None).fullmatch("aXb+c")


def test_a_policy_for_get_matches_head() -> None:
    """Servers answer a HEAD with the GET handler (Starlette, FastAPI, Flask, Rails, Express; ``guard proxy``
    forwards it), so a policy listing GET judges HEAD too; one listing only HEAD or POST does not gain GET."""
    set_ = PolicySet(load_text("""
policies:
  - {id: gets, version: 1, match: {http: {methods: [get]}}, questions: {q: {type: noul, instructions: q}}}
  - {id: heads, version: 1, match: {http: {methods: [HEAD]}}, questions: {q: {type: noul, instructions: q}}}
  - {id: posts, version: 1, match: {http: {methods: [POST]}}, questions: {q: {type: noul, instructions: q}}}
"""))
    matched = {m: [p.id for p in set_.matching(http(method=m))] for m in ("GET", "HEAD", "POST")}
    assert matched == {"GET": ["gets"], "HEAD": ["gets", "heads"], "POST": ["posts"]}


def test_a_request_is_judged_by_every_policy_that_matches_one_of_its_path_views() -> None:
    """A policy whose glob matches only the path as sent (upper case) is not hidden by one that matches the
    lower-cased view: both decide, each once, in file order, and the subject keeps the first view matched."""
    view = PolicySet(load_text("""
policies:
  - {id: exact-admin, version: 1, match: {http: {paths: ["/V1/Admin/**"]}}, rules: [{id: b, when: 'true', action: block}]}
  - {id: general, version: 1, match: {http: {paths: ["/v1/**"]}}, rules: [{id: a, when: 'true', action: allow}]}
  - {id: both, version: 1, match: {http: {paths: ["/**"]}}, rules: [{id: a, when: 'true', action: allow}]}
""")).view()
    views = [http(path="/v1/admin/users"), http(path="/V1/Admin/users")]
    judged, found, own = view.matching_views(views)
    assert (judged.path, [p.id for p in found]) == ("/v1/admin/users", ["exact-admin", "general", "both"])
    assert {policy_id: subject.path for policy_id, subject in own.items()} == {"exact-admin": "/V1/Admin/users"}
    judged, found, own = view.matching_views([http(path="/v2/x")])
    assert (judged.path, [p.id for p in found], own) == ("/v2/x", ["both"], {})
    with pytest.raises(ValueError, match="at least one view"):
        view.matching_views([])


def test_each_policy_is_judged_on_the_first_view_it_matches_whatever_else_is_loaded() -> None:
    """A policy that matches only the path as sent was judged on the lower-cased view once any other policy (a
    catch-all) matched that view: adding an unrelated policy turned its block into an allow."""
    alone = PolicySet(load_text(_ADMIN_AS_SENT)).view()
    both = PolicySet(load_text(_ADMIN_AS_SENT + _CATCH_ALL)).view()
    views = [http(path="/admin/users", sent_path="/Admin/users"), http(path="/Admin/users")]
    for view in (alone, both):
        judged, found, own = view.matching_views(views)
        subjects = {p.id: own.get(p.id, judged) for p in found}
        assert subjects["r"].path == "/Admin/users"
        assert subjects["r"].sent_path == ""
    assert both.matching_views(views).subject.path == "/admin/users"  # the catch-all matched the first view
    with_body = policy_subjects(http(path="/admin/users", sent_path="/Admin/users", body={"a": 1}), own)
    assert [(k, s.path, s.sent_path, s.body) for k, s in with_body.items()] == [("r", "/Admin/users", "", {"a": 1})]


_ADMIN_AS_SENT = """
policies:
  - id: r
    version: 1
    match: {http: {paths: ["/Admin/**"]}}
    state: {route: path}
    rules: [{id: mixed, when: 'state.route.matches("^/Admin/")', action: block}]
"""
_CATCH_ALL = """
  - id: any
    version: 1
    match: {http: {}}
    rules: [{id: never, when: 'subject.path == "/nothing-here"', action: block}]
"""


@pytest.mark.parametrize(("glob", "separator", "text", "matched"), [
    ("/a/**", "/", "/a/b/c", True), ("/a/**", "/", "/a/", True), ("/a/**", "/", "/a", False),
    ("/a/*/c", "/", "/a/b/c", True), ("/a/*/c", "/", "/a/b/x/c", False), ("/a/*", "/", "/a/", True),
    ("/a/?", "/", "/a/é", True), ("/a/?", "/", "/a//", False), ("/a/**", "/", "/a/x\ny", True),  # ** crosses "\n"
    ("*.example.com", ".", "api.example.com", True), ("*.example.com", ".", "a.b.example.com", False),
    ("2*", None, "2024-01", True), ("*", None, "", True), ("a?c", None, "a.c", True), ("a?c", None, "a\nc", True),
    ("(x)[y]{1}$^|\\", None, "(x)[y]{1}$^|\\", True), ("a.b", None, "aXb", False), ("ü*", None, "über", True),
])  # fmt: skip
def test_glob_semantics(glob: str, separator: str | None, text: str, matched: bool) -> None:
    assert _fullmatch(compile_glob(glob, separator), text) is matched


def test_globs_match_in_linear_time() -> None:
    """``**`` compiled to ``.*`` for Python's ``re`` backtracked: ``/**/a/**/a/**/x`` took 9 s on a 4 KB path, and
    two 9.9 KB paths held a proxy's event loop 8 s. Globs with two or more wildcard runs (in any of a list's
    alternatives) are RE2 patterns; those with at most one, which cannot backtrack, stay in ``re``."""
    import re2

    re2_pattern = type(re2.compile(""))
    request, response = load_text("""
policies:
  - id: request
    version: 1
    match:
      http: {paths: ["/v1/**", "/**/a/**/a/**/x"], hosts: ["*.example.com"], headers: {x-v: "2*"}}
      agent: {tools: ["fs_*", "mcp_*_read_*"]}
    questions: {q: {type: noul, instructions: q}}
  - id: response
    version: 1
    match: {http: {response: {headers: {x-r: "text/*"}}}}
    questions: {q: {type: noul, instructions: q}}
""")
    several = [request.http.paths, request.agent.tools, compile_glob("/**/a/**", "/")]
    assert all(isinstance(pattern, re2_pattern) for pattern in several)
    at_most_one = [request.http.hosts, request.http.headers[0][1], response.http.response.headers[0][1],
                   compile_glob("/v1/**", "/"), compile_glob("/v1/health", "/")]
    assert all(isinstance(pattern, re.Pattern) for pattern in at_most_one)
    assert not request.http.matches(http(path="/a" * 2000 + "/b", host="x.example.com", headers={"x-v": "2"}))


def test_a_lone_surrogate_in_a_tool_name_is_matched_as_a_replacement_character() -> None:
    """RE2 reads UTF-8, which cannot hold a lone surrogate (a tool name decoded from JSON ``"\\ud800"`` may): it is
    read as U+FFFD, one character for one (a policy file cannot hold one: the loader refuses it)."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {agent: {events: [tool_call], tools: ["fs_?", "x*"]}}
    questions: {q: {type: noul, instructions: q}}
""")
    for name, matched in [("fs_\ud800", True), ("fs_\ud83d\ude00", False), ("x\ud800y", True), ("y\ud800", False)]:
        assert policy.agent.matches(AgentSubject(event="tool_call", tool_name=name)) is matched
