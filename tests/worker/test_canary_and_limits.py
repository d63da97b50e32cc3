"""The worker side of health and limits: the canary self-test (a degenerate model never becomes ready),
truncation reported on the wire, content types, image pixel limits and API keys, all over real HTTP."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from guard.backends.compact import CompactBackend
from guard.backends.http import SystemOneClient
from guard.backends.local import LocalBackend, _probe_image
from guard.backends.selftest import (
    CLEF_CANARY_MARGIN,
    SELF_TEST_APART,
    SELF_TEST_REQUEST,
    CanaryFailed,
    catalog_canaries,
    clef_canaries,
    run_canaries,
)
from guard.clef.model import ClefModel
from guard.cli import main
from guard.engine import Guard
from guard.engine.health import HealthMonitor
from guard.errors import BackendRejected, BackendUnavailable, MalformedAnswer, RequestValidationError
from guard.policy import load_text
from guard.subject import AgentSubject
from guard.systemone import SystemOneRequestV1
from guard.worker.app import FAILED_ENCODINGS_TO_PROBE, HUNG_CANARY_RUNS, WorkerConfig, WorkerPhase, create_app
from tests._degenerate import always_no_app
from tests.worker._requests import ticket_body
from tests.worker._serve import ServerThread, serve_app_in_thread, serve_worker

pytestmark = pytest.mark.anyio

KEY = "worker-key-0123456789abcdef"


@pytest.fixture(scope="module")
def zeroed_checkpoint(golden_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden tiny checkpoint with every joint-head tensor zeroed: it answers 0.5 to every noul question."""
    target = tmp_path_factory.mktemp("zeroed") / "checkpoint"
    shutil.copytree(golden_checkpoint, target)
    weights = load_file(target / "joint_head.safetensors")
    save_file({name: torch.zeros_like(t) for name, t in weights.items()}, target / "joint_head.safetensors")
    return target


def wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


# Canary ---------------------------------------------------------------------------------------------------------


async def test_a_zeroed_head_fails_local_backend_start_with_the_canary_named(zeroed_checkpoint: Path) -> None:
    backend = LocalBackend.from_pretrained(zeroed_checkpoint, dtype=torch.float32)
    with pytest.raises(BackendUnavailable) as info:
        await backend.start()
    assert info.value.reason == "self_test_failed"
    message = str(info.value)
    assert "canary 'guard.prompt_injection'" in message and "benign 0.5000, attack 0.5000" in message
    with pytest.raises(BackendUnavailable):  # closed: it answers nothing
        await backend.decide(SystemOneRequestV1.from_json(ticket_body(0)))


async def test_the_real_tiny_checkpoint_passes_its_canaries(clef_fp32: ClefModel) -> None:
    async with LocalBackend(clef_fp32) as backend:
        results = await run_canaries(backend, backend.canaries)
    assert len(results) == 2 and all(r.passed and abs(r.spread) >= CLEF_CANARY_MARGIN > 0 for r in results)
    # a directional margin a release model must reach is not reached by random tiny weights
    strict = clef_canaries(margin=0.3, directional=True)
    async with LocalBackend(clef_fp32, canaries=()) as backend:
        with pytest.raises(CanaryFailed, match="needs >= 0.3"):
            await run_canaries(backend, strict)
    with pytest.raises(BackendUnavailable, match="needs >= 0.3"):
        await LocalBackend(clef_fp32, canaries=strict).start()


def test_a_worker_over_a_zeroed_head_is_never_ready(zeroed_checkpoint: Path) -> None:
    app = create_app(lambda: LocalBackend.from_pretrained(zeroed_checkpoint, dtype=torch.float32))
    server = ServerThread(app)
    url = server.start(ready_path=None)
    try:
        wait_for(lambda: app.state.worker.phase is WorkerPhase.FAILED)
        with httpx.Client(base_url=url, timeout=30) as client:
            ready = client.get("/readyz")
            answer = client.post("/v1/systemone", json=ticket_body(0))
            alive = client.get("/healthz")
    finally:
        server.stop()
    assert ready.status_code == 503 and "canary 'guard.prompt_injection'" in ready.json()["message"]
    assert answer.status_code == 503 and alive.status_code == 503


def test_a_model_that_degenerates_after_start_makes_the_worker_unready(golden_checkpoint: Path) -> None:
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test zeroes it
    saved = {name: p.detach().clone() for name, p in model.head.named_parameters()}
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        assert c.get("/readyz").status_code == 200 and c.post("/v1/systemone", json=ticket_body(1)).status_code == 200
        with torch.no_grad():
            for p in model.head.parameters():
                p.zero_()
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        ready = c.get("/readyz")
        refused = c.post("/v1/systemone", json=ticket_body(1))
        assert ready.status_code == 503 and ready.json()["code"] == "canary_failed"
        assert refused.status_code == 503 and refused.json()["code"] == "canary_failed"
        with torch.no_grad():
            for name, p in model.head.named_parameters():
                p.copy_(saved[name])
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        assert c.get("/readyz").status_code == 200


