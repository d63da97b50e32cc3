"""``_method`` spellings and copies that frameworks read as different methods (review findings): Express runs the
first item of ``_method[]``, ``_method[0]`` and a JSON ``_method`` list, which ``refuse`` let through; Rails reads
the last copy of a repeated field and a blank one hides the override header, Express reads the first copy, which
``judge`` skipped (judging a DELETE while the application ran the POST a policy blocks).

The applications below answer with the method they would run, modelled on Express 4's ``method-override`` as its
README sets it up (header, query and ``urlencoded({extended: true})``/``json()`` body getters) and on Rails'
``Rack::MethodOverride``."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_plus

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.asgi import GuardMiddleware
from guard.engine import Guard
from guard.policy import PolicySet, load_text
from tests._backends import ScriptedBackend
from tests.asgi._apps import client_for, scripted_answers

pytestmark = pytest.mark.anyio

FORM = {"content-type": "application/x-www-form-urlencoded"}
JSON = {"content-type": "application/json"}
NODE_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH", "LINK", "UNLINK", "PURGE"})
RACK_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH", "LINK", "UNLINK"})
QS_LIST_ITEM = re.compile(r"_method\[(\d*)\]")  # qs reads _method[] and _method[0..20] as items of the list _method


def _policy(blocked: str, allowed: str | None) -> str:
    text = f"""
policies:
  - id: {blocked.lower()}s_blocked
    version: 1
    match: {{http: {{methods: [{blocked}], paths: ["/v1/**"]}}}}
    rules: [{{id: refused, when: "true", action: block}}]
    default: block
"""
    if allowed:
        text += f"""
  - id: {allowed.lower()}s_allowed
    version: 1
    match: {{http: {{methods: [{allowed}], paths: ["/v1/**"]}}}}
    rules: [{{id: fine, when: "true", action: allow}}]
    default: allow
"""
    return text


def _pairs(text: str) -> list[tuple[str, str | None]]:
    return [(unquote_plus(name), unquote_plus(value) if eq else None)
            for name, eq, value in (piece.partition("=") for piece in re.split("[&;]", text) if piece)]


def _express(request: Request, body: bytes) -> str:
    """The method Express routes on: each getter in turn overrides a POST with a method Node knows; a list's first
    item counts (``method-override``); the query by Node's ``querystring``, the body by ``qs`` or ``JSON.parse``."""
    header = request.headers.get("x-http-method-override", "").split(",")[0].strip() or None
    query = [value or "" for name, value in _pairs(request.url.query) if name == "_method"]
    if request.headers.get("content-type") == JSON["content-type"]:
        field = json.loads(body).get("_method")
    else:
        items = [value or "" for name, value in _pairs(body.decode()) if name == "_method"
                 or ((item := QS_LIST_ITEM.fullmatch(name)) is not None and int(item.group(1) or 0) <= 20)]
        field = items or None
    method = request.method
    for asked in (header, query or None, field):
        asked = asked[0] if isinstance(asked, list) and asked else asked
        if isinstance(asked, str) and asked.upper() in NODE_METHODS:
            method = asked.upper()
    return method


def _rack(request: Request, body: bytes) -> str:
    """The method Rails runs: ``req.POST['_method'] || X-HTTP-Method-Override`` (the last copy of a repeated field;
    ``""`` is truthy, a name without ``=`` is nil, ``_method[...]`` a truthy Array or Hash), upper-cased, if Rack
    knows it."""
    params: dict[str, Any] = {}
    for name, value in _pairs(body.decode()):
        if name == "_method":
            params["_method"] = value
        elif name.startswith("_method["):
            params["_method"] = [value]
    asked = params.get("_method")
    if asked is None:
        asked = request.headers.get("x-http-method-override", "")
    return asked.upper() if isinstance(asked, str) and asked.upper() in RACK_METHODS else request.method


def _app(framework: str, policy: str, **options: Any) -> Starlette:
    async def run(request: Request) -> JSONResponse:
        body = await request.body()
        ran = (_express if framework == "express" else _rack)(request, body)
        return JSONResponse({"ran": ran})

    guard = Guard(PolicySet(load_text(policy)), backends=ScriptedBackend(scripted_answers))
    return Starlette(routes=[Route("/v1/items/{id}", run, methods=["POST"])],
                     middleware=[Middleware(GuardMiddleware, guard=guard, **options)])


LISTS = [(b"_method[]=DELETE", FORM), (b"_method[0]=DELETE", FORM), (b"x=1&_method%5B%5D=DELETE", FORM),
         (b'{"_method": ["DELETE"]}', JSON)]


@pytest.mark.parametrize("mode", ["refuse", "judge"])
@pytest.mark.parametrize(("body", "headers"), LISTS)
async def test_a_method_list_express_runs_is_refused(mode: str, body: bytes, headers: dict[str, str]) -> None:
    """``_method[]=DELETE``, ``_method[0]=DELETE`` and ``{"_method": ["DELETE"]}`` reached Express unjudged (200
    ``{"ran": "DELETE"}`` with DELETE blocked): 400 ``method_override`` under ``refuse``, and under ``judge`` too
    (Express runs the DELETE, Rails and Symfony the POST)."""
    async with client_for(_app("express", _policy("DELETE", "POST"), method_override=mode)) as client:
        plain = await client.post("/v1/items/1", content=b"_method=DELETE", headers=FORM)
        assert plain.status_code == (400 if mode == "refuse" else 403)  # judged as the DELETE: blocked
        answer = await client.post("/v1/items/1", content=body, headers=headers)
    assert (answer.status_code, answer.json().get("code"), answer.json().get("field")) == \
        (400, "method_override", "_method"), answer.text


