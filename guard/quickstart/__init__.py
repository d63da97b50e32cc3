"""The quickstart: an example API behind the guard, real traffic replayed through it, and a table of verdicts.

Everything runs in one process on the embedded CPU model by default: the API is a small Starlette app wrapped in
:class:`~guard.asgi.GuardMiddleware` and called through httpx's ASGI transport (no sockets), the probability cache is
in-process, and the agent tool calls go through :meth:`guard.engine.Guard.aevaluate` as ``tool_call`` subjects. The
traffic (``data/``) is benign API requests and attacks (jailbreaks, payloads) plus AgentDojo tool calls; attack text is
never printed, only its source.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TextIO

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.asgi import GuardMiddleware
from guard.backends import start_backend
from guard.backends.base import DecisionBackend
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.subject import AgentSubject, TurnMessage

__all__ = [
    "NEXT_STEPS",
    "TOOL_CALL_NOTE",
    "QuickstartResult",
    "Row",
    "example_app",
    "load_traffic",
    "policy_path",
    "run_quickstart",
]

_DATA = "guard.quickstart"
_TEXT_WIDTH = 44

#: Printed after the summary when the embedded CPU model answered (``guard quickstart`` without ``--backend``).
TOOL_CALL_NOTE = """\
  Tool calls: decided by argument provenance and the tool-result check (docs/agents.md); the embedded CPU model
  ranks guard.tool_call_serves_task at AUROC 0.77 on agent suites it never saw (docs/catalog.md), so the policy
  reads it only as an optional signal.
"""

#: Ports in NEXT_STEPS: the protected API (examples/api/app.py's default) and the decision worker, kept apart.
_API_PORT = 9000
_WORKER_PORT = 8000

NEXT_STEPS = f"""
Next steps
  * Real Clef-flash weights (a local release directory; on a GPU, bfloat16 like the reference):
      guard quickstart --backend local:/path/to/clef-flash --device cuda
  * Your API (here the example one on :{_API_PORT}) behind the guard, Clef in the proxy's process:
      python examples/api/app.py --port {_API_PORT}
      guard proxy --policy policies/api_abuse.yaml --upstream http://127.0.0.1:{_API_PORT} \\
          --backend local:/path/to/clef-flash --device cuda
  * A GPU worker on :{_WORKER_PORT} shared by many gateways and agents:
      guard worker serve --model /path/to/clef-flash --device cuda --port {_WORKER_PORT}
      guard proxy --policy policies/api_abuse.yaml --upstream http://127.0.0.1:{_API_PORT} \\
          --backend http://127.0.0.1:{_WORKER_PORT}
  * A shared Redis probability cache (replicas agree, single-flight across processes):
      GUARD_STORE_KEY=$(openssl rand -hex 32) guard quickstart --redis-url redis://127.0.0.1:6379/0
  * Write and test your own policy: docs/recipes.md; all docs: docs/concepts.md
"""


def policy_path() -> str:
    """Path of the quickstart policy file (catalog questions only, so the embedded CPU model answers them all)."""
    return str(resources.files(_DATA).joinpath("policies.yaml"))


def load_traffic(name: str) -> list[dict[str, Any]]:
    """Rows of ``data/<name>.jsonl`` (``http_traffic`` or ``tool_calls``); see ``data/README.md``."""
    text = resources.files(_DATA).joinpath("data", f"{name}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def example_app() -> Starlette:
    """The example API: three JSON endpoints that answer what they were sent (the guard sits in front)."""

    async def messages(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"reply": f"Received {len(json.dumps(body))} bytes."})

    return Starlette(
        routes=[
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/chat/completions", messages, methods=["POST"]),
            Route("/v1/search", messages, methods=["POST"]),
        ]
    )


@dataclass
class Row:
    """One replayed item and what the guard did with it."""

    kind: str
    id: str
    label: str
    what: str
    action: str
    rule: str
    probabilities: dict[str, float]
    latency_ms: float
    status: int | None = None


@dataclass
class QuickstartResult:
    """What ``guard quickstart`` replayed: one :class:`Row` per request or tool call, in the order they were judged."""

    rows: list[Row] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts of actions per (kind, label), and latency percentiles in ms."""
        counts: dict[str, dict[str, int]] = {}
        for row in self.rows:
            key = f"{row.kind}/{row.label}"
            counts.setdefault(key, dict(Counter()))
            counts[key][row.action] = counts[key].get(row.action, 0) + 1
        latencies = sorted(row.latency_ms for row in self.rows)
        return {
            "counts": counts,
            "latency_ms": {
                "p50": statistics.median(latencies) if latencies else 0.0,
                "p95": latencies[max(0, math.ceil(0.95 * len(latencies)) - 1)] if latencies else 0.0,  # nearest rank
            },
        }


