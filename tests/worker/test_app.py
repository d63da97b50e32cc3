"""The decision worker over real HTTP: uvicorn in a thread, the golden tiny checkpoint (float32), real requests."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from guard.asgi.server import server_options
from guard.backends.batcher import BatcherConfig
from guard.backends.local import LocalBackend
from guard.clef import processor as processor_module
from guard.clef.model import ClefModel
from guard.systemone import SystemOneRequestV1
from guard.worker.app import WorkerConfig, create_app
from tests.worker._requests import golden_case, long_body, ticket_body
from tests.worker._serve import RunningWorker, ServerThread, serve_app_in_thread, serve_worker

pytestmark = pytest.mark.anyio

BODY_CAP = 64 * 1024
ONE_OPTION = (
    b'{"model": "clef-public-tiny", "state": "s", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": {"a": 1}}}}'
)


def assert_close(got: Any, want: Any, tol: float = 2e-4, path: str = "$") -> None:
    """Recursive JSON equality with a tolerance on floats (batched and single fp32 runs differ by ~1e-6)."""
    if isinstance(want, float) or isinstance(got, float):
        assert abs(float(got) - float(want)) <= tol, f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_close(got[key], want[key], tol, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, tol, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def worker(clef_fp32: ClefModel) -> Iterator[RunningWorker]:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=16, max_wait_ms=5))
    config = WorkerConfig(max_body_bytes=BODY_CAP, model_name="clef-flash", model_aliases=("clef-public-tiny",),
                          canary_interval_s=0)  # counts of forward passes below must not see a periodic canary run
    with serve_worker(backend, config=config) as running:
        yield running


async def hold_inference_thread(worker: RunningWorker, client: httpx.AsyncClient) -> asyncio.Future[httpx.Response]:
    """Send a long request and return once it is computing, so that what follows has to queue behind it."""
    busy = asyncio.ensure_future(client.post("/v1/systemone", json=long_body()))
    deadline = time.monotonic() + 60
    while worker.batcher.in_flight == 0:
        assert time.monotonic() < deadline and not busy.done(), "the long request never started computing"
        await asyncio.sleep(0.002)
    return busy


async def test_answer_matches_the_reference_fixture(worker: RunningWorker) -> None:
    case = golden_case("01-three-types")
    async with worker.client() as client:
        response = await client.post("/v1/systemone", json=case["request"])
    assert response.status_code == 200, response.text
    assert_close(response.json(), case["response_fp32"])
    assert response.json()["model"] == "clef-public-tiny"
    assert response.json()["usage"] == {"input_tokens": case["input_ids_len"], "output_tokens": 0}
    assert response.headers["x-guard-model-revision"] == worker.backend.model_revision


async def test_concurrent_requests_get_their_own_answers_in_fewer_forward_passes(worker: RunningWorker) -> None:
    bodies = [ticket_body(i) for i in range(16)]
    async with worker.client(timeout=60) as client:
        one_at_a_time = [(await client.post("/v1/systemone", json=body)).json() for body in bodies]
        passes_before = worker.batcher.stats.batches
        responses = await asyncio.gather(*(client.post("/v1/systemone", json=body) for body in bodies))
        passes = worker.batcher.stats.batches - passes_before
    assert [r.status_code for r in responses] == [200] * len(bodies)
    for i, (response, single) in enumerate(zip(responses, one_at_a_time, strict=True)):
        assert_close(response.json(), single, path=f"request {i}")
        assert list(response.json()["answers"]) == list(bodies[i]["questions"])
    assert passes < len(bodies), f"{passes} forward passes for {len(bodies)} concurrent requests"


async def test_deadline_header_drops_a_queued_request_before_compute(worker: RunningWorker) -> None:
    stats = worker.batcher.stats
    async with worker.client(timeout=60) as client:
        busy = await hold_inference_thread(worker, client)
        computed, expired = stats.batched_requests, stats.expired
        late = await client.post("/v1/systemone", json=ticket_body(1), headers={"x-request-timeout-ms": "50"})
        answered_while_busy = not busy.done()
        assert (await busy).status_code == 200
        assert (await client.post("/v1/systemone", json=ticket_body(2))).status_code == 200
    assert late.status_code == 504 and late.json()["code"] == "timeout"
    assert answered_while_busy  # at its deadline, not after the long request
    assert stats.expired == expired + 1
    assert stats.batched_requests == computed + 1  # only the follow-up request was computed, never the late one


async def test_client_disconnect_drops_a_queued_request_before_compute(worker: RunningWorker) -> None:
    stats = worker.batcher.stats
    async with worker.client(timeout=60) as client:
        busy = await hold_inference_thread(worker, client)
        computed, cancelled = stats.batched_requests, stats.cancelled
        async with worker.client() as impatient:
            gone = asyncio.ensure_future(impatient.post("/v1/systemone", json=ticket_body(3)))
            while worker.batcher.queue_depth == 0:
                await asyncio.sleep(0.002)
            gone.cancel()  # the client goes away while its request waits behind the long one
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        assert gone.cancelled()
        assert (await busy).status_code == 200
        assert (await client.post("/v1/systemone", json=ticket_body(4))).status_code == 200
    assert stats.cancelled == cancelled + 1
    assert stats.batched_requests == computed + 1


@pytest.mark.parametrize(
    ("content", "headers", "status", "code", "field"),
    [
        (b"not json", {}, 400, "invalid_json", "body"),
        (b"", {}, 400, "invalid_json", "body"),
        (b'{"model": "m", "model": "n", "state": "s", "questions": {}}', {}, 400, "invalid_json", "body"),
        (b'{"model": "m", "state": NaN, "questions": {}}', {}, 400, "invalid_json", "body"),
        (b"\xff\xfe{}", {}, 400, "invalid_json", "body"),
        (b"[1, 2]", {}, 422, "invalid_request", "body"),
        (b'{"model": "m", "state": "s"}', {}, 422, "invalid_request", "questions"),
        (
            b'{"model": "m", "state": "s", "questions": {"q": {"type": "maybe"}}}',
            {},
            422,
            "invalid_request",
            "questions.q.type",
        ),
        (
            b'{"model": "m", "state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}, "extra": 1}',
            {},
            422,
            "invalid_request",
            "extra",
        ),
        (ONE_OPTION, {}, 422, "invalid_request", "questions.q.criteria"),
        (b"{}", {"x-request-timeout-ms": "soon"}, 400, "invalid_header", "headers.x-request-timeout-ms"),
        (b"{}", {"x-request-timeout-ms": "-5"}, 400, "invalid_header", "headers.x-request-timeout-ms"),
        (b"x" * (BODY_CAP + 1), {}, 413, "body_too_large", "body"),
    ],
    ids=[
        "text",
        "empty",
        "duplicate-key",
        "nan",
        "utf16-bom",
        "array",
        "no-questions",
        "bad-type",
        "unknown-field",
        "one-option",
        "timeout-text",
        "timeout-negative",
        "too-large",
    ],
)
async def test_bad_requests_get_a_4xx_naming_the_field(
    worker: RunningWorker, content: bytes, headers: dict[str, str], status: int, code: str, field: str
) -> None:
    async with worker.client() as client:
        response = await client.post(
            "/v1/systemone", content=content, headers={"content-type": "application/json", **headers}
        )
        assert response.status_code == status, response.text
        body = response.json()
        assert body["code"] == code and body["field"] == field and body["message"]
        # the worker survives: the next valid request is answered
        assert (await client.post("/v1/systemone", json=ticket_body(0))).status_code == 200


@pytest.mark.parametrize("values", [("1", "30000"), ("30000", "1"), ("30000", "30000")])
async def test_a_repeated_deadline_header_is_refused(worker: RunningWorker, values: tuple[str, str]) -> None:
    """Two ``x-request-timeout-ms`` lines were read as the first (review finding), where a front proxy may read the
    last: the field holds one value, so two are a 400 ``repeated_header``, as for ``Content-Type``."""
    headers = [("x-request-timeout-ms", value) for value in values]
    async with worker.client() as client:
        response = await client.post("/v1/systemone", json=ticket_body(0), headers=headers)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["code"] == "repeated_header" and body["field"] == "headers.x-request-timeout-ms", body


async def test_every_bad_field_is_listed(worker: RunningWorker) -> None:
    body = {"model": "", "state": 5, "questions": {"a b": {"type": "score", "instructions": "", "criteria": ["x"]}}}
    async with worker.client() as client:
        response = await client.post("/v1/systemone", json=body)
    assert response.status_code == 422
    fields = [e["field"] for e in response.json()["errors"]]
    assert {"model", "state", "questions.a b", "questions.a b.instructions", "questions.a b.criteria"} <= set(fields)
    assert all(e["message"] for e in response.json()["errors"])


async def test_unknown_routes_and_methods_are_json_errors(worker: RunningWorker) -> None:
    async with worker.client() as client:
        missing = await client.get("/v2/nothing")
        wrong = await client.get("/v1/systemone")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"  # a 405 names the methods the route takes (RFC 9110 section 15.5.6)


async def test_a_path_with_a_slash_added_is_not_found_not_redirected(worker: RunningWorker) -> None:
    """``POST /v1/systemone/`` was a 307 with an empty body to ``http://<the request's Host>/v1/systemone`` (review
    finding: a Host of ``evil.example`` sent the client there); it is an unknown path like any other. So is
    ``GET /v1/models/``, which was a ``model_not_found`` naming the model ``''``."""
    async with worker.client() as client:
        slashed = await client.post("/v1/systemone/", json=ticket_body(0), headers={"host": "evil.example"})
        probe = await client.get("/healthz/")
        listing = await client.get("/v1/models/")
        unknown = await client.get("/v2/nothing")
    for response in (slashed, probe, listing):
        assert response.status_code == 404 and response.json()["code"] == "not_found", response.text
        assert "location" not in response.headers
    assert listing.json() == {**unknown.json(), "message": "GET /v1/models/: Not Found"}


async def test_models_health_ready_and_metrics(worker: RunningWorker) -> None:
    async with worker.client() as client:
        await client.post("/v1/systemone", json=ticket_body(5))
        await client.post("/v1/systemone", content=b"nope")
        models = (await client.get("/v1/models")).json()
        health = await client.get("/healthz")
        ready = await client.get("/readyz")
        metrics = await client.get("/metrics")
    assert [entry["name"] for entry in models["models"]] == ["clef-flash", "checkpoint", "clef-public-tiny"]
    entry = models["models"][0]
    assert entry["revision"] == worker.backend.model_revision
    assert entry["description"] and entry["dtype"] == "float32" and entry["max_input_tokens"] == 16384
    assert health.status_code == 200 and ready.status_code == 200 and ready.json()["status"] == "ready"
    text = metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "guard_worker_queue_depth",
        "guard_worker_in_flight",
        "guard_worker_batch_size_bucket",
        "guard_worker_batch_tokens_bucket",
        "guard_worker_request_duration_seconds_bucket",
        "guard_worker_batch_compute_seconds_bucket",
        "guard_worker_forward_passes_total",
    ):
        assert name in text, name
    assert "guard_worker_requests_total{" in text and 'outcome="ok"' in text and 'outcome="invalid"' in text


async def test_full_queue_answers_429_with_retry_after_at_once(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=1, max_queue=2, max_wait_ms=0))
    with serve_worker(backend) as worker:
        async with worker.client(timeout=60) as client:
            busy = await hold_inference_thread(worker, client)
            sent = [asyncio.ensure_future(client.post("/v1/systemone", json=ticket_body(i))) for i in range(6)]
            while sum(task.done() for task in sent) < 4 and not busy.done():
                await asyncio.sleep(0.002)
            refused = [task.result() for task in sent if task.done() and task.result().status_code == 429]
            refused_while_busy = not busy.done()
            results = await asyncio.gather(*sent)
            assert (await busy).status_code == 200
            assert (await client.get("/healthz")).status_code == 200
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 429, 429, 429, 429]
    assert len(refused) == 4 and refused_while_busy  # refused at once, not after the long request
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["code"] == "overloaded"
    assert backend.batcher.stats.rejected == 4


async def test_a_full_queue_refuses_before_reading_the_body(clef_fp32: ClefModel) -> None:
    """Requests the queue could not take were read, decompressed and parsed first (seconds of GIL-bound JSON parsing
    for 8 MiB of ``[]``) and only then refused (attack finding): a full queue answers 429 before the body."""
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=1, max_queue=1, max_wait_ms=0))
    with serve_worker(backend) as worker:
        async with worker.client(timeout=60) as client:
            busy = await hold_inference_thread(worker, client)
            queued = asyncio.ensure_future(client.post("/v1/systemone", json=ticket_body(1)))
            while worker.batcher.queue_depth < 1:
                await asyncio.sleep(0.002)
            host, port = worker.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/systemone HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000\r\n\r\n{\"model\": ")  # the rest never comes
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
            assert (await busy).status_code == 200 and (await queued).status_code == 200
    assert head.startswith(b"HTTP/1.1 429") and b"retry-after" in head.lower()


async def _open_uploads(worker: RunningWorker, heads: list[bytes]) -> list[tuple[asyncio.StreamReader,
                                                                                 asyncio.StreamWriter]]:
    """One connection per head (after the request line and ``Content-Type``), each sending only that much."""
    host, port = worker.url.removeprefix("http://").split(":")
    connections = []
    for head in heads:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/systemone HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                     b"x-request-timeout-ms: 300000\r\n" + head)
        await writer.drain()
        connections.append((reader, writer))
    return connections


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One response, head and ``Content-Length`` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    return head + await reader.readexactly(length)


async def _body_bytes(client: httpx.AsyncClient) -> int:
    return (await client.get("/readyz")).json()["body_bytes"]


async def test_declared_lengths_hold_nothing_so_header_only_uploads_lock_no_one_out(clef_fp32: ClefModel) -> None:
    """Each body held its ``Content-Length`` (the body cap when chunked) from before its first byte, so 8 connections
    declaring 8 MiB and sending nothing got every other request 429 for up to 300 s while ``/readyz`` said ready
    (review finding). Bytes count as they arrive: declared lengths and chunked heads hold nothing, a body holds what
    it sent, and a client that leaves gives it back."""
    config = WorkerConfig(max_body_bytes=BODY_CAP, max_pending_body_bytes=2 * BODY_CAP, model_name="clef-flash",
                          canary_interval_s=0)
    heads = [b"Content-Length: %d\r\n\r\n" % BODY_CAP] * 8 + [b"Transfer-Encoding: chunked\r\n\r\n"] * 8
    heads.append(b"Content-Length: %d\r\n\r\n%s" % (BODY_CAP, b" " * 1000))
    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        connections = await _open_uploads(worker, heads)  # the rest of each body never comes
        async with worker.client(timeout=60) as client:
            deadline = time.monotonic() + 10
            while (held := await _body_bytes(client)) < 1000:
                assert time.monotonic() < deadline, f"the uploads hold {held} bytes"
            answered = await client.post("/v1/systemone", json=ticket_body(0))
            for _, writer in connections:
                writer.close()
                await writer.wait_closed()
            while (left := await _body_bytes(client)) > 0:
                assert time.monotonic() < deadline, f"the clients that left still hold {left} bytes"
    assert held == 1000
    assert answered.status_code == 200, answered.text


async def test_stalled_uploads_hold_at_most_max_pending_body_bytes_until_the_idle_timeout(
    clef_fp32: ClefModel,
) -> None:
    """40 connections each sending half of a large body and stalling: the bytes held never pass
    ``max_pending_body_bytes`` (a body whose bytes would, and a request arriving while they are at it, get the full
    queue's 429), each stalled body is a 408 ``body_timeout`` after ``body_idle_timeout_s``, not at its 300 s
    deadline, and the accounting ends at 0."""
    half = BODY_CAP // 2
    config = WorkerConfig(max_body_bytes=BODY_CAP, max_pending_body_bytes=4 * BODY_CAP, body_idle_timeout_s=1.0,
                          model_name="clef-flash", canary_interval_s=0)
    heads = [b"Content-Length: %d\r\n\r\n%s" % (BODY_CAP, b" " * half)] * 40
    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        async with worker.client(timeout=60) as client:
            started = time.monotonic()
            connections = await _open_uploads(worker, heads)
            held = [await _body_bytes(client)]
            while held[-1] < 4 * BODY_CAP:
                assert time.monotonic() < started + 10, f"the stalled uploads hold {held[-1]} bytes"
                held.append(await _body_bytes(client))
            refused = await client.post("/v1/systemone", json=ticket_body(0))
            gauge = [line for line in (await client.get("/metrics")).text.splitlines()
                     if line.startswith("guard_worker_body_bytes ")]
            answers = [await asyncio.wait_for(_read_answer(reader), 10) for reader, _ in connections]
            cut_after = time.monotonic() - started
            held.append(await _body_bytes(client))
            answered = await client.post("/v1/systemone", json=ticket_body(0))
        for _, writer in connections:
            writer.close()
    assert max(held) <= 4 * BODY_CAP and held[-1] == 0, held
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["code"] == "overloaded" and str(4 * BODY_CAP) in refused.json()["message"]
    assert gauge == [f"guard_worker_body_bytes {4 * BODY_CAP:.1f}"]
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(timed_out) == 8 and all(b'"code":"body_timeout"' in a for a in timed_out), answers
    assert sum(a.startswith(b"HTTP/1.1 429") and b'"code":"overloaded"' in a for a in answers) == 32, answers
    assert cut_after < 10
    assert answered.status_code == 200, answered.text


async def test_a_request_holds_its_body_bytes_until_it_is_answered(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body's bytes were given back once it was parsed, while the parsed request (and the body, still referenced)
    waited for an encoding thread, the queue and the forward pass: requests piled up past ``max_pending_body_bytes``
    (16 bodies of 8 MiB a second and a half apart held 1.8 GB, attack finding). They count until the answer, so a
    request arriving while they are at the limit gets the full queue's 429."""
    config = WorkerConfig(max_body_bytes=BODY_CAP, max_pending_body_bytes=BODY_CAP, model_name="clef-flash",
                          canary_interval_s=0)
    body = json.dumps({**ticket_body(0), "state": "word " * 8000}).encode()  # more than half of BODY_CAP
    headers = {"content-type": "application/json"}
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
                while worker.batcher.in_flight == 0:  # read, parsed, encoded: in the forward pass
                    assert time.monotonic() < deadline, "the request never reached the forward pass"
                    await asyncio.sleep(0.01)
                held = await _body_bytes(client)
                second = await client.post("/v1/systemone", content=body, headers=headers)
            finally:
                released.set()
            answered = await first
            left = await _body_bytes(client)
    assert held == len(body)
    assert second.status_code == 429 and second.json()["code"] == "overloaded", second.text
    assert answered.status_code == 200 and left == 0, answered.text


def _image_body(size: tuple[int, int]) -> dict[str, Any]:
    """A ticket request with one solid PNG of ``size``: a few hundred bytes that encode to megabytes of pixels."""
    out = io.BytesIO()
    Image.new("RGB", size, "red").save(out, format="PNG")
    return {**ticket_body(0), "images": [{"content_type": "image/png", "base64": base64.b64encode(out.getvalue()).decode()}]}


async def test_a_request_holds_its_images_pixel_tensors_until_it_is_answered(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's encoded images (float32 ``pixel_values``: 4 PNGs of 313 KB were 96 MiB) were counted nowhere, so
    24 such requests took the worker from 0.8 to 3.8 GiB while ``/readyz`` said 7.5 MB (attack finding). They count
    with the bodies from their encoding to the answer: alone a request may pass the limit (it is still served), and
    while it is in memory another request is refused, as is one whose images would pass it while others hold bytes."""
    config = WorkerConfig(max_body_bytes=BODY_CAP, max_pending_body_bytes=BODY_CAP, model_name="clef-flash",
                          canary_interval_s=0)
    body = json.dumps(_image_body((512, 512))).encode()
    pixels = clef_fp32.encode(SystemOneRequestV1.from_json(json.loads(body))).media_bytes
    assert pixels > BODY_CAP
    headers = {"content-type": "application/json"}
    released = threading.Event()
    forward = clef_fp32.forward_records

    def wedged(records: Any) -> Any:
        released.wait(30)
        return forward(records)

    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        async with worker.client() as client:
            monkeypatch.setattr(clef_fp32, "forward_records", wedged)
            try:
                first = asyncio.ensure_future(client.post("/v1/systemone", content=body, headers=headers))
                deadline = time.monotonic() + 30
                while worker.batcher.in_flight == 0:
                    assert time.monotonic() < deadline, "the request never reached the forward pass"
                    await asyncio.sleep(0.01)
                held = await _body_bytes(client)
                refused = await client.post("/v1/systemone", json=ticket_body(1))
            finally:
                released.set()
            answered = await first
            released.clear()
            try:  # a text request in the forward pass holds its body: the image request's pixels do not fit beside it
                text = asyncio.ensure_future(client.post("/v1/systemone", json=ticket_body(2)))
                while worker.batcher.in_flight == 0:
                    assert time.monotonic() < deadline, "the text request never reached the forward pass"
                    await asyncio.sleep(0.01)
                crowded = await client.post("/v1/systemone", content=body, headers=headers)
            finally:
                released.set()
            assert (await text).status_code == 200
            left = await _body_bytes(client)
    assert held == len(body) + pixels
    assert refused.status_code == 429 and refused.json()["code"] == "overloaded", refused.text
    assert crowded.status_code == 429 and crowded.json()["code"] == "overloaded", crowded.text
    assert answered.status_code == 200 and left == 0, answered.text


async def test_an_image_request_is_refused_before_its_images_are_decoded_and_gives_back_what_it_held(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images' pixel tensors counted only once encoded: 8 requests of four 4096x4096 PNGs took the worker to 3 GiB
    while ``body_bytes`` said 100 MB, and each of the 7 refused had decoded all its images (8.8-16 s) before its 429
    (attack finding). The tensors' bytes are counted from the images' headers before the encoding: while one image
    request is in the forward pass, another is refused with no image decoded; what each held is given back whether
    it is answered, refused, its image cannot be decoded or its deadline passes while it is decoded."""
    config = WorkerConfig(max_body_bytes=BODY_CAP, max_pending_body_bytes=BODY_CAP, model_name="clef-flash",
                          canary_interval_s=0)
    body = json.dumps(_image_body((512, 512))).encode()
    broken = _image_body((512, 512))  # a readable header, pixel data cut short
    raw = base64.b64decode(broken["images"][0]["base64"])
    broken["images"][0]["base64"] = base64.b64encode(raw[:60] + raw[-12:]).decode()
    headers = {"content-type": "application/json"}
    decoded: list[str] = []
    decode = processor_module._decoded
    released = threading.Event()

    def counting(item: Any, image: Any, where: str) -> Any:  # the real decoding, counted, held until released
        decoded.append(where)
        released.wait(30)
        return decode(item, image, where)

    async def decoding(count: int) -> None:
        deadline = time.monotonic() + 30
        while len(decoded) < count:
            assert time.monotonic() < deadline, "the request never reached its decoding"
            await asyncio.sleep(0.01)

    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        monkeypatch.setattr(processor_module, "_decoded", counting)  # once started: the image canary decodes one
        async with worker.client() as client:
            try:
                first = asyncio.ensure_future(client.post("/v1/systemone", content=body, headers=headers))
                await decoding(1)
                held = await _body_bytes(client)
                refused = await client.post("/v1/systemone", content=body, headers=headers)
                decodes_while_held = len(decoded)
            finally:
                released.set()
            answered = await first
            after_answer = await _body_bytes(client)
            undecodable = await client.post("/v1/systemone", json=broken)
            after_error = await _body_bytes(client)
            released.clear()
            try:
                late = await client.post("/v1/systemone", content=body,
                                         headers={**headers, "x-request-timeout-ms": "300"})
                after_timeout = await _body_bytes(client)
            finally:
                released.set()
            while worker.batcher.in_flight:
                await asyncio.sleep(0.01)
            left = await _body_bytes(client)
    assert held == len(body) + clef_fp32.encode(SystemOneRequestV1.from_json(json.loads(body))).media_bytes
    assert refused.status_code == 429 and refused.json()["code"] == "overloaded", refused.text
    assert decodes_while_held == 1  # the first request's image alone
    assert answered.status_code == 200 and after_answer == 0, answered.text
    assert undecodable.status_code == 422 and "images[0]" in undecodable.text and after_error == 0, undecodable.text
    assert late.status_code == 504 and after_timeout == 0, late.text
    assert left == 0


async def test_a_request_of_four_images_at_the_largest_size_is_served_beside_other_traffic_by_default(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At the default 64 MiB a valid request of four images of 1,024 tokens (96 MiB of pixel tensors) was refused
    429 whenever any other request held a byte, so never served under steady traffic (verification finding). The
    default is the body cap plus 128 MiB: such a request is served while a text request is in the forward pass, and
    a worker whose limit is below one such request warns at start."""
    body = json.dumps({**_image_body((1024, 1024)), "images": [_image_body((1024, 1024))["images"][0]] * 4}).encode()
    pixels = clef_fp32.encode(SystemOneRequestV1.from_json(json.loads(body))).media_bytes
    assert pixels == 4 * clef_fp32.processor.max_image_tensor_bytes() == 4 * 1024 * 24 * 1024 + 4 * 24
    headers = {"content-type": "application/json"}
    released = threading.Event()
    forward = clef_fp32.forward_records

    def wedged(records: Any) -> Any:
        released.wait(30)
        return forward(records)

    with serve_worker(LocalBackend(clef_fp32), config=WorkerConfig(model_name="clef-flash", canary_interval_s=0)) as worker:
        async with worker.client() as client:
            monkeypatch.setattr(clef_fp32, "forward_records", wedged)
            try:
                text = asyncio.ensure_future(client.post("/v1/systemone", json=ticket_body(2)))
                deadline = time.monotonic() + 30
                while worker.batcher.in_flight == 0:
                    assert time.monotonic() < deadline, "the text request never reached the forward pass"
                    await asyncio.sleep(0.01)
                images = asyncio.ensure_future(client.post("/v1/systemone", content=body, headers=headers))
                while not images.done() and await _body_bytes(client) < pixels:
                    assert time.monotonic() < deadline, "the image request never held its pixels"
                    await asyncio.sleep(0.01)
            finally:
                released.set()
            answered, beside = await images, await text
    assert answered.status_code == 200 and beside.status_code == 200, answered.text
    assert "max_pending_body_bytes" not in caplog.text
    with serve_worker(LocalBackend(clef_fp32), config=WorkerConfig(max_pending_body_bytes=64 * 1024 * 1024,
                                                                   canary_interval_s=0)):
        pass
    assert "max_pending_body_bytes (--max-pending-body-bytes) is 67108864 bytes, below the" in caplog.text


async def test_a_request_with_both_framings_is_refused_and_its_connection_closed(clef_fp32: ClefModel) -> None:
    """Under ``guard worker serve``'s h11 protocol, Content-Length and Transfer-Encoding: chunked on one request were
    served and the connection kept open, so a request pipelined after the chunks was served too (review finding;
    RFC 9112 section 6.3). The worker answers 400 ``ambiguous_length`` as ``guard proxy`` does, closes the connection
    and serves nothing after it."""
    body = json.dumps(ticket_body(0)).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with serve_worker(LocalBackend(clef_fp32), options=server_options()) as worker:
        host, port = worker.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/systemone HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (len(chunked), chunked)
                     + b"GET /readyz HTTP/1.1\r\nHost: w\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # to the end: the worker closes the connection
        writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), answer
    assert json.loads(rest)["code"] == "ambiguous_length" and json.loads(rest)["field"] == "content-length"
    assert b"HTTP/1.1" not in rest  # the pipelined GET was not served


async def test_a_request_sending_content_type_twice_is_refused(clef_fp32: ClefModel) -> None:
    """A JSON body sent with ``Content-Type: application/json`` and then ``multipart/form-data`` was read as JSON by
    the first copy (attack finding): a front proxy reading the last would inspect it as another kind. The field holds
    one value (RFC 9110 section 8.3); the worker answers 400 ``repeated_header`` on every route."""
    twice = [("content-type", "application/json"), ("content-type", "multipart/form-data; boundary=B")]
    with serve_worker(LocalBackend(clef_fp32)) as worker:
        async with worker.client() as client:
            posted = await client.post("/v1/systemone", content=json.dumps(ticket_body(0)).encode(), headers=twice)
            probed = await client.get("/readyz", headers=twice)
    for response in (posted, probed):
        assert response.status_code == 400, response.text
        assert response.json() == {"code": "repeated_header", "message": "the content-type header is sent more than "
                                   "once; send it once", "field": "headers.content-type", "errors": []}


async def test_overload_status_can_be_503(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=1, max_queue=1, max_wait_ms=0))
    with serve_worker(backend, config=WorkerConfig(overload_status=503, model_name="clef-flash")) as worker:
        async with worker.client(timeout=60) as client:
            busy = await hold_inference_thread(worker, client)
            results = await asyncio.gather(*(client.post("/v1/systemone", json=ticket_body(i)) for i in range(3)))
            await busy
    assert sorted(r.status_code for r in results) == [200, 503, 503]
    assert all("retry-after" in r.headers for r in results if r.status_code == 503)


async def test_schema_longer_than_max_length_is_422(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, max_length=600)  # the self-test request fits, so the worker becomes ready
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement number {i} true?"} for i in range(12)}
    with serve_worker(backend) as worker:
        async with worker.client() as client:
            response = await client.post("/v1/systemone", json={"model": "clef-flash", "state": "s", "questions": many})
            long_state = await client.post("/v1/systemone", json=long_body(400))
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "invalid_request" and "maximum is 600" in response.json()["message"]
    assert long_state.status_code == 200 and long_state.json()["usage"]["input_tokens"] == 600  # state cut to fit


async def test_serves_on_a_unix_socket(clef_fp32: ClefModel, tmp_path: Path) -> None:
    backend = LocalBackend(clef_fp32)
    with serve_worker(backend, uds=str(tmp_path / "worker.sock")) as worker:
        async with worker.client() as client:
            results = await asyncio.gather(*(client.post("/v1/systemone", json=ticket_body(i)) for i in range(4)))
            ready = await client.get("/readyz")
    assert [r.status_code for r in results] == [200] * 4 and ready.status_code == 200
    assert results[0].json()["answers"]["churn_risk"]["type"] == "noul"


async def test_graceful_shutdown_answers_requests_already_queued(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=2, max_wait_ms=0))
    app = create_app(backend, config=WorkerConfig(model_name="clef-flash"))
    server = ServerThread(app)
    server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        busy = asyncio.ensure_future(client.post("/v1/systemone", json=long_body()))
        while backend.batcher.in_flight == 0:
            await asyncio.sleep(0.002)
        queued = [asyncio.ensure_future(client.post("/v1/systemone", json=ticket_body(i))) for i in range(5)]
        while backend.batcher.queue_depth < 5:
            await asyncio.sleep(0.002)
        await asyncio.to_thread(server.stop)
        results = await asyncio.gather(busy, *queued)
    assert [r.status_code for r in results] == [200] * 6
    assert backend.batcher.state.value == "closed"


async def test_not_ready_until_loaded_and_unhealthy_when_loading_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed load is logged in one line (it was a traceback, which read as a crash of a worker still running)."""
    caplog.set_level(logging.INFO, logger="guard")
    app = create_app(lambda: LocalBackend.from_pretrained(tmp_path / "missing"))
    with serve_app_in_thread(app, ready_path=None) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            deadline = time.monotonic() + 30
            while (health := await client.get("/healthz")).status_code == 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            ready = await client.get("/readyz")
            answer = await client.post("/v1/systemone", json=ticket_body(0))
            models = await client.get("/v1/models")
    assert health.status_code == 503 and "not a Clef checkpoint" in health.json()["message"]
    assert ready.status_code == 503 and ready.json()["code"] == "not_ready" and "retry-after" in ready.headers
    assert answer.status_code == 503 and answer.json()["code"] == "not_ready"
    assert models.status_code == 503
    failed = [record for record in caplog.records if "failed to become ready" in record.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None
    assert failed[0].getMessage() == ("worker failed to become ready: FileNotFoundError: "
                                      f"{tmp_path / 'missing'} is not a Clef checkpoint: config.json is missing")


async def test_loads_from_a_callable_on_startup(clef_fp32: ClefModel) -> None:
    app = create_app(lambda: LocalBackend(clef_fp32), config=WorkerConfig(model_name="clef-flash"))
    with serve_app_in_thread(app) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            models = (await client.get("/v1/models")).json()
            response = await client.post(
                "/v1/systemone", content=json.dumps(ticket_body(9)), headers={"content-type": "application/json"}
            )
    assert models["models"][0]["name"] == "clef-flash"
    assert response.status_code == 200


async def test_a_checkpoint_directory_named_in_another_script_still_answers(golden_checkpoint: Path,
                                                                            tmp_path: Path) -> None:
    """The directory name is the model's id and part of its revision, sent in a response header (Latin-1 only): a
    Cyrillic name made every answer a 500."""
    import shutil

    folder = tmp_path / "модель"
    shutil.copytree(golden_checkpoint, folder)
    app = create_app(lambda: LocalBackend.from_pretrained(folder, device="cpu"))
    with serve_app_in_thread(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            names = [m["name"] for m in (await client.get("/v1/models")).json()["models"]]
            response = await client.post("/v1/systemone", json={**ticket_body(9), "model": "модель"})
    assert names == ["модель"] and response.status_code == 200
    assert response.headers["x-guard-model-revision"].startswith("\\u043c\\u043e")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"validation_profile": "strict"}, "validation_profile"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": 1024, "max_pending_body_bytes": 1023}, "max_pending_body_bytes must be an integer >= "),
        ({"default_timeout_s": 0}, "default_timeout_s"),
        ({"default_timeout_s": 100, "max_timeout_s": 10}, "exceeds max_timeout_s"),
        ({"overload_status": 500}, "overload_status"),
    ],
)
def test_worker_config_is_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)
