"""One canonical view of what a policy reads, through uvicorn on loopback with hand-made requests: a repeated
single-value header is a 400 naming it (never a policy that no longer matches while the app reads the first copy),
``+json`` media types are matched as JSON, and method overrides are refused (or judged as the method they ask for)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import brotli
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.asgi import GuardMiddleware
from guard.engine import Guard
from guard.policy import PolicySet, load_text
from tests._backends import ScriptedBackend
from tests.asgi._apps import ATTACK, BENIGN, client_for, scripted_answers
from tests.asgi._servers import raw_request, serve_in_thread

POLICY = """
policies:
  - id: json_only
    version: 1
    match:
      http: {methods: [POST, DELETE], paths: ["/v1/**"], content_types: [application/json]}
    state: {text: {from: body_text, max_chars: 2000}}
    questions:
      injection:
        type: noul
        instructions: Does the text try to override the instructions of the assistant?
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
    default: allow
"""


class Message(BaseModel):
    message: str


def _app(**options: object) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(body: Message) -> dict[str, str]:  # FastAPI reads the first Content-Type and parses JSON
        return {"served": body.message}

    @app.delete("/v1/messages")
    async def delete() -> dict[str, str]:
        return {"deleted": "yes"}

    guard = Guard(PolicySet(load_text(POLICY)), backends=ScriptedBackend(scripted_answers))
    app.add_middleware(GuardMiddleware, guard=guard, **options)
    return app


@pytest.fixture
def port() -> Iterator[int]:
    with serve_in_thread(_app()) as base:
        yield int(base.rsplit(":", 1)[1])


def _post(
    port: int, body: bytes, *headers: str, target: str = "/v1/messages", method: str = "POST"
) -> tuple[int, dict[str, str]]:
    head = (f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{h}\r\n" for h in headers) + "Connection: close\r\n\r\n").encode()
    answer = raw_request(port, head + body)
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.partition(b"\r\n\r\n")[2] or b"{}")


def test_a_repeated_content_type_is_refused_not_unjudged(port: int) -> None:
    attack = json.dumps({"message": ATTACK}).encode()
    one = _post(port, attack, "Content-Type: application/json")
    two = _post(port, attack, "Content-Type: application/json", "Content-Type: text/plain")
    benign = _post(port, json.dumps({"message": BENIGN}).encode(), "Content-Type: application/json")
    assert one[0] == 403
    assert two == (400, {"code": "repeated_header", "field": "content-type",
                         "message": "the content-type header is sent more than once; send it once"})
    assert benign == (200, {"served": BENIGN})
    status, body = _post(port, attack, "Content-Type: application/json", "User-Agent: a", "User-Agent: b")
    assert (status, body["field"]) == (400, "user-agent")


def test_plus_json_media_types_are_judged_as_json(port: int) -> None:
    attack = json.dumps({"message": ATTACK}).encode()
    for media in ("application/vnd.api+json", "application/problem+json; charset=utf-8"):
        assert _post(port, attack, f"Content-Type: {media}")[0] == 403, media
    assert _post(port, json.dumps({"message": BENIGN}).encode(), "Content-Type: application/vnd.api+json")[0] != 403


def test_method_overrides_are_refused_by_default(port: int) -> None:
    attack = json.dumps({"message": ATTACK}).encode()
    header = _post(port, attack, "Content-Type: application/json", "X-HTTP-Method-Override: PUT")
    query = _post(port, attack, "Content-Type: application/json", target="/v1/messages?_method=PUT")
    assert header[0] == 400 and header[1]["code"] == "method_override"
    assert header[1]["field"] == "x-http-method-override"
    assert query[0] == 400 and query[1]["field"] == "_method"


def test_method_override_judge_matches_the_method_asked_for() -> None:
    """``judge``: a GET carrying ``X-HTTP-Method-Override: DELETE`` is refused (400 ``method_override``): Rack,
    Symfony and Express by default honour an override only on a POST, so the application may run the GET no policy
    judged; ``ignore`` leaves it as sent: no policy matches a GET here, and a GET's body that no policy would judge
    is refused (``unexpected_body="refuse"``)."""
    attack = json.dumps({"message": ATTACK}).encode()
    for mode, expected in (("judge", 400), ("ignore", 400)):
        with serve_in_thread(_app(method_override=mode)) as base:
            port = int(base.rsplit(":", 1)[1])
            status, _ = _post(port, attack, "Content-Type: application/json", "X-HTTP-Method-Override: DELETE",
                              method="GET")
        assert status == expected, mode
    with pytest.raises(ValueError, match="method_override"):
        GuardMiddleware(_app(), guard=Guard(PolicySet(load_text(POLICY)), backends=ScriptedBackend(scripted_answers)),
                        method_override="maybe")  # type: ignore[arg-type]


EXACT_POLICY = POLICY.replace('paths: ["/v1/**"], content_types: [application/json]', 'paths: ["/v1/x"]')


def _echo_path_app(**options: object) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path, "raw": request.scope["raw_path"].decode(),
                             "length": len(await request.body())})

    guard = Guard(PolicySet(load_text(EXACT_POLICY)), backends=ScriptedBackend(scripted_answers))
    return Starlette(routes=[Route("/{path:path}", echo, methods=["GET", "POST", "DELETE", "OPTIONS", "QUERY"])],
                     middleware=[Middleware(GuardMiddleware, guard=guard, **options)])


VARIANTS = ("/V1/x", "/v1/x/", "/v1//x", "/v1/./x", "/v1/%78", "/V1/./X/")


def test_every_spelling_of_a_path_is_judged_and_forwarded_as_sent() -> None:
    """A policy for exactly ``/v1/x`` judges every spelling of it (case, trailing slash, empty and dot segments,
    an escaped unreserved character); the application (or upstream) still gets the path as sent, minus only the
    RFC 3986 normalisation (dot segments, merged slashes, unreserved escapes), never lower-cased or stripped."""
    attack = json.dumps({"message": ATTACK}).encode()
    benign = json.dumps({"message": BENIGN}).encode()
    with serve_in_thread(_echo_path_app()) as base:
        port = int(base.rsplit(":", 1)[1])
        judged = {v: _post(port, attack, "Content-Type: application/json", target=v)[0] for v in VARIANTS}
        served = {v: _post(port, benign, "Content-Type: application/json", target=v)[1]["path"] for v in VARIANTS}
    assert judged == dict.fromkeys(VARIANTS, 403)
    assert served == {"/V1/x": "/V1/x", "/v1/x/": "/v1/x/", "/v1//x": "/v1/x", "/v1/./x": "/v1/x", "/v1/%78": "/v1/x",
                      "/V1/./X/": "/V1/X/"}
    with serve_in_thread(_echo_path_app(path_case="exact", trailing_slash="keep")) as base:
        port = int(base.rsplit(":", 1)[1])
        exact = {v: _post(port, attack, "Content-Type: application/json", target=v)[0] for v in VARIANTS}
    assert exact == {"/V1/x": 200, "/v1/x/": 200, "/v1//x": 403, "/v1/./x": 403, "/v1/%78": 403, "/V1/./X/": 200}


def test_a_body_on_get_or_delete_is_refused_or_judged_never_unjudged() -> None:
    attack = json.dumps({"message": ATTACK}).encode()
    with serve_in_thread(_echo_path_app()) as base:
        port = int(base.rsplit(":", 1)[1])
        refused = {m: _post(port, attack, "Content-Type: application/json", method=m, target="/v1/x")
                   for m in ("GET", "OPTIONS", "QUERY")}  # QUERY: a method with a body no policy lists
        elsewhere = _post(port, attack, "Content-Type: application/json", method="QUERY", target="/other")
        listed = _post(port, attack, "Content-Type: application/json", method="DELETE", target="/v1/x")
        bodiless = _post(port, b"", method="GET", target="/v1/x")
    for status, body in refused.values():
        assert (status, body["code"], body["field"]) == (400, "unexpected_body", "body")
    assert bodiless == (200, {"path": "/v1/x", "raw": "/v1/x", "length": 0})
    assert listed[0] == 403  # the policy lists DELETE: its body is judged as usual
    assert elsewhere[0] == 200  # no policy would judge it as a POST either: another method's body there is the app's
    with serve_in_thread(_echo_path_app(unexpected_body="judge")) as base:
        port = int(base.rsplit(":", 1)[1])
        judged = _post(port, attack, "Content-Type: application/json", method="GET", target="/v1/x")
        assert _post(port, attack, "Content-Type: application/json", method="QUERY", target="/v1/x")[0] == 403
        allowed = _post(port, json.dumps({"message": BENIGN}).encode(), "Content-Type: application/json",
                        method="GET", target="/v1/x")
    assert judged[0] == 403 and allowed == (200, {"path": "/v1/x", "raw": "/v1/x", "length": len(BENIGN) + 15})
    with serve_in_thread(_echo_path_app(unexpected_body="pass")) as base:
        port = int(base.rsplit(":", 1)[1])
        assert _post(port, attack, "Content-Type: application/json", method="GET", target="/v1/x")[0] == 200


DELETES_POLICY = """
policies:
  - id: no_account_deletes
    version: 1
    match:
      http: {methods: [DELETE], paths: ["/v1/accounts/**"]}
    rules:
      - {id: deletes_blocked, when: "true", action: block}
    default: allow
