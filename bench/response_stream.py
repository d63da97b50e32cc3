"""What judging a streamed response costs: an SSE stream bare vs behind a response policy (sliding window).

One uvicorn process on loopback serves the same Starlette app twice: ``/bare/sse`` (no policy watches it) and
``/judged/sse`` (a response policy judges it with the default window, 4 KiB, and the default timed flush, answered by
a constant in-process backend: every window is a cache miss, so each costs one engine evaluation). Events come
``PACE_MS`` apart, like tokens from a model. The client reads each stream whole and reports, per variant, the median
time to the first byte and to the last byte over interleaved rounds, and the difference. A plain
(``Content-Length``) JSON response, judged whole, is measured the same way.

Then a slow token stream (``SLOW_EVENTS`` small events ``SLOW_PACE_MS`` apart): the delay of every event from the
app's send to its arrival at the client (one process, one clock), bare, judged with the window alone
(``stream_flush_s=None``: held until 4 KiB or the end), judged with the timed flush and no hold
(``stream_hold_chars=0``: each event goes once judged) and judged with the defaults (the timed flush, and the last
64 characters of the joined tokens held until more follows, at most ``stream_hold_s``), interleaved; median and p99
per variant.

Run:  python bench/response_stream.py [--events 200] [--rounds 30] [--slow-events 40] [--slow-pace-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from guard.asgi import GuardMiddleware
from guard.asgi.limits import DEFAULT_STREAM_FLUSH_S, DEFAULT_STREAM_HOLD_CHARS, BodyLimits
from guard.engine import Guard
from guard.systemone import AnswerV1, SystemOneResponseV1, UsageV1

# Settings -----------------------------------------------------------------------------------------------------------
EVENTS = 200  # SSE events per stream (about 90 bytes each: an OpenAI-style delta chunk)
PACE_MS = 1.0  # pause between events, as a model generating tokens (0: as fast as the app can)
ROUNDS = 30
SLOW_EVENTS = 40  # events of the slow stream (about 40 bytes each: one token)
SLOW_PACE_MS = 100.0  # between them, as a slow model's tokens
SLOW_ROUNDS = 3
POLICY = """
policies:
  - id: answers
    version: 1
    match: {http: {paths: ["/judged/**", "/window/**", "/nohold/**"], response: {status: [200]}}}
    state: {text: body_text}
    questions:
      leak: {type: noul, instructions: "Does the text leak a secret?"}
    rules:
      - {id: leak, when: leak.noul >= 0.8, action: block}