def test_a_model_whose_encoding_fails_answers_503_and_its_canaries_go_on(golden_checkpoint: Path) -> None:
    """An error while encoding answers the request 503 ``unavailable`` (a 500 before). The canaries' records were
    encoded at start, so their runs go on and pass (the forward pass works); once encoding works again requests are
    answered."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    encode = model.encode

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tokenizer failure (injected)")

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        assert c.get("/readyz").status_code == 200
        model.encode = broken  # type: ignore[method-assign]
        refused = c.post("/v1/systemone", json=ticket_body(1))
        assert refused.status_code == 503 and refused.json()["code"] == "unavailable", refused.text
        assert "encoding failed" in refused.json()["message"]
        runs = runtime.canary_runs
        wait_for(lambda: runtime.canary_runs >= runs + 2)
        assert runtime.phase is WorkerPhase.READY and runtime.canary_error is None
        model.encode = encode  # type: ignore[method-assign]
        assert c.post("/v1/systemone", json=ticket_body(1)).status_code == 200


def test_a_model_whose_every_encoding_fails_makes_the_worker_unready_until_it_encodes_again(
    golden_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer that broke after start answered every request 503 ``unavailable`` while ``/readyz`` stayed green,
    the canaries running from records encoded at start (verification finding). After
    ``FAILED_ENCODINGS_TO_PROBE`` failed requests in a row the worker encodes a canary request live on a thread of its
    own: that failing too, it is unready (``encoding failed: RuntimeError: <message>``), each canary run probes again,
    and it is ready once the encoding works. Each failure's traceback is logged at most once every 10 s, the probe's
    once while it fails."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    encode = model.encode

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tokenizer failure (injected)")

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        model.encode = broken  # type: ignore[method-assign]
        refused = [c.post("/v1/systemone", json=ticket_body(i)) for i in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        runs = runtime.canary_runs
        wait_for(lambda: runtime.canary_runs >= runs + 2)  # the runs' own probes fail: still unready
        ready, unready_error = c.get("/readyz"), runtime.canary_error
        model.encode = encode  # type: ignore[method-assign]
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        answered = c.post("/v1/systemone", json=ticket_body(1))
    assert [r.json()["code"] for r in refused] == ["unavailable"] * FAILED_ENCODINGS_TO_PROBE
    assert unready_error == "encoding failed: RuntimeError: tokenizer failure (injected)"
    assert ready.status_code == 503 and ready.json()["code"] == "canary_failed"
    assert unready_error in ready.json()["message"]
    assert answered.status_code == 200 and runtime.canary_error is None
    logged = [r for r in caplog.records if r.getMessage().startswith("encoding failed in 'clef-local'")]
    assert len(logged) == 1 and logged[0].exc_info is not None
    probed = [r for r in caplog.records if r.getMessage() == "live encoding probe failed"]
    assert len(probed) == 1 and probed[0].exc_info is not None


def test_a_model_whose_image_path_fails_makes_the_worker_unready(golden_checkpoint: Path) -> None:
    """The live probe encoded a text-only request, so a processor whose image path broke kept the worker ready (the
    probe passing started the count again) while every request with an image got 503. With a checkpoint that reads
    images the probe also encodes one with a small PNG: that failing, the worker is unready until it works again."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    encode = model.encode

    def images_broken(request: SystemOneRequestV1, **kwargs: Any) -> Any:
        if request.images:
            raise RuntimeError("image processor failure (injected)")
        return encode(request, **kwargs)

    with_image = _with_image()
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        assert c.post("/v1/systemone", json=with_image).status_code == 200
        model.encode = images_broken  # type: ignore[method-assign]
        refused = [c.post("/v1/systemone", json=with_image) for _ in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        unready_error = runtime.canary_error
        model.encode = encode  # type: ignore[method-assign]
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        answered = c.post("/v1/systemone", json=with_image).status_code
    assert [r.json()["code"] for r in refused] == ["unavailable"] * FAILED_ENCODINGS_TO_PROBE
    assert unready_error == "encoding failed: RuntimeError: image processor failure (injected)" and answered == 200


def test_an_image_path_that_fails_makes_the_worker_unready_while_text_requests_are_answered(
    golden_checkpoint: Path,
) -> None:
    """Any request answered started the count of failures again, so under mixed traffic (one image request per text
    request) a processor whose image path broke never had the worker probe it, and every image request got 503 while
    it stayed ready (verification finding). Requests with images and without are counted apart: the image requests'
    failures alone start the probe, and the worker is unready until the image path works again."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    encode = model.encode

    def images_broken(request: SystemOneRequestV1, **kwargs: Any) -> Any:
        if request.images:
            raise RuntimeError("image processor failure (injected)")
        return encode(request, **kwargs)

    with_image = _with_image()
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        model.encode = images_broken  # type: ignore[method-assign]
        codes = [(c.post("/v1/systemone", json=with_image).status_code,
                  c.post("/v1/systemone", json=ticket_body(i)).status_code) for i in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        unready_error = runtime.canary_error
        model.encode = encode  # type: ignore[method-assign]
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        answered = c.post("/v1/systemone", json=with_image).status_code
    assert codes[:-1] == [(503, 200)] * (FAILED_ENCODINGS_TO_PROBE - 1) and codes[-1][0] == 503
    assert unready_error == "encoding failed: RuntimeError: image processor failure (injected)" and answered == 200


def test_a_vision_tower_that_fails_makes_the_worker_unready_without_text_traffic(golden_checkpoint: Path) -> None:
    """The canaries were text records encoded at start and the live probe only encoded, so a vision tower whose
    forward pass failed after start kept the worker ready while every request with an image got 503 (verification
    finding). With a checkpoint that reads images each canary run also asks the self-test request with an 8x8 PNG
    through the batcher: the worker is unready while the vision tower fails, with no other request, and ready once it
    works again."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    visual = model.backbone.model.visual

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("vision tower failure (injected)")

    with_image = _with_image()
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        visual.forward = broken
        refused = c.post("/v1/systemone", json=with_image).status_code
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        ready, unready_error = c.get("/readyz").status_code, runtime.canary_error
        del visual.forward  # the class's forward again
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        answered = c.post("/v1/systemone", json=with_image).status_code
    assert refused == 503 and ready == 503 and answered == 200
    assert unready_error is not None and unready_error.startswith("BackendUnavailable")


def test_at_a_max_length_asking_the_questions_apart_the_image_probe_asks_the_first_and_the_worker_recovers(
    golden_checkpoint: Path,
) -> None:
    """At a max_length the self-test request with an 8x8 PNG does not fit, the image canary and the live probe ask
    the first self-test question with it (which the least max_length leaves room for), so after any 5 failed requests
    the probe passes the image path again and the worker is ready once the encoding works."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    with pytest.raises(RequestValidationError):
        model.encode(SELF_TEST_REQUEST.override(images=(_probe_image(),)), max_length=500)
    encode = model.encode

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tokenizer failure (injected)")

    backend = LocalBackend(model, max_length=500)
    with serve_worker(backend, config=config) as worker, httpx.Client(
        base_url=worker.url, timeout=30
    ) as c:
        runtime = worker.app.state.worker
        model.encode = broken  # type: ignore[method-assign]
        refused = [c.post("/v1/systemone", json=ticket_body(i)).status_code for i in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        model.encode = encode  # type: ignore[method-assign]
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        answered = c.post("/v1/systemone", json=ticket_body(1)).status_code
    assert refused == [503] * FAILED_ENCODINGS_TO_PROBE and answered == 200
    assert backend._image_canary is not None
    assert backend._image_canary[0] == SELF_TEST_APART[0].override(images=(_probe_image(),))


def _with_image() -> dict[str, Any]:
    """A ticket request with one 64x64 PNG."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(out, format="PNG")
    png = base64.b64encode(out.getvalue()).decode()
    return {**ticket_body(0), "images": [{"content_type": "image/png", "base64": png}]}


def test_a_forward_pass_that_fails_for_every_request_makes_the_worker_unready_before_the_next_canary_run(
    golden_checkpoint: Path,
) -> None:
    """A forward pass that broke after start (every batch raising) answered every request 503 while ``/readyz`` stayed
    green until the next periodic canary run (60 s by default): the probe after ``FAILED_ENCODINGS_TO_PROBE`` failures
    encoded only, passed, and started the count again. The probe now runs the canaries too, so the worker is unready
    at once, and ready again once a run passes."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=3600)
    forward = model.forward_records

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device failure (injected)")

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        model.forward_records = broken  # type: ignore[method-assign]
        refused = [c.post("/v1/systemone", json=ticket_body(i)) for i in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime._probe is not None and runtime._probe.done(), timeout=20)
        phase, ready = runtime.phase, c.get("/readyz")
        model.forward_records = forward  # type: ignore[method-assign]
    assert [r.json()["code"] for r in refused] == ["unavailable"] * FAILED_ENCODINGS_TO_PROBE
    assert phase is WorkerPhase.UNREADY
    assert ready.status_code == 503 and "device failure (injected)" in ready.json()["message"]


def test_a_model_that_answers_nan_to_every_request_makes_the_worker_unready_before_the_next_canary_run(
    golden_checkpoint: Path,
) -> None:
    """A model whose weights turned NaN after start answered every request 503 ``malformed_answer`` while ``/readyz``
    stayed green until the next periodic canary run: malformed answers were not counted as failed requests. They are
    now, so ``FAILED_ENCODINGS_TO_PROBE`` of them in a row run the canaries at once."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    saved = {name: p.detach().clone() for name, p in model.head.named_parameters()}
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=3600)
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        with torch.no_grad():
            model.head.residual_gate.fill_(float("nan"))
        refused = [c.post("/v1/systemone", json=ticket_body(i)) for i in range(FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime._probe is not None and runtime._probe.done(), timeout=20)
        phase, ready = runtime.phase, c.get("/readyz")
        with torch.no_grad():
            for name, p in model.head.named_parameters():
                p.copy_(saved[name])
    assert [r.json()["code"] for r in refused] == ["malformed_answer"] * FAILED_ENCODINGS_TO_PROBE
    assert phase is WorkerPhase.UNREADY and ready.status_code == 503


@pytest.mark.parametrize("breaks", ["forward pass", "answer"])
def test_requests_whose_own_forward_pass_fails_or_answers_nan_never_make_the_worker_unready(
    golden_checkpoint: Path, breaks: str
) -> None:
    """One client whose requests each break their own forward pass (the batch is rerun one request at a time) or
    come back NaN (503 ``malformed_answer``) cannot take a healthy worker out: the probe their failures start runs
    the canaries, which pass, so the worker stays ready and answers the others."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=3600)
    encode, forward, answer = model.encode, model.forward_records, model.answer
    poisoned: set[int] = set()  # id() of the records of the requests that break

    def marking(request: SystemOneRequestV1, **kwargs: Any) -> Any:
        record = encode(request, **kwargs)
        if request.state == "poison":
            poisoned.add(id(record))
        return record

    def forward_breaking(records: Any) -> Any:
        if breaks == "forward pass" and any(id(r) in poisoned for r in records):
            raise RuntimeError("a forward pass failure on one input (injected)")
        return forward(records)

    def answer_breaking(request: SystemOneRequestV1, record: Any, *args: Any, **kwargs: Any) -> Any:
        if breaks == "answer" and id(record) in poisoned:
            raise MalformedAnswer("NaN for one input (injected)")
        return answer(request, record, *args, **kwargs)

    model.encode, model.forward_records = marking, forward_breaking  # type: ignore[method-assign]
    model.answer = answer_breaking  # type: ignore[method-assign]
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        runs = runtime.canary_runs
        with ThreadPoolExecutor(4) as pool:
            bad = [pool.submit(c.post, "/v1/systemone", json={**ticket_body(i), "state": "poison"})
                   for i in range(2 * FAILED_ENCODINGS_TO_PROBE)]
            good = [pool.submit(c.post, "/v1/systemone", json=ticket_body(i)) for i in range(4)]
            refused, answered = [f.result().status_code for f in bad], [f.result().status_code for f in good]
        wait_for(lambda: runtime._probe is not None and runtime._probe.done())
        phase, ready = runtime.phase, c.get("/readyz").status_code
    assert refused == [503] * 2 * FAILED_ENCODINGS_TO_PROBE and answered == [200] * 4
    assert runtime.canary_runs > runs and phase is WorkerPhase.READY and ready == 200


def test_probes_after_failed_requests_never_make_a_slow_worker_look_hung(golden_checkpoint: Path) -> None:
    """The canary run of the probe after failed requests, timing out beside a periodic run during the same slow (but
    finishing) forward pass, counted as a second stalled run: ``/healthz`` answered 503 (the inference thread "hung")
    and an orchestrator restarts the worker. Only periodic runs count towards a hang."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test slows it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=2.0, canary_timeout_s=1.0)
    encode, forward = model.encode, model.forward_records

    def poisoned(request: SystemOneRequestV1, **kwargs: Any) -> Any:
        if request.state == "poison":
            raise RuntimeError("tokenizer failure on one input (injected)")
        return encode(request, **kwargs)

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.8)  # every pass finishes, later than a run's timeout
        return forward(*args, **kwargs)

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        model.encode, model.forward_records = poisoned, slow  # type: ignore[method-assign]
        stalled, alive = [], []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for i in range(FAILED_ENCODINGS_TO_PROBE):
                c.post("/v1/systemone", json={**ticket_body(i), "state": "poison"})
            stalled.append(runtime.stalled_runs)
            alive.append(c.get("/healthz").status_code)
            time.sleep(0.3)
        model.encode, model.forward_records = encode, forward  # type: ignore[method-assign]
    assert max(stalled) < HUNG_CANARY_RUNS and set(alive) == {200}


