"""Closed-loop load on the decision worker: batching on vs ``--max-batch 1``, side by side, and an exactly-once check.

Starts two real workers (``guard worker serve``, each its own process on a Unix socket, float32 golden tiny checkpoint
on CPU): one batching (the defaults), one with ``--max-batch 1``. At each concurrency (1, 8, 32, 64) C clients each
send a request, wait for its answer and send the next, first to one worker then to the other (alternating, so drifting
background load hits both alike), and the script prints throughput, p50/p95/p99 latency, forward passes per request
and the batched/unbatched throughput ratio. Then it sends ``--check-requests`` distinct requests (default 10,000) at
concurrency 32 to the batching worker and checks that every one was answered exactly once with its own answer: each
request carries a unique ``model`` name (echoed back) and unique question ids (model input, so a swapped answer would
show), and the worker's own ``guard_worker_requests_total{outcome="ok"}`` must grow by exactly the number sent.

Usage (repository root; not part of CI)::

    python bench/worker_load.py
    python bench/worker_load.py --requests-per-level 200 --check-requests 2000   # quicker
    python bench/worker_load.py --json results.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

# ---- settings -------------------------------------------------------------------------------------------------------
MODEL = ROOT / "tests" / "fixtures" / "clef-golden" / "checkpoint"
CONCURRENCY = (1, 8, 32, 64)
REQUESTS_PER_LEVEL = 384  # timed requests per worker per concurrency level
WARMUP_PER_LEVEL = 2  # untimed rounds of C requests before each timed run
CHECK_REQUESTS = 10_000
CHECK_CONCURRENCY = 32
STATE_REPEAT = 3  # sentences in each request's state (~350 prompt tokens with the golden tokenizer)
TORCH_THREADS = 1  # per worker: robust on a shared CPU (oversubscribed OpenMP threads spin and stall)
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
# ----------------------------------------------------------------------------------------------------------------------

_TOOLS = ("delete_records", "send_email", "read_file", "transfer_funds", "search_web", "run_shell")


def make_body(i: int, state_repeat: int = STATE_REPEAT) -> dict[str, Any]:
    """Request ``i``: unique model name (echoed) and question ids (model input), a tool call as the state."""
    tool = _TOOLS[i % len(_TOOLS)]
    return {
        "model": f"bench-{i}",
        "state": {
            "task": f"Request {i}: tidy up the account of customer {i * 7919 % 10007}. " * state_repeat,
            "tool_call": {"name": tool, "arguments": {"id": i, "scope": "all" if i % 3 else "one"}},
        },
        "questions": {
            f"destructive_{i}": {"type": "noul", "instructions": "Does this tool call delete or overwrite data?"},
            f"serves_task_{i}": {
                "type": "choice",
                "instructions": "Does the tool call serve the user's task?",
                "criteria": {"yes": "Directly needed", "partly": None, "no": "Unrelated or harmful"},
            },
        },
    }


@dataclass
class LevelResult:
    """One timed run: ``concurrency`` clients, ``requests`` answered in ``elapsed_s``."""

    concurrency: int
    requests: int
    elapsed_s: float
    latencies_ms: list[float] = field(repr=False)
    failures: int
    forward_passes: float

    @property
    def throughput(self) -> float:
        return self.requests / self.elapsed_s

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]

    def summary(self) -> dict[str, float]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "failures": self.failures,
            "throughput_rps": round(self.throughput, 2),
            "p50_ms": round(self.percentile(50), 2),
            "p95_ms": round(self.percentile(95), 2),
            "p99_ms": round(self.percentile(99), 2),
            "mean_ms": round(statistics.fmean(self.latencies_ms), 2),
            "passes_per_request": round(self.forward_passes / max(1, self.requests), 3),
        }


class Worker:
    """A worker process on a Unix socket, started from ``command`` (``--uds`` is appended)."""

    def __init__(self, label: str, command: Sequence[str], sock: str) -> None:
        self.label = label
        self.sock = sock
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([*command, "--uds", sock], cwd=ROOT, env=env)

    def client(self, concurrency: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1))
        transport = httpx.AsyncHTTPTransport(uds=self.sock, limits=limits)
        return httpx.AsyncClient(base_url="http://worker", transport=transport, timeout=REQUEST_TIMEOUT_S)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url="http://worker", transport=httpx.HTTPTransport(uds=self.sock)) as client:
            while True:
                if self.process.poll() is not None:
                    raise SystemExit(f"worker {self.label} exited with {self.process.returncode}")
                try:
                    if client.get("/readyz").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {self.label} not ready after {READY_TIMEOUT_S:g} s")
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def counter(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def passes_so_far(client: httpx.AsyncClient) -> float:
    return counter((await client.get("/metrics")).text, "guard_worker_forward_passes_total")


async def closed_loop(
    client: httpx.AsyncClient,
    concurrency: int,
    total: int,
    first_id: int,
    body: Callable[[int], dict[str, Any]],
    seen: dict[str, int] | None = None,
) -> tuple[list[float], int, float]:
    """``concurrency`` clients send ``total`` requests (ids ``first_id``...) one after another each.

    Returns:
        ``(latencies_ms, failures, elapsed_s)``; a failure is a non-200, a transport error, or an answer that is not the
        request's own (wrong echoed model or question ids). ``seen`` counts each echoed model name (duplicates).
    """
    ids = itertools.count(first_id)
    end = first_id + total
    latencies: list[float] = []
    failures = 0

    async def one_client() -> None:
        nonlocal failures
        while (i := next(ids)) < end:
            payload = body(i)
            started = time.perf_counter()
            try:
                response = await client.post("/v1/systemone", json=payload)
            except httpx.HTTPError:
                failures += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000.0)
            if response.status_code != 200:
                failures += 1
                continue
            answer = response.json()
            if answer.get("model") != payload["model"] or list(answer.get("answers", {})) != list(payload["questions"]):
                failures += 1
            if seen is not None:
                seen[answer.get("model", "")] = seen.get(answer.get("model", ""), 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return latencies, failures, time.perf_counter() - started


async def measure(
    worker: Worker, concurrency: int, total: int, first_id: int, body: Callable[[int], dict[str, Any]]
) -> LevelResult:
    async with worker.client(concurrency) as client:
        await closed_loop(client, concurrency, WARMUP_PER_LEVEL * concurrency, first_id + total, body)
        before = await passes_so_far(client)
        latencies, failures, elapsed = await closed_loop(client, concurrency, total, first_id, body)
        passes = await passes_so_far(client) - before
    return LevelResult(concurrency, len(latencies), elapsed, latencies, failures, passes)


async def exactly_once(
    worker: Worker, total: int, concurrency: int, body: Callable[[int], dict[str, Any]]
) -> dict[str, Any]:
    """Send ``total`` distinct requests; count lost, duplicated and mismatched answers, client- and server-side."""
    seen: dict[str, int] = {}
    first = 10_000_000
    async with worker.client(concurrency) as client:
        ok_before = counter((await client.get("/metrics")).text, "guard_worker_requests_total", outcome="ok")
        latencies, failures, elapsed = await closed_loop(client, concurrency, total, first, body, seen)
        ok_after = counter((await client.get("/metrics")).text, "guard_worker_requests_total", outcome="ok")
    expected = {f"bench-{i}" for i in range(first, first + total)}
    return {
        "requests": total,
        "concurrency": concurrency,
        "answered": len(latencies),
        "failures_or_mismatches": failures,
        "lost": len(expected - set(seen)),
        "duplicated": sum(count - 1 for count in seen.values() if count > 1),
        "unexpected": len(set(seen) - expected),
        "server_ok_delta": int(ok_after - ok_before),
        "throughput_rps": round(len(latencies) / elapsed, 2),
    }


def print_levels(rows: list[tuple[LevelResult, LevelResult]], title: str) -> None:
    print(title)
    head = f"{'conc':>4} | {'batched rps':>11} {'p50':>7} {'p95':>7} {'p99':>7} {'pass/req':>8} | "
    head += f"{'max-batch 1 rps':>15} {'p50':>7} {'p95':>7} {'p99':>7} | {'ratio':>5} | fail"
    print(head)
    print("-" * len(head))
    for batched, single in rows:
        b, s = batched.summary(), single.summary()
        print(
            f"{b['concurrency']:>4} | {b['throughput_rps']:>11.1f} {b['p50_ms']:>7.1f} {b['p95_ms']:>7.1f} "
            f"{b['p99_ms']:>7.1f} {b['passes_per_request']:>8.3f} | {s['throughput_rps']:>15.1f} {s['p50_ms']:>7.1f} "
            f"{s['p95_ms']:>7.1f} {s['p99_ms']:>7.1f} | {batched.throughput / single.throughput:>5.2f} | "
            f"{batched.failures}/{single.failures}"
        )
    print("latencies in ms; pass/req = forward passes per request on the batching worker")


def run(
    batched_command: Sequence[str],
    single_command: Sequence[str],
    *,
    concurrency: Sequence[int],
    per_level: int,
    check_requests: int,
    body: Callable[[int], dict[str, Any]],
    title: str,
    json_path: str | None,
) -> None:
    """Start both workers, measure every level side by side, run the exactly-once check, print (and save) results."""
    with tempfile.TemporaryDirectory(prefix="guard-bench-") as tmp:
        batched = Worker("batched", batched_command, str(Path(tmp) / "batched.sock"))
        single = Worker("max-batch-1", single_command, str(Path(tmp) / "single.sock"))
        try:
            batched.wait_ready()
            single.wait_ready()
            rows = []
            next_id = 0
            for c in concurrency:
                total = max(per_level, 4 * c)
                s = asyncio.run(measure(single, c, total, next_id, body))
                b = asyncio.run(measure(batched, c, total, next_id + 2 * total, body))
                next_id += 4 * total + 2 * WARMUP_PER_LEVEL * c
                rows.append((b, s))
                print(f"  c={c}: batched {b.throughput:.1f} rps, max-batch 1 {s.throughput:.1f} rps", flush=True)
            print_levels(rows, title)
            check = (
                asyncio.run(exactly_once(batched, check_requests, CHECK_CONCURRENCY, body)) if check_requests else {}
            )
            if check:
                print(
                    f"exactly-once over {check['requests']} requests at concurrency {check['concurrency']}: "
                    f"lost {check['lost']}, duplicated {check['duplicated']}, mismatched/failed "
                    f"{check['failures_or_mismatches']}, unexpected {check['unexpected']}, worker ok-count delta "
                    f"{check['server_ok_delta']} ({check['throughput_rps']} rps)"
                )
            if json_path:
                payload = {
                    "title": title,
                    "levels": [{"batched": b.summary(), "max_batch_1": s.summary()} for b, s in rows],
                    "exactly_once": check,
                }
                Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
        finally:
            batched.stop()
            single.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(MODEL), help="checkpoint directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--requests-per-level", type=int, default=REQUESTS_PER_LEVEL)
    parser.add_argument("--check-requests", type=int, default=CHECK_REQUESTS, help="0 skips the exactly-once check")
    parser.add_argument("--max-batch", type=int, default=32, help="the batching worker's --max-batch")
    parser.add_argument("--max-wait-ms", type=float, default=3.0, help="the batching worker's --max-wait-ms")
    parser.add_argument("--torch-threads", type=int, default=TORCH_THREADS, help="each worker's torch intra-op threads")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    common = [
        sys.executable,
        "-m",
        "guard",
        "worker",
        "serve",
        "--model",
        args.model,
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        "--max-queue",
        "4096",
        "--torch-threads",
        str(args.torch_threads),
    ]
    batched = [*common, "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    single = [*common, "--max-batch", "1", "--max-wait-ms", "0"]
    title = (
        f"guard worker, {Path(args.model).name} float32 on CPU ({os.cpu_count()} cores, torch threads "
        f"{args.torch_threads}), batched = --max-batch {args.max_batch} "
        f"--max-wait-ms {args.max_wait_ms:g}, {args.requests_per_level} timed requests per level"
    )
    run(
        batched,
        single,
        concurrency=args.concurrency,
        per_level=args.requests_per_level,
        check_requests=args.check_requests,
        body=make_body,
        title=title,
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
