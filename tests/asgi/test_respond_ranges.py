"""Range requests on paths a response policy watches, through the middleware and the proxy (real uvicorn on
loopback): the request goes on without ``Range`` and ``If-Range``, so the response is judged whole; a part that comes
back anyway (206, ``multipart/byteranges``) is refused. HEAD and conditional requests are answered as before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from guard.asgi import GuardMiddleware
from guard.asgi.proxy import ProxyConfig, proxy_app
from guard.engine import Guard
from guard.policy import load_text
from tests._backends import ScriptedBackend
from tests.asgi._servers import serve_in_thread

#: ``status: [200]`` and ``content_types`` as the docs' example writes them: a 206 (or multipart/byteranges) is
#: neither, and passed unjudged before the fix; without them, each range was judged alone.
FILTERED = "{status: [200], content_types: [text/plain]}"
POLICY = r"""
policies:
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: RESPONSE}}
    state: {text: body_text}
    rules:
      - {id: secret, when: 'state.text.contains("SECRET-PLAN")', action: block, message: leak}
      - {id: keys, when: 'state.text.matches("sk-")', action: redact, redact: {patterns: {api_key: 'sk-[A-Za-z0-9]{8,}'}}}
"""
PLAN = "the plan is SECRET-PLAN and key sk-abcdefgh1234\n"
KEY = "the key is sk-abcdefgh1234, keep it\n"
RANGES = ["bytes=0-", "bytes=0-16", "bytes=17-", "bytes=0-10,12-30,35-"]


async def _partial_anyway(request: Request) -> Response:
    """An application that answers a range whatever the request asked for."""
    return Response(PLAN[:17], status_code=206, media_type="text/plain",
                    headers={"content-range": f"bytes 0-16/{len(PLAN)}"})


async def _byteranges_anyway(request: Request) -> Response:
    body = f"--b\r\ncontent-type: text/plain\r\ncontent-range: bytes 0-16/{len(PLAN)}\r\n\r\n{PLAN[:17]}\r\n--b--\r\n"
    return Response(body, status_code=200, media_type="multipart/byteranges; boundary=b")


def _app(files: Path) -> Starlette:
    (files / "plan.txt").write_text(PLAN)
    (files / "key.txt").write_text(KEY)
    return Starlette(routes=[
        Route("/out/plan", lambda request: FileResponse(files / "plan.txt", media_type="text/plain")),
        Route("/out/key", lambda request: FileResponse(files / "key.txt", media_type="text/plain")),
        Route("/public/plan", lambda request: FileResponse(files / "plan.txt", media_type="text/plain")),
        Route("/out/partial", _partial_anyway),
        Route("/out/byteranges", _byteranges_anyway),
        Mount("/out/static", StaticFiles(directory=files)),
    ])


def _guard(response: str) -> Guard:
    return Guard(load_text(POLICY.replace("RESPONSE", response)), backends=ScriptedBackend(lambda request: {}))


@contextmanager
def _served(how: str, files: Path, guard: Guard) -> Iterator[httpx.Client]:
    """A client of the app behind the middleware, or of the app as the upstream of ``guard proxy``."""
    if how == "middleware":
        app = _app(files)
        app.user_middleware.insert(0, Middleware(GuardMiddleware, guard=guard))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield client
    else:
        with serve_in_thread(_app(files)) as upstream, serve_in_thread(proxy_app(guard, ProxyConfig(upstream))) as url, \
                httpx.Client(base_url=url, timeout=10) as client:
            yield client


@pytest.mark.parametrize("how", ["middleware", "proxy"])
@pytest.mark.parametrize("response", [FILTERED, "{}"])
def test_a_range_on_a_watched_path_is_answered_whole_and_judged(how: str, response: str, tmp_path: Path) -> None:
    guard = _guard(response)
    with _served(how, tmp_path, guard) as client:
        plan = {r: client.get("/out/plan", headers={"range": r}) for r in RANGES}
        key = {r: client.get("/out/key", headers={"range": r, "if-range": "x"}) for r in RANGES}
        static = client.get("/out/static/plan.txt", headers={"range": "bytes=0-16"})
        public = client.get("/public/plan", headers={"range": "bytes=0-16"})
    guard.close()
    for r, answer in [*plan.items(), ("static", static)]:
        assert answer.status_code == 403 and answer.json()["code"] == "response_blocked", (r, answer.text)
        assert "SECRE" not in answer.text
    for r, answer in key.items():
        assert answer.status_code == 200 and answer.text == "the key is [REDACTED:api_key], keep it\n", (r, answer.text)
        assert "x-guard-response-decision-id" in answer.headers and "content-range" not in answer.headers
    assert public.status_code == 206 and public.text == PLAN[:17]  # no policy watches it: ranges work as before


@pytest.mark.parametrize("how", ["middleware", "proxy"])
@pytest.mark.parametrize("path", ["/out/partial", "/out/byteranges"])
def test_a_part_of_a_response_that_comes_anyway_is_refused(how: str, path: str, tmp_path: Path) -> None:
    guard = _guard(FILTERED)
    with _served(how, tmp_path, guard) as client:
        answer = client.get(path, headers={"range": "bytes=0-16"})
    guard.close()
    assert answer.status_code == 502 and "SECRE" not in answer.text
    assert answer.json()["code"] == "response_uninspectable" and answer.json()["policy"] == "leaks"


@pytest.mark.parametrize("how", ["middleware", "proxy"])
def test_head_and_conditional_requests_on_a_watched_path_are_answered_as_before(how: str, tmp_path: Path) -> None:
    guard = _guard("{}")
    with _served(how, tmp_path, guard) as client:
        first = client.get("/out/static/key.txt")
        head = client.head("/out/static/key.txt", headers={"range": "bytes=0-4"})
        unchanged = client.get("/out/static/key.txt", headers={"if-none-match": first.headers["etag"]})
    guard.close()
    assert first.status_code == 200 and first.text == "the key is [REDACTED:api_key], keep it\n"
    assert head.status_code == 200 and head.content == b"" and "content-range" not in head.headers
    assert unchanged.status_code == 304 and unchanged.content == b""