def test_requests_whose_own_encoding_fails_never_make_the_worker_unready(golden_checkpoint: Path) -> None:
    """Requests refused 422 at encoding (a schema over ``max_length``, an image that cannot be decoded) are not
    counted, and requests whose encoding fails for what they hold (an input that crashes the tokenizer) leave the
    worker ready: the live probe of a canary request passes and the count starts again."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test breaks it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    encode = model.encode

    def poisoned(request: SystemOneRequestV1, **kwargs: Any) -> Any:
        if request.state == "poison":
            raise RuntimeError("tokenizer failure on one input (injected)")
        return encode(request, **kwargs)

    long_schema = {"model": "clef-flash", "state": "s", "questions": {
        f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true? " * 40} for i in range(12)}}
    png = base64.b64encode(png_header(512, 512)).decode()  # a readable header, too little pixel data
    broken_image = {**ticket_body(0), "images": [{"content_type": "image/png", "base64": png}]}
    with serve_worker(LocalBackend(model, max_length=2048), config=config) as worker, httpx.Client(
        base_url=worker.url, timeout=30
    ) as c:
        runtime = worker.app.state.worker
        invalid = [c.post("/v1/systemone", json=body).status_code for body in [long_schema, broken_image] * 5]
        counted = dict(runtime.model_failures)
        model.encode = poisoned  # type: ignore[method-assign]
        crashed = [c.post("/v1/systemone", json={**ticket_body(i), "state": "poison"}).status_code
                   for i in range(2 * FAILED_ENCODINGS_TO_PROBE)]
        wait_for(lambda: runtime._probe is not None and runtime._probe.done())
        runs = runtime.canary_runs
        wait_for(lambda: runtime.canary_runs >= runs + 2)
        phase, ready = runtime.phase, c.get("/readyz").status_code
        answered = c.post("/v1/systemone", json=ticket_body(1)).status_code
    assert invalid == [422] * 10 and counted == {False: 0, True: 0}
    assert crashed == [503] * 2 * FAILED_ENCODINGS_TO_PROBE
    assert phase is WorkerPhase.READY and ready == 200 and answered == 200


def test_clients_holding_every_encoding_thread_do_not_make_the_worker_look_hung(
    golden_checkpoint: Path,
) -> None:
    """Canaries were encoded on the 4 encoding threads, behind clients' encodings: 12 clients sending 4 large PNGs
    each (refused 422 at encoding, so no forward pass ran) made ``/healthz`` answer 503 ``canary_failed`` (the
    inference thread "hung") within 14 s, and an orchestrator restarts it in a loop (attack finding). The canaries'
    records are encoded at start and go straight to the batcher: with every encoding thread held, runs still pass."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test slows it
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.1, canary_timeout_s=2.0)
    released = threading.Event()
    encode = model.encode

    def slow(*args: Any, **kwargs: Any) -> Any:
        released.wait(60)
        return encode(*args, **kwargs)

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=60) as c:
        runtime = worker.app.state.worker
        assert c.get("/readyz").status_code == 200
        model.encode = slow  # type: ignore[method-assign]
        with ThreadPoolExecutor(8) as pool:
            try:
                sent = [pool.submit(c.post, "/v1/systemone", json=ticket_body(i)) for i in range(8)]
                runs, passes = runtime.canary_runs, runtime.passes
                wait_for(lambda: runtime.canary_runs >= runs + 4)
                phase, alive, stalled = runtime.phase, c.get("/healthz").status_code, runtime.stalled_runs
            finally:
                released.set()
            answered = [future.result().status_code for future in sent]
    assert runtime.passes > passes  # the canaries' own passes
    assert phase is WorkerPhase.READY and alive == 200 and stalled == 0
    assert answered == [200] * 8


