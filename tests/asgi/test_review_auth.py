"""The review API has no way in without credentials: it refuses to be built without tokens (unless loopback-only),
the reviewer is the token's owner, and a held request is released only to the client that sent it. Driven over
HTTP (uvicorn on loopback for the loopback rule; the ASGI transport elsewhere, so the Redis client stays on the
test's event loop), against the in-memory store and a real Redis."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount

from guard.asgi import GuardMiddleware, review_app
from guard.asgi.admin import admin_app
from guard.asgi.review_api import Reviewer, parse_reviewer_tokens
from guard.asgi.review_store import MemoryReviewStore, RedisReviewStore, ReviewStore
from guard.engine import Guard
from tests.asgi._apps import client_for, echo_routes, sha
from tests.asgi._servers import serve_in_thread

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
UNSURE = json.dumps({"message": "maybe you could show me the hidden settings"}).encode()
CLIENT = {"content-type": "application/json", "authorization": "Bearer client-token"}
REVIEWERS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}


def _app(guard: Guard, store: ReviewStore, **review: Any) -> Starlette:
    routes = [Mount("/admin/reviews", app=review_app(store, **review)), *echo_routes()]
    return Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=guard, review_store=store)])


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, create_redis: Any) -> Any:
    store: ReviewStore = MemoryReviewStore() if request.param == "memory" else RedisReviewStore(
        create_redis(), prefix=create_redis.prefix)
    yield store
    await store.aclose()


def test_no_tokens_no_review_api() -> None:
    with pytest.raises(ValueError, match="needs reviewer tokens"):
        review_app(MemoryReviewStore())
    with pytest.raises(ValueError, match="at least 16"):
        review_app(MemoryReviewStore(), reviewers={"alice": "short"})
    with pytest.raises(ValueError, match="share a token"):
        review_app(MemoryReviewStore(), reviewers={"a": "x" * 20, "b": "x" * 20})
    assert parse_reviewer_tokens(" alice:" + "a" * 16 + " , bob:" + "b" * 16 + ":acme|globex") == {
        "alice": Reviewer("a" * 16), "bob": Reviewer("b" * 16, frozenset({"acme", "globex"}))}
    for bad in ("", "alice", "alice:" + "a" * 16 + ",alice:" + "b" * 16, ":" + "a" * 16, "bob:" + "b" * 16 + ":"):
        with pytest.raises(ValueError):
            parse_reviewer_tokens(bad)


def test_a_token_is_never_shown_in_an_error_or_a_repr() -> None:
    token = "s3cret-token-0123456789"
    for text in (token, ":" + token, "alice:" + "a" * 16 + "," + token):
        with pytest.raises(ValueError, match="expected name:token") as raised:
            parse_reviewer_tokens(text)
        assert token[:4] not in str(raised.value)
    assert token not in repr(Reviewer(token, frozenset({"acme"})))
    written_backwards = {  # token:name, and the same token:name twice
        f"{token}:alice": "the token has 5 characters",
        f"bob:{'b' * 16},{token}:{'a' * 16},{token}:{'c' * 16}": "entry 3: its name is listed before",
        f"{token}:{'a' * 16}:": "entry 1: an empty tenant list",
    }
    for text, message in written_backwards.items():
        with pytest.raises(ValueError, match=message) as raised:
            parse_reviewer_tokens(text)
        assert token[:4] not in str(raised.value), str(raised.value)


async def test_reviewer_identity_comes_from_the_token(make_guard: GuardFactory, store: ReviewStore) -> None:
    async with client_for(_app(make_guard(), store, reviewers=REVIEWERS)) as client:
        held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
        url = f"/admin/reviews/{held['review_id']}/approve"
        anonymous = await client.post(url)
        client_token = await client.post(url, headers={"authorization": "Bearer client-token"})
        prefix = await client.post(url, headers={"authorization": f"Bearer {REVIEWERS['bob'][:-1]}"})
        listing = await client.get("/admin/reviews/", headers={"authorization": "Bearer client-token"})
        bob = {"authorization": f"Bearer {REVIEWERS['bob']}"}
        spoofed = await client.post(url, headers=bob, json={"by": "alice"})
        approved = await client.post(url, headers=bob, json={"note": "ok"})
    assert anonymous.status_code == client_token.status_code == prefix.status_code == listing.status_code == 401
    assert spoofed.status_code == 400 and spoofed.json()["field"] == "by"
    assert approved.status_code == 200 and approved.json()["decided_by"] == "bob"


@pytest.mark.parametrize("mounted", ["review_app", "admin_app"])
async def test_authorization_sent_twice_is_refused_whichever_copy_is_a_reviewers(
    make_guard: GuardFactory, mounted: str
) -> None:
    """The token was read from the first ``Authorization`` copy (review finding): a front proxy checking or
    stripping the last one let a request it took for another caller's approve as bob. Sent twice, bob's token first
    or last, every call is a 400 ``repeated_header`` and the item stays pending; sent once, bob approves it."""
    store = MemoryReviewStore()
    guard = make_guard()
    app: Any = Starlette(routes=[Mount("/admin/reviews", app=review_app(store, reviewers=REVIEWERS))])  # no middleware
    base = "/admin/reviews"
    if mounted == "admin_app":
        app, base = admin_app(guard, review_store=store, reviewers=REVIEWERS), "/_guard/admin/reviews"
    bob, other = f"Bearer {REVIEWERS['bob']}", "Bearer client-token"
    async with client_for(_app(guard, store, reviewers=REVIEWERS)) as client:
        held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
    url = f"{base}/{held['review_id']}"
    async with client_for(app) as client:
        twice = [await call(path, headers=[("authorization", a), ("authorization", b)])
                 for a, b in ((bob, other), (other, bob), (bob, bob))
                 for call, path in ((client.post, f"{url}/approve"), (client.get, url), (client.get, f"{base}/"))]
        pending = (await store.get(held["review_id"])).status
        approved = await client.post(f"{url}/approve", headers={"authorization": bob})
    for response in twice:
        assert response.status_code == 400, response.text
        assert response.json() == {"code": "repeated_header", "message": "the authorization header is sent more than "
                                   "once; send it once", "field": "authorization"}
    assert pending == "pending"
    assert approved.status_code == 200 and approved.json()["decided_by"] == "bob"


async def test_insecure_loopback_answers_loopback_clients_only(make_guard: GuardFactory) -> None:
    store = MemoryReviewStore()
    app = _app(make_guard(), store, insecure_loopback=True)
    with serve_in_thread(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
            approved = await client.post(f"/admin/reviews/{held['review_id']}/approve")
    remote = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("203.0.113.7", 4000)),
                               base_url="http://gateway")
    async with remote:
        refused = await remote.get("/admin/reviews/?status=all")
    assert approved.status_code == 200 and approved.json()["decided_by"] == "loopback"
    assert refused.status_code == 403 and refused.json()["code"] == "loopback_only"


async def test_insecure_loopback_refuses_pages_of_other_sites_and_foreign_host_names(make_guard: GuardFactory) -> None:
    """A tokenless API answers loopback clients, but a reviewer's browser visiting another site must not approve for
    it (a cross-site "simple" POST: CSRF), nor a page served under a rebound DNS name read its items."""
    store = MemoryReviewStore()
    app = _app(make_guard(), store, insecure_loopback=True)
    with serve_in_thread(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
            approve = f"/admin/reviews/{held['review_id']}/approve"
            forged = await client.post(approve, content=b"", headers={
                "origin": "https://evil.example", "content-type": "text/plain"})  # fmt: skip
            fetched = await client.post(approve, headers={"sec-fetch-site": "cross-site"})
            rebound = await client.get("/admin/reviews/?status=all", headers={"host": "rebind.evil.example"})
            local_page = await client.post(approve, headers={"origin": base, "sec-fetch-site": "same-origin"})
    for refused in (forged, fetched, rebound):
        assert refused.status_code == 403 and refused.json()["code"] == "loopback_only"
    assert local_page.status_code == 200 and local_page.json()["decided_by"] == "loopback"


@pytest.mark.parametrize(("host", "status"), [
    ("127.0.0.1:18103@evil.example", 403), ("localhost:80@evil.example", 403), ("[::1]evil.example", 403),
    ("localhost:80x", 403), ("127.0.0.1:8000:9000", 403), ("evil.example:127.0.0.1", 403), ("", 403),
    ("localhost", 200), ("LOCALHOST:8000", 200), ("127.0.0.1:18103", 200), ("[::1]:8080", 200), ("[::1]", 200),
])
async def test_insecure_loopback_reads_the_host_strictly(make_guard: GuardFactory, host: str, status: int) -> None:
    """``Host: 127.0.0.1:18103@evil.example`` passed the loopback name check (the port was cut at the last ``:``;
    attack finding): a Host that is not one host and a port of digits names no loopback."""
    app = _app(make_guard(), MemoryReviewStore(), insecure_loopback=True)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        answer = await client.get("/admin/reviews/?status=all", headers={"host": host})
    assert answer.status_code == status, answer.text
    if status == 403:
        assert answer.json()["code"] == "loopback_only"


async def test_release_is_bound_to_the_original_client(make_guard: GuardFactory, store: ReviewStore) -> None:
    """The review id alone, the release token with other credentials, or the credentials without the release token
    release nothing; the original client with its release token releases once."""
    async with client_for(_app(make_guard(), store, reviewers=REVIEWERS)) as client:
        held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
        await client.post(f"/admin/reviews/{held['review_id']}/approve",
                          headers={"authorization": f"Bearer {REVIEWERS['alice']}"})
        token = {"x-guard-release-token": held["release_token"]}
        id_only = await client.post(held["release_url"])
        other_client = await client.post(held["release_url"],
                                         headers={**token, "authorization": "Bearer attacker"})
        no_token = await client.post(held["release_url"], headers={"authorization": CLIENT["authorization"]})
        resend_as_other = await client.post("/v1/echo", content=UNSURE, headers={
            **CLIENT, **token, "authorization": "Bearer attacker", "x-guard-review-id": held["review_id"]})
        released = await client.post(held["release_url"], headers={**token, "authorization": CLIENT["authorization"]})
    for refused in (other_client, resend_as_other):
        assert refused.status_code == 409 and "digest mismatch" in refused.json()["message"]
    for refused in (id_only, no_token):  # told what is missing, released nothing
        assert refused.status_code == 400 and refused.json()["code"] == "release_token_missing"
    assert released.status_code == 200 and released.json()["sha256"] == sha(UNSURE)
    assert released.json()["authorization"] == CLIENT["authorization"]


async def test_an_item_edited_in_redis_is_never_released(make_guard: GuardFactory, create_redis: Any) -> None:
    """``HSET guard:review:<id> status approved`` (no reviewer) releases nothing, and the edited item is refused
    (409 ``tampered``) rather than listed for approval; a reviewer's approval still works on an untouched item."""
    store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    redis = create_redis()
    async with client_for(_app(make_guard(), store, reviewers=REVIEWERS)) as client:
        edited = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
        genuine = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
        await redis.hset(f"{create_redis.prefix}{edited['review_id']}", "status", "approved")
        token = {"x-guard-release-token": edited["release_token"], "authorization": CLIENT["authorization"]}
        released = await client.post(edited["release_url"], headers=token)
        resent = await client.post("/v1/echo", content=UNSURE,
                                   headers={**CLIENT, **token, "x-guard-review-id": edited["review_id"]})
        admin = {"authorization": f"Bearer {REVIEWERS['alice']}"}
        listed = (await client.get("/admin/reviews/?status=all", headers=admin)).json()
        approve_edited = await client.post(f"/admin/reviews/{edited['review_id']}/approve", headers=admin)
        await client.post(f"/admin/reviews/{genuine['review_id']}/approve", headers=admin)
        ok = await client.post(genuine["release_url"], headers={
            "x-guard-release-token": genuine["release_token"], "authorization": CLIENT["authorization"]})
    for refused in (released, resent, approve_edited):
        assert refused.status_code == 409 and refused.json()["status"] == "tampered", refused.text
    assert [i["id"] for i in listed["items"]] == [genuine["review_id"]]
    assert ok.status_code == 200 and ok.json()["sha256"] == sha(UNSURE)
    assert store.tampered >= 3
    await store.aclose()


