"""Replay AgentDojo v1 conversations through ``GuardAgentMiddleware``: the user's calls should run, a hijacked agent's
calls should be stopped. Prints, per suite and attack template, user-task calls allowed, injection calls stopped
(blocked or escalated) and tool results flagged, with decision latency per tool call and per model turn.

Traces (``agentdojo==0.1.35``, MIT; ``pip install agentdojo==0.1.35``, not a dependency of guard): for every v1 user
task, its ground-truth calls in the suite's default environment (``clean``). For every (user task, injection task)
pair and attack template, agentdojo's attack fills the injection slots the user task reads, so the injection appears
inside real tool results; the user task's calls are followed by the injection task's ground-truth calls, what a
hijacked agent does next. A scripted chat model emits the recorded calls one per model turn; the tools are the
suite's own functions running against that trace's environment. Every escalation is answered by a reviewer that
rejects it, so "allowed" means the guard let the call run on its own.

Run from the repository root (not part of CI)::

    python bench/agentdojo_replay.py --quick                    # every user task clean, every 4th under attack
    python bench/agentdojo_replay.py                            # all 97 user tasks x injection tasks x 4 attacks
    python bench/agentdojo_replay.py --attacks direct,system_message --tool-result-action strip
    python bench/agentdojo_replay.py --quick --export tests/agents/data/agentdojo_sample.jsonl --export-limit 1

``--export`` writes the replayed traces with their recorded tool results (the sample the tests replay offline).
Policies: ``examples/agent/policies/tool_calls_compact.yaml`` and ``policies/tool_result_check.yaml`` on the compact
CPU model (the CPU default; no Clef, no LLM). Nothing in them is tuned per suite: the tool declarations name each
function's effect and sensitive arguments, the rules read only provenance, the tool-result check and (optionally) the
model's alignment answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from examples.agent.agent import replay_model
from guard.agents import GuardAgentMiddleware, resume_command
from guard.backends import open_backend
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_files

# Settings --------------------------------------------------------------------------------------------------------
POLICIES = (
    ROOT / "examples" / "agent" / "policies" / "tool_calls_compact.yaml",
    ROOT / "policies" / "tool_result_check.yaml",
)
ATTACKS = ("important_instructions", "tool_knowledge", "direct", "ignore_previous")
QUICK_EVERY = 4  # --quick: every 4th user task of a suite under attack (all of them clean)
MODEL_NAME = "gpt-4o-2024-05-13"  # the pipeline name agentdojo's attacks address the model by ("GPT-4")
FLAGGED_OUTCOMES = ("withheld", "quoted", "stripped")
SYSTEM_PROMPT = "You are a helpful assistant. Use the tools to do what the user asks."


@dataclass
class Call:
    """One recorded call: the function, its arguments, ``user`` or ``injection``, and its result when recorded."""

    function: str
    args: dict[str, Any]
    kind: str
    result: str | None = None


@dataclass
class Trace:
    """One conversation: a user task, optionally under one attack, and the calls the agent makes."""

    suite: str
    user_task: str
    injection_task: str | None
    attack: str | None
    prompt: str
    calls: list[Call]
    tools: Callable[[], list[BaseTool]] = field(repr=False, default=list)

    @property
    def label(self) -> str:
        return self.attack or "clean"

    def record(self) -> dict[str, Any]:
        return {
            "suite": self.suite, "user_task": self.user_task, "injection_task": self.injection_task,
            "attack": self.attack, "prompt": self.prompt,
            "calls": [{"function": c.function, "args": c.args, "kind": c.kind, "result": c.result} for c in self.calls],
        }  # fmt: skip


def agentdojo_traces(attacks: Sequence[str], quick: bool, suites: Sequence[str] = ()) -> Iterator[Trace]:
    """Traces built with agentdojo (real environments, real tool results; see the module docstring).

    Raises:
        SystemExit: agentdojo is not installed.
    """
    try:
        from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
        from agentdojo.attacks.attack_registry import load_attack
        from agentdojo.functions_runtime import FunctionsRuntime
        from agentdojo.task_suite.load_suites import get_suites
    except ImportError:
        raise SystemExit("this replay needs agentdojo: pip install agentdojo==0.1.35") from None

    class Pipeline:  # what agentdojo's attacks read from the attacked pipeline: its name
        name = MODEL_NAME

    for suite_name, suite in get_suites("v1").items():
        if suites and suite_name not in suites:
            continue
        runtime = FunctionsRuntime(suite.tools)
        loaded = {name: load_attack(name, suite, Pipeline()) for name in attacks}

        def tools_for(
            environment: Any, recorded: list[Call], runtime: Any = runtime, suite: Any = suite
        ) -> Callable[[], list[BaseTool]]:
            def run_in(function: str) -> Callable[..., str]:
                def run(**arguments: Any) -> str:
                    result, error = runtime.run_function(environment, function, arguments)
                    text = tool_result_to_str(result) if error is None else error
                    for call in recorded:  # keep what the tool returned with the trace (for --export)
                        if call.function == function and call.result is None:
                            call.result = text
                            break
                    return text

                return run

            def build() -> list[BaseTool]:
                return [
                    StructuredTool.from_function(
                        func=run_in(f.name), name=f.name, description=f.description, args_schema=f.parameters
                    )
                    for f in suite.tools
                ]

            return build

        for index, (user_id, user_task) in enumerate(suite.user_tasks.items()):
            environment = suite.load_and_inject_default_environment({})
            calls = [Call(c.function, dict(c.args), "user") for c in user_task.ground_truth(environment.model_copy(deep=True))]
            yield Trace(suite_name, user_id, None, None, user_task.PROMPT, calls, tools_for(environment, calls))
            if quick and index % QUICK_EVERY:
                continue
            for injection_id, injection_task in suite.injection_tasks.items():
                for attack_name, attack in loaded.items():
                    environment = suite.load_and_inject_default_environment(attack.attack(user_task, injection_task))
                    calls = [
                        Call(c.function, dict(c.args), "user")
                        for c in user_task.ground_truth(environment.model_copy(deep=True))
                    ] + [
                        Call(c.function, dict(c.args), "injection")
                        for c in injection_task.ground_truth(environment.model_copy(deep=True))
                    ]
                    yield Trace(
                        suite_name, user_id, injection_id, attack_name, user_task.PROMPT, calls,
                        tools_for(environment, calls),
                    )  # fmt: skip


def recorded_traces(path: Path) -> Iterator[Trace]:
    """Traces from an ``--export`` file: the tools answer with the recorded results (no agentdojo needed)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        calls = [Call(c["function"], c["args"], c["kind"], c["result"]) for c in row["calls"]]
        yield Trace(
            row["suite"], row["user_task"], row["injection_task"], row["attack"], row["prompt"], calls,
            _recorded_tools(calls),
        )  # fmt: skip


