"""How an LLM reviewer settled a handoff is recorded: the decision log gets the settled verdict under the handoff's
decision id, and ``guard.handoffs`` counts it by outcome; before, only the ``handoff`` record was written, so a call a
reviewer denied, or one blocked because the reviewer's answer was malformed, read as a bare handoff."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from guard.engine.telemetry import DecisionLog, Telemetry
from guard.engine.verdicts import FAIL_ACTIONS
from guard.verdict import Verdict
from tests.agents._drive import drive
from tests.agents._fakes import Turn
from tests.agents.test_middleware_events import USER, _reviewer, make_agent


@pytest.mark.parametrize(("answer", "action", "outcome"), [
    ({"decision": "deny", "reason": "the user never named this payee"}, "block", "denied"),
    ({"decision": "allow", "reason": "the user asked for it"}, "allow", "allowed"),
    ({"decision": "deny", "reason": "r" * 1500}, "block", "failed"),  # malformed: fail mode closed
])  # fmt: skip
def test_a_settled_handoff_is_recorded_and_counted(harness: Any, thread: Any, answer: dict[str, str], action: str,
                                                   outcome: str) -> None:
    h = harness()
    reader = InMemoryMetricReader()
    h.guard.telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    agent = make_agent(h, Turn(calls=[("pay", {"amount": 50, "to": "reviewer"}, "a")]),
                       reviewers={"second_opinion": _reviewer(json.dumps(answer))}, fail_mode="closed")
    drive(agent, USER, thread(), "invoke")
    [handoff] = [r for r in h.decisions() if r["input"]["event"] == "tool_call"]  # decisions: records with no kind
    [settled] = [json.loads(line) for line in h.lines if json.loads(line).get("kind") == "handoff_outcome"]
    assert handoff["result"]["action"] == "handoff" and handoff["result"]["handoff"] == "second_opinion"
    assert settled["decision_id"] == handoff["decision_id"] and settled["action"] == action
    assert settled["outcome"] == outcome and settled["policy"]["id"] == handoff["policy"]["id"]
    assert (settled["fail_mode"] == "closed") == (outcome == "failed")
    assert (settled["error"] == "reviewer 'second_opinion' did not answer with one JSON object {decision, reason}: "
            "reason: string_too_long") == (outcome == "failed")
    assert "input" not in settled and "state" not in settled  # the handoff's own record holds them
    assert "payee" not in json.dumps(settled) and "the user asked" not in json.dumps(settled)  # the reviewer's text
    assert "rrrr" not in json.dumps(settled)  # a malformed answer's text is not quoted in the error
    data = reader.get_metrics_data()
    counted = [(dict(p.attributes), p.value) for rm in data.resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics if m.name == "guard.handoffs" for p in m.data.data_points]
    assert counted == [({"guard.policy.id": handoff["policy"]["id"], "outcome": outcome}, 1)]
    assert h.runs.count() == (action == "allow")


@pytest.mark.parametrize("fail_mode", ["closed", "open", "escalate"])
def test_a_handoff_that_fails_takes_its_fail_modes_action_from_the_engines_one_table(harness: Any, thread: Any,
                                                                                    fail_mode: str) -> None:
    """A handoff that fails takes its fail mode's action from the engine's one table,
    :data:`~guard.engine.verdicts.FAIL_ACTIONS`: closed blocks, open allows, escalate escalates."""
    h = harness()
    malformed = json.dumps({"decision": "deny", "reason": "r" * 1500})
    agent = make_agent(h, Turn(calls=[("pay", {"amount": 50, "to": "reviewer"}, "a")]),
                       reviewers={"second_opinion": _reviewer(malformed)}, fail_mode=fail_mode)
    drive(agent, USER, thread(), "invoke")
    [settled] = [json.loads(line) for line in h.lines if json.loads(line).get("kind") == "handoff_outcome"]
    assert settled["outcome"] == "failed" and settled["fail_mode"] == fail_mode
    assert settled["action"] == FAIL_ACTIONS[fail_mode] == {"closed": "block", "open": "allow", "escalate": "escalate"}[
        fail_mode]


@pytest.mark.parametrize("log_input", ["redacted", "none"])
def test_a_failed_handoffs_error_is_scrubbed_of_secrets_as_a_decisions_is(log_input: str) -> None:
    """An outcome's error that quotes an endpoint (with ``?api-key=``) or a key (a reviewer's failure named its whole
    exception before it named only its type) is scrubbed of those shapes as a decision record's error is, under
    ``none`` too (it kept them in clear, where ``redacted`` masked them)."""
    key = "sk-" + "Q7wErTy9uIoP3aSdF6gH" * 2
    exc = ConnectionError(f"POST https://llm.example/openai/deployments/g4/chat?api-key=azk3y0987654321 with {key}")
    error = f"reviewer 'second_opinion' failed: {exc!r}"
    verdict = Verdict("block", "d1", policy_id="p", error=error)
    record = DecisionLog(io.StringIO(), log_input=log_input).handoff_outcome(verdict, "failed")
    decision = DecisionLog(io.StringIO(), log_input=log_input).event(verdict, None)
    assert "azk3y0987654321" not in decision["error"] and key not in decision["error"]
    assert "azk3y0987654321" not in record["error"] and key not in record["error"]
    assert record["error"].startswith("reviewer 'second_opinion' failed: ConnectionError('POST https://llm.example/")