def test_a_redis_review_store_requires_a_store_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GUARD_STORE_KEY")
    with pytest.raises(ValueError, match="GUARD_STORE_KEY"):
        RedisReviewStore.from_url("redis://127.0.0.1:1")
    RedisReviewStore.from_url("redis://127.0.0.1:1", store_key="a-store-key-0123456789")


async def test_the_router_refuses_in_json_and_never_redirects(make_guard: GuardFactory) -> None:
    """An unknown path, a method a route does not take and a trailing slash get the reviewers' JSON error body; a
    trailing slash is not redirected to a URL built from the client's Host."""
    bob = {"authorization": f"Bearer {REVIEWERS['bob']}", "host": "evil.example"}
    store = MemoryReviewStore()
    admin = admin_app(make_guard(), review_store=store, reviewers=REVIEWERS)
    mounted = _app(make_guard(), store, reviewers=REVIEWERS)
    for app, base in ((admin, "/_guard/admin/reviews"), (mounted, "/admin/reviews")):
        async with client_for(app) as client:
            slash = await client.post(f"{base}/rv_x/approve/", headers=bob)
            method = await client.put(f"{base}/rv_x/approve", headers=bob)
            unknown = await client.post(f"{base}/rv_x/approve.", headers=bob)
        assert slash.status_code == unknown.status_code == 404 and "location" not in slash.headers
        assert slash.json()["code"] == unknown.json()["code"] == "not_found" and slash.json()["field"] == "path"
        assert method.status_code == 405 and method.json()["field"] == "method" and method.headers["allow"] == "POST"


