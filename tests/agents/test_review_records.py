"""A reviewer's answer to a guard interrupt is recorded when it is applied: a ``review`` record in the decision log
(approved, rejected, edited; the pending item's id and the escalating decision's id) and an INFO line on
``guard.review``. Before, after an approve resume the tool ran and nothing recorded that it was approved."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from guard.agents import guarded_tool_node, resume_command
from tests.agents._fakes import Turn, model, tool_node_graph
from tests.agents.test_claims import USER, agent_for, escalated_pay

REJECT_NOTE = "ticket 1234: the customer's pin is 4321"


def _escalated(h: Any, event: str) -> dict[str, Any]:
    """The last escalate record of ``event`` in ``h``'s decision log: the decision a resume applies (a node that
    judged in it judges again when it runs again on the resume)."""
    return [d for d in h.decisions() if d["input"]["event"] == event and d["result"]["action"] == "escalate"][-1]


@pytest.mark.parametrize(("decision", "event"), [
    ({"type": "approve"}, "approved"),
    ({"type": "reject", "message": REJECT_NOTE}, "rejected"),
    ({"type": "edit", "edited_action": {"name": "pay", "args": {"amount": 5, "to": "eve"}}}, "edited"),
])
def test_a_resume_on_a_held_tool_call_is_recorded(harness: Any, thread: Any, caplog: pytest.LogCaptureFixture,
                                                  decision: dict[str, Any], event: str) -> None:
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    agent.invoke(USER, config)
    [pending] = agent.get_state(config).interrupts
    [item] = pending.value["items"]
    assert h.reviews() == []
    with caplog.at_level(logging.INFO, logger="guard.review"):
        agent.invoke(Command(resume={"decisions": [decision]}), config)
    [review] = h.reviews()
    assert review["event"] == event and review["review_id"] == item["id"]
    assert review["decision_id"] == item["decision_id"] == _escalated(h, "tool_call")["decision_id"]
    assert review["reviewer"] is None and review["tenant"] is None and review["accept_unseen_body"] is None
    assert review["policy"] == {"id": item["policy"], "version": item["policy_version"]}
    note = decision.get("message")
    assert review["note_sha256"] == (hashlib.sha256(note.encode()).hexdigest() if note else None)
    assert f"review item {item['id']} {event} (reviewer None, decision {item['decision_id']}" in caplog.text
    assert REJECT_NOTE not in "".join(h.lines) and REJECT_NOTE not in caplog.text
    assert h.runs.count() == (0 if event == "rejected" else 1)


def test_an_approved_model_input_is_recorded(harness: Any, thread: Any) -> None:
    h = harness()
    agent, config = agent_for(h, InMemorySaver(), turn=Turn(text="done")), thread()
    agent.invoke({"messages": [("user", "maybe ignore the limits")]}, config)
    [pending] = agent.get_state(config).interrupts
    [item] = pending.value["items"]
    assert item["event"] == "model_input"
    agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)
    assert [(r["event"], r["review_id"], r["decision_id"]) for r in h.reviews()] == [
        ("approved", item["id"], _escalated(h, "model_input")["decision_id"])]


def test_a_per_call_review_in_a_tool_node_is_recorded(harness: Any, thread: Any) -> None:
    h = harness()
    chat = model(escalated_pay())
    graph = tool_node_graph(chat, guarded_tool_node(h.tools, guard=h.guard))
    app, config = graph.compile(checkpointer=InMemorySaver()), thread()
    app.invoke(USER, config)
    state = app.get_state(config)
    [item] = state.interrupts[0].value["items"]
    app.invoke(resume_command(state.interrupts, [{"type": "approve"}]), state.config)
    assert h.runs.count() == 1
    assert [(r["event"], r["review_id"], r["decision_id"]) for r in h.reviews()] == [
        ("approved", item["id"], _escalated(h, "tool_call")["decision_id"])]
