"""What sealing the agent middleware's records costs per thread length: one seal and one check of the ``inputs``
part (one entry per input message of the thread) and of a ``turn`` part with four tool calls; and checking the stamps
of a thread's model replies and tool results.

``GuardAgentMiddleware`` checks the ``inputs`` part about three times per model step (``before_model`` twice,
``wrap_model_call`` once) and the ``turn`` part once per step and once per tool call, and seals each part it writes
(``guard/agents/_records.py``). The cost is one JSON serialisation of the part plus one HMAC-SHA256.

The model node, the tools node and the middleware's hooks stamp every reply and tool result they write, and the
input check reads the stamp of every reply and tool result in the thread (twice per model step) to tell them from
ones a client wrote (``InputGate.pending``, ``TurnKeeper.is_input``): one JSON serialisation and one HMAC-SHA256 per
message, once per message object of a run (later passes compare each message with the copy kept when its stamp was
checked). The stamp figure is such a later pass over a whole thread (``InputGate.pending``), whose messages are half
model replies (200 characters, one tool call each) and half the tool results answering them (1,000 characters).

With ``--steps``: guard's CPU per model step of a ``create_agent`` run (a scripted model calling a read-only tool
at every step, ``GuardAgentMiddleware`` on ``CompactBackend.default()`` and ``examples/agent/policies``), by step
index, for runs of each number of steps: the CPU (``time.process_time``) of the middleware's hooks, less the model's
and the tool's own; ``--profile`` adds a cProfile of the longest run's guard functions. ``--baseline DIR`` runs the
same in a subprocess on the guard package of DIR (an older checkout) and prints both side by side.

Run from the repository root::

    python bench/agent_record_seal.py [--sizes 10,100,1000,5000] [--runs 50]
    python bench/agent_record_seal.py --steps 10,40,80 [--profile] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import hashlib
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("GUARD_TREE") or Path(__file__).resolve().parents[1])  # the guard package measured
sys.path.insert(0, str(ROOT))

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from guard import Guard
from guard.agents import GuardAgentMiddleware
from guard.agents._records import open_part, record_owner, record_sealer, seal_record
from guard.backends.compact import CompactBackend
from guard.backends.fixture import FixtureBackend
from guard.policy import load_files

OWNER = record_owner("GuardAgentMiddleware", [])
KEY = "a-benchmark-record-key-of-32-b!"


def inputs_part(messages: int) -> dict[str, dict[str, str]]:
    """An input record of ``messages`` entries, keyed as the middleware keys them (``<id>:<digest>``)."""
    entries = {}
    for i in range(messages):
        digest = hashlib.sha256(f"message {i}".encode()).hexdigest()
        entries[f"lc_run--{i:08d}:{digest}"] = {"digest": digest, "status": "allowed"}
    return entries


def turn_part() -> dict[str, object]:
    """A turn record with four judged tool calls."""
    call = {"tool": "send_money", "arguments": {"recipient": "UK12345678901234567890", "amount": 98.7},
            "problem": None, "effect": "side_effecting", "digest": "d" * 64, "outcome": "allow",
            "verdict": {"action": "allow", "probabilities": {"serves": {"true": 0.9, "false": 0.1}}},
            "status": "allowed", "run_tool": "send_money", "run_digest": "e" * 64}
    return {"message_id": "lc_run--turn", "thread_id": "t1", "output": None, "held": None,
            "calls": {f"call_{i}": dict(call) for i in range(4)}}


def stamped_thread(middleware: GuardAgentMiddleware, messages: int) -> list[AIMessage | ToolMessage]:
    """``messages`` stamped messages: model replies of 200 characters, each with a tool call, and the tool results
    answering them (1,000 characters), alternating."""
    thread: list[AIMessage | ToolMessage] = []
    for i in range(messages):
        if i % 2 == 0:
            call = {"name": "search", "args": {"query": f"q{i}"}, "id": f"call_{i}", "type": "tool_call"}
            thread.append(AIMessage(f"reply {i} " + "r" * 190, id=f"lc_run--{i:08d}", tool_calls=[call]))
        else:
            thread.append(ToolMessage(f"result {i} " + "t" * 990, tool_call_id=f"call_{i - 1}", id=f"tool-{i:08d}"))
    return middleware._turns.stamp_all(thread, [])


def best_us(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median and minimum microseconds of ``runs`` calls of ``fn``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), min(times)


# A create_agent run, step by step -----------------------------------------------------------------------------------

AGENT_POLICIES = [ROOT / "examples" / "agent" / "policies" / "tool_calls_compact.yaml",
                  ROOT / "policies" / "tool_result_check.yaml"]  # fmt: skip
"""The example agent's policies on the compact model (``examples/agent/replay.py``'s ``COMPACT_POLICIES``)."""


@functools.cache
def compact() -> CompactBackend:
    """The compact model, loaded once."""
    return CompactBackend.default()


class ScriptedModel(GenericFakeChatModel):
    """A chat model answering with scripted replies, that accepts ``bind_tools``."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self