def test_an_unexpected_error_in_a_canary_run_makes_the_worker_unready_and_the_runs_go_on(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error that ends a run is a failed run (logged with its traceback), never the end of the runs."""
    failing = True

    async def run(**options: Any) -> list[Any]:
        if failing:
            raise KeyError("answers")
        return []

    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.05)
    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        runtime = worker.app.state.worker
        monkeypatch.setattr(runtime.backend, "run_canaries", run)
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        assert runtime.canary_error == "KeyError: 'answers'"
        failing = False
        wait_for(lambda: runtime.phase is WorkerPhase.READY)


def test_a_hung_inference_thread_makes_the_worker_unready_and_unhealthy(golden_checkpoint: Path) -> None:
    """Canary runs that time out (``canary_timeout_s``; the startup self-test's 120 s before, so a hang went unseen
    for about 2 x (interval + 120 s), 6 minutes at the defaults) while no forward pass finishes take the worker out
    (``/readyz`` and ``/healthz`` 503, so it is restarted) within 2 to 3 x (interval + timeout); it is ready again once
    a run finishes."""
    model = ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)  # its own copy: the test wedges it
    # a run that times out while passes finish changes nothing, so the timeout must let a run pass on a loaded machine
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.1, canary_timeout_s=2.0)
    released = threading.Event()
    forward = model.forward_records

    def wedged(records: Any) -> Any:
        released.wait()
        return forward(records)

    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        try:
            assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
            model.forward_records = wedged  # type: ignore[method-assign]
            wedged_at = time.monotonic()
            wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
            assert time.monotonic() - wedged_at < 15  # 3 x (0.1 + 2) s, and room for a loaded machine
            ready, alive = c.get("/readyz"), c.get("/healthz")
            assert ready.status_code == 503 and ready.json()["code"] == "canary_failed"
            assert alive.status_code == 503 and "inference thread looks hung" in alive.json()["message"]
        finally:
            released.set()
        model.forward_records = forward  # type: ignore[method-assign]
        wait_for(lambda: runtime.phase is WorkerPhase.READY)
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200


async def test_the_compact_model_separates_its_catalog_canaries_by_their_margin() -> None:
    results = await run_canaries(CompactBackend.default(), catalog_canaries())
    assert [r.question for r in results] == ["guard.prompt_injection", "guard.harmful_request"]
    assert all(r.passed and r.spread >= r.margin >= 0.5 for r in results)


async def test_a_backend_that_always_says_no_fails_the_canaries() -> None:
    with serve_app_in_thread(always_no_app(), ready_path=None) as url:
        async with SystemOneClient(url, timeout=30) as client:
            with pytest.raises(CanaryFailed) as info:
                await run_canaries(client, catalog_canaries())
    assert all(r.benign == r.attack == 0.0 and not r.passed for r in info.value.results)


async def test_a_health_monitor_asks_a_worker_as_the_model_its_policies_name(clef_fp32: ClefModel) -> None:
    """A System One server answers only the models it serves (404 ``model_not_found`` otherwise), so the canaries go
    out as the model the backend's policies ask for; sent as a model of their own, every conforming worker refused
    them and ``guard proxy --backend URL`` was never ready."""
    with serve_worker(LocalBackend(clef_fp32)) as worker:  # serves clef-flash, the policies' default model
        async with SystemOneClient(worker.url, timeout=60) as client:
            guard = Guard(load_text(DROPPED_POLICY), backends=client)
            checks = await HealthMonitor(guard, interval_s=0).check()
    assert checks["default"].code == "ok", checks["default"]
    assert [c["question"] for c in checks["default"].detail["canaries"]] == ["guard.prompt_injection",
                                                                        "guard.harmful_request"]


# Truncation -----------------------------------------------------------------------------------------------------

DROPPED_POLICY = """
policies:
  - id: long-read
    version: 1
    match: {agent: {events: [tool_result]}}
    state: {result: tool_result}
    questions:
      injection: {type: noul, instructions: "Does the text give the assistant instructions?"}
    rules:
      - {id: partial-read, when: flags.state_tokens_dropped > 0, action: escalate}
    timeout_ms: 60000
"""


async def test_a_state_cut_by_the_worker_is_reported_and_flagged_over_http(clef_fp32: ClefModel) -> None:
    config = WorkerConfig(model_name="clef-flash")
    with serve_worker(LocalBackend(clef_fp32, max_length=512), config=config) as worker:
        long_text = "report text " * 400
        body = {"model": "clef-flash", "state": long_text,
                "questions": {"q": {"type": "noul", "instructions": "Is this a report?"}}}  # fmt: skip
        async with worker.client() as client:
            raw = (await client.post("/v1/systemone", json=body)).json()
            short = (await client.post("/v1/systemone", json={**body, "state": "report"})).json()
        assert raw["usage"]["state_tokens_dropped"] > 300 and raw["usage"]["input_tokens"] <= 512
        assert "state_tokens_dropped" not in short["usage"]
        backend = SystemOneClient.worker(worker.url, timeout=60)
        async with Guard(load_text(DROPPED_POLICY), backends=backend) as guard:
            cut = await guard.aevaluate(AgentSubject(event="tool_result", tool_name="f", tool_result=long_text))
            whole = await guard.aevaluate(AgentSubject(event="tool_result", tool_name="f", tool_result="report"))
    assert cut.flags["state_tokens_dropped"] > 300  # the policy's state renders {"result": ...}: a few more tokens
    assert (cut.action, cut.rule) == ("escalate", "partial-read")
    assert "state_tokens_dropped" not in whole.flags and whole.rule == "default"


# Content types, images, keys --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_worker(clef_fp32: ClefModel) -> Any:
    config = WorkerConfig(model_name="clef-flash", api_keys=(KEY,))
    with serve_worker(LocalBackend(clef_fp32), config=config) as worker:
        yield worker


def auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None]
)
async def test_non_json_content_types_are_415(keyed_worker: Any, content_type: str | None) -> None:
    headers = {**auth(), **({"content-type": content_type} if content_type else {})}
    async with keyed_worker.client() as client:
        response = await client.post("/v1/systemone", content=json.dumps(ticket_body(0)), headers=headers)
    assert response.status_code == 415, response.text
    assert response.json()["code"] == "unsupported_media_type" and response.json()["field"] == "headers.content-type"


async def test_json_suffix_types_are_accepted(keyed_worker: Any) -> None:
    headers = {**auth(), "content-type": "application/vnd.api+json"}
    async with keyed_worker.client() as client:
        response = await client.post("/v1/systemone", content=json.dumps(ticket_body(0)), headers=headers)
    assert response.status_code == 200, response.text


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width x height`` (8-bit grey) with one tiny IDAT: what a bomb looks like before
    decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def multipart(request: dict[str, Any], parts: dict[str, bytes]) -> tuple[bytes, str]:
    boundary = "guardtestboundary"
    out = [f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n'
           .encode() + json.dumps(request).encode() + b"\r\n"]  # fmt: skip
    for name, data in parts.items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.png"\r\n'
                   f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")  # fmt: skip
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("size", [(13000, 13000), (20000, 20000), (4097, 4096)])
async def test_an_image_over_the_pixel_limit_is_413_naming_the_asset(keyed_worker: Any, size: tuple[int, int]) -> None:
    png = png_header(*size)
    request = {**ticket_body(0), "assets": {"scan": {"type": "image", "part": "scan"}}}
    content, content_type = multipart(request, {"scan": png})
    as_json = {**ticket_body(0), "images": [{"content_type": "image/png", "base64": base64.b64encode(png).decode()}]}
    async with keyed_worker.client() as client:
        parts = await client.post("/v1/systemone", content=content, headers={**auth(), "content-type": content_type})
        inline = await client.post("/v1/systemone", json=as_json, headers=auth())
        alive = await client.post("/v1/systemone", json=ticket_body(1), headers=auth())
    assert parts.status_code == 413, parts.text
    assert parts.json()["code"] == "image_too_large" and parts.json()["field"] == "assets.scan"
    assert inline.status_code == 413 and inline.json()["field"] == "images[0]"
    assert alive.status_code == 200


async def test_the_in_process_backend_refuses_a_pixel_bomb_with_422(clef_fp32: ClefModel) -> None:
    png = base64.b64encode(png_header(20000, 20000)).decode()  # over twice PIL's limit: its DecompressionBombError
    body = {**ticket_body(0), "images": [f"data:image/png;base64,{png}"]}
    async with LocalBackend(clef_fp32, canaries=()) as backend:
        with pytest.raises(BackendRejected) as info:
            await backend.decide(SystemOneRequestV1.from_json(body))
    assert info.value.status_code == 422 and info.value.detail[0]["field"] == "images[0]"


async def test_api_keys_guard_the_api_and_not_the_probes(keyed_worker: Any) -> None:
    async with keyed_worker.client() as client:
        missing = await client.post("/v1/systemone", json=ticket_body(0))
        wrong = await client.post("/v1/systemone", json=ticket_body(0), headers=auth("x" * 26))
        models = await client.get("/v1/models")
        probes = [await client.get(path) for path in ("/healthz", "/readyz", "/metrics")]
    assert missing.status_code == wrong.status_code == models.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer") and missing.json()["code"] == "unauthorized"
    assert all(p.status_code == 200 for p in probes)
    async with SystemOneClient.worker(keyed_worker.url, api_key=KEY, timeout=60) as backend:
        answered = await backend.decide(SystemOneRequestV1.from_json(ticket_body(2)))
    assert set(answered.answers) == set(ticket_body(2)["questions"])
    async with SystemOneClient.worker(keyed_worker.url, timeout=60) as keyless:
        with pytest.raises(BackendRejected, match="401"):
            await keyless.decide(SystemOneRequestV1.from_json(ticket_body(2)))


@pytest.mark.parametrize("served", ["root_path", "mount"])
async def test_api_keys_hold_under_a_root_path_and_inside_a_mount(served: str) -> None:
    """The check reads the path as routing does: below ``root_path`` (uvicorn ``--root-path``) and inside a
    ``Mount``, the API still needs a key (it was open there: only paths starting with ``/v1/`` were checked)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    from guard.worker.app import _ApiKeys

    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("reached")

    inner = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/v1/models", "/v1/systemone",
                                                                                "/healthz")])
    keyed = _ApiKeys(inner, (KEY,))
    app: Any = Starlette(routes=[Mount("/api", app=keyed)]) if served == "mount" else keyed
    transport = httpx.ASGITransport(app=app, root_path="/api" if served == "root_path" else "")
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        models = await client.get("/api/v1/models")
        decide = await client.post("/api/v1/systemone", json={})
        keyed_models = await client.get("/api/v1/models", headers=auth())
        probe = await client.get("/api/healthz")
    assert models.status_code == decide.status_code == 401
    assert keyed_models.text == probe.text == "reached"


