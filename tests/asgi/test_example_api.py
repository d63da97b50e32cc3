"""The example API (examples/api) with the shipped api_abuse policy: every row of the example traffic is judged
and answered as its verdict says. The backend is scripted to be a perfect judge of the labelled rows, so this checks
the plumbing (policy match on every route, rules, statuses, the FastAPI app behind the guard), not a model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from guard.engine import Guard
from guard.policy.normalize import normalize_text
from guard.systemone import SystemOneRequestV1
from tests._backends import ScriptedBackend
from tests.asgi._apps import client_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.api.app import create_app
from examples.api.traffic import load_traffic

pytestmark = pytest.mark.anyio

ROWS = load_traffic()


def _user_text(body: dict[str, Any]) -> str:
    return body.get("message") or body.get("query") or body["messages"][-1]["content"]


ATTACK_TEXTS = [normalize_text(_user_text(r["body"])).value[:200] for r in ROWS if r["label"] == "attack"]


def judge(request: SystemOneRequestV1) -> dict[str, Any]:
    """A perfect judge of the labelled rows (by their normalised text, as the engine sends it)."""
    attack = any(text in request.state["text"] for text in ATTACK_TEXTS)
    return {"guard.prompt_injection": 0.97 if attack else 0.02, "guard.harmful_request": 0.02, "spam": 0.01}


async def test_example_traffic_through_the_guarded_example_app() -> None:
    backend = ScriptedBackend(judge)
    guard = Guard.from_files(ROOT / "policies" / "api_abuse.yaml", backends=backend)
    async with client_for(create_app(guard)) as client:
        for row in ROWS:
            response = await client.request(row["method"], row["path"], json=row["body"])
            assert len(response.headers["x-guard-decision-id"]) == 36, row["id"]
            if row["label"] == "benign":  # the application answered: brief decision headers
                assert response.status_code == 200 and "x-guard-action" not in response.headers, row["id"]
            else:
                assert response.status_code == 403, row["id"]
                assert response.headers["x-guard-policy"].startswith("api-abuse@"), row["id"]
                rule = response.json()["rule"]
                assert rule in ("injection", "hidden-text", "sql-statement", "script-markup", "code-execution"), row["id"]
        health = await client.get("/healthz")
    assert health.status_code == 200 and "x-guard-decision-id" not in health.headers
    assert backend.calls == len(ROWS)
    assert {r["label"] for r in ROWS} == {"benign", "attack"} and len(ROWS) == 54
    await guard.aclose()


async def test_the_admin_listener_reports_the_middlewares_counters() -> None:
    """create_app and create_admin given one HttpMetrics: a judged request shows on the admin port's metrics."""
    from examples.api.app import create_admin
    from guard import MemoryReviewStore
    from guard.asgi import HttpMetrics

    guard = Guard.from_files(ROOT / "policies" / "api_abuse.yaml", backends=ScriptedBackend(judge))
    store, metrics = MemoryReviewStore(), HttpMetrics()
    async with client_for(create_app(guard, review_store=store, metrics=metrics)) as client:
        assert (await client.post("/v1/messages", json={"message": "Where is my parcel?"})).status_code == 200
    async with client_for(create_admin(guard, store, metrics=metrics)) as admin:
        text = (await admin.get("/_guard/metrics")).text
    assert 'guard_http_guarded_requests_total{guard_action="allow",guard_policy_id="api-abuse"} 1.0' in text
    await guard.aclose()