@tool
def search_emails(query: str) -> str:
    """Search the user's e-mails for ``query``."""
    return f"3 e-mails match {query!r}. " + "From: accounts@example.com, Subject: your statement is ready. " * 15


class TimedMiddleware(GuardAgentMiddleware):
    """``GuardAgentMiddleware`` whose sync hooks add their CPU, less the model's and the tool's own, to ``cpu``: one
    entry per model step (``before_model`` opens it); ``decisions`` gets the part of it spent in ``Guard.evaluate``
    (the policies' decisions: the compact model, provenance, the rules)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cpu: list[float] = []
        self.decisions: list[float] = []
        evaluate = self.guard.evaluate

        def timed_evaluate(subject: Any) -> Any:
            start = time.process_time()
            try:
                return evaluate(subject)
            finally:
                self.decisions[-1] += time.process_time() - start

        self.guard.evaluate = timed_evaluate  # type: ignore[method-assign]

    def _charged(self, hook: Callable[..., Any], *args: Any, handler: Callable[..., Any] | None = None) -> Any:
        outside = [0.0]

        def inner(request: Any) -> Any:
            start = time.process_time()
            try:
                return handler(request)  # type: ignore[misc]
            finally:
                outside[0] += time.process_time() - start

        start = time.process_time()
        try:
            return hook(*args, inner) if handler is not None else hook(*args)
        finally:
            self.cpu[-1] += time.process_time() - start - outside[0]

    def before_model(self, state: Any, runtime: Any) -> Any:
        self.cpu.append(0.0)
        self.decisions.append(0.0)
        return self._charged(super().before_model, state, runtime)

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return self._charged(super().wrap_model_call, request, handler=handler)

    def after_model(self, state: Any, runtime: Any) -> Any:
        return self._charged(super().after_model, state, runtime)

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return self._charged(super().wrap_tool_call, request, handler=handler)


def agent_run(steps: int, salt: str) -> tuple[list[float], list[float]]:
    """Guard's CPU seconds per model step of one run of ``steps`` steps, each calling ``search_emails`` once (the
    last step answers with text), and the part of it the decisions took. ``salt`` makes every call new to the
    decision cache."""
    guard = Guard(load_files(*AGENT_POLICIES), backends=compact())
    replies = [AIMessage("", tool_calls=[{"name": "search_emails", "args": {"query": f"invoice {salt}-{n}"},
                                          "id": f"call_{n}", "type": "tool_call"}]) for n in range(steps - 1)]  # fmt: skip
    replies.append(AIMessage("Found them all."))
    middleware = TimedMiddleware(guard=guard, state_key=KEY)
    agent = create_agent(ScriptedModel(messages=iter(replies)), [search_emails], middleware=[middleware],
                         system_prompt="You are an e-mail assistant.", checkpointer=InMemorySaver())  # fmt: skip
    config = {"configurable": {"thread_id": f"bench-{salt}"}, "recursion_limit": 10 * steps + 10}
    result = agent.invoke({"messages": [("user", "Find my invoices from last year, one month at a time.")]}, config)
    ran = sum(isinstance(m, ToolMessage) and m.status != "error" for m in result["messages"])
    assert ran == steps - 1 and len(middleware.cpu) == steps, (ran, len(middleware.cpu))  # every call ran and was timed
    return middleware.cpu, middleware.decisions


def agent_steps(step_counts: list[int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """For each run length: guard's CPU (ms) per step by step index (``guard``) and the part outside the decisions
    (``middleware``), the median of ``rounds`` runs each."""
    agent_run(3, "warm-up")  # the model's first call, imports
    out = {}
    for steps in step_counts:
        runs = [agent_run(steps, f"{steps}-{r}") for r in range(rounds)]
        guard = [statistics.median(cpu[n] for cpu, _ in runs) * 1000 for n in range(steps)]
        own = [statistics.median(cpu[n] - spent[n] for cpu, spent in runs) * 1000 for n in range(steps)]
        out[str(steps)] = {"guard": guard, "middleware": own}
    return out


def agent_profile(steps: int, top: int) -> str:
    """cProfile of a run of ``steps`` steps: the guard functions with the most cumulative time."""
    agent_run(3, "profile-warm-up")
    profile = cProfile.Profile()
    profile.runcall(agent_run, steps, "profile")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(r"guard/(agents|_seal|subject)", top)
    return text.getvalue()


def print_steps(columns: dict[str, dict[str, dict[str, list[float]]]]) -> None:
    """Guard CPU per step (ms) at a few step indexes, and per run, for each tree, with each tree's ratio to the
    first: all of guard's, and the middleware's own (without the decisions)."""
    names = list(columns)
    for steps in next(iter(columns.values())):
        count = int(steps)
        marks = sorted({0, 1, count // 4, count // 2, 3 * count // 4, count - 2, count - 1})
        for part, label in (("guard", "all of guard"), ("middleware", "middleware without the decisions")):
            print(f"\nrun of {steps} steps, CPU ms per step, {label}")
            print(f"  {'step':<10}" + "".join(f" {name:>12}" for name in names)
                  + "".join(f" {name + ' x':>14}" for name in names[1:]))  # fmt: skip
            rows = [(f"{mark + 1}", [columns[name][steps][part][mark] for name in names]) for mark in marks]
            rows.append(("whole run", [sum(columns[name][steps][part]) for name in names]))
            for label_, values in rows:
                print(f"  {label_:<10}" + "".join(f" {v:12.2f}" for v in values)
                      + "".join(f" {v / values[0]:14.2f}" for v in values[1:]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000,5000", help="input messages per thread, comma-separated")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per figure")
    parser.add_argument("--steps", default=None, help="create_agent runs of these many model steps, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="with --steps: runs per length (median per step)")
    parser.add_argument("--profile", action="store_true", help="with --steps: cProfile the longest run")
    parser.add_argument("--baseline", type=Path, default=None, help="with --steps: a checkout of guard to compare")
    parser.add_argument("--steps-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps:
        counts = [int(s) for s in args.steps.split(",")]
        if args.steps_json:
            print(json.dumps(agent_steps(counts, args.rounds)))
            return 0
        columns = {"this tree": agent_steps(counts, args.rounds)}
        if args.baseline is not None:
            env = {**os.environ, "GUARD_TREE": str(args.baseline.resolve())}
            argv = [sys.executable, __file__, "--steps", args.steps, "--rounds", str(args.rounds), "--steps-json"]
            done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
            columns = {"baseline": json.loads(done.stdout.strip().splitlines()[-1]), **columns}
        print_steps(columns)
        if args.profile:
            print(agent_profile(max(counts), 25))
        return 0
    sealer = record_sealer(KEY)
    print(f"{'part':<24} {'seal us (median/min)':>22} {'check us (median/min)':>23}")
    turn = turn_part()
    stored = seal_record(sealer, OWNER, "t1", {}, {"turn": turn})
    seal = best_us(lambda: seal_record(sealer, OWNER, "t1", {}, {"turn": turn}), args.runs)
    check = best_us(lambda: open_part(sealer, OWNER, "t1", stored, "turn"), args.runs)
    print(f"{'turn (4 calls)':<24} {seal[0]:>12.0f} / {seal[1]:<8.0f} {check[0]:>13.0f} / {check[1]:<8.0f}")
    for size in (int(s) for s in args.sizes.split(",")):
        inputs = inputs_part(size)
        stored = seal_record(sealer, OWNER, "t1", {}, {"inputs": inputs})
        assert open_part(sealer, OWNER, "t1", stored, "inputs") == inputs
        seal = best_us(lambda inputs=inputs: seal_record(sealer, OWNER, "t1", {}, {"inputs": inputs}), args.runs)
        check = best_us(lambda stored=stored: open_part(sealer, OWNER, "t1", stored, "inputs"), args.runs)
        label = f"inputs ({size} messages)"
        print(f"{label:<24} {seal[0]:>12.0f} / {seal[1]:<8.0f} {check[0]:>13.0f} / {check[1]:<8.0f}")
    guard = Guard.from_files(ROOT / "policies" / "tool_call_guard.yaml", backends=FixtureBackend())
    middleware = GuardAgentMiddleware(guard=guard, state_key=KEY)
    print(f"\n{'thread':<24} {'stamp checks us (median/min)':>30} {'us per message':>16}")
    for size in (int(s) for s in args.sizes.split(",")):
        thread = stamped_thread(middleware, size)
        assert middleware._inputs.pending({"messages": thread}) == ({}, [])  # every message stamped: none to judge
        check = best_us(lambda thread=thread: middleware._inputs.pending({"messages": thread}), max(3, args.runs // 10))
        label = f"{size} replies and results"
        print(f"{label:<24} {check[0]:>19.0f} / {check[1]:<8.0f} {check[0] / size:>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
