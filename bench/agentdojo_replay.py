"""Replay AgentDojo v1 ground-truth tool calls through guard: wanted calls should be allowed, attacker calls blocked
or escalated. Prints counts per suite and decision latency (p50/p95/p99).

Data: ``examples/agent/data/ground_truth_calls.jsonl`` (AgentDojo 0.1.35, MIT; 124 tasks, 386 calls). Each call of a
user task is judged with its own task as ``user_message``. Each call of an injection task is judged as a hijacked
agent would make it: with the prompt of a user task of the same suite as ``user_message`` (the first
``HOSTS_PER_INJECTION`` user tasks, so each attacker call is judged that many times).

Run from the repository root (not part of CI)::

    python bench/agentdojo_replay.py                         # compact CPU model, examples/agent policy
    python bench/agentdojo_replay.py --backend local:PATH    # Clef checkpoint, policies/tool_call_guard.yaml
    python bench/agentdojo_replay.py --json out.json

The engine's probability cache is off for the timed pass (every decision calls the model); a second pass over the same
subjects measures the cache-hit path side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guard.backends import open_backend
from guard.engine import Guard
from guard.engine.cache import MemoryCache
from guard.policy import load_files
from guard.subject import AgentSubject

# Settings --------------------------------------------------------------------------------------------------------
DATA = ROOT / "examples" / "agent" / "data" / "ground_truth_calls.jsonl"
COMPACT_POLICY = ROOT / "examples" / "agent" / "policies" / "tool_calls_compact.yaml"
CLEF_POLICY = ROOT / "policies" / "tool_call_guard.yaml"
HOSTS_PER_INJECTION = 3
WARMUP = 5
CONCURRENCY = 1  # decisions in flight at once in the timed pass (1 = one agent making one call at a time)
POLICY_TIMEOUT_S = 30.0  # generous, so slow CPU inference is measured rather than cut off by the fail mode


def subjects(rows: list[dict[str, Any]], hosts: int) -> list[tuple[str, str, AgentSubject]]:
    """``(suite, kind, subject)`` for every replayed call."""
    out: list[tuple[str, str, AgentSubject]] = []
    users = [r for r in rows if r["kind"] == "user"]
    for row in rows:
        contexts = [row["prompt"]] if row["kind"] == "user" else [
            u["prompt"] for u in users if u["suite"] == row["suite"]
        ][:hosts]  # fmt: skip
        for context in contexts:
            for n, call in enumerate(row["calls"]):
                subject = AgentSubject(
                    event="tool_call",
                    tool_name=call["function"],
                    tool_call_id=f"{row['task_id']}_{n}",
                    arguments=call["args"],
                    user_message=context,
                )
                out.append((row["suite"], row["kind"], subject))
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


async def run(guard: Guard, items: list[tuple[str, str, AgentSubject]], concurrency: int) -> list[Any]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(subject: AgentSubject) -> tuple[Any, float]:
        async with semaphore:
            started = time.perf_counter()
            verdict = await guard.aevaluate(subject)
            return verdict, (time.perf_counter() - started) * 1000

    return list(await asyncio.gather(*(one(s) for _, _, s in items)))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    items = subjects(rows, args.hosts)
    if args.sample:  # every k-th subject, so every suite and both kinds stay represented
        step = max(1, len(items) // args.sample)
        items = items[::step][: args.sample]
    policy_path = args.policy or (COMPACT_POLICY if args.backend == "compact" else CLEF_POLICY)
    loaded = list(load_files(policy_path))
    # Measure the model, not the fail mode (a generous timeout), and every decision a model call (no cache) ...
    uncached = [replace(p, timeout=max(p.timeout, POLICY_TIMEOUT_S), cache_ttl=0.0) for p in loaded]
    # ... then the same subjects again with the cache on, side by side.
    cached_policies = [replace(p, cache_ttl=300.0) for p in uncached]
    import torch

    backend = open_backend(args.backend, dtype=getattr(torch, args.dtype))
    async with Guard(uncached, backends=backend, cache=MemoryCache()) as guard:
        await run(guard, items[:WARMUP], 1)
        started = time.perf_counter()
        results = await run(guard, items, args.concurrency)
        wall = time.perf_counter() - started
        guard.policies.replace(cached_policies)
        await run(guard, items, args.concurrency)  # fill the cache
        cached = await run(guard, items, args.concurrency)
    table: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    errors: Counter[str] = Counter()
    for (suite, kind, _), (verdict, _) in zip(items, results, strict=True):
        table[(suite, kind)][verdict.action] += 1
        table[("all", kind)][verdict.action] += 1
        if verdict.fail_mode:
            errors[verdict.error.split(":")[0] if verdict.error else "error"] += 1
    latencies = [ms for verdict, ms in results if not verdict.fail_mode]
    return {
        "backend": args.backend,
        "model_revision": getattr(backend, "model_revision", None),
        "policy": str(policy_path.relative_to(ROOT)) if policy_path.is_relative_to(ROOT) else str(policy_path),
        "decisions": len(items),
        "concurrency": args.concurrency,
        "counts": {f"{suite}/{kind}": dict(counter) for (suite, kind), counter in sorted(table.items())},
        "fail_mode_decisions": dict(errors),
        "latency_ms_model": percentiles(latencies),
        "latency_ms_cache_hit": percentiles([ms for _, ms in cached]),
        "throughput_per_s": len(items) / wall if wall else 0.0,
    }


def render(summary: dict[str, Any]) -> str:
    lines = [
        (
            f"backend {summary['backend']} ({summary['model_revision']}), policy {summary['policy']}, "
            f"{summary['decisions']} decisions, concurrency {summary['concurrency']}"
        ),
        f"{'suite/kind':<22} {'allow':>6} {'escalate':>9} {'block':>6} {'handoff':>8}   wanted: allowed / attacker: stopped",
    ]
    for key, counts in summary["counts"].items():
        total = sum(counts.values())
        allow = counts.get("allow", 0)
        stopped = total - allow
        rate = f"{allow}/{total} allowed" if key.endswith("/user") else f"{stopped}/{total} blocked or escalated"
        lines.append(
            f"{key:<22} {allow:>6} {counts.get('escalate', 0):>9} {counts.get('block', 0):>6} "
            f"{counts.get('handoff', 0):>8}   {rate}"
        )
    model, hit = summary["latency_ms_model"], summary["latency_ms_cache_hit"]
    lines.append(f"decision latency, model call: p50 {model['p50']:.1f} ms  p95 {model['p95']:.1f} ms  "
                 f"p99 {model['p99']:.1f} ms;  cache hit: p50 {hit['p50']:.2f} ms  p99 {hit['p99']:.2f} ms "
                 f"(x{model['p50'] / hit['p50'] if hit['p50'] else 0:.0f})")  # fmt: skip
    lines.append(f"throughput {summary['throughput_per_s']:.1f} decisions/s; fail-mode decisions: "
                 f"{summary['fail_mode_decisions'] or 'none'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="compact", help="compact (default), local:CHECKPOINT_DIR or http:URL")
    parser.add_argument("--policy", type=Path, help="tool-call policy file (default: by backend)")
    parser.add_argument("--hosts", type=int, default=HOSTS_PER_INJECTION, help="user tasks per injection task")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--dtype", default="bfloat16", help="Clef weights dtype: bfloat16 (reference) or float32")
    parser.add_argument("--sample", type=int, default=0, help="judge only this many calls, spread evenly (0 = all)")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON")
    args = parser.parse_args(argv)
    summary = asyncio.run(main_async(args))
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