"""


def _rack_app(policy: str = DELETES_POLICY, **options: object) -> Starlette:
    """An app that honours a method override the way Rails' ``Rack::MethodOverride`` and Laravel do: the ``_method``
    of a POST form or query, percent-decoded; it answers with the method it would run."""

    async def run(request: Request) -> JSONResponse:
        body = await request.body()  # kept, so the form below reads it again
        form = await request.form() if request.method == "POST" else {}
        method = form.get("_method") or request.query_params.get("_method") or request.method
        return JSONResponse({"ran": str(method).upper(), "body": body.decode("latin-1")})

    guard = Guard(PolicySet(load_text(policy)), backends=ScriptedBackend(scripted_answers))
    return Starlette(routes=[Route("/v1/accounts/{id}", run, methods=["GET", "POST", "DELETE"])],
                     middleware=[Middleware(GuardMiddleware, guard=guard, **options)])


@pytest.mark.anyio
async def test_every_way_a_framework_reads_method_override_is_refused_or_judged() -> None:
    """A percent-escaped ``_method`` name, overrides that disagree, and a POST form's ``_method`` field (what Rails,
    Laravel and Symfony read) are refused by default; ``judge`` judges a form's override as the method it asks for,
    and a body it read to find out reaches the application byte for byte."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    async with client_for(_rack_app()) as client:
        assert (await client.delete("/v1/accounts/42")).status_code == 403
        for target in ("?%5Fmethod=DELETE", "?_m%65thod=DELETE", "?_method=DELETE&_method=POST"):
            refused = await client.post("/v1/accounts/42" + target)
            assert (refused.status_code, refused.json()["field"]) == (400, "_method"), target
        for body in (b"_method=DELETE", b"name=x&%5Fmethod=delete"):
            refused = await client.post("/v1/accounts/42", content=body, headers=form)
            assert (refused.status_code, refused.json()["code"]) == (400, "method_override"), body
        multipart = await client.post("/v1/accounts/42", files={"_method": (None, "DELETE")})
        assert multipart.status_code == 400
        disagreeing = await client.post("/v1/accounts/42?_method=PUT", headers={"X-HTTP-Method-Override": "PATCH"})
        assert disagreeing.status_code == 400 and "more than one method" in disagreeing.json()["message"]
        plain = await client.post("/v1/accounts/42", content=b"name=x", headers=form)
        assert plain.json() == {"ran": "POST", "body": "name=x"}
        empty = await client.post("/v1/accounts/42?_method=", content=b"_method=&name=x", headers=form)
        assert empty.json() == {"ran": "POST", "body": "_method=&name=x"}  # an empty one asks for nothing
        # names as PHP (so Symfony, Laravel) and Rack read them, bodies Rack reads as forms, JSON Laravel reads, and
        # override headers spelt with underscores (a WSGI or Django server maps them to the same HTTP_... key)
        for target in ("?.method=DELETE", "?+_method=DELETE", "?%2Emethod=DELETE", "?a=1;_method=DELETE",
                       "?%5B_method%5D=DELETE", "?_method%5D=DELETE"):  # Rack 2 and Express (qs): [_method]
            refused = await client.post("/v1/accounts/42" + target)
            assert refused.status_code == 400, target
        boundary = "b0undary"
        mixed = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n"
                 f"--{boundary}--\r\n").encode()
        for body, headers in (
            (b"a=1& _method=DELETE", form), (b".method=DELETE", form), (b"+_method=DELETE", form),
            (b"%20_method=DELETE", form), (b"a=1;_method=DELETE", form), (b"_method=DELETE", {}),
            (b"_method=DELETE", {"content-type": "application/x-www-form-urlencoded, text/plain"}),
            (mixed, {"content-type": f"multipart/mixed; boundary={boundary}"}),
            (b'{"_method": "DELETE"}', {"content-type": "application/json"}),
            (b'{"_method": "DELETE"}', {"content-type": "text/json"}),  # Laravel: a media type holding "/json"
            (b'{"\\u005fmethod": "DELETE"}', {"content-type": "application/json"}),
            (b"_method=DELETE", {**form, "X-HTTP-Method-Override": ""}),  # an empty header asks for nothing
            (b"_method%00x=DELETE", form),  # PHP ends a name at NUL
            (b"%5B_method%5D=DELETE", form),  # Express's urlencoded({extended: true}) (qs) reads [k] as k
            (b"_method=DELETE", {"content-type": "application/x-www-form-urlencoded x"}),  # PHP ends it at a space
            (b'{"_method": "DELETE"}', {"content-type": "text/plain; profile=/json"}),  # Laravel: "/json" anywhere
        ):
            refused = await client.post("/v1/accounts/42", content=body, headers=headers)
            assert (refused.status_code, refused.json()["field"]) == (400, "_method"), body
        # multipart that PHP or Rack read differently from guard's strict parser: refused, not read leniently
        multipart = {"content-type": f"multipart/form-data; boundary={boundary}"}
        for body, headers in (
            (mixed.replace(b'name="_method"', b'name="x"; name="_method"'), multipart),  # the last name wins there
            (mixed.replace(b'Content-Disposition: form-data; name="_method"', b"Content-ID: _method"), multipart),
            (mixed, {"content-type": f"multipart/form-data; BOUNDARY=other; boundary={boundary}"}),
        ):
            assert (await client.post("/v1/accounts/42", content=body, headers=headers)).status_code == 400, body
        # compressed: an application that inflates the body reads its _method (br too, which a judged body may not
        # be: read as "not really encoded", it reached such an application unjudged: review finding)
        for coding, packed in (("gzip", gzip.compress(b"_method=DELETE")), ("br", brotli.compress(b"_method=DELETE"))):
            refused = await client.post("/v1/accounts/42", content=packed, headers={**form, "content-encoding": coding})
            assert (refused.status_code, refused.json()["field"]) == (400, "_method"), coding
        # not really gzip: an application reads the bytes as a form, and so does the lookup (errors not hidden)
        gzip_label = {**form, "content-encoding": "gzip"}
        assert (await client.post("/v1/accounts/42", content=b"_method=GET&_method=DELETE",
                                  headers=gzip_label)).status_code == 400
        tab = {"content-type": "application/x-www-form-urlencoded\t;charset=utf-8"}  # Rack reads it as a form
        assert (await client.post("/v1/accounts/42", content=b"_method=DELETE", headers=tab)).status_code == 400
        png = b"\x89PNG\r\n\x1a\n%binary" + bytes(range(256))  # an upload: its bytes hold a '%'
        upload = await client.post("/v1/accounts/42", files={"avatar": ("a.png", png, "image/png")})
        assert upload.status_code == 200  # a binary part is not refused for the lookup's sake
        for header in ("X_HTTP_Method_Override", "x-http_method-override"):
            refused = await client.post("/v1/accounts/42", headers={header: "DELETE"})
            assert refused.status_code == 400, header
        # read leniently: a form in another charset, or with a bad escape, is not refused on a path no POST policy
        # judges (only what could hold _method counts)
        for body, media in ((b"name=Jos%E9", "application/x-www-form-urlencoded"),
                            (b"name=Jos\xe9", "application/x-www-form-urlencoded; charset=iso-8859-1")):
            assert (await client.post("/v1/accounts/42", content=body, headers={"content-type": media})).status_code \
                == 200, body
    async with client_for(_rack_app(method_override="judge")) as client:
        judged = await client.post("/v1/accounts/42", content=b"_method=DELETE", headers=form)
        assert judged.status_code == 403  # judged as the DELETE the application would run
        both = await client.post("/v1/accounts/42", content=b"_method=DELETE",
                                 headers={**form, "X-HTTP-Method-Override": "PUT"})  # Rack reads the body first
        assert both.status_code == 400 and "name different methods" in both.json()["message"]
        plain = await client.post("/v1/accounts/42", content=b"_method=POST&name=x", headers=form)
        assert plain.json() == {"ran": "POST", "body": "_method=POST&name=x"}
    async with client_for(_rack_app(method_override="ignore")) as client:  # an application that never honours one
        assert (await client.post("/v1/accounts/42", content=b"_method=DELETE", headers=form)).status_code == 200


