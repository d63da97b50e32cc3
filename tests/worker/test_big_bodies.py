"""Large bodies (megabytes of JSON, a state far past ``max_length``) must not stall the worker's other requests nor
outlive their deadline: parsing runs off the event loop, encoding is bounded by the deadline."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import pytest

from guard._json import loads
from guard.backends.batcher import BatcherConfig
from guard.backends.local import LocalBackend
from guard.clef.model import ClefModel
from guard.worker.app import WorkerConfig
from tests.worker._requests import ticket_body
from tests.worker._serve import RunningWorker, serve_worker

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def worker(clef_fp32: ClefModel) -> Iterator[RunningWorker]:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_wait_ms=2))
    with serve_worker(backend, config=WorkerConfig(model_name="clef-flash", canary_interval_s=0)) as running:
        yield running


def timed(parse: Callable[[str], object], text: str) -> float:
    """Seconds of the fastest of three ``parse(text)``."""
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        parse(text)
        runs.append(time.perf_counter() - started)
    return min(runs)


@pytest.mark.parametrize("tail", ["", ', "b": "\\ud83d\\ude00"'])
def test_strict_parsing_costs_about_what_json_loads_does(tail: str) -> None:
    """5.2 MB of ``[0]`` arrays (1.3 million values; with a surrogate pair, which is valid): the depth and surrogate
    checks walk no value in Python, so strict parsing stays near json's own C parser (it took 6 to 8 times as long
    when both checks walked every value)."""
    text = '{"model": "m", "state": {"a": [' + ",".join(["[0]"] * 1_300_000) + "]" + tail + "}}"
    assert timed(loads, text) < 2.5 * timed(json.loads, text)


async def test_megabytes_of_json_are_parsed_off_the_event_loop(worker: RunningWorker) -> None:
    """While a 7.6 MB body (1.9 million small arrays) is parsed, the worker's event loop answers probes."""
    body = '{"model": "clef-flash", "state": {"a": [' + ",".join(["[0]"] * 1_900_000) + ']}, "questions": {}}'
    async with worker.client() as client:
        busy = asyncio.ensure_future(client.post("/v1/systemone", content=body,
                                                 headers={"content-type": "application/json"}))
        probes = 0
        while not busy.done():
            assert (await client.get("/healthz")).status_code == 200
            probes += 1
            await asyncio.sleep(0.02)
        refused = await busy
    assert refused.status_code == 422 and refused.json()["field"] == "questions"
    assert probes > 1


async def test_a_state_slow_to_encode_is_answered_504_at_its_deadline(worker: RunningWorker) -> None:
    """Two 7 MB states with a 1 s deadline are answered 504 near the deadline, not once tokenization ends; a small
    request sent meanwhile is answered (the encodings hold neither the event loop nor asyncio's default threads)."""
    big = {**ticket_body(0), "state": "hello world " * 600_000}
    headers = {"x-request-timeout-ms": "1000"}
    async with worker.client() as client:
        started = time.monotonic()
        slow = [asyncio.ensure_future(client.post("/v1/systemone", json=big, headers=headers)) for _ in range(2)]
        small = await client.post("/v1/systemone", json=ticket_body(1))
        answered = await asyncio.gather(*slow)
        took = time.monotonic() - started
    assert [r.status_code for r in answered] == [504, 504] and answered[0].json()["code"] == "timeout"
    assert took < 4.0, f"the 504s came after {took:.1f} s"
    assert small.status_code == 200, small.text