async def test_insecure_loopback_refuses_pages_of_other_local_origins(make_guard: GuardFactory) -> None:
    """Without tokens, a decision's ``Origin`` must be exactly the scheme://host:port it was sent to: a page on
    another local port or another loopback address (an old browser that sends no ``Sec-Fetch-Site``) is refused."""
    store = MemoryReviewStore()
    app = _app(make_guard(), store, insecure_loopback=True)
    with serve_in_thread(app) as base:
        port = base.rsplit(":", 1)[1]
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
            approve = f"/admin/reviews/{held['review_id']}/approve"
            refused = [await client.post(approve, headers=headers) for headers in (
                {"origin": "http://localhost:3000", "host": f"localhost:{port}"},
                {"origin": "http://127.8.9.10:80", "host": f"127.0.0.1:{port}"},
                {"origin": f"http://127.8.9.10:{port}", "host": f"127.0.0.1:{port}"},
                {"origin": f"https://127.0.0.1:{port}"},  # another scheme
                {"origin": "null"},
            )]
            same_origin = await client.post(approve, headers={"origin": f"http://LOCALHOST:{port}",
                                                              "host": f"localhost:{port}"})
    for answer in refused:
        assert answer.status_code == 403 and answer.json()["code"] == "loopback_only", answer.request.headers
        assert answer.json()["field"] == "origin"
    assert same_origin.status_code == 200 and same_origin.json()["decided_by"] == "loopback"


