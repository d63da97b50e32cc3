"""Routes do not depend on the order a policy lists a choice's options: options go to a remote backend sorted by id,
answers come back in the policy's order, and the cache key is the same for either listing.

The backend is a real System One endpoint on uvicorn (loopback) that answers **by position**: the first option it is
sent gets the most probability, as a model that favours the first listed option would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.backends import SystemOneClient
from guard.engine import Guard
from guard.policy import PolicySet, load_text
from guard.subject import HttpSubject
from tests.asgi._servers import serve_in_thread

POLICY = """
policies:
  - id: ORDER
    version: 1
    match: {http: {paths: ["/ORDER/**"]}}
    state: {text: body_text}
    questions:
      queue:
        type: choice
        instructions: Which team should answer this message?
        criteria: CRITERIA
    rules:
      - {id: refunds, when: 'queue.choice == "refund"', action: escalate}
      - {id: disputes, when: 'queue.choice == "dispute"', action: block}
    default: allow
"""
OPTIONS = {"refund": "Refunds and chargebacks", "billing": "Invoices and payments", "dispute": "Card disputes"}


def _policies() -> str:
    """Two policies with the same question, options listed in two orders (``refund`` first, ``dispute`` first)."""
    out = []
    for order, ids in (("a", ["refund", "billing", "dispute"]), ("b", ["dispute", "billing", "refund"])):
        criteria = "{" + ", ".join(f"{i}: {OPTIONS[i]}" for i in ids) + "}"
        text = POLICY.replace("ORDER", order).replace("CRITERIA", criteria)
        out.append(text if not out else text.split("policies:\n", 1)[1])
    return "".join(out)


class Positional:
    """A System One endpoint whose answers depend on option position: the first option sent gets 0.5, the next
    0.3, the last 0.2 (with ``"tie"`` in the state, every option gets the same share and the first sent is chosen)."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    async def systemone(self, request: Request) -> JSONResponse:
        body: dict[str, Any] = await request.json()
        answers = {}
        for qid, question in body["questions"].items():
            ids = list(question["criteria"])
            self.sent.append(ids)
            tie = "tie" in str(body["state"])
            shares = [1 / len(ids)] * len(ids) if tie else [0.5, 0.3, 0.2][: len(ids)]
            probabilities = dict(zip(ids, shares, strict=True))
            answers[qid] = {"type": "choice", "choice": ids[0], "confidence": shares[0], "probabilities": probabilities}
        return JSONResponse({"model": body["model"], "answers": answers, "usage": {"input_tokens": 1}})


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[str, Positional]]:
    backend = Positional()
    app = Starlette(routes=[Route("/v1/systemone", backend.systemone, methods=["POST"])])
    with serve_in_thread(app) as url:
        yield url, backend


def _subject(order: str, text: str) -> HttpSubject:
    return HttpSubject(method="POST", path=f"/{order}/messages", body={"text": text}, body_text=text)


def test_the_endpoint_answers_by_position(endpoint: tuple[str, Positional]) -> None:
    url, _ = endpoint
    for ids in (["refund", "billing"], ["billing", "refund"]):
        question = {"type": "choice", "instructions": "Team?", "criteria": dict.fromkeys(ids, "")}
        body = {"model": "m", "state": "x", "questions": {"queue": question}}
        answer = httpx.post(f"{url}/v1/systemone", json=body, timeout=10).json()["answers"]["queue"]
        assert answer["choice"] == ids[0]  # the first listed wins: listing order would pick the route


@pytest.mark.anyio
async def test_the_route_is_the_same_for_either_listing_order(endpoint: tuple[str, Positional]) -> None:
    url, backend = endpoint
    guard = Guard(PolicySet(load_text(_policies())), backends=SystemOneClient(url))
    try:
        sent_before = len(backend.sent)
        first = await guard.aevaluate(_subject("a", "My card was charged twice for one order"))
        second = await guard.aevaluate(_subject("b", "Please resend last month's invoice"))
        assert backend.sent[sent_before:] == [["billing", "dispute", "refund"]] * 2  # sorted by id on the wire
        for verdict, listed in ((first, ["refund", "billing", "dispute"]), (second, ["dispute", "billing", "refund"])):
            answer = verdict.answers["queue"]
            assert (verdict.action, verdict.rule, answer.choice) == ("allow", "default", "billing")
            assert list(answer.probabilities) == listed  # reported in the policy's own order
            assert answer.probabilities == {"billing": 0.5, "dispute": 0.3, "refund": 0.2}
        ties = [await guard.aevaluate(_subject(order, "tie: either team")) for order in "ab"]
        # an exact tie goes to the option id that sorts first, for both listings
        assert [(v.answers["queue"].choice, v.action) for v in ties] == [("billing", "allow")] * 2
    finally:
        await guard.aclose()


@pytest.mark.anyio
async def test_both_listings_share_one_cache_entry(endpoint: tuple[str, Positional]) -> None:
    url, backend = endpoint
    guard = Guard(PolicySet(load_text(_policies())), backends=SystemOneClient(url))
    try:
        text = "Why is there a fee on my statement?"
        plans = [guard._plan(policy) for policy in guard.policies.policies]
        keys = {plan.prepare(_subject(order, text))[3] for plan, order in zip(plans, "ab", strict=True)}
        assert len(keys) == 1  # the key does not depend on the listing order
        sent_before = len(backend.sent)
        miss = await guard.aevaluate(_subject("a", text))
        hit = await guard.aevaluate(_subject("b", text))
        assert len(backend.sent) == sent_before + 1 and (miss.cache_hit, hit.cache_hit) == (False, True)
        assert list(hit.answers["queue"].probabilities) == ["dispute", "billing", "refund"]
        assert hit.answers["queue"].probabilities == miss.answers["queue"].probabilities
        assert hit.answers["queue"].choice == miss.answers["queue"].choice == "billing"
    finally:
        await guard.aclose()