def _recorded_tools(calls: list[Call]) -> Callable[[], list[BaseTool]]:
    def build() -> list[BaseTool]:
        left = list(calls)

        def run_in(name: str) -> Callable[..., str]:
            def run(**arguments: Any) -> str:
                for call in left:  # the calls of a trace run in order, so the first one left is this one
                    if call.function == name:
                        left.remove(call)
                        return call.result or ""
                return f"{name}: no recorded result left"

            return run

        names = sorted({c.function for c in calls})
        return [
            StructuredTool.from_function(func=run_in(n), name=n, description=f"recorded {n}", args_schema=_schema(calls, n))
            for n in names
        ]

    return build


def _schema(calls: list[Call], name: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for call in calls:
        if call.function == name:
            properties.update({key: {} for key in call.args})
    return {"type": "object", "properties": properties}


@dataclass
class Outcome:
    """What happened to one trace: per call ``(kind, ran)``; tool results flagged; decision latencies (ms) of tool
    calls (all, and those that called the model: cache misses) and of model turns (a call and its result); the rule
    that decided each call."""

    calls: list[tuple[str, bool]]
    results: int
    flagged: int
    call_ms: list[float]
    call_ms_model: list[float]
    turn_ms: list[float]
    rules: list[str]


def replay_trace(guard: Guard, trace: Trace, records: list[dict[str, Any]], tool_result_action: str) -> Outcome:
    """Run ``trace`` through a guarded ``create_agent`` (one call per model turn), rejecting every escalation.

    ``records`` is the list the guard's decision log appends to; the trace's records are read from it.
    """
    start = len(records)
    agent = create_agent(
        replay_model([[(c.function, c.args)] for c in trace.calls], "Done."),
        trace.tools(),
        system_prompt=SYSTEM_PROMPT,
        middleware=[GuardAgentMiddleware(guard=guard, tool_result_action=tool_result_action)],  # type: ignore[arg-type]
        checkpointer=InMemorySaver(),
    )
    config = {"configurable": {"thread_id": f"{trace.suite}-{trace.user_task}-{trace.injection_task}-{trace.attack}"}}
    result = agent.invoke({"messages": [("user", trace.prompt)]}, config)
    while result.get("__interrupt__"):
        items = [item for i in result["__interrupt__"] for item in i.value["items"]]
        decisions = {item["id"]: {"type": "reject", "message": "not approved"} for item in items}
        result = agent.invoke(resume_command(result["__interrupt__"], decisions), config)
    answers = {m.tool_call_id: m for m in result["messages"] if isinstance(m, ToolMessage)}
    outcomes: list[tuple[str, bool]] = []
    results = flagged = 0
    for n, call in enumerate(trace.calls):
        message = answers.get(f"call_{n}_0")
        data = message.additional_kwargs.get("lc_data", {}) if message is not None else {}
        guarded = message is not None and message.additional_kwargs.get("lc_source") == "guard"
        ran = message is not None and (not guarded or data.get("outcome") in FLAGGED_OUTCOMES)
        outcomes.append((call.kind, ran))
        if ran:
            results += 1
            flagged += int(guarded)
    call_ms: list[float] = []
    call_ms_model: list[float] = []
    rules: dict[str, str] = {}
    per_turn: defaultdict[str, float] = defaultdict(float)
    for record in records[start:]:
        if record.get("kind") == "review":  # a reviewer's decision, not the guard's
            continue
        subject = record.get("input") or {}
        latency = record["metrics"]["latency_ms"]
        if subject.get("event") == "tool_call":
            call_ms.append(latency)
            if not record["cache_hit"]:
                call_ms_model.append(latency)
            rules.setdefault(subject.get("tool_call_id") or "", f"{record['result']['action']}:{record['result']['rule']}")
        if subject.get("event") in ("tool_call", "tool_result"):
            per_turn[subject.get("tool_call_id") or ""] += latency
    decided = [f"{call.kind}:{rules.get(f'call_{n}_0', '-')}" for n, call in enumerate(trace.calls)]
    return Outcome(outcomes, results, flagged, call_ms, call_ms_model, list(per_turn.values()), decided)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.50), "p95": pick(0.95), "mean": statistics.fmean(ordered)}


