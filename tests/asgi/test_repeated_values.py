"""A query parameter, form field or header the policy reads as one value, sent twice, is refused (400): parsers
differ on which copy counts, so a string rule could compare a list or a joined value while the application reads
one copy. ``repeated: list`` (query, form) and ``repeated: join`` (header) read every copy on purpose."""

from __future__ import annotations

import asyncio
from urllib.parse import urlencode

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from guard import Guard
from guard.asgi import GuardMiddleware
from guard.asgi.limits import BodyLimits
from guard.backends.fixture import FixtureBackend
from guard.errors import PolicyError
from guard.policy.loader import load_text

POLICY = """
data: {banned: [mallory, eve]}
policies:
  - id: users
    version: 1
    match: {http: {}}
    state: {user: "query:user", form_user: "form:user", header_user: "header:x-user", tags: TAGS}
    rules:
      - {id: banned, when: 'state.user in data.banned', action: block}
      - {id: banned-form, when: 'state.form_user == "mallory"', action: block}
      - {id: banned-header, when: 'state.header_user == "mallory"', action: block}
      - {id: banned-rule-header, when: '"x-role" in subject.headers && subject.headers["x-role"] == "admin"',
         action: block}
      - {id: banned-tag, when: 'state.tags != null && "secret" in state.tags', action: block}
    on_error: {mode: open}
"""


async def _echo(request: Request) -> PlainTextResponse:
    form = await request.form() if request.method == "POST" else {}
    return PlainTextResponse(f"user={request.query_params.get('user')} form={form.get('user')}")


