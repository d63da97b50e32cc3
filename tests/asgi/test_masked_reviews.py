"""An escalation (or a handoff) that wins over another enforced policy's ``redact`` keeps that policy's masks: the
request is masked before it is held, so reviewers, the store (memory and a real Redis), the decision log, the
application after a release (either kind) and a handoff target never see what the redact rule masks."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from guard.asgi import GuardMiddleware, review_app
from guard.asgi.handoff import HandoffClient, HandoffTarget
from guard.asgi.review_store import MemoryReviewStore, RedisReviewStore, ReviewStore
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import PolicySet, load_text
from tests._backends import ScriptedBackend
from tests.asgi._apps import client_for, scripted_answers
from tests.asgi._servers import OpenAIStandIn, serve_in_thread

pytestmark = pytest.mark.anyio

CARD = "4111 1111 1111 1111"
POLICIES = """
handoff_targets:
  helpdesk: {base_url: "http://127.0.0.1:9/v1", model: helpdesk-1, timeout: 5}
policies:
  - id: card-mask
    version: 1
    match: {http: {methods: [POST], paths: ["/v1/**"]}}
    state:
      text: {from: body_text, max_chars: 4000}
    rules:
      - id: card-numbers
        when: state.text.matches("[0-9]{4}")
        action: redact
        redact:
          patterns: {card: '\\b\\d{4}(?: ?\\d{4}){3}\\b'}
    default: allow
  - id: unsure
    version: 1
    match: {http: {methods: [POST], paths: ["/v1/**"]}}
    state:
      text: {from: body_text, max_chars: 4000}
    rules:
      - id: maybe
        when: state.text.contains("maybe")
        action: escalate
        message: held
      - id: helpdesk
        when: state.text.contains("helpdesk")
        action: handoff
        handoff: helpdesk
    default: allow
