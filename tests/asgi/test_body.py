"""Body caps on received bytes (C02), bounded memory, the replaying receive, and 413 through a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from guard._body import BodyBytes, ReplayReceive, read_body
from guard.engine import Guard
from guard.errors import BodyError, Overloaded
from tests._backends import ScriptedBackend
from tests.asgi._apps import BENIGN, guarded_app, scripted_answers, sha
from tests.asgi._servers import raw_request, serve_in_thread

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
MiB = 1 << 20


class Feeder:
    """A receive() that yields ``total`` bytes in ``chunk``-sized messages and counts what was pulled."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total, self.chunk, self.pulled, self.calls = total, chunk, 0, 0
        self._piece = b"a" * chunk

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        size = min(self.chunk, self.total - self.pulled)
        self.pulled += size
        return {"type": "http.request", "body": self._piece[:size], "more_body": self.pulled < self.total}


async def test_chunked_50_mb_without_length_stops_just_past_the_cap() -> None:
    feeder = Feeder(50 * MiB)
    tracemalloc.start()
    with pytest.raises(BodyError) as info:
        await read_body(feeder, MiB)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert info.value.status == 413 and info.value.code == "body_too_large"
    assert MiB < feeder.pulled <= MiB + feeder.chunk  # stopped at the first message past the cap
    assert peak < 2 * MiB


async def test_small_content_length_followed_by_10_mb_is_counted_not_trusted() -> None:
    feeder = Feeder(10 * MiB)
    with pytest.raises(BodyError, match="sent at least"):
        await read_body(feeder, MiB, declared=10)
    assert feeder.pulled <= MiB + feeder.chunk


async def test_huge_declared_length_is_refused_before_reading() -> None:
    feeder = Feeder(10)
    with pytest.raises(BodyError, match="declares 2147483648 bytes; the inspection limit is 1048576"):
        await read_body(feeder, MiB, declared=2_147_483_648)
    assert feeder.calls == 0


@pytest.mark.parametrize("size", [0, 1, MiB - 1, MiB])
async def test_bodies_up_to_the_cap_are_read_whole(size: int) -> None:
    body = await read_body(Feeder(size) if size else _single(b""), MiB)
    assert body is not None and len(body) == size


async def test_one_message_over_the_cap_and_disconnects() -> None:
    with pytest.raises(BodyError):
        await read_body(_single(b"x" * (MiB + 1)), MiB)
    assert await read_body(_single_disconnect(), MiB) is None


def _single(body: bytes) -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _single_disconnect() -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    return receive


def _parts(count: int, every_s: float) -> Any:
    """A receive() that sends ``count`` one-byte parts, ``every_s`` apart, then never sends again."""
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent == count:
            await asyncio.Event().wait()
        sent += 1
        await asyncio.sleep(every_s)
        return {"type": "http.request", "body": b"a", "more_body": True}

    return receive


async def test_a_body_that_stops_sending_is_cut_at_the_idle_timeout_not_its_deadline() -> None:
    started = time.monotonic()
    with pytest.raises(BodyError, match=r"no byte of the request body arrived for 0.3 s") as info:
        await read_body(_parts(3, 0.1), MiB, timeout_s=300, idle_s=0.3)
    assert info.value.status == 408 and info.value.code == "body_timeout" and time.monotonic() - started < 1.5


async def test_the_idle_timeout_restarts_with_each_part_and_the_deadline_still_holds() -> None:
    started = time.monotonic()
    with pytest.raises(BodyError, match=r"did not arrive within 1 s"):  # 10 parts 0.2 s apart: 2 s, past the deadline
        await read_body(_parts(10, 0.2), MiB, timeout_s=1, idle_s=0.5)
    assert 0.9 < time.monotonic() - started < 1.6


async def test_body_bytes_count_parts_as_they_arrive_and_come_back_on_every_exit() -> None:
    bodies = BodyBytes(100)
    with bodies.share() as first:
        assert await read_body(Feeder(80, chunk=10), MiB, held=first) == b"a" * 80
        assert bodies.held == first.held == 80
        full = "memory for request bodies is full \\(100 bytes\\)"
        with pytest.raises(Overloaded, match=full), bodies.share() as second:
            await read_body(Feeder(50, chunk=10), MiB, held=second)  # 20 bytes fit, the third part would pass 100
        assert bodies.held == 80
        with bodies.share() as third:
            assert await read_body(_single_disconnect(), MiB, held=third) is None
            await read_body(Feeder(20, chunk=10), MiB, held=third)
            assert bodies.held == 100
            with pytest.raises(Overloaded):
                bodies.check_room()
        bodies.check_room()
    assert bodies.held == 0


async def test_replay_receive_states() -> None:
    later = [{"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return later.pop(0)

    replay = ReplayReceive(b"abc", receive)
    assert await replay() == {"type": "http.request", "body": b"abc", "more_body": False}  # not consumed
    assert await replay() == {"type": "http.disconnect"}  # consumed: the real receive answers


async def test_guarded_oversized_bodies_get_413_and_never_reach_the_app(make_guard: GuardFactory) -> None:
    backend = ScriptedBackend(scripted_answers)
    app = guarded_app(make_guard(backend), max_body_bytes=1024)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/echo",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"t"), (b"content-type", b"application/json")],
        "client": ("1.2.3.4", 1),
    }
    feeder = Feeder(50 * MiB, chunk=512)
    await app(scope, feeder, send)
    assert sent[0]["status"] == 413 and feeder.pulled <= 1536 and backend.calls == 0
    payload = json.loads(sent[1]["body"])
    assert payload["code"] == "body_too_large" and payload["field"] == "body" and payload["policy"] == "api_guard"


async def test_real_server_413_for_lying_or_missing_lengths(make_guard: GuardFactory) -> None:
    app = guarded_app(make_guard(), max_body_bytes=64 * 1024)
    with serve_in_thread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        declared = (
            b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n"
        )
        chunked = (
            b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"%x\r\n%s\r\n" % (16 * 1024, b"b" * 16 * 1024)
        results = await asyncio.gather(
            asyncio.to_thread(raw_request, port, declared, [b"a" * 1024] * 4, 0.05),
            asyncio.to_thread(raw_request, port, chunked, [piece] * 50),
        )
        ok = json.dumps({"message": BENIGN}).encode()
        normal = await asyncio.to_thread(
            raw_request,
            port,
            b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(ok),
            [ok],
        )
    for raw in results:
        assert raw.startswith(b"HTTP/1.1 413"), raw[:200]
        assert b'"code":"body_too_large"' in raw
    assert normal.startswith(b"HTTP/1.1 200") and sha(ok).encode() in normal
