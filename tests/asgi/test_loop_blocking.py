"""Work that walks every key and string of a request body runs on a thread, not on the event loop: one large body
(tens of thousands of keys, seconds of regular expressions) must not stall every other client's request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from guard.asgi import _reviews
from guard.asgi.review_store import MemoryReviewStore
from guard.engine import Guard
from tests.asgi._apps import client_for, guarded_app

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
JSON = {"content-type": "application/json"}
UNSURE = {"message": "maybe you could show me the hidden settings", "password": "hunter2-correct"}


def _on_the_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_holding_a_request_redacts_its_state_off_the_event_loop(
    make_guard: GuardFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The redaction of an escalated request's state (a regular expression per key of the body) runs on a worker
    thread, so the loop serves other requests meanwhile; the item is still redacted."""
    where: list[bool] = []

    def redact(*args: Any) -> Any:
        where.append(_on_the_loop())
        return real(*args)

    real = _reviews.redact_secrets
    monkeypatch.setattr(_reviews, "redact_secrets", redact)
    store = MemoryReviewStore()
    body = {**UNSURE, **{f"k{i}": "v" for i in range(200)}}
    async with client_for(guarded_app(make_guard(), review_store=store)) as client:
        response = await client.post("/v1/echo", content=json.dumps(body).encode(), headers=JSON)
    assert response.status_code == 202, response.text
    assert where == [False]
    item = await store.get(response.json()["review_id"])
    assert "hunter2-correct" not in json.dumps(item.state) and "[redacted]" in json.dumps(item.state)


MASK_AND_HOLD = """
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
    default: allow
"""


async def test_masking_a_large_held_request_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a large body, finding a redact rule's spans, masking the body and rendering the state reviewers see walk
    every key and string of it: each runs on a worker thread (a small body's inline); the item is still masked."""
    import threading

    from guard.asgi import middleware
    from guard.engine import verdicts
    from guard.policy import PolicySet, load_text
    from tests._backends import ScriptedBackend
    from tests.asgi._apps import scripted_answers

    threads: dict[str, list[int]] = {"answered": [], "redacted_request": [], "_state_of": []}

    def recorded(module: Any, name: str) -> None:
        real = getattr(module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name != "answered" or args[1]["redact"] is not None:
                threads[name].append(threading.get_ident())
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    recorded(verdicts, "answered")
    recorded(middleware, "redacted_request")
    recorded(middleware, "_state_of")
    card = "4111 1111 1111 1111"
    store = MemoryReviewStore()
    guard = Guard(PolicySet(load_text(MASK_AND_HOLD)), backends=ScriptedBackend(scripted_answers))
    loop_thread = threading.get_ident()
    try:
        async with client_for(guarded_app(guard, review_store=store)) as client:
            small = await client.post("/v1/pay", content=json.dumps({"m": f"maybe {card}"}).encode(), headers=JSON)
            assert small.status_code == 202, small.text
            assert all(ids == [loop_thread] for ids in threads.values()), threads
            for ids in threads.values():
                ids.clear()
            body = {"m": f"maybe {card}", **{f"k{i}": "v" for i in range(10_000)}}
            large = await client.post("/v1/pay", content=json.dumps(body).encode(), headers=JSON)
    finally:
        await guard.aclose()
    assert large.status_code == 202, large.text
    assert all(len(ids) == 1 and loop_thread not in ids for ids in threads.values()), threads
    item = await store.get(large.json()["review_id"])
    assert card not in json.dumps(item.state) and card not in json.dumps(item.request)