"""


class ConstantBackend:
    """Answers P(leak) = 0.01 to every question."""

    name = "constant"
    model_revision = "constant-1"

    async def decide(self, request: object, *, timeout: float | None = None) -> SystemOneResponseV1:
        answers = {q.id: AnswerV1(question_id=q.id, type="noul", probabilities={"true": 0.01, "false": 0.99},
                                  noul=0.01) for q in request.questions}  # type: ignore[attr-defined]
        return SystemOneResponseV1(model="constant", answers=answers, usage=UsageV1(input_tokens=1))

    async def aclose(self) -> None:
        return None


def _app(policy_file: str, events: int, pace_ms: float, slow_events: int, slow_pace_ms: float) -> Any:
    """``/window/...`` behind a guard without the timed flush, ``/nohold/...`` without the hold; every other path
    behind one with the defaults."""

    async def sse(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            for i in range(events):
                chunk = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"delta": {"content": f" w{i}"}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(pace_ms / 1000)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def slow(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            for i in range(slow_events):
                yield f"data: {json.dumps({'t': f' w{i}', 'sent': time.perf_counter()})}\n\n"
                await asyncio.sleep(slow_pace_ms / 1000)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def plain(request: Request) -> Response:
        return JSONResponse({"answer": " ".join(f"w{i}" for i in range(events))})

    routes = [Route(f"/{p}/{name}", view) for p in ("bare", "judged", "window", "nohold")
              for name, view in (("sse", sse), ("slow", slow), ("plain", plain))]
    guard = Guard.from_files(policy_file, backends=ConstantBackend())
    apps = {prefix: Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=guard, limits=limits)])
            for prefix, limits in (("/judged/", BodyLimits()), ("/window/", BodyLimits(stream_flush_s=None)),
                                   ("/nohold/", BodyLimits(stream_hold_chars=0)))}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        await next((a for prefix, a in apps.items() if path.startswith(prefix)), apps["/judged/"])(scope, receive, send)

    return app


async def _read(client: httpx.AsyncClient, path: str) -> tuple[float, float, int]:
    started = time.perf_counter()
    first = None
    size = 0
    async with client.stream("GET", path) as response:
        async for piece in response.aiter_raw():
            first = first if first is not None else time.perf_counter()
            size += len(piece)
    return ((first or time.perf_counter()) - started) * 1000, (time.perf_counter() - started) * 1000, size


async def _delays(client: httpx.AsyncClient, path: str) -> list[float]:
    """Each event's delay (ms) from the app's send to its arrival here."""
    out: list[float] = []
    async with client.stream("GET", path) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                out.append((time.perf_counter() - json.loads(line[len("data: "):])["sent"]) * 1000)
    return out


async def _measure_slow(url: str, rounds: int) -> dict[str, list[float]]:
    paths = ["/bare/slow", "/window/slow", "/nohold/slow", "/judged/slow"]
    out: dict[str, list[float]] = {p: [] for p in paths}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(rounds):
            for path in paths:
                out[path] += await _delays(client, path)
    return out


async def _measure(url: str, rounds: int) -> dict[str, list[tuple[float, float, int]]]:
    paths = ["/bare/sse", "/judged/sse", "/bare/plain", "/judged/plain"]
    out: dict[str, list[tuple[float, float, int]]] = {p: [] for p in paths}
    async with httpx.AsyncClient(base_url=url) as client:
        for path in paths:  # warm-up
            await _read(client, path)
        for _ in range(rounds):
            for path in paths:
                out[path].append(await _read(client, path))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--pace-ms", type=float, default=PACE_MS)
    parser.add_argument("--slow-events", type=int, default=SLOW_EVENTS)
    parser.add_argument("--slow-pace-ms", type=float, default=SLOW_PACE_MS)
    parser.add_argument("--slow-rounds", type=int, default=SLOW_ROUNDS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy_file = Path(tmp) / "policy.yaml"
        policy_file.write_text(POLICY)
        app = _app(str(policy_file), args.events, args.pace_ms, args.slow_events, args.slow_pace_ms)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        results = asyncio.run(_measure(url, args.rounds))
        slow = asyncio.run(_measure_slow(url, args.slow_rounds))
        server.should_exit = True
        thread.join(10)
    print(f"{args.slow_rounds} rounds; slow SSE stream of {args.slow_events} events {args.slow_pace_ms:g} ms apart; "
          "delay of each event from the app's send to the client, ms")
    print(f"{'variant':<38} {'events':>6} {'p50':>9} {'p99':>9} {'max':>9}")
    names = {"/bare/slow": "bare", "/window/slow": "judged, window only (no flush)",
             "/nohold/slow": f"judged, flush {DEFAULT_STREAM_FLUSH_S:g} s, no hold",
             "/judged/slow": f"judged, defaults (hold {DEFAULT_STREAM_HOLD_CHARS} chars)"}
    for path, delays in slow.items():
        ordered = sorted(delays)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(f"{names[path]:<38} {len(delays):>6} {statistics.median(delays):9.1f} {p99:9.1f} {ordered[-1]:9.1f}")
    print(f"{args.rounds} rounds; SSE stream of {args.events} events {args.pace_ms:g} ms apart, plain JSON of the "
          "same words; medians, ms")
    print(f"{'path':<16} {'bytes':>8} {'first byte':>11} {'last byte':>10}")
    med = {p: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), rows[0][2])
           for p, rows in results.items()}
    for path, (first, last, size) in med.items():
        print(f"{path:<16} {size:>8} {first:11.3f} {last:10.3f}")
    for kind in ("sse", "plain"):
        bare, judged = med[f"/bare/{kind}"], med[f"/judged/{kind}"]
        print(f"added by the response policy ({kind}): first byte {judged[0] - bare[0]:+.3f} ms, last byte "
              f"{judged[1] - bare[1]:+.3f} ms")


if __name__ == "__main__":
    main()