def _send(policy: str, *requests: dict) -> list[httpx.Response]:
    guard = Guard(load_text(policy), backends=FixtureBackend())
    app = Starlette(routes=[Route("/x", _echo, methods=["GET", "POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.request(**r) for r in requests]

    try:
        return asyncio.run(run())
    finally:
        guard.close()


FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.mark.parametrize(
    ("once", "twice", "field"),
    [
        ({"url": "/x?user=mallory"}, {"url": "/x?user=mallory&user=mallory"}, "query parameter 'user'"),
        ({"url": "/x?user=mallory"}, {"url": "/x?user=x&user=mallory"}, "query parameter 'user'"),
        ({"method": "POST", "content": "user=mallory", "headers": FORM},
         {"method": "POST", "content": "user=mallory&user=mallory", "headers": FORM}, "form field 'user'"),
        ({"headers": [("x-user", "mallory")]}, {"headers": [("x-user", "mallory"), ("x-user", "mallory")]},
         "header 'x-user'"),
        ({"headers": [("X-Role", "admin")]}, {"headers": [("X-Role", "admin"), ("x-role", "admin")]},
         "header 'x-role'"),
        ({"headers": [("x-user", "mallory")]}, {"headers": [("x-user", "alice"), ("x_user", "mallory")]},
         "header 'x-user'"),  # a WSGI app reads both as HTTP_X_USER
        ({"headers": [("x-user", "mallory")]}, {"headers": [("x_user", "mallory")]}, "header 'x-user'"),
    ],
)
def test_a_value_read_as_one_sent_twice_is_refused_not_allowed(once: dict, twice: dict, field: str) -> None:
    """Each was a 200 (the string rule compared a list or ``"mallory, mallory"``; the app read ``mallory``)."""
    base = {"method": "GET", "url": "/x"}
    blocked, refused = _send(POLICY.replace("TAGS", "'query:tag'"), base | once, base | twice)
    assert blocked.status_code == 403
    assert refused.status_code == 400, refused.text
    assert field in refused.text and "more than once" in refused.text


@pytest.mark.parametrize(
    ("request_", "what"),
    [
        ({"url": "/x?user[]=mallory"}, "query parameter 'user' (as 'user[]'"),
        ({"url": "/x?user%5B0%5D=mallory"}, "query parameter 'user' (as 'user[0]'"),
        ({"url": "/x?user=alice&user[role]=mallory"}, "query parameter 'user' (as 'user[role]'"),
        ({"url": "/x?%20user=mallory"}, "query parameter 'user' (as ' user'"),  # PHP drops leading spaces
        ({"url": "/x?tag[]=secret"}, "query parameter 'tag' (as 'tag[]'"),  # repeated: list reads only 'tag'
        ({"method": "POST", "url": "/x", "content": "user[]=mallory", "headers": FORM},
         "form field 'user' (as 'user[]'"),
        # Express (qs) reads a leading [k] as k, and so does Rack 2, whose key drops the brackets around it
        ({"url": "/x?[user]=mallory"}, "(as '[user]', which Rails (Rack 2) and Express read into 'user')"),
        ({"url": "/x?%5Buser%5D%5B%5D=mallory"}, "(as '[user][]', which Rails (Rack 2) and Express read into"),
        ({"url": "/x?]user=mallory"}, "(as ']user', which Rails (Rack 2) reads into 'user')"),
        ({"url": "/x?user]=mallory"}, "(as 'user]', which Rails (Rack 2) reads into 'user')"),
        ({"url": "/x?user[x=mallory"}, "(as 'user[x', which Rails and Express read into 'user')"),  # {'[x': ..}
        # Rack 2 splits a query at ';' too: guard reads a=1;user=mallory as a
        ({"url": "/x?a=1;user=mallory"}, "(as ';user', which Rails (Rack 2) reads into 'user')"),
        ({"url": "/x?a=1;user[]=mallory"}, "(as ';user[]', which Rails (Rack 2) reads into 'user')"),
        # qs ends a name at ']=' before its first '=': guard read 'user[' = ']=mallory', Express user = {'=': ...}
        # (and qs 6.15 reads guard's 'user[' as user = {'[': ...} too: that spelling is named first)
        ({"url": "/x?user[=]=mallory"}, "(as 'user[', which Express reads into 'user')"),
        # and so does Express's urlencoded({extended: true}) in a form body, which guard read as 'user[' too
        ({"method": "POST", "url": "/x", "content": "user[=]=mallory", "headers": FORM},
         "form field 'user' (as 'user[', which Express reads into 'user')"),
        ({"method": "POST", "url": "/x", "content": "user=alice&user[=]=mallory", "headers": FORM},
         "form field 'user' (as 'user[', which Express reads into 'user')"),
        # qs reads %5B and %5D as brackets before it splits: user[=%5D=mallory is user[=]=mallory to it
        ({"url": "/x?user[=%5D=mallory"}, "(as 'user[', which Express reads into 'user')"),
        # qs 6.15 (Express 4.22, 5) reads an unclosed bracket as a child: user[=mallory is user = {'[': 'mallory'}
        ({"url": "/x?user[=mallory"}, "(as 'user[', which Express reads into 'user')"),
        ({"method": "POST", "url": "/x", "content": "user%5B=mallory", "headers": FORM},
         "form field 'user' (as 'user[', which Express reads into 'user')"),
        ({"method": "POST", "url": "/x", "content": "user[=%5D=mallory", "headers": FORM},
         "form field 'user' (as 'user[', which Express reads into 'user')"),
        ({"method": "POST", "url": "/x", "content": "user=alice&user%5B=%5d=mallory", "headers": FORM},
         "form field 'user' (as 'user[', which Express reads into 'user')"),
    ],
)
def test_a_value_read_by_name_sent_under_a_php_or_rack_spelling_is_refused(request_: dict, what: str) -> None:
    """PHP, Rails (Rack) and Express (qs) read ``user[]=mallory`` as ``user``; the policy read ``user`` absent and
    the request was forwarded (a 200). Now a 400 ``state_ambiguous`` naming the field and the spelling sent."""
    policy = POLICY.replace("TAGS", "{from: query, name: tag, repeated: list}")
    (refused,) = _send(policy, {"method": "GET"} | request_)
    assert refused.status_code == 400, refused.text
    assert "state_ambiguous" in refused.text and what in refused.text and "under another name" in refused.text


def test_names_no_framework_reads_as_the_field_pass() -> None:
    """``users`` and ``user_id`` fill other parameters, and an escaped ``;`` is part
    of a value for Rack 2 too: not refused."""
    (ok,) = _send(POLICY.replace("TAGS", "'query:tag'"), {"method": "GET", "url": "/x?user=alice&users=mallory"
                                                          "&user_id=mallory&a=1%3Buser=x"})
    assert (ok.status_code, ok.text) == (200, "user=alice form=None")


QUERY_ONLY = """
policies:
  - id: users
    version: 1
    match: {http: {}}
    state: {user: "query:user"}
    rules: [{id: banned, when: 'state.user == "mallory"', action: block}]
"""


def test_a_form_whose_names_qs_reads_as_guard_does_or_that_no_policy_reads_so_passes() -> None:
    """Only a form body where qs names a field the policy reads otherwise than guard is refused: raw brackets
    (``filter[a]=1``, which hold ``]=``), a value holding ``]=``, bodies a browser or ``urlencode()`` writes, a qs
    spelling of a field no policy reads, and a multipart body (whose names qs does not split) pass as before."""
    ordinary = [
        "user=alice&filter[a]=1&filter[b][c]=2&tags[]=x",
        "user=alice&note=a]=b",  # qs names it 'note=a]': guard's 'note' is read by no policy
        urlencode({"user": "alice", "filter[=]": "x", "note": "a]=b"}),  # escaped: user=alice&filter%5B%3D%5D=x...
        "user=alice&other[=]=mallory",
        "user=alice&note=a%5D=b&filter%5Ba%5D=1",  # escaped brackets qs reads as guard's split names them
    ]
    multipart = '--b\r\nContent-Disposition: form-data; name="note"\r\n\r\nx&user[=]=mallory\r\n--b--\r\n'
    responses = _send(POLICY.replace("TAGS", "'query:tag'"),
                      *({"method": "POST", "url": "/x", "content": body, "headers": FORM} for body in ordinary),
                      {"method": "POST", "url": "/x", "content": multipart,
                       "headers": {"content-type": "multipart/form-data; boundary=b"}})
    assert [(r.status_code, r.text) for r in responses] == [(200, "user=None form=alice")] * 5 + [
        (200, "user=None form=None")]
    (passed,) = _send(QUERY_ONLY, {"method": "POST", "url": "/x", "content": "user[=]=mallory", "headers": FORM})
    assert passed.status_code == 200, passed.text


def test_a_name_nested_past_every_parser_or_with_a_huge_index_is_judged_not_a_crash() -> None:
    """``x[a][a]...`` 1000 deep (a recursion per level) and ``x[<4400 digits>]`` (past ``int()``'s digit limit) were
    a 500 with a traceback, and under ``on_error: open`` let ``user=mallory`` beside them through unjudged (the ``_method`` scan: a 500). Each
    framework reads such a name only to its own depth, so it is checked like any other."""
    deep, index = "x" + "[a]" * 1000, "x[" + "9" * 4400 + "]"
    responses = _send(POLICY.replace("TAGS", "'query:tag'"),
                      *({"method": "GET", "url": f"/x?user=mallory&{name}=1"} for name in (deep, index)),
                      *({"method": "GET", "url": f"/x?user=alice&{name}=1&_method="} for name in (deep, index)))
    assert [r.status_code for r in responses] == [403, 403, 200, 200], [r.text[:200] for r in responses]


def test_a_json_key_only_some_frameworks_read_as_the_field_is_not_refused() -> None:
    """A JSON body's keys are read by no framework's form parser: ``[user]``, ``user]`` and ``user[x`` (which only
    Rack 2, qs or Rack 3 read as ``user`` in a query or form) were 400 for ``form:user`` since the alias check read
    them as form names; ``user[]``, which every framework reads so, is refused as it was before."""
    policy = POLICY.replace("TAGS", "'query:tag'")
    requests = [{"method": "POST", "url": "/x", "json": {"user": "alice", key: "mallory"}}
                for key in ("[user]", "user]", "user[x", "user[]")]
    responses = _send(policy, *requests)
    assert [r.status_code for r in responses] == [200, 200, 200, 400], [r.text for r in responses]
    assert "(as 'user[]', which PHP, Rails and Express read into 'user')" in responses[3].text


def test_a_value_rack2_ends_at_a_semicolon_is_refused_a_bare_name_after_one_is_not() -> None:
    """Rack 2 ends a value at ``;``: ``user=mallory;`` was judged as ``mallory;`` (not banned) while Rails on Rack 2
    reads ``mallory`` (a 200). Now a 400 ``state_ambiguous``. A bare name after a ``;`` (``sort=name;user``) is
    ``nil`` to Rack 2, nothing to judge: it was a 400 and now passes, as does an escaped ``;``."""
    policy = POLICY.replace("TAGS", "'query:tag'")
    refused, bare, escaped, other = _send(policy, {"method": "GET", "url": "/x?user=mallory;"},
                                          {"method": "GET", "url": "/x?sort=name;user"},
                                          {"method": "GET", "url": "/x?user=alice%3B"},
                                          {"method": "GET", "url": "/x?user=alice&sort=a;b"})
    assert refused.status_code == 400 and "state_ambiguous" in refused.text, refused.text
    assert "query parameter 'user'" in refused.text and "splits a query at ';'" in refused.text
    assert (bare.status_code, escaped.status_code, other.status_code) == (200, 200, 200), (bare.text, other.text)


def test_a_bracketed_field_lets_its_siblings_through() -> None:
    """A field read as ``filter[search]`` (JSON:API) was refused for a sibling ``filter[status]`` with a message
    saying PHP, Rails and Express read that as ``filter[search]``; only what fills ``filter[search]`` is refused."""
    policy = POLICY.replace("TAGS", "'query:filter[search]'")
    ok, refused = _send(policy, {"method": "GET", "url": "/x?user=alice&filter[search]=ok&filter[status]=open"},
                        {"method": "GET", "url": "/x?filter[search]=ok&filter[search][]=x"})
    assert (ok.status_code, ok.text) == (200, "user=alice form=None")
    assert refused.status_code == 400 and "(as 'filter[search][]', which PHP, Rails and Express read into" in refused.text


def test_values_sent_once_and_headers_nobody_reads_pass() -> None:
    ok, other_header = _send(
        POLICY.replace("TAGS", "'query:tag'"),
        {"method": "GET", "url": "/x?user=alice&tag=a"},
        {"method": "GET", "url": "/x?user=alice", "headers": [("x-forwarded-for", "1.2.3.4"),
                                                              ("x-forwarded-for", "5.6.7.8")]},
    )
    assert (ok.status_code, ok.text) == (200, "user=alice form=None")
    assert other_header.status_code == 200


def test_repeated_list_reads_every_value_as_a_list() -> None:
    policy = POLICY.replace("TAGS", "{from: query, name: tag, repeated: list}")
    one, two, clean = _send(
        policy,
        {"method": "GET", "url": "/x?tag=secret"},
        {"method": "GET", "url": "/x?tag=public&tag=secret"},
        {"method": "GET", "url": "/x?tag=public&tag=open"},
    )
    assert (one.status_code, two.status_code, clean.status_code) == (403, 403, 200)


def test_repeated_join_reads_a_header_as_rfc_9110_combines_it() -> None:
    policy = """
policies:
  - id: hops
    version: 1
    match: {http: {}}
    state: {hops: {from: header, name: x-forwarded-for, repeated: join}}
    rules:
      - {id: two-hops, when: 'state.hops == "1.2.3.4, 5.6.7.8"', action: block}
"""
    (response,) = _send(policy, {"method": "GET", "url": "/x", "headers": [("x-forwarded-for", "1.2.3.4"),
                                                                             ("x-forwarded-for", "5.6.7.8")]})
    assert response.status_code == 403


def test_a_header_a_match_names_sent_twice_is_refused_not_a_policy_switched_off() -> None:
    """``match.http.headers`` compared the joined copies ("acme, acme") with its glob, so the policy did not apply
    and the request passed while the app read ``acme`` (review finding)."""
    policy = """
policies:
  - id: acme
    version: 1
    match: {http: {headers: {x-tenant: acme}}}
    rules: [{id: acme-blocked, when: 'true', action: block}]
"""
    once, twice, mixed = _send(
        policy,
        {"method": "GET", "url": "/x", "headers": [("x-tenant", "acme")]},
        {"method": "GET", "url": "/x", "headers": [("x-tenant", "acme"), ("x-tenant", "acme")]},
        {"method": "GET", "url": "/x", "headers": [("x-tenant", "acme"), ("x-tenant", "other")]},
    )
    assert (once.status_code, twice.status_code, mixed.status_code) == (403, 400, 400)
    assert "header 'x-tenant'" in twice.text


def test_a_rule_reading_headers_by_a_computed_name_sees_repeated_headers_joined() -> None:
    """Which header such a rule reads is not known before it runs, so proxies' repeated headers (two via lines)
    are not refused for it; it reads the copies joined, as before."""
    policy = """
policies:
  - id: debug-headers
    version: 1
    match: {http: {}}
    rules:
      - {id: debug, when: 'subject.headers.exists(h, h.startsWith("x-debug"))', action: block}
"""
    proxied, debug = _send(
        policy,
        {"method": "GET", "url": "/x", "headers": [("via", "1.1 cdn"), ("via", "1.1 lb")]},
        {"method": "GET", "url": "/x", "headers": [("x-debug-mode", "1")]},
    )
    assert (proxied.status_code, debug.status_code) == (200, 403)


def test_a_json_key_repeated_under_collect_is_refused_where_a_pointer_reads_it() -> None:
    """With ``duplicate_keys="collect"`` the state held both values as a list and a string rule passed
    ``{"user": "x", "user": "mallory"}``, whose last value Python's json reads (review finding)."""
    policy = """
policies:
  - id: users
    version: 1
    match: {http: {}}
    state: {user: "body:/user", name: "body:/profile/name"}
    rules:
      - {id: banned, when: 'state.user == "mallory" || state.name == "mallory"', action: block}
"""
    guard = Guard(load_text(policy), backends=FixtureBackend())
    app = Starlette(routes=[Route("/x", _echo, methods=["POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard, limits=BodyLimits(duplicate_keys="collect"))])

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            json_type = {"content-type": "application/json"}
            return [await client.post("/x", content=body, headers=json_type) for body in (
                '{"user": "mallory"}', '{"user": "x", "user": "mallory"}',
                '{"profile": {"name": "x"}, "profile": {"name": "mallory"}}', '{"user": "alice", "tag": 1, "tag": 2}')]

    try:
        blocked, twice, nested, elsewhere = asyncio.run(run())
    finally:
        guard.close()
    assert (blocked.status_code, twice.status_code, nested.status_code) == (403, 400, 400)
    assert "JSON member '/user'" in twice.text and "'/profile'" in nested.text
    assert elsewhere.status_code == 200  # a repeated key the policy does not read


def test_a_response_policy_reads_the_requests_query() -> None:
    """A response policy saw an empty query (its subject was built before the query was parsed), so a rule on it
    never fired (review finding); a parameter it reads sent twice is refused as on the request side."""
    policy = """
policies:
  - id: responses
    version: 1
    match: {http: {response: {status: [200]}}}
    state: {user: "query:user", body: body_text}
    rules:
      - {id: banned, when: 'state.user == "mallory"', action: block}
"""
    blocked, allowed, twice = _send(policy, {"method": "GET", "url": "/x?user=mallory"},
                                    {"method": "GET", "url": "/x?user=alice"},
                                    {"method": "GET", "url": "/x?user=a&user=mallory"})
    assert (blocked.status_code, allowed.status_code) == (403, 200), blocked.text
    assert twice.status_code == 400 and "state_ambiguous" in twice.text


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{from: header, name: x-a, repeated: list}", "repeated: list does not apply to header; use refuse or join"),
        ("{from: query, name: a, repeated: join}", "repeated: join does not apply to query; use refuse or list"),
        ("{from: body_text, repeated: list}", "needs from: query, form or header and a 'name'"),
        ("{from: query, repeated: list}", "needs from: query, form or header and a 'name'"),
    ],
)
def test_repeated_is_checked_at_load(source: str, message: str) -> None:
    policy = f"""
policies:
  - id: p
    version: 1
    match: {{http: {{}}}}
    state: {{a: {source}}}
    rules:
      - {{id: r, when: 'state.a != null', action: block}}
"""
    with pytest.raises(PolicyError, match="repeated") as caught:
        load_text(policy)
    assert message in str(caught.value)
