"""GuardAgentMiddleware with a real decision model: the tiny Clef checkpoint in process (LocalBackend), no scripted
answers. The tiny model's weights are random, so the test checks the plumbing, not the judgement: every tool call
gets a real model decision, and what runs is exactly what the decisions allow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain.agents import create_agent
from langgraph.checkpoint.memory import InMemorySaver

from guard.agents import GuardAgentMiddleware, resume_command
from guard.backends.compact import CompactBackend
from guard.backends.local import LocalBackend
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.errors import PolicyError
from guard.policy import load_text
from tests.agents._fakes import Runs, Turn, counting_tools, model

POLICY = """
policies:
  - id: e2e-tools
    version: "1"
    match: {agent: {events: [tool_call]}}
    state: {task: user_message, tool: tool_name, arguments: arguments}
    questions:
      serves: {catalog: guard.tool_call_serves_task}
    rules:
      - {id: off_task, when: serves.noul < 0.3, action: block, message: off task}
      - {id: unsure, when: serves.noul < 0.7, action: escalate}
    default: allow
    timeout_ms: 60000
"""


@pytest.mark.anyio
async def test_real_model_decisions_are_enforced(golden_checkpoint: Path) -> None:
    lines: list[str] = []
    backend = LocalBackend.from_pretrained(golden_checkpoint, dtype=torch.float32)
    runs = Runs()
    turn = Turn(calls=[("pay", {"amount": 5, "to": "bob"}, "a"), ("read_file", {"path": "notes.txt"}, "b"),
                       ("delete_all_records", {}, "c")])  # fmt: skip
    async with Guard(load_text(POLICY), backends=backend, decision_log=DecisionLog(lines.append)) as guard:
        agent = create_agent(model(turn), counting_tools(runs), middleware=[GuardAgentMiddleware(guard=guard)],
                             checkpointer=InMemorySaver())  # fmt: skip
        config: dict[str, Any] = {"configurable": {"thread_id": "e2e"}}
        result = await agent.ainvoke({"messages": [("user", "pay bob 5 and read my notes")]}, config)
        approved: set[str] = set()
        if result.get("__interrupt__"):
            items = [item for i in result["__interrupt__"] for item in i.value["items"]]
            approved = {item["tool_call_id"] for item in items}
            decisions = {item["id"]: {"type": "approve"} for item in items}
            result = await agent.ainvoke(resume_command(result["__interrupt__"], decisions), config)
    records = {r["input"]["tool_call_id"]: r for r in map(json.loads, lines)}
    assert set(records) == {"a", "b", "c"}
    for record in records.values():
        assert record["backend"] == "clef-local" and record["fail_mode"] is None and record["revision"]
        assert abs(sum(record["answers"]["serves"].values()) - 1.0) < 1e-6
    ran = {name for name, _ in runs.calls}
    names = {"a": "pay", "b": "read_file", "c": "delete_all_records"}
    for call_id, record in records.items():
        action = record["result"]["action"]
        should_run = action == "allow" or (action == "escalate" and call_id in approved)
        assert (names[call_id] in ran) == should_run, (call_id, action)
    assert result["messages"][-1].text == "done"


def test_the_clef_policies_docs_agents_md_names_need_a_clef_backend(golden_checkpoint: Path) -> None:
    """docs/agents.md: the compact model refuses policies/tool_call_guard.yaml at load time; a Clef backend loads it."""
    root = Path(__file__).resolve().parents[2]
    files = (root / "policies" / "tool_call_guard.yaml", root / "policies" / "tool_result_check.yaml")
    with pytest.raises(PolicyError, match="cannot answer question 'destructive'"):
        Guard.from_files(*files, backends=CompactBackend.default())
    guard = Guard.from_files(*files, backends=LocalBackend.from_pretrained(golden_checkpoint, dtype=torch.float32))
    try:
        assert {policy.id for policy in guard.policies} == {"tool-call-guard", "tool-result-check"}
    finally:
        guard.close()
