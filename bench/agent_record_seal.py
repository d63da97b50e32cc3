"""What sealing the agent middleware's records costs per thread length: one seal and one check of the ``inputs``
part (one entry per input message of the thread) and of a ``turn`` part with four tool calls; and checking the stamps
of a thread's model replies and tool results.

``GuardAgentMiddleware`` checks the ``inputs`` part about three times per model step (``before_model`` twice,
``wrap_model_call`` once) and the ``turn`` part once per step and once per tool call, and seals each part it writes
(``guard/agents/_records.py``). The cost is one JSON serialisation of the part plus one HMAC-SHA256.

The model node, the tools node and the middleware's hooks stamp every reply and tool result they write, and the
input check reads the stamp of every reply and tool result in the thread (twice per model step) to tell them from
ones a client wrote (``InputGate.pending``, ``TurnKeeper.is_input``): one JSON serialisation and one HMAC-SHA256 per
message. The stamp figure is one such pass over a whole thread (``InputGate.pending``), whose messages are half
model replies (200 characters, one tool call each) and half the tool results answering them (1,000 characters).

Run from the repository root::

    python bench/agent_record_seal.py [--sizes 10,100,1000,5000] [--runs 50]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from langchain_core.messages import AIMessage, ToolMessage

from guard import Guard
from guard.agents import GuardAgentMiddleware
from guard.agents._records import open_part, record_owner, record_sealer, seal_record
from guard.backends.fixture import FixtureBackend

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000,5000", help="input messages per thread, comma-separated")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per figure")
    args = parser.parse_args(argv)
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