@pytest.mark.parametrize(("target", "body", "headers"), [
    ("?_method=&_method=DELETE", b"", {}),  # Node's querystring: the first copy
    ("", b"_method=&_method=DELETE", FORM),  # qs: the first copy
])
async def test_judge_refuses_copies_express_reads_as_the_post(target: str, body: bytes, headers: dict[str, str]) -> None:
    """Under ``judge`` a blank first copy hid the POST Express runs: guard judged the DELETE (allowed) and Express ran
    the POST the policy blocks (200 ``{"ran": "POST"}``); now 400 ``method_override``."""
    async with client_for(_app("express", _policy("POST", "DELETE"), method_override="judge")) as client:
        answer = await client.post("/v1/items/1" + target, content=body, headers=headers)
    assert (answer.status_code, answer.json().get("code"), answer.json().get("field")) == \
        (400, "method_override", "_method"), answer.text


@pytest.mark.parametrize(("unexpected", "allowed"), [("refuse", "DELETE"), ("pass", None)])
@pytest.mark.parametrize(("body", "override"), [
    (b"_method=DELETE&x=1&_method=", None),  # Rails reads the last copy: blank, so the POST
    (b"_method=DELETE&x=1&_method", None),
    (b"_method=DELETE&x=1&_method=%20", None),
    (b"_method=&x=1", "DELETE"),  # "" is truthy in Ruby: the header is never read
    (b".method=DELETE", None),  # _method to PHP only: Rails runs the POST
    (b"%5B_method%5D=DELETE", None),  # _method to Rack 2 and Express, not to Rack 3
    (b"_method=DELETE&_method[]=PUT", None),  # Rails: a type error, so no _method and the POST
])
async def test_judge_refuses_copies_rails_reads_as_the_post(unexpected: str, allowed: str | None, body: bytes,
                                                            override: str | None) -> None:
    """Under ``judge`` guard judged a DELETE (allowed, or by no policy) where Rails runs the POST a policy blocks (200
    ``{"ran": "POST"}``); now 400 ``method_override``."""
    headers = {**FORM, "x-http-method-override": override} if override else FORM
    app = _app("rack", _policy("POST", allowed), method_override="judge", unexpected_body=unexpected)
    async with client_for(app) as client:
        answer = await client.post("/v1/items/1", content=body, headers=headers)
    assert (answer.status_code, answer.json().get("code"), answer.json().get("field")) == \
        (400, "method_override", "_method"), answer.text


@pytest.mark.parametrize("framework", ["express", "rack"])
async def test_judge_still_judges_what_every_framework_runs(framework: str) -> None:
    """A Rails or Laravel form's ``_method`` (lower case), the same method sent twice, a blank field alone, and an
    override header beside a body without ``_method``: judged as the method every framework runs."""
    async with client_for(_app(framework, _policy("POST", "PATCH"), method_override="judge")) as client:
        for body, headers, status, ran in (
            (b"_method=patch&authenticity_token=abc", FORM, 200, "PATCH"),
            (b"_method=PATCH&name=x&_method=patch", FORM, 200, "PATCH"),
            (b"_method=&name=x", FORM, 403, None),  # asks for nothing: the POST, blocked
            (b"name=x", {**FORM, "x-http-method-override": "PATCH"}, 200, "PATCH"),
            (b'{"_method": "PATCH"}', JSON, 200, None),  # Rails does not read JSON; Laravel and Express do
        ):
            answer = await client.post("/v1/items/1", content=body, headers=headers)
            assert answer.status_code == status, (body, answer.text)
            assert ran is None or answer.json() == {"ran": ran}, body
        query = await client.post("/v1/items/1?_method=", content=b"_method=PATCH", headers=FORM)
        assert query.status_code == 200  # a blank query field beside a body field: every framework reads the body


async def test_an_unread_body_beside_an_override_header_is_not_passed_on_where_the_post_is_enforced() -> None:
    """A POST asking for a DELETE by its header, where only a shadow policy judges the DELETE: a body too large to
    read for its ``_method`` was passed on, and Rails, reading a blank ``_method`` there, ran the POST an enforced
    policy blocks (200 ``{"ran": "POST"}``); now refused as a body guard cannot inspect is (413)."""
    policy = _policy("POST", "DELETE").replace("default: allow", "default: allow\n    mode: shadow")
    app = _app("rack", policy, method_override="judge", max_body_bytes=64)
    async with client_for(app) as client:
        answer = await client.post("/v1/items/1", content=b"_method=&x=" + b"1" * 100,
                                   headers={**FORM, "x-http-method-override": "DELETE"})
    assert answer.status_code == 413, answer.text