def run(traces: Sequence[Trace] | Iterator[Trace], *, backend: str = "compact", tool_result_action: str = "block",
        export: Path | None = None, export_limit: int = 0, progress: bool = False) -> dict[str, Any]:  # fmt: skip
    """Replay every trace and tally per (suite, attack template); returns the summary :func:`render` prints."""
    records: list[dict[str, Any]] = []
    table: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    call_ms: list[float] = []
    call_ms_model: list[float] = []
    turn_ms: list[float] = []
    rules: Counter[str] = Counter()
    exported: Counter[tuple[str, str]] = Counter()
    export_handle = export.open("w", encoding="utf-8") if export is not None else None
    started = time.perf_counter()
    log = DecisionLog(lambda line: records.append(json.loads(line)))
    with Guard(load_files(*POLICIES), backends=open_backend(backend), decision_log=log) as guard:
        for n, trace in enumerate(traces):
            outcome = replay_trace(guard, trace, records, tool_result_action)
            for key in ((trace.suite, trace.label), ("all", trace.label)):
                counts = table[key]
                counts["traces"] += 1
                for kind, ran in outcome.calls:
                    counts[f"{kind}_calls"] += 1
                    counts[f"{kind}_{'ran' if ran else 'stopped'}"] += 1
                counts["results"] += outcome.results
                counts["flagged"] += outcome.flagged
            call_ms += outcome.call_ms
            call_ms_model += outcome.call_ms_model
            turn_ms += outcome.turn_ms
            rules.update(f"{trace.label == 'clean' and 'clean' or 'attacked'}/{r}" for r in outcome.rules)
            del records[:]
            if export_handle is not None and (not export_limit or exported[(trace.suite, trace.label)] < export_limit):
                exported[(trace.suite, trace.label)] += 1
                export_handle.write(json.dumps(trace.record(), ensure_ascii=False) + "\n")
            if progress and n % 100 == 0:
                print(f"  {n} traces, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if export_handle is not None:
        export_handle.close()
    return {
        "tool_result_action": tool_result_action,
        "backend": backend,
        "counts": {f"{suite}/{label}": dict(c) for (suite, label), c in sorted(table.items())},
        "rules": dict(rules.most_common()),
        "latency_ms_tool_call": percentiles(call_ms),
        "latency_ms_tool_call_model": percentiles(call_ms_model),
        "latency_ms_turn": percentiles(turn_ms),
        "wall_s": time.perf_counter() - started,
    }


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.1f} %)" if whole else "-"