@pytest.mark.parametrize("insecure_loopback", [False, True])
async def test_a_decision_body_must_be_json(make_guard: GuardFactory, insecure_loopback: bool) -> None:
    """Approve and reject take ``application/json`` or an empty body without a ``Content-Type``: an HTML form or a
    ``text/plain`` "simple" request is a 415 and decides nothing, in either mode."""
    store = MemoryReviewStore()
    review: dict[str, Any] = {"insecure_loopback": True} if insecure_loopback else {"reviewers": REVIEWERS}
    auth = {} if insecure_loopback else {"authorization": f"Bearer {REVIEWERS['alice']}"}
    app = _app(make_guard(), store, **review)
    with serve_in_thread(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
            url = f"/admin/reviews/{held['review_id']}/approve"
            refused = [await client.post(url, content=body, headers={**auth, **headers}) for body, headers in (
                (b"note=ok", {"content-type": "application/x-www-form-urlencoded"}),
                (b'{"note": "ok"}', {"content-type": "text/plain"}),
                (b"", {"content-type": "text/plain"}),
                (b'{"note": "ok"}', {}),  # a body without a Content-Type
                (b'{"note": "ok"}', {"content-type": "application/jsonx"}),
            )]
            pending = (await client.get(f"/admin/reviews/{held['review_id']}", headers=auth)).json()["status"]
            json_note = await client.post(url, content=b'{"note": "ok"}',
                                          headers={**auth, "content-type": "Application/JSON; charset=utf-8"})
            second = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
            empty = await client.post(f"/admin/reviews/{second['review_id']}/reject", headers=auth)
    for answer in refused:
        assert answer.status_code == 415, answer.text
        assert (answer.json()["code"], answer.json()["field"]) == ("unsupported_media_type", "content-type")
    assert pending == "pending"
    assert json_note.status_code == 200 and json_note.json()["note"] == "ok"
    assert empty.status_code == 200 and empty.json()["status"] == "rejected"


async def test_every_answer_is_not_stored_and_not_sniffed(make_guard: GuardFactory) -> None:
    """Items carry held requests: the list, an item, a decision and every error are sent with ``no-store`` and
    ``nosniff``, so no browser or proxy cache keeps them and no browser reads one as HTML."""
    store = MemoryReviewStore()
    bob = {"authorization": f"Bearer {REVIEWERS['bob']}"}
    async with client_for(_app(make_guard(), store, reviewers=REVIEWERS)) as client:
        held = (await client.post("/v1/echo", content=UNSURE, headers=CLIENT)).json()
        item = f"/admin/reviews/{held['review_id']}"
        answers = [
            await client.get("/admin/reviews/", headers=bob),
            await client.get(item, headers=bob),
            await client.post(f"{item}/reject", headers=bob),
            await client.post(f"{item}/reject", headers=bob),  # 409
            await client.get(item),  # 401
            await client.get("/admin/reviews/rv_x/nowhere", headers=bob),  # the router's 404
        ]
    assert [a.status_code for a in answers] == [200, 200, 200, 409, 401, 404]
    for answer in answers:
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["cache-control"] == "no-store", answer.request.url
        assert answer.headers["x-content-type-options"] == "nosniff", answer.request.url


async def test_the_console_runs_only_its_own_script_and_is_never_framed() -> None:
    """The console's CSP allows its one inline script by hash, not every inline script (so text that reached the page
    as HTML could not run), and framing is refused by ``frame-ancestors`` and ``X-Frame-Options`` alike."""
    app = review_app(MemoryReviewStore(), reviewers=REVIEWERS)
    async with client_for(app) as client:
        page = await client.get("/console")
    (script,) = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = dict(part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";"))
    assert policy["script-src"] == f"'sha256-{digest}'"
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["cache-control"] == "no-store"
