"""Shadow policies beside enforced ones in the agent middleware: decisions made without the model (an output guard
cannot read, a malformed call) follow every matching policy, so an enforced policy applies whatever the file order,
and the record names it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from langchain_core.tools import tool

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_files
from tests.agents._drive import drive
from tests.agents._fakes import Turn
from tests.agents.conftest import POLICIES
from tests.agents.test_middleware_events import USER, make_agent


def with_shadow_copy(h: Any, policy_id: str, order: str) -> None:
    """``h``'s guard with a shadow copy of ``policy_id`` (id ``<id>-trial``) first or last in the match order."""
    loaded = list(load_files(POLICIES))
    trial = dataclasses.replace(next(p for p in loaded if p.id == policy_id), id=f"{policy_id}-trial", mode="shadow")
    policies = [trial, *loaded] if order == "shadow_first" else [*loaded, trial]
    h.guard.close()
    h.guard = Guard(policies, backends=h.backend, decision_log=DecisionLog(h.lines.append))


@pytest.mark.parametrize("order", ["shadow_first", "shadow_last"])
def test_an_unreadable_output_is_withheld_by_an_enforced_policy_whatever_the_order(
    harness: Any, thread: Any, order: str
) -> None:
    @tool
    def fetch(url: str) -> list:
        """Fetch an image."""
        return [{"type": "image", "url": "https://example.com/a.png"}]

    h = harness()
    with_shadow_copy(h, "agent-results", order)
    out = drive(make_agent(h, Turn(calls=[("fetch", {"url": "http://x/a.png"}, "f")]), tools=[fetch]), USER,
                thread(), "invoke")
    assert "withheld" in out.tool_messages()["f"].text
    (logged,) = [d for d in h.decisions() if d["result"]["rule"] == "unreadable_result"]
    assert (logged["policy"]["id"], logged["result"]["action"]) == ("agent-results", "block")


@pytest.mark.parametrize("order", ["shadow_first", "shadow_last"])
def test_a_malformed_call_is_recorded_under_the_enforced_policy_whatever_the_order(
    harness: Any, thread: Any, order: str
) -> None:
    h = harness()
    with_shadow_copy(h, "agent-tools", order)
    drive(make_agent(h, Turn(calls=[("pay", '{"{"amount":1}', "bad")]), Turn(text="done")), USER, thread(), "invoke")
    (logged,) = [d for d in h.decisions() if d["result"]["rule"] == "malformed_arguments"]
    assert (logged["policy"]["id"], logged["result"]["action"]) == ("agent-tools", "block")
