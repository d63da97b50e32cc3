"""Real servers for HTTP tests: uvicorn on a loopback port in a thread, and an OpenAI-compatible stand-in LLM."""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread cannot own signal handlers
        pass


@contextmanager
def serve_in_thread(app: ASGIApp, **config: Any) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL ``http://host:port``.

    Startup (``lifespan="on"`` may load and warm up a model) gets up to 120 s on a loaded machine; a server that
    fails to start is seen at once, when its thread ends.
    """
    config.setdefault("lifespan", "off")
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config)
    server = _Server(cfg)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def raw_request(port: int, head: bytes, body_pieces: Sequence[bytes] = (), pause: float = 0.0) -> bytes:
    """Send a hand-made HTTP/1.1 request (the head, then body pieces one by one) to 127.0.0.1:``port`` and read one
    whole response (to ``Content-Length``, or to the end of the connection without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(head)
        for piece in body_pieces:
            try:
                conn.sendall(piece)
            except OSError:  # the server answered and closed: fine, read the answer
                break
            time.sleep(pause)
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
            head_part, _, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: (\d+)", head_part)
            while (length is None or len(rest) < int(length.group(1))) and (chunk := conn.recv(65536)):
                rest += chunk
            return head_part + b"\r\n\r\n" + rest
        except OSError:
            return data



@functools.cache
def gzip_bomb() -> bytes:
    """64 MiB of zeros, gzip-compressed (about 64 KB): made once, so a test's timed answer does not include making it."""
    return gzip.compress(b"0" * (64 << 20), compresslevel=9)


class OpenAIStandIn:
    """A small OpenAI-compatible ``/v1/chat/completions`` server for handoff tests.

    The answer is ``"Stand-in answer to: <last user message>"``. The requested model picks a behaviour:
    ``fail-500`` (HTTP 500), ``fail-500-drip`` (HTTP 500 with a body that never ends), ``fail-401-echo`` (HTTP 401
    echoing the key it got and a forged log line), ``redirect-with-answer`` (a 302 whose body is a valid completion),
    ``redirect-elsewhere`` (a 307 to a URL where it answers), ``tool-call`` (an answer calling a tool),
    ``slow`` (sleeps 1.5 s), ``slow-head`` (6 s), ``malformed`` (200 with a non-JSON body), ``deep`` (JSON nested
    100,000 deep), ``huge`` (a 5 MiB answer), ``drip`` (an answer one byte every 0.3 s), ``keepalive`` (a stream of
    SSE comments only), ``trickle`` (a content event every 0.3 s for 12 s), ``broken-stream``
    (streams one chunk, then a non-JSON event), ``error-event`` (streams one chunk, then
    an ``{"error": ...}`` event naming a key and a host), ``gated`` (when streaming, waits after the first chunk until
    :attr:`gate` is set, so a test can prove the chunk reached it before the rest was generated). Every request
    body is kept in :attr:`calls`.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.gate = threading.Event()
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    @staticmethod
    def answer(body: dict[str, Any]) -> str:
        user = [m["content"] for m in body["messages"] if m["role"] == "user"]
        return f"Stand-in answer to: {user[-1] if user else ''}"

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(body)
        self.headers.append(dict(request.headers))
        model = body["model"]
        if model == "fail-500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if model == "fail-401-echo":  # echoes the key it got and a forged log line
            text = f"bad key {request.headers.get('authorization')}\nCRITICAL guard: forged line"
            return PlainTextResponse(text, status_code=401)
        if model == "redirect-with-answer":  # a valid completion under a redirect to the metadata address
            return JSONResponse(self.completion(model, self.answer(body)), status_code=302,
                                headers={"location": "http://169.254.169.254/latest/meta-data/"})
        if model == "redirect-elsewhere" and "followed" not in request.query_params:  # answers once redirected
            return Response(status_code=307, headers={"location": "/v1/chat/completions?followed=1"})
        if model == "tool-call":  # text with a call of a tool the client may have declared (guard sends none)
            call = {"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "transfer_funds", "arguments": '{"to": "attacker"}'}}
            if not body.get("stream"):
                answer = self.completion(model, "Sure.")
                answer["choices"][0]["message"]["tool_calls"] = [call]
                return JSONResponse(answer)
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
            return StreamingResponse(iter([f"data: {json.dumps(chunk)}\n\n", "data: [DONE]\n\n"]),
                                     media_type="text/event-stream")
        if model == "fail-500-drip":  # an error answer that never ends
            async def endless() -> AsyncIterator[bytes]:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0.1)

            return StreamingResponse(endless(), status_code=500, media_type="text/plain")
        if model == "slow":
            await asyncio.sleep(1.5)
        if model == "slow-head":
            await asyncio.sleep(6.0)
        if model == "malformed":
            return PlainTextResponse("this is not json")
        if model == "deep":  # nested past any parser's recursion limit
            return PlainTextResponse('{"choices": ' + "[" * 100_000 + "]" * 100_000 + "}", media_type="application/json")
        if model == "huge":  # over the handoff client's answer limit
            return PlainTextResponse('{"pad": "' + "x" * (5 << 20) + '"}', media_type="application/json")
        if model == "drip":  # one byte of a valid answer every 0.3 s: each read is quick, the whole is not
            async def drip() -> AsyncIterator[bytes]:
                for byte in json.dumps({"choices": [{"message": {"content": "late"}}]}).encode():
                    await asyncio.sleep(0.3)
                    yield bytes([byte])

            return StreamingResponse(drip(), media_type="application/json")
        if model == "gzip-bomb":  # 64 MiB of zeros in about 64 KB, sent compressed though identity was asked for
            bomb = gzip_bomb()
            headers = {"content-encoding": "gzip", "content-type": "application/json"}
            return Response(bomb, headers=headers, media_type="text/event-stream" if body.get("stream") else None)
        if model == "identity-twice":  # two proxies each saying so: nothing to decode
            answer = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
            response = Response(json.dumps(answer), media_type="application/json")
            response.raw_headers += [(b"content-encoding", b"identity")] * 2
            return response
        if model == "endless-stream":  # content events past any answer's size (40 MiB), each in time
            async def flood() -> AsyncIterator[str]:
                chunk = json.dumps({"object": "chat.completion.chunk", "choices": [{"delta": {"content": "x" * 65536}}]})
                for _ in range(640):
                    yield f"data: {chunk}\n\n"
                    await asyncio.sleep(0)

            return StreamingResponse(flood(), media_type="text/event-stream")
        if model == "trickle":  # a content event every 0.3 s for 12 s: each in time, the whole stream not
            async def trickle() -> AsyncIterator[str]:
                chunk = json.dumps({"object": "chat.completion.chunk", "choices": [{"delta": {"content": "x"}}]})
                for _ in range(40):
                    yield f"data: {chunk}\n\n"
                    await asyncio.sleep(0.3)

            return StreamingResponse(trickle(), media_type="text/event-stream")
        if model == "keepalive":  # a stream of SSE comments only
            async def comments() -> AsyncIterator[str]:
                for _ in range(40):
                    await asyncio.sleep(0.3)
                    yield ": keepalive\n\n"

            return StreamingResponse(comments(), media_type="text/event-stream")
        text = self.answer(body)
        if not body.get("stream"):
            return JSONResponse(self.completion(model, text))
        return StreamingResponse(self._events(model, text), media_type="text/event-stream")

    @staticmethod
    def completion(model: str, text: str) -> dict[str, Any]:
        """A whole ``chat.completion`` answering ``text``."""
        return {
            "id": "chatcmpl-standin",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }

    async def _events(self, model: str, text: str) -> AsyncIterator[str]:
        def event(delta: dict[str, Any], finish: str | None = None) -> str:
            chunk = {
                "id": "chatcmpl-standin",
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(chunk)}\n\n"

        yield event({"role": "assistant"})
        words = text.split(" ")
        for i, word in enumerate(words):
            yield event({"content": word if i == 0 else " " + word})
            if i == 0 and model == "broken-stream":
                yield "data: {not json\n\n"
                return
            if i == 0 and model == "error-event":  # OpenAI's mid-stream error, naming the key and an internal host
                error = {"message": "Incorrect API key provided: sk-handoff-secret-0123456789 at 10.0.0.5",
                         "type": "invalid_request_error", "code": "invalid_api_key"}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            if i == 0 and model == "gated":
                deadline = time.monotonic() + 5
                while not self.gate.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                if not self.gate.is_set():
                    yield event({"content": " [GATE TIMEOUT]"})
        yield event({}, "stop")
        yield "data: [DONE]\n\n"