"""
REVIEWER = {"authorization": "Bearer alice-secret-0123456789"}
CLIENT = {"content-type": "application/json", "authorization": "Bearer client-token"}


async def body_echo(request: Request) -> Response:
    """The body as the application reads it."""
    return JSONResponse({"body": (await request.body()).decode()})


def _body(message: str) -> bytes:
    return json.dumps({"message": message, "note": "card on file"}).encode()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, create_redis: Any) -> Any:
    if request.param == "memory":
        store: ReviewStore = MemoryReviewStore()
    else:
        store = RedisReviewStore(create_redis(), prefix=create_redis.prefix)
    yield store
    await store.aclose()


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[OpenAIStandIn, str]]:
    server = OpenAIStandIn()
    with serve_in_thread(server.app) as url:
        yield server, url


def _app(guard: Guard, store: ReviewStore, **options: Any) -> Starlette:
    routes = [Mount("/admin/reviews", app=review_app(store, reviewers={"alice": REVIEWER["authorization"][7:]})),
              Route("/{path:path}", body_echo, methods=["POST"])]
    return Starlette(routes=routes,
                     middleware=[Middleware(GuardMiddleware, guard=guard, review_store=store, **options)])


async def test_an_escalation_beside_a_redact_holds_shows_stores_logs_and_releases_the_masked_request(
    store: ReviewStore, create_redis: Any
) -> None:
    records: list[str] = []
    guard = Guard(PolicySet(load_text(POLICIES)), backends=ScriptedBackend(scripted_answers),
                  decision_log=DecisionLog(records.append))
    try:
        async with client_for(_app(guard, store)) as client:
            plain = await client.post("/v1/pay", content=_body(f"pay with {CARD} please"), headers=CLIENT)
            held = await client.post("/v1/pay", content=_body(f"maybe pay with {CARD} please"), headers=CLIENT)
            assert held.status_code == 202, held.text
            review_id, token = held.json()["review_id"], held.json()["release_token"]
            item = (await client.get(f"/admin/reviews/{review_id}", headers=REVIEWER)).json()
            stored = await store.get(review_id)
            raw = b""
            if isinstance(store, RedisReviewStore):
                fields = await create_redis().hgetall(f"{create_redis.prefix}{review_id}")
                raw = b"\n".join(k + b"=" + v for k, v in fields.items())
            await client.post(f"/admin/reviews/{review_id}/approve", headers=REVIEWER)
            released = await client.post(held.json()["release_url"], headers={
                "authorization": "Bearer client-token", "x-guard-release-token": token})

            # the other release: the client resends the request as it sent it
            again = await client.post("/v1/pay", content=_body(f"maybe pay with {CARD} again"), headers=CLIENT)
            resend = {**CLIENT, "x-guard-review-id": again.json()["review_id"],
                      "x-guard-release-token": again.json()["release_token"]}
            await store.approve(again.json()["review_id"], by="alice")
            other_card = await client.post("/v1/pay", content=_body(f"maybe pay with {CARD} and 5500 0000 0000 0004"
                                                                     " again"), headers=resend)
            resent = await client.post("/v1/pay", content=_body(f"maybe pay with {CARD} again"), headers=resend)
    finally:
        await guard.aclose()
    masked = "[REDACTED:card]"
    assert plain.status_code == 200 and masked in plain.json()["body"]  # the redact alone, as before
    assert held.headers["x-guard-action"] == "escalate"
    assert item["state"] == {"text": f"maybe pay with {masked} please\ncard on file"}
    held_body = base64.b64decode(stored.request["body_b64"]).decode()  # type: ignore[index]
    assert CARD not in held_body and masked in held_body
    assert CARD.encode() not in raw and CARD.replace(" ", "").encode() not in raw  # Redis: the view, in clear
    assert released.status_code == 200 and released.headers["x-guard-review"] == "released"
    assert json.loads(released.json()["body"]) == {"message": f"maybe pay with {masked} please", "note": "card on file"}
    assert other_card.status_code == 409 and "digest mismatch" in other_card.json()["message"]
    assert resent.status_code == 200 and resent.headers["x-guard-review"] == "released"
    assert json.loads(resent.json()["body"])["message"] == f"maybe pay with {masked} again"
    for line in records:
        assert CARD not in line, line
    escalated = json.loads(records[1])
    assert escalated["result"]["action"] == "escalate" and escalated["result"]["redactions"]


async def test_a_handoff_beside_a_redact_sends_the_target_the_masked_request(
    standin: tuple[OpenAIStandIn, str]
) -> None:
    server, url = standin
    guard = Guard(PolicySet(load_text(POLICIES)), backends=ScriptedBackend(scripted_answers))
    handoff = HandoffClient(targets={"helpdesk": HandoffTarget("helpdesk", f"{url}/v1", "helpdesk-1", timeout=5)})
    try:
        async with client_for(_app(guard, MemoryReviewStore(), handoff=handoff)) as client:
            answered = await client.post("/v1/pay", content=_body(f"helpdesk: pay with {CARD}"), headers=CLIENT)
    finally:
        await guard.aclose()
        await handoff.aclose()
    assert answered.status_code == 200 and answered.headers["x-guard-action"] == "handoff"
    user = server.calls[-1]["messages"][1]["content"]
    assert CARD not in user and "[REDACTED:card]" in user


async def test_a_block_beside_a_redact_still_blocks() -> None:
    """A block passes nothing on: the verdict keeps no spans and the request is refused as before."""
    policies = POLICIES.replace("action: escalate\n        message: held", "action: block\n        message: held")
    guard = Guard(PolicySet(load_text(policies)), backends=ScriptedBackend(scripted_answers))
    try:
        verdict = await guard.aevaluate(_subject(f"maybe pay with {CARD}"))
        async with client_for(_app(guard, MemoryReviewStore())) as client:
            blocked = await client.post("/v1/pay", content=_body(f"maybe pay with {CARD}"), headers=CLIENT)
    finally:
        await guard.aclose()
    assert verdict.action == "block" and verdict.redactions == ()
    assert blocked.status_code == 403 and blocked.json()["rule"] == "maybe"


def _subject(message: str) -> Any:
    from guard.subject import HttpSubject

    body = json.loads(_body(message))
    return HttpSubject(method="POST", path="/v1/pay", body=body, body_text="\n".join(body.values()),
                       content_type="application/json")


async def test_a_multipart_body_the_redact_cannot_mask_is_refused_naming_the_redacting_policy() -> None:
    """Review nit: a multipart body beside an escalation and an enforced redact got 422 ``redact_unsupported`` naming
    the escalating policy (``unsure``); it names the policy whose redaction cannot be applied."""
    guard = Guard(PolicySet(load_text(POLICIES)), backends=ScriptedBackend(scripted_answers))
    try:
        async with client_for(_app(guard, MemoryReviewStore())) as client:
            for message in (f"maybe pay with {CARD}", f"pay with {CARD}"):  # escalated, and the redact alone
                refused = await client.post("/v1/pay", files={"message": (None, message)})
                assert (refused.status_code, refused.json()["code"], refused.json()["policy"]) == \
                    (422, "redact_unsupported", "card-mask"), refused.text
    finally:
        await guard.aclose()