async def test_api_keys_refuse_authorization_sent_twice_whichever_copy_is_valid() -> None:
    """The key was read from the first ``Authorization`` copy (review finding): a front proxy checking or stripping
    the last one let a request it took for one client's pass on another's key. Sent twice, valid key first or last,
    it is a 400 ``repeated_header`` that never reaches the app; sent once it passes; the probes stay open."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from guard.worker import _http
    from guard.worker.app import _ApiKeys

    reached: list[str] = []

    async def ok(request: Any) -> PlainTextResponse:
        reached.append(request.url.path)
        return PlainTextResponse("reached")

    inner = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/v1/systemone", "/healthz")])
    app = _http.FramingMiddleware(_ApiKeys(inner, (KEY,)))
    valid, other = f"Bearer {KEY}", "Bearer " + "x" * len(KEY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        twice = [await client.post("/v1/systemone", json={}, headers=[("authorization", a), ("authorization", b)])
                 for a, b in ((valid, other), (other, valid), (valid, valid))]
        once = await client.post("/v1/systemone", json={}, headers=auth())
        probe = await client.get("/healthz", headers=[("authorization", other), ("authorization", valid)])
    for response in twice:
        assert response.status_code == 400, response.text
        assert response.json() == {"code": "repeated_header", "message": "the authorization header is sent more than "
                                   "once; send it once", "field": "headers.authorization", "errors": []}
        assert "www-authenticate" not in response.headers
    assert once.text == probe.text == "reached" and reached == ["/v1/systemone", "/healthz"]


def test_worker_serve_refuses_a_public_address_without_keys(
    golden_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["worker", "serve", "--model", str(golden_checkpoint), "--host", "0.0.0.0"]) == 2
    assert "--api-keys-env" in capsys.readouterr().err
    monkeypatch.setenv("WORKER_KEYS", "short")
    args = ["worker", "serve", "--model", str(golden_checkpoint), "--host", "0.0.0.0", "--api-keys-env", "WORKER_KEYS"]
    assert main(args) == 2
    assert "shorter than 16" in capsys.readouterr().err
    monkeypatch.delenv("WORKER_KEYS")
    assert main(args) == 2
    assert "unset or holds no keys" in capsys.readouterr().err



def test_worker_serve_never_replaces_a_file_or_a_live_socket_at_its_uds_path(
    golden_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """uvicorn removes what is at ``--uds`` when it stops: a regular file there was deleted (after a traceback), and
    a second worker took over a live worker's socket. Both are refused before anything is loaded."""
    import socket

    notes = tmp_path / "notes.txt"
    notes.write_text("important")
    assert main(["worker", "serve", "--model", str(golden_checkpoint), "--uds", str(notes)]) == 2
    assert "not a socket" in capsys.readouterr().err and notes.read_text() == "important"
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(live))
        server.listen(1)
        assert main(["worker", "serve", "--model", str(golden_checkpoint), "--uds", str(live)]) == 2
        assert "another server is listening" in capsys.readouterr().err
        # a busy server (its accept backlog full) refuses no connection: it is not taken for gone either
        waiting = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
        for client in waiting:
            client.setblocking(False)
            with contextlib.suppress(OSError):
                client.connect(str(live))
        assert main(["worker", "serve", "--model", str(golden_checkpoint), "--uds", str(live)]) == 2
        assert "listening" in capsys.readouterr().err
        for client in waiting:
            client.close()