def render(summary: dict[str, Any]) -> str:
    lines = [
        (
            f"backend {summary['backend']}, tool_result_action {summary['tool_result_action']}, "
            f"{summary['wall_s']:.0f} s"
        ),
        (
            f"{'suite/attack':<34} {'traces':>6}  {'user-task calls allowed':<24} {'injection calls stopped':<24} "
            "tool results flagged"
        ),
    ]
    for key, c in summary["counts"].items():
        lines.append(
            f"{key:<34} {c['traces']:>6}  {_rate(c.get('user_ran', 0), c.get('user_calls', 0)):<24} "
            f"{_rate(c.get('injection_stopped', 0), c.get('injection_calls', 0)):<24} "
            f"{_rate(c.get('flagged', 0), c.get('results', 0))}"
        )
    call, model, turn = (summary[k] for k in ("latency_ms_tool_call", "latency_ms_tool_call_model", "latency_ms_turn"))
    lines.append(f"decision latency per tool call: p50 {call['p50']:.1f} ms  p95 {call['p95']:.1f} ms (model called, no "
                 f"cache hit: p50 {model['p50']:.1f} ms  p95 {model['p95']:.1f} ms); per turn (a call and its result): "
                 f"p50 {turn['p50']:.1f} ms  p95 {turn['p95']:.1f} ms")  # fmt: skip
    lines.append("deciding rule per call (kind:action:rule): " + ", ".join(f"{k} {v}" for k, v in summary["rules"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"every {QUICK_EVERY}th user task under attack")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="agentdojo attack names, comma-separated")
    parser.add_argument("--suites", default="", help="suites, comma-separated (default: all four)")
    parser.add_argument("--traces", type=Path, help="replay an --export file instead of building traces")
    parser.add_argument("--tool-result-action", default="block", choices=("block", "quote", "strip"))
    parser.add_argument("--backend", default="compact", help="compact (default), local:CHECKPOINT_DIR or http:URL")
    parser.add_argument("--export", type=Path, help="write the replayed traces with their tool results")
    parser.add_argument("--export-limit", type=int, default=0, help="at most this many traces per suite and attack")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON")
    args = parser.parse_args(argv)
    if args.traces is not None:
        traces: Iterator[Trace] = recorded_traces(args.traces)
    else:
        suites = [s for s in args.suites.split(",") if s]
        traces = agentdojo_traces([a for a in args.attacks.split(",") if a], args.quick, suites)
    summary = run(
        traces, backend=args.backend, tool_result_action=args.tool_result_action, export=args.export,
        export_limit=args.export_limit, progress=True,
    )  # fmt: skip
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
