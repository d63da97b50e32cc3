"""Send the example traffic (benign requests and attacks) through the guard and print the verdicts.

Three ways to run it:

    # the guard inside the app's process (no sockets)
    python examples/api/traffic.py --mode inprocess

    # the same app behind `guard proxy` (both started here, on loopback ports)
    python examples/api/traffic.py --mode proxy

    # any running guarded endpoint, e.g. one started with `guard proxy ... --listen 127.0.0.1:8080`
    python examples/api/traffic.py --mode url --url http://127.0.0.1:8080

``--backend`` is ``compact`` (the default: the embedded CPU model, catalog questions only), ``local:CHECKPOINT_DIR``
(Clef in process, with ``--device`` / ``--dtype``) or a System One endpoint (a guard worker): ``http://HOST:PORT``.
``--policy`` defaults to the quickstart's policy (``guard/quickstart/policies.yaml``: catalog questions, so the
compact model answers it); ``policies/api_abuse.yaml`` adds a free-form ``spam`` question that needs Clef. A backend
that cannot answer the policy stops the script with one line naming the question. The script prints ids, labels and
verdicts, never the request text (the attack rows are real jailbreak prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
TRAFFIC = ROOT / "guard" / "quickstart" / "data" / "http_traffic.jsonl"
DEFAULT_POLICY = ROOT / "guard" / "quickstart" / "policies.yaml"


def load_traffic(limit: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in TRAFFIC.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """uvicorn on a free loopback port in a daemon thread; yields the base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server failed to start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _action(response: httpx.Response) -> str:
    """What guard decided: named on the responses guard gives itself; an allowed request's response carries only the
    decision id (brief decision headers); no id, no decision (no policy matched)."""
    if "x-guard-action" in response.headers:
        return response.headers["x-guard-action"]
    return "allow" if "x-guard-decision-id" in response.headers else "-"


async def send_all(client: httpx.AsyncClient, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for row in rows:
        started = time.perf_counter()
        response = await client.request(row["method"], row["path"], json=row["body"])
        results.append({
            "id": row["id"], "label": row["label"], "path": row["path"], "status": response.status_code,
            "action": _action(response), "rule": response.headers.get("x-guard-rule", "-"),
            "fail_mode": response.headers.get("x-guard-fail-mode"),
            "ms": (time.perf_counter() - started) * 1000,
        })
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'id':<26} {'label':<7} {'path':<22} {'status':>6} {'action':<9} {'rule':<16} {'ms':>8}")
    for r in results:
        flag = f" (fail {r['fail_mode']})" if r["fail_mode"] else ""
        print(f"{r['id']:<26} {r['label']:<7} {r['path']:<22} {r['status']:>6} {r['action']:<9} {r['rule']:<16} "
              f"{r['ms']:8.1f}{flag}")
    counts = Counter((r["label"], r["action"]) for r in results)
    print("\nlabel    " + "  ".join(f"{a:>9}" for a in ("allow", "block", "escalate", "handoff")))
    for label in ("benign", "attack"):
        print(f"{label:<8} " + "  ".join(f"{counts[(label, a)]:>9}" for a in ("allow", "block", "escalate", "handoff")))
    latencies = sorted(r["ms"] for r in results)
    print(f"\n{len(results)} requests; latency p50 {latencies[len(latencies) // 2]:.1f} ms, "
          f"max {latencies[-1]:.1f} ms (first requests include model warm-up)")


async def run(args: argparse.Namespace) -> None:
    """Send the traffic the way ``--mode`` says.

    Raises:
        ValueError, FileNotFoundError, PolicyError: an unusable backend, policy, or pair of them (``main`` prints
            them as one line).
    """
    rows = load_traffic(args.limit)
    if args.mode == "url":
        async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
            print_table(await send_all(client, rows))
        return

    from examples.api.app import create_app
    from guard import Guard
    from guard.backends import start_backend
    from guard.backends.options import open_cli_backend

    if args.mode == "inprocess":
        guard = Guard.from_files(args.policy, backends=open_cli_backend(args))
        try:
            await start_backend(guard.backends["default"])  # warm up before anything is timed
            app = create_app(guard)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://example", timeout=120) as client:
                print_table(await send_all(client, rows))
        finally:
            await guard.aclose()
        return

    from guard.asgi.proxy import ProxyConfig, proxy_app

    guard = Guard.from_files(args.policy, backends=open_cli_backend(args))

    async def warm_up() -> None:
        await start_backend(guard.backends["default"])

    try:
        with serve_in_thread(create_app()) as upstream:
            app = proxy_app(guard, ProxyConfig(upstream), on_startup=warm_up)
            with serve_in_thread(app) as proxy:  # its lifespan starts (warms up) the backend
                print(f"example API at {upstream}, guard proxy at {proxy}\n")
                async with httpx.AsyncClient(base_url=proxy, timeout=120) as client:
                    print_table(await send_all(client, rows))
    finally:
        await guard.aclose()


def main() -> None:
    from guard.backends.options import add_backend_options
    from guard.errors import GuardError

    parser = argparse.ArgumentParser(description="Send the example traffic through the guard and print verdicts.")
    parser.add_argument("--mode", choices=["inprocess", "proxy", "url"], default="inprocess")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="for --mode url")
    parser.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="default: the quickstart's policy")
    add_backend_options(parser, default="compact")
    parser.add_argument("--limit", type=int, default=None, help="send only the first N requests")
    try:
        asyncio.run(run(parser.parse_args()))
    except (GuardError, OSError, ValueError) as exc:  # PolicyError is a GuardError
        raise SystemExit(f"traffic.py: {exc}") from None
    except httpx.TransportError as exc:  # --mode url before the proxy listens (it prints its address once it does)
        raise SystemExit(f"traffic.py: cannot reach {exc.request.url}: {type(exc).__name__}: {exc}; is the proxy "
                         "up? guard proxy prints 'guard proxy: http://...' once it listens") from None


if __name__ == "__main__":
    main()