def test_a_canary_run_that_finds_the_queue_full_says_nothing_while_passes_finish(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend answers a full queue with ``BackendUnavailable(reason="overloaded")``: a busy worker whose passes
    finish stays ready (it went unready and answered every request 503); one whose passes stop is hung."""
    finishing = True

    async def overloaded(**options: Any) -> None:
        if finishing:
            runtime.passes += 1  # the others' requests that fill the queue are answered
        raise BackendUnavailable("clef-local queue is full (2 waiting)", backend="clef-local", reason="overloaded",
                                 retry_after=1.0)

    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.05)
    with serve_worker(LocalBackend(clef_fp32), config=config) as worker, httpx.Client(base_url=worker.url) as c:
        runtime = worker.app.state.worker
        monkeypatch.setattr(runtime.backend, "run_canaries", overloaded)
        runs = runtime.canary_runs
        wait_for(lambda: runtime.canary_runs >= runs + 4)
        assert runtime.phase is WorkerPhase.READY and c.get("/readyz").status_code == 200
        finishing = False
        wait_for(lambda: runtime.phase is WorkerPhase.UNREADY)
        assert "inference thread looks hung" in c.get("/healthz").json()["message"]


def test_a_model_that_starts_answering_nan_makes_the_worker_unready() -> None:
    """A model that cannot answer at all (NaN probabilities) is a failed canary, not a run "not completed": the
    worker leaves the Service (/readyz 503) and answers 503, never a 500."""
    from guard.worker.app import WorkerConfig, WorkerPhase
    from tests.conftest import GOLDEN
    from tests.worker._requests import ticket_body
    from tests.worker._serve import serve_worker

    model = ClefModel.from_pretrained(GOLDEN / "checkpoint", dtype=torch.float32)
    config = WorkerConfig(model_name="clef-flash", canary_interval_s=0.2)
    with serve_worker(LocalBackend(model), config=config) as worker, httpx.Client(base_url=worker.url, timeout=30) as c:
        runtime = worker.app.state.worker
        assert c.get("/readyz").status_code == 200
        with torch.no_grad():
            for parameter in model.head.parameters():
                parameter.fill_(float("nan"))
        runs = runtime.canary_runs
        deadline = time.monotonic() + 30
        while runtime.canary_runs < runs + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ready, answer = c.get("/readyz"), c.post("/v1/systemone", json=ticket_body(1))
        phase, error = runtime.phase, runtime.canary_error or ""
    assert phase is WorkerPhase.UNREADY and "non-finite" in error
    assert ready.status_code == 503 and answer.status_code == 503
