"""Shadow policies beside enforced ones in the agent middleware: decisions made without the model (an output guard
cannot read, a malformed call) follow every matching policy, so an enforced policy applies whatever the file order,
and the record names it; a shadow policy's verdict never decides a tool call's record."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from langchain_core.tools import tool

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.errors import BackendUnavailable
from guard.policy import load_files, load_text
from tests._backends import ScriptedBackend
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


# An enforced and a shadow policy on every tool call, each on a backend of its own ("down" fails every call).
TOOL_CALLS = """
policies:
  - id: tools
    version: 1
    match: {agent: {events: [tool_call]}}
    questions: {risky: {type: noul, instructions: "Is this call risky?"}}
    rules: [{id: risky, when: risky.noul >= 0.5, action: block, message: risky}]
    on_error: {mode: open}
    backend: ENFORCED_BACKEND
  - id: tools-trial
    version: 1
    mode: shadow
    match: {agent: {events: [tool_call]}}
    questions: {unusual: {type: noul, instructions: "Is this call unusual?"}}
    rules: [{id: unusual, when: unusual.noul >= 0.5, action: block}]
    on_error: {mode: open}
    backend: SHADOW_BACKEND
"""


@pytest.mark.parametrize(("enforced", "shadow", "fail_mode"), [
    pytest.param("down", "up", "open", id="enforced-fails-open-shadow-would-block"),
    pytest.param("up", "down", None, id="enforced-allows-shadow-fails-open"),
])
def test_a_tool_calls_record_is_the_enforced_policys_whatever_the_shadow_policy_found(
    harness: Any, thread: Any, enforced: str, shadow: str, fail_mode: str | None
) -> None:
    h = harness(answer=lambda r: {"risky": 0.01, "unusual": 0.95})
    h.guard.close()
    text = TOOL_CALLS.replace("ENFORCED_BACKEND", enforced).replace("SHADOW_BACKEND", shadow)
    h.guard = Guard(load_text(text), backends={"up": h.backend, "down": ScriptedBackend(fail=BackendUnavailable(
        "down", backend="down"))}, decision_log=DecisionLog(h.lines.append))
    drive(make_agent(h, Turn(calls=[("pay", {"amount": 5, "to": "bob"}, "c1")]), Turn(text="done")), USER, thread(),
          "invoke")
    assert h.runs.count("pay") == 1
    (logged,) = h.decisions()
    assert (logged["policy"]["id"], logged["result"]["shadow_action"], logged["fail_mode"]) == ("tools", None,
                                                                                                fail_mode)
    assert ("fail_open" in logged["flags"]) == (fail_mode == "open")
    trial = logged["policies"][1]
    assert (trial["id"], trial["shadow_action"]) == ("tools-trial", "block" if shadow == "up" else "allow")
