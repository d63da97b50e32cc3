"""Large bodies (megabytes of JSON, a state far past ``max_length``) must not stall the worker's other requests nor
outlive their deadline: parsing runs off the event loop, encoding is bounded by the deadline."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from guard._json import _check_surrogates, loads
from guard.backends.batcher import BatcherConfig
from guard.backends.local import LocalBackend
from guard.clef.model import ClefModel
from guard.errors import InvalidJson
from guard.worker.app import WorkerConfig
from tests.worker._requests import ticket_body
from tests.worker._serve import RunningWorker, serve_worker

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def worker(clef_fp32: ClefModel) -> Iterator[RunningWorker]:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_wait_ms=2))
    with serve_worker(backend, config=WorkerConfig(model_name="clef-flash", canary_interval_s=0)) as running:
        yield running


@pytest.mark.parametrize(("text", "deepest"), [
    ('{"a": "[[[[[[", "b": [[1]]}', 3),  # brackets inside strings are text
    ('{"a\\"[[[[": [["x\\\\"]], "c": "\\"}"}', 3),  # escaped quotes and backslashes end no string early
    ("[" * 6 + "]" * 6, 6),
    ('[{"k": [{}]}, [[[]]], {"m": {"n": {}}}]', 4),  # the deepest branch counts, not the number of brackets
])
def test_the_depth_limit_reads_the_deepest_branch(text: str, deepest: int) -> None:
    """The depth is read from the brackets (no Python walk of the parsed value): exactly ``deepest`` passes, one
    level less is refused (``python bench/json_strict.py`` times it against ``json.loads``)."""
    assert loads(text, max_depth=deepest) == json.loads(text)
    with pytest.raises(InvalidJson, match="nests more than"):
        loads(text, max_depth=deepest - 1)


def test_a_lone_surrogate_nested_past_the_recursion_limit_is_named() -> None:
    """A value json.dumps cannot write for its depth (a depth limit set near the recursion limit) is walked."""
    value: object = ["\ud800"]
    for _ in range(300):
        value = [value]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(250 + len(inspect.stack()))
    try:
        with pytest.raises(InvalidJson, match="lone UTF-16 surrogate") as caught:
            _check_surrogates(value)
    finally:
        sys.setrecursionlimit(limit)
    assert caught.value.reason == "lone_surrogate" and caught.value.path.startswith("$[0][0]")


async def test_a_state_slow_to_encode_is_answered_504_at_its_deadline(worker: RunningWorker) -> None:
    """Two 7 MB states with a 250 ms deadline are answered 504 near the deadline, not once tokenization ends (about
    0.5-2 s a state, by CPU); a small request sent meanwhile is answered (the encodings hold neither the event loop
    nor asyncio's default threads)."""
    big = {**ticket_body(0), "state": "hello world " * 600_000}
    headers = {"x-request-timeout-ms": "250"}
    async with worker.client() as client:
        started = time.monotonic()
        slow = [asyncio.ensure_future(client.post("/v1/systemone", json=big, headers=headers)) for _ in range(2)]
        small = await client.post("/v1/systemone", json=ticket_body(1))
        answered = await asyncio.gather(*slow)
        took = time.monotonic() - started
    assert [r.status_code for r in answered] == [504, 504] and answered[0].json()["code"] == "timeout"
    assert took < 4.0, f"the 504s came after {took:.1f} s"
    assert small.status_code == 200, small.text


async def test_a_body_that_takes_past_the_deadline_to_parse_is_504_naming_that(worker: RunningWorker) -> None:
    """The deadline covers reading and parsing the body: spent there, the 504 says so (not a negative one)."""
    body = json.dumps({**ticket_body(0), "state": {"a": [0] * 1_500_000}})  # one list: within MAX_JSON_CONTAINERS
    async with worker.client() as client:
        response = await client.post("/v1/systemone", content=body,
                                      headers={"content-type": "application/json", "x-request-timeout-ms": "20"})
    assert response.status_code == 504 and response.json()["code"] == "timeout", response.text
    assert "reading and parsing the body took longer than the 20 ms deadline" in response.json()["message"]


async def test_a_body_of_millions_of_arrays_is_refused_before_parsing(worker: RunningWorker) -> None:
    """8 MiB of ``[]`` (8 KB gzipped) are 2.8 million lists: json's C parser held the GIL for half a second each,
    and a few such requests stalled ``/healthz`` past a probe's 1 s timeout (attack finding). The brackets are
    counted first."""
    import gzip

    from guard.worker.app import MAX_JSON_CONTAINERS

    state = "[" + ",".join(["[]"] * 2_700_000) + "]"
    body = gzip.compress(f'{{"model": "clef-flash", "questions": {{}}, "state": {state}}}'.encode())
    passes = worker.batcher.stats.batches
    started = time.perf_counter()
    async with worker.client() as client:
        response = await client.post("/v1/systemone", content=body,
                                      headers={"content-type": "application/json", "content-encoding": "gzip"})
    took = time.perf_counter() - started
    assert response.status_code == 400 and response.json()["code"] == "invalid_json", response.text
    assert f"at most {MAX_JSON_CONTAINERS} are read" in response.json()["message"]
    assert worker.batcher.stats.batches == passes and took < 2.0  # a bound on a hang, not a speed claim
    assert loads("[[], {}]", max_containers=3) == [[], {}]
    with pytest.raises(InvalidJson, match="holds 4 arrays and objects"):
        loads("[[], {}, []]", max_containers=3)


async def test_a_compressed_body_counts_its_decoded_bytes_against_the_pending_limit(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the bytes received counted: eight zstd bodies of 703 bytes, each 6.5 MB of JSON once decoded, were all
    taken in beside each other under a 9 MB ``max_pending_body_bytes`` (``body_bytes`` never above 5,624 while the
    worker grew by 440 MB), where the same bodies sent plain got 429 (review finding). The decoded body counts, from
    its decoding until the answer, so a second such body while the first is held gets the full queue's 429."""
    import zstandard

    cap = 64 * 1024
    config = WorkerConfig(max_body_bytes=cap, max_pending_body_bytes=cap, model_name="clef-flash", canary_interval_s=0)
    plain = json.dumps({**ticket_body(0), "state": "word " * 8000}).encode()  # more than half of the limit
    body = zstandard.compress(plain)
    headers = {"content-type": "application/json", "content-encoding": "zstd"}
    released = threading.Event()
    forward = clef_fp32.forward_records

    def wedged(records: Any) -> Any:
        released.wait(30)
        return forward(records)

    with serve_worker(LocalBackend(clef_fp32, max_length=2048), config=config) as worker:
        async with worker.client() as client:
            monkeypatch.setattr(clef_fp32, "forward_records", wedged)
            try:
                first = asyncio.ensure_future(client.post("/v1/systemone", content=body, headers=headers))
                deadline = time.monotonic() + 10
                while worker.batcher.in_flight == 0:  # read, decoded, parsed, encoded: in the forward pass
                    assert time.monotonic() < deadline, "the request never reached the forward pass"
                    await asyncio.sleep(0.01)
                held = (await client.get("/readyz")).json()["body_bytes"]
                second = await client.post("/v1/systemone", content=body,
                                           headers={**headers, "x-request-timeout-ms": "2000"})
            finally:
                released.set()
            answered = await first
            left = (await client.get("/readyz")).json()["body_bytes"]
    assert len(body) < 1000 and held == len(plain)
    assert second.status_code == 429 and second.headers["retry-after"] == "1", second.text
    assert second.json()["code"] == "overloaded" and str(cap) in second.json()["message"]
    assert answered.status_code == 200 and left == 0, answered.text


async def test_megabytes_of_instructions_are_refused_without_holding_the_encoding_threads(
    worker: RunningWorker,
) -> None:
    """Four bodies with 2 MB of instructions each were tokenized whole before the length check (about 6.5 s each on
    a 2-core machine, all four encoding threads busy, so other requests timed out for ~28 s: attack finding). Each is
    refused 422 naming the field once the schema passes ``max_length``, and a small request sent meanwhile is
    answered within its deadline."""
    huge = {**ticket_body(0), "questions": {"q": {"type": "noul", "instructions": "word " * 400_000}}}
    async with worker.client() as client:
        started = time.monotonic()
        refused = [asyncio.ensure_future(client.post("/v1/systemone", json=huge)) for _ in range(4)]
        small = await client.post("/v1/systemone", json=ticket_body(1), headers={"x-request-timeout-ms": "5000"})
        answered = await asyncio.gather(*refused)
        took = time.monotonic() - started
    assert small.status_code == 200, small.text
    assert took < 10, f"answered after {took:.1f} s"  # a bound on a stall, not a speed claim
    for response in answered:
        assert response.status_code == 422, response.text
        (error,) = response.json()["errors"]
        assert error["field"] == "questions.q.instructions"
        assert error["message"].startswith("schema requires at least ") and "maximum is 16384" in error["message"]