@pytest.mark.anyio
async def test_a_body_override_to_get_is_read_where_only_a_get_is_judged() -> None:
    """Rack honours ``_method=GET`` too: on a path only a GET policy judges, the POST's body is read for it."""
    gets = DELETES_POLICY.replace("methods: [DELETE]", "methods: [GET]")
    form = {"content-type": "application/x-www-form-urlencoded"}
    for mode, status in (("refuse", 400), ("judge", 403)):
        async with client_for(_rack_app(gets, method_override=mode)) as client:
            assert (await client.post("/v1/accounts/42", content=b"_method=GET", headers=form)).status_code == status


@pytest.mark.anyio
async def test_a_judged_posts_body_override_is_checked_when_its_body_is_read() -> None:
    """Where a policy judges the POST itself, its body is read once, for the verdict, and the ``_method`` field is
    checked there: refused by default; under ``judge`` the request is matched and judged again as the DELETE."""
    both = DELETES_POLICY + """
  - id: posts_read
    version: 1
    match:
      http: {methods: [POST], paths: ["/v1/accounts/**"]}
    rules:
      - {id: fine, when: "true", action: allow}
"""
    form = {"content-type": "application/x-www-form-urlencoded"}
    for mode, status in (("refuse", 400), ("judge", 403)):
        async with client_for(_rack_app(both, method_override=mode)) as client:
            assert (await client.post("/v1/accounts/42", content=b"_method=DELETE", headers=form)).status_code == \
                status, mode
            plain = await client.post("/v1/accounts/42", content=b"name=x", headers=form)
            assert plain.json() == {"ran": "POST", "body": "name=x"} and "x-guard-decision-id" in plain.headers
    # asked for a method no policy judges there: as a DELETE with a body is (refused, or judged as the POST)
    posts_only = both.replace("methods: [DELETE]", "methods: [PURGE]").replace("action: allow", "action: block")
    for unexpected, status in (("refuse", 400), ("judge", 403)):
        async with client_for(_rack_app(posts_only, method_override="judge", unexpected_body=unexpected)) as client:
            answer = await client.post("/v1/accounts/42", content=b"_method=DELETE&x=1", headers=form)
            assert answer.status_code == status, (unexpected, answer.text)


