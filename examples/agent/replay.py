"""Replay scripted agent tasks through guard and show what ran, what was blocked, and an approval round trip.

Run from the repository root::

    python -m examples.agent.replay                         # compact CPU model, AgentDojo banking + hand-written
    python -m examples.agent.replay --backend local:PATH    # a Clef checkpoint (in-process)
    python -m examples.agent.replay --suite all --limit 5   # per suite: the first 5 user and 5 injection tasks

Every tool call passes ``GuardAgentMiddleware`` (policies: ``policies/tool_result_check.yaml`` and a tool-call policy:
``policies/tool_call_guard.yaml`` for Clef, ``examples/agent/policies/tool_calls_compact.yaml`` for the compact
model, which answers only catalog questions). Escalated calls stop the run with an interrupt; the script plays the
reviewer: it rejects the attacker's calls and approves the others, then resumes with ``resume_command``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from langchain_core.messages import ToolMessage

from examples.agent.agent import LocalSite, build_agent
from examples.agent.scenarios import DATA, Scenario, agentdojo, hand_written, site_pages, tool_specs
from examples.agent.tools import Sandbox, sandbox_tools, stub_tools
from guard import DecisionLog, Guard
from guard.agents import resume_command
from guard.backends import open_backend
from guard.errors import GuardError
from guard.policy import load_files

ROOT = Path(__file__).resolve().parents[2]
COMPACT_POLICIES = [
    Path(__file__).parent / "policies" / "tool_calls_compact.yaml",
    ROOT / "policies/tool_result_check.yaml",
]
CLEF_POLICIES = [ROOT / "policies" / "tool_call_guard.yaml", ROOT / "policies/tool_result_check.yaml"]
SUITES = [*json.loads((DATA / "tools.json").read_text()), "all"]  # banking, slack, travel, workspace, all


def _suite(scenario: Scenario) -> str:
    return scenario.name.partition("/")[0]


def limited(tasks: list[Scenario], limit: int) -> list[Scenario]:
    """Of each suite, the first ``limit`` user tasks and the first ``limit`` injection tasks (replayed as hijacks),
    in their order; every task when ``limit`` is 0."""
    if not limit:
        return tasks
    seen: Counter[tuple[str, str]] = Counter()
    kept = []
    for task in tasks:
        seen[_suite(task), task.kind] += 1
        if seen[_suite(task), task.kind] <= limit:
            kept.append(task)
    return kept


def run_scenario(guard: Guard, sandbox: Sandbox, tools: list[Any], scenario: Scenario, out: Any) -> dict[str, Any]:
    """Run one task to the end, answering escalations as the reviewer; returns the per-call outcome."""
    for name, text in scenario.files.items():
        sandbox.path(name).write_text(text)
    agent = build_agent(guard, tools, scenario.turns, scenario.final)
    config = {"configurable": {"thread_id": scenario.name}}
    result = agent.invoke({"messages": [("user", scenario.user)]}, config)
    reviews = []
    while result.get("__interrupt__"):
        pending = agent.get_state(config).interrupts  # the thread's pending ones, never a kept result's
        items = [item for i in pending for item in i.value["items"]]
        decisions: dict[str, Any] = {}
        for item in items:
            turn, _, index = (item["tool_call_id"] or "call_0_0").removeprefix("call_").partition("_")
            hijacked = (int(turn), int(index)) in scenario.hijacked
            decisions[item["id"]] = (
                {"type": "reject", "message": "the user did not ask for this"} if hijacked else {"type": "approve"}
            )
            reviews.append((item["tool"], item["rule"], decisions[item["id"]]["type"]))
            print(
                f"    review  {item['id']}  {item['tool']} {json.dumps(item['arguments'])[:60]}  policy {item['policy']} "
                f"rule {item['rule']} -> reviewer {'rejects' if hijacked else 'approves'}",
                file=out,
            )
        result = agent.invoke(resume_command(pending, decisions), config)
    answers = {m.tool_call_id: m for m in result["messages"] if isinstance(m, ToolMessage)}
    return {"answers": answers, "reviews": reviews}


def _verdicts(records: list[dict[str, Any]], call_id: str, event: str) -> list[dict[str, Any]]:
    return [
        r for r in records if (r.get("input") or {}).get("tool_call_id") == call_id and r["input"]["event"] == event
    ]


def report(scenario: Scenario, outcome: dict[str, Any], records: list[dict[str, Any]], out: Any) -> Counter[str]:
    counts: Counter[str] = Counter()
    for t, turn in enumerate(scenario.turns):
        for n, (tool_name, args) in enumerate(turn):
            call_id = f"call_{t}_{n}"
            message = outcome["answers"].get(call_id)
            guarded = message is not None and message.additional_kwargs.get("lc_source") == "guard"
            stopped = message is None or (guarded and message.status == "error" and
                                          message.additional_kwargs["lc_data"].get("outcome") != "withheld")  # fmt: skip
            verdict = (_verdicts(records, call_id, "tool_call") or [{"result": {"action": "allow", "rule": None},
                                                                     "policy": {"id": None}, "metrics": {}}])[0]  # fmt: skip
            withheld = any(r["result"]["action"] != "allow" for r in _verdicts(records, call_id, "tool_result"))
            hijacked = (t, n) in scenario.hijacked
            label = "attacker" if hijacked else "wanted"
            counts[f"{label}_calls"] += 1
            counts[f"{label}_{'stopped' if stopped else 'ran'}"] += 1
            counts["outputs_withheld"] += int(withheld)
            action, rule = verdict["result"]["action"], verdict["result"]["rule"]
            latency = verdict.get("metrics", {}).get("latency_ms")
            print(f"    {tool_name:<30} {action:<8} {rule or '-':<26} {latency or 0:>7.1f} ms  "
                  f"{'NOT RUN' if stopped else 'ran'}{'  (output withheld)' if withheld else ''}  [{label}]",
                  file=out)  # fmt: skip
    return counts


def replay(guard: Guard, records: list[dict[str, Any]], *, suite: str, limit: int, out: Any) -> Counter[str]:
    """Run the hand-written tasks and the AgentDojo tasks of ``suite``; ``records`` fills with the guard's decision
    log (the guard's ``DecisionLog`` must append to it). Returns the totals printed at the end."""
    totals: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="guard-example-") as folder, LocalSite(site_pages()) as site:
        sandbox = Sandbox(Path(folder))
        real = sandbox_tools(sandbox)
        tools = real + stub_tools(sandbox, tool_specs(suite), skip={t.name for t in real})
        every = agentdojo(suite)
        tasks = limited(every, limit)
        handmade = hand_written(site.base_url)
        for scenario in handmade + tasks:
            start = len(records)
            print(f"[{scenario.kind}] {scenario.name}: {scenario.user[:90]}", file=out)
            outcome = run_scenario(guard, sandbox, tools, scenario, out)
            totals += report(scenario, outcome, records[start:], out)
            totals["approvals"] += len(outcome["reviews"])
    ran, available = Counter(s.kind for s in tasks), Counter(s.kind for s in every)
    print(
        f"\nAgentDojo ({suite}): {ran['benign']} of {available['benign']} user tasks, {ran['attack']} of "
        f"{available['attack']} injection tasks replayed as hijacks; plus {len(handmade)} hand-written tasks "
        f"({sum(s.kind == 'attack' for s in handmade)} of them attacks)",
        file=out,
    )
    print(
        f"wanted calls that ran: {totals['wanted_ran']}/{totals['wanted_calls']}; attacker calls stopped: "
        f"{totals['attacker_stopped']}/{totals['attacker_calls']}; tool outputs withheld: {totals['outputs_withheld']}; "
        f"reviewer decisions: {totals['approvals']}\n(stopped = blocked by the guard, or escalated by it and then "
        "rejected by this script's reviewer, which knows the scripted attacks: with a weak model the guard escalates, "
        "and the human decides)",
        file=out,
    )
    return totals