def _what(row: dict[str, Any], kind: str) -> str:
    if row["label"] == "attack":  # real attack text stays out of terminals and logs
        return f"[attack from {row.get('source') or row.get('suite')}]"
    text = json.dumps(row.get("body")) if kind == "http" else f"{row['tool']} for: {row['task']}"
    return text if len(text) <= _TEXT_WIDTH else text[: _TEXT_WIDTH - 1] + "…"


def _probabilities(answers: dict[str, dict[str, float]]) -> dict[str, float]:
    """P(true) for noul questions, the top probability otherwise, from a decision record's ``answers``."""
    return {key: probs["true"] if "true" in probs else max(probs.values()) for key, probs in answers.items()}


async def run_quickstart(
    backend: DecisionBackend,
    *,
    redis_url: str | None = None,
    limit: int | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> QuickstartResult:
    """Replay the quickstart traffic through the example API behind the guard, and the tool calls through the engine.

    The backend is started first (:func:`~guard.backends.start_backend`: a ``LocalBackend`` or the compact model
    warms up), so no row pays for model warm-up.

    Args:
        backend: the decision backend (the embedded CPU model by default in the CLI).
        redis_url: a Redis for the probability cache; in-process cache when ``None``.
        limit: replay at most this many HTTP requests and this many tool calls.
        on_row: called with each row as soon as it is decided (the CLI prints it).

    Returns:
        Every row, in replay order.
    """
    result = QuickstartResult()
    records: dict[str, dict[str, Any]] = {}

    def keep(line: str) -> None:
        record = json.loads(line)
        records[record["decision_id"]] = record

    await start_backend(backend)
    log = DecisionLog(keep, include_input=False)  # the record carries each question's probabilities
    guard = Guard.from_files(policy_path(), backends=backend, redis_url=redis_url, decision_log=log)
    try:
        app = GuardMiddleware(example_app(), guard=guard)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api.example") as client:
            for item in load_traffic("http_traffic")[:limit]:
                started = time.perf_counter()
                response = await client.request(item["method"], item["path"], json=item["body"])
                elapsed = (time.perf_counter() - started) * 1000
                record = records.get(response.headers.get("x-guard-decision-id", ""), {})
                row = Row(
                    kind="http",
                    id=item["id"],
                    label=item["label"],
                    what=_what(item, "http"),
                    # from the decision record: the response to an allowed request names only the decision
                    action=record.get("result", {}).get("action", "allow"),
                    rule=record.get("result", {}).get("rule") or "-",
                    probabilities=_probabilities(record.get("answers") or {}),
                    latency_ms=elapsed,
                    status=response.status_code,
                )
                result.rows.append(row)
                if on_row:
                    on_row(row)
        for item in load_traffic("tool_calls")[:limit]:
            subject = AgentSubject(
                event="tool_call",
                tool_name=item["tool"],
                tool_call_id=item["id"],
                arguments=item["arguments"],
                user_message=item["task"],
                history=(
                    TurnMessage("user", item["task"]),
                    *(
                        TurnMessage("tool", h["text"], h["tool_name"], f"{item['id']}-{n}")
                        for n, h in enumerate(item.get("history", []))
                    ),
                ),
            )
            verdict = await guard.aevaluate(subject)
            row = Row(
                kind="tool",
                id=item["id"],
                label=item["label"],
                what=_what(item, "tool"),
                action=verdict.action,
                rule=verdict.rule or "-",
                probabilities={
                    k: (a.noul if a.noul is not None else max(a.probabilities.values()))
                    for k, a in verdict.answers.items()
                },
                latency_ms=verdict.latency_ms,
            )
            result.rows.append(row)
            if on_row:
                on_row(row)
    finally:
        await guard.aclose()
    return result


def print_row(row: Row, out: TextIO) -> None:
    """One table line: kind, id, label, what, action (HTTP status), rule, probabilities, latency."""
    probs = " ".join(f"{k}={v:.2f}" for k, v in row.probabilities.items())
    action = f"{row.action} ({row.status})" if row.status is not None else row.action
    out.write(
        f"{row.kind:<4} {row.id:<28.28} {row.label:<6} {row.what:<{_TEXT_WIDTH}} {action:<15} {row.rule:<13.13} "
        f"{probs:<34} {row.latency_ms:7.1f}\n"
    )


def print_header(out: TextIO) -> None:
    out.write(
        f"{'kind':<4} {'id':<28} {'label':<6} {'what':<{_TEXT_WIDTH}} {'verdict':<15} {'rule':<13} "
        f"{'probabilities':<34} {'ms':>7}\n"
    )


def print_summary(result: QuickstartResult, out: TextIO) -> None:
    summary = result.summary()
    out.write("\nSummary (verdicts by traffic kind and label)\n")
    for key, counts in sorted(summary["counts"].items()):
        total = sum(counts.values())
        parts = ", ".join(f"{action} {n}" for action, n in sorted(counts.items()))
        out.write(f"  {key:<13} {total:>3} items: {parts}\n")
    latency = summary["latency_ms"]
    out.write(f"  latency per decision: p50 {latency['p50']:.1f} ms, p95 {latency['p95']:.1f} ms\n")