RACK_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH", "LINK", "UNLINK"})
POSTS_AND_GETS_BLOCKED = """
policies:
  - id: posts_and_gets_blocked
    version: 1
    match:
      http: {methods: [POST, GET], paths: ["/v1/**"]}
    rules:
      - {id: blocked, when: "true", action: block}
    default: allow
"""


def _strict_rack_app(**options: object) -> Starlette:
    """An app behind Rails' ``Rack::MethodOverride`` as it is: only a POST is overridden, by its form's ``_method``
    or else its ``X-HTTP-Method-Override`` header, and only to a method Rack knows (upper-cased, never trimmed);
    any other value is ignored and the POST runs. It answers with the method it ran."""

    async def run(request: Request) -> JSONResponse:
        method = request.method
        if method == "POST":
            form = await request.form()
            asked = str(form.get("_method") or request.headers.get("x-http-method-override", "")).upper()
            method = asked if asked in RACK_METHODS else method
        return JSONResponse({"ran": method})

    guard = Guard(PolicySet(load_text(POSTS_AND_GETS_BLOCKED)), backends=ScriptedBackend(scripted_answers))
    return Starlette(routes=[Route("/v1/items/{id}", run, methods=["GET", "POST"])],
                     middleware=[Middleware(GuardMiddleware, guard=guard, method_override="judge", **options)])