def _check_writable(path: Path) -> None:
    """Raises ValueError naming ``--decisions PATH`` when it cannot be appended to."""
    try:
        path.open("a").close()
    except OSError as exc:
        reason = {FileNotFoundError: "no such directory", IsADirectoryError: "is a directory, not a file"}.get(
            type(exc), exc.strerror or str(exc)
        )
        raise ValueError(f"--decisions {path}: {reason}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="compact", help="compact (default), local:CHECKPOINT_DIR or http:URL")
    parser.add_argument("--policy", action="append", type=Path, help="policy files (default: by backend)")
    parser.add_argument("--suite", default="banking", choices=SUITES, help="AgentDojo suite (default: banking)")
    parser.add_argument("--limit", type=int, default=0, metavar="N",
                        help="of each suite, only the first N user tasks and the first N injection tasks (replayed as "
                             "hijacks); 0 (default) = every task. The hand-written tasks always run")  # fmt: skip
    parser.add_argument("--decisions", type=Path, help="also append the decision log (JSON lines) to this file")
    args = parser.parse_args(argv)
    records: list[dict[str, Any]] = []

    def sink(line: str) -> None:
        records.append(json.loads(line))
        if args.decisions is not None:
            with args.decisions.open("a") as handle:
                handle.write(line + "\n")

    try:
        if args.limit < 0:
            raise ValueError(f"--limit must be 0 (every task) or positive, got {args.limit}")
        if args.decisions is not None:
            _check_writable(args.decisions)
        compact = args.backend.partition(":")[0] == "compact"  # compact or compact:DIR
        policies = load_files(*(args.policy or (COMPACT_POLICIES if compact else CLEF_POLICIES)))
        guard = Guard(policies, backends=open_backend(args.backend), decision_log=DecisionLog(sink))
    except (GuardError, OSError, ValueError) as exc:  # PolicyError (a question the backend cannot answer) is one
        print(f"replay.py: {exc}", file=sys.stderr)
        return 2
    with guard:
        replay(guard, records, suite=args.suite, limit=args.limit, out=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