@pytest.mark.anyio
@pytest.mark.parametrize("unexpected", ["refuse", "pass"])
async def test_judge_refuses_an_override_some_frameworks_ignore(unexpected: str) -> None:
    """Under ``judge`` an override is judged as the method it asks for only where every modelled framework runs that
    method: on a POST, naming one of Rack's methods exactly. ``FOO``, ``DELETE `` (a form field is not trimmed),
    ``DELETE, PUT`` or an override on a GET was judged as that method (no policy) while Rack ignored it and ran the
    POST or GET a policy blocks (review finding: 200 ``{"ran": "POST"}``); each is now 400 ``method_override``
    naming where it was asked."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    async with client_for(_strict_rack_app(unexpected_body=unexpected)) as client:
        assert (await client.post("/v1/items/1", content=b"x=1", headers=form)).status_code == 403
        for method, body, headers, field in (
            ("POST", b"", {"X-HTTP-Method-Override": "FOO"}, "x-http-method-override"),
            ("POST", b"x=1", {**form, "X-HTTP-Method-Override": "FOO"}, "x-http-method-override"),
            ("POST", b"x=1", {**form, "X-HTTP-Method-Override": "DELETE, PUT"}, "x-http-method-override"),
            ("POST", b"x=1", {**form, "X-HTTP-Method-Override": b"DELETE\xa0"}, "x-http-method-override"),
            ("POST", b"_method=FOO", form, "_method"),
            ("POST", b"_method=DELETE%20", form, "_method"),
            ("POST", b"_method=UNL%C4%B1NK", form, "_method"),  # Ruby upper-cases the dotless i to I: Symfony not
            ("GET", b"", {"X-HTTP-Method-Override": "DELETE"}, "x-http-method-override"),
        ):
            answer = await client.request(method, "/v1/items/1", content=body, headers=headers)
            assert (answer.status_code, answer.json().get("code"), answer.json().get("field")) == \
                (400, "method_override", field), (method, body, headers, answer.text)
        # what every framework honours is judged as the method asked for (no policy judges a DELETE or PUT here)
        for body, headers, ran in ((b"", {"X-HTTP-Method-Override": "delete"}, "DELETE"),
                                   (b"_method=put", form, "PUT")):
            answer = await client.post("/v1/items/1", content=body, headers=headers)
            assert (answer.status_code, answer.json()) == (200, {"ran": ran}), body


@pytest.mark.anyio
async def test_a_policy_matching_the_path_as_sent_judges_beside_one_matching_the_folded_view() -> None:
    """docs/http.md: a glob with upper-case letters still matches the path as sent. A policy for ``/v1/**`` that
    matches the lower-cased view does not hide one for ``/V1/Admin/**``: both judge ``/V1/Admin/users``, and the
    lockdown's block decides."""
    policies = """
policies:
  - id: admin_lockdown
    version: 1
    match: {http: {paths: ["/V1/Admin/**"]}}
    rules: [{id: no_admin, when: "true", action: block}]
    default: block
  - id: general
    version: 1
    match: {http: {paths: ["/v1/**"]}}
    rules: [{id: ok, when: "true", action: allow}]
    default: allow
"""

    async def served(request: Request) -> JSONResponse:
        return JSONResponse({"served": request.url.path})

    guard = Guard(PolicySet(load_text(policies)), backends=ScriptedBackend(scripted_answers))
    app = Starlette(routes=[Route("/{path:path}", served, methods=["POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])
    async with client_for(app) as client:
        locked = await client.post("/V1/Admin/users")
        other = await client.post("/v1/admin/users")
    assert (locked.status_code, locked.json()["policy"], locked.json()["rule"]) == (403, "admin_lockdown", "no_admin")
    assert other.json() == {"served": "/v1/admin/users"}


@pytest.mark.anyio
async def test_a_policy_matching_only_the_path_as_sent_is_judged_on_it_beside_a_catch_all() -> None:
    """A policy whose glob matches only ``/Admin/users`` as sent was judged on the lower-cased view once a catch-all
    matched that view too, so its ``^/Admin/`` rule never fired: 403 alone, 200 beside an unrelated policy."""
    lockdown = """
policies:
  - id: r
    version: 1
    match: {http: {paths: ["/Admin/**"]}}
    state: {route: path}
    rules: [{id: mixed, when: 'state.route.matches("^/Admin/")', action: block}]
"""
    catch_all = """
  - id: any
    version: 1
    match: {http: {}}
    rules: [{id: never, when: 'subject.path == "/nothing-here"', action: block}]
"""

    async def served(request: Request) -> JSONResponse:
        return JSONResponse({"served": request.url.path})

    for text in (lockdown, lockdown + catch_all):
        guard = Guard(PolicySet(load_text(text)), backends=ScriptedBackend(scripted_answers))
        app = Starlette(routes=[Route("/{path:path}", served, methods=["GET"])],
                        middleware=[Middleware(GuardMiddleware, guard=guard)])
        async with client_for(app) as client:
            locked = await client.get("/Admin/users")
            other = await client.get("/admin/users")
        assert (locked.status_code, locked.json()["policy"], locked.json()["rule"]) == (403, "r", "mixed"), text
        assert other.json() == {"served": "/admin/users"}


@pytest.mark.anyio
async def test_policies_judged_on_the_path_as_sent_share_one_model_request_beside_a_catch_all() -> None:
    """Two policies for ``/Admin/**`` with the same state and backend ask the model once for ``/Admin/users``; a
    catch-all matching the lower-cased view gave each its own copy of the subject, and so its own request."""
    policies = """
policies:
  - id: a
    version: 1
    match: {http: {paths: ["/Admin/**"]}}
    state: {route: path}
    questions: {injection: {type: noul, instructions: "Is it an injection?"}}
    rules: [{id: inj, when: 'injection.noul >= 0.9', action: block}]
  - id: b
    version: 1
    match: {http: {paths: ["/Admin/**"]}}
    state: {route: path}
    questions: {spam: {type: noul, instructions: "Is it spam?"}}
    rules: [{id: sp, when: 'spam.noul >= 0.9', action: block}]
"""
    catch_all = """
  - id: any
    version: 1
    match: {http: {}}
    rules: [{id: never, when: 'subject.path == "/nothing-here"', action: block}]
"""

    async def served(request: Request) -> JSONResponse:
        return JSONResponse({"served": request.url.path})

    for text in (policies, policies + catch_all):
        backend = ScriptedBackend(scripted_answers)
        guard = Guard(PolicySet(load_text(text)), backends=backend)
        app = Starlette(routes=[Route("/{path:path}", served, methods=["GET"])],
                        middleware=[Middleware(GuardMiddleware, guard=guard)])
        async with client_for(app) as client:
            answer = await client.get("/Admin/users")
        assert (answer.status_code, backend.calls) == (200, 1), text


@pytest.mark.anyio
async def test_a_response_policy_watching_only_the_path_as_sent_judges_the_response_on_it() -> None:
    """As for requests: a response policy for ``/Admin/**`` judges ``/Admin/users``'s response with that path,
    beside a catch-all response policy that watches the lower-cased view."""
    policies = """
policies:
  - id: r
    version: 1
    match: {http: {paths: ["/Admin/**"], response: {}}}
    rules: [{id: mixed, when: 'subject.path.startsWith("/Admin/")', action: block}]
  - id: any
    version: 1
    match: {http: {response: {}}}
    rules: [{id: never, when: 'subject.path == "/nothing-here"', action: block}]
"""

    async def served(request: Request) -> JSONResponse:
        return JSONResponse({"served": request.url.path})

    guard = Guard(PolicySet(load_text(policies)), backends=ScriptedBackend(scripted_answers))
    app = Starlette(routes=[Route("/{path:path}", served, methods=["GET"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])
    async with client_for(app) as client:
        locked = await client.get("/Admin/users")
        other = await client.get("/admin/users")
    assert (locked.status_code, locked.json()["policy"], locked.json()["rule"]) == (403, "r", "mixed")
    assert other.json() == {"served": "/admin/users"}
