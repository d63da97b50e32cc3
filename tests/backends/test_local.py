"""LocalBackend: in-process Clef behind the micro-batcher, on the golden tiny checkpoint."""

from __future__ import annotations

import asyncio
import base64
import compileall
import gc
import hashlib
import io
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from guard.backends.base import PACKAGE_DIR, DecisionBackend, code_digest, installed_code_digest
from guard.backends.batcher import BatcherConfig, BatchInfo
from guard.backends.local import LocalBackend, _probe_image
from guard.backends.selftest import SELF_TEST_APART, SELF_TEST_REQUEST, clef_canaries
from guard.clef.model import ClefModel
from guard.errors import BackendRejected, BackendTimeout, BackendUnavailable, Overloaded
from guard.systemone import QuestionV1, SystemOneRequestV1, confidence
from tests.worker._requests import golden_case, long_body, ticket_body

pytestmark = pytest.mark.anyio


def request(body: dict[str, object]) -> SystemOneRequestV1:
    return SystemOneRequestV1.from_json(body, profile="reference")


async def busy(backend: LocalBackend) -> asyncio.Task[object]:
    """Start a long request and return once it computes, so that what follows must queue."""
    task = asyncio.ensure_future(backend.decide(request(long_body())))
    while backend.batcher.in_flight == 0:
        await asyncio.sleep(0.002)
    return task


async def test_answers_match_the_reference_fixture(clef_fp32: ClefModel) -> None:
    case = golden_case("01-three-types")
    async with LocalBackend(clef_fp32) as backend:
        response = await backend.decide(request(case["request"]))
    assert isinstance(backend, DecisionBackend)
    want = case["response_fp32"]
    got = response.to_json()
    assert got["usage"] == want["usage"] and got["model"] == want["model"]
    for qid, answer in want["answers"].items():
        assert got["answers"][qid]["type"] == answer["type"]
        for key in ("noul", "score", "confidence", "choice"):
            if key in answer:
                assert got["answers"][qid][key] == pytest.approx(answer[key], abs=2e-4)


async def test_concurrent_decides_share_forward_passes(clef_fp32: ClefModel) -> None:
    bodies = [request(ticket_body(i)) for i in range(8)]
    async with LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_wait_ms=20)) as backend:
        alone = [await backend.decide(r) for r in bodies]
        before = backend.batcher.stats.batches
        together = await asyncio.gather(*(backend.decide(r) for r in bodies))
        passes = backend.batcher.stats.batches - before
    assert passes < len(bodies)
    for got, want in zip(together, alone, strict=True):
        assert got.usage == want.usage and list(got.answers) == list(want.answers)
        for qid, answer in want.answers.items():
            assert got.answers[qid].probabilities == pytest.approx(answer.probabilities, abs=1e-4)


async def test_lengths_far_apart_are_not_padded_together(clef_fp32: ClefModel) -> None:
    infos: list[BatchInfo] = []
    config = BatcherConfig(max_wait_ms=50, max_length_ratio=2.0)
    async with LocalBackend(clef_fp32, batcher_config=config, on_batch=infos.append) as backend:
        bodies = [long_body(200), ticket_body(0), ticket_body(1), long_body(210), ticket_body(2)]
        responses = await asyncio.gather(*(backend.decide(request(b)) for b in bodies))
    assert len(responses) == 5 and len(infos) >= 2
    for info in infos:
        assert info.padded_tokens <= 2 * info.tokens


async def test_schema_too_long_is_rejected_with_field_errors(clef_fp32: ClefModel) -> None:
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(12)}
    async with LocalBackend(clef_fp32, max_length=600) as backend:  # the self-test request fits in 600
        with pytest.raises(BackendRejected) as info:
            await backend.decide(request({"model": "m", "state": "s", "questions": many}))
    assert info.value.status_code == 422 and "maximum is 600" in str(info.value)
    assert info.value.detail and info.value.detail[0]["field"]


def _png(size: tuple[int, int]) -> dict[str, str]:
    out = io.BytesIO()
    Image.new("RGB", size, "red").save(out, format="PNG")
    return {"content_type": "image/png", "base64": base64.b64encode(out.getvalue()).decode()}


async def test_images_that_can_never_fit_the_prompt_are_422_before_their_bytes_are_held(clef_fp32: ClefModel) -> None:
    """``hold`` took a request's pixel bytes before its images' tokens were checked against the prompt, so a request
    that can never be served got the retryable 429 of a full memory (verification finding). Images taking more than
    the prompt's room beside the schema are refused 422 from their headers before ``hold`` is called; images that fit
    are held for what their tensors will take, and refused as ``hold`` refuses them."""
    held: list[int] = []

    def full(size: int) -> None:
        held.append(size)
        raise Overloaded("memory for request bodies", 1, 1.0, counted="bytes")

    fitting = request({**ticket_body(0), "images": [_png((512, 512))]})  # 256 tokens
    too_large = request({**ticket_body(0), "images": [_png((1024, 1024))]})  # 1,024 tokens
    async with LocalBackend(clef_fp32, max_length=1024) as backend:
        assert 256 < backend.state_room(too_large.questions) < 1024
        with pytest.raises(BackendRejected) as never:
            await backend.decide(too_large, hold=full)
        with pytest.raises(BackendRejected) as encoded:  # what the encoding says without a hold: the same refusal
            await backend.decide(too_large)
        with pytest.raises(BackendUnavailable) as later:
            await backend.decide(fitting, hold=full)
    assert never.value.status_code == 422 and never.value.detail == encoded.value.detail
    assert never.value.detail and never.value.detail[0]["field"] == "images"
    assert later.value.reason == "overloaded"
    assert held == [clef_fp32.encode(fitting, max_length=1024).media_bytes]


async def test_images_are_checked_against_the_schema_on_an_encoding_thread(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room an image request's schema leaves was counted on the event loop before its bytes were held: 64
    questions of 100 KB and one small image held the worker's loop 9.6 s. The questions are tokenized and the image
    headers read on an encoding thread; only the hold runs on the loop."""
    threads: list[threading.Thread] = []
    processor = clef_fp32.processor
    for name in ("encode_texts", "image_pads"):
        method = getattr(processor, name)

        def recorded(*args: Any, _method: Any = method) -> Any:
            threads.append(threading.current_thread())
            return _method(*args)

        monkeypatch.setattr(processor, name, recorded)
    held: list[tuple[int, threading.Thread]] = []
    async with LocalBackend(clef_fp32, max_length=1024) as backend:
        threads.clear()
        await backend.decide(request({**ticket_body(0), "images": [_png((64, 64))]}),
                             hold=lambda size: held.append((size, threading.current_thread())))  # fmt: skip
    assert threads and threading.current_thread() not in threads
    assert held and held[0][1] is threading.current_thread()


class _Panic(BaseException):
    """What a Rust tokenizer's panic raises in Python (pyo3's ``PanicException`` is a ``BaseException``)."""


@pytest.mark.parametrize("error", [RuntimeError("tokenizer failure"), MemoryError(), _Panic("index out of bounds")])
async def test_an_encoding_that_fails_is_unavailable_not_an_internal_error(
    clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: BaseException
) -> None:
    """Only a ValueError is the request's fault (422); any other error while encoding is the model's: the caller gets
    ``BackendUnavailable(reason="inference_failed")`` (it escaped as itself, the worker's 500, before) and the log
    the traceback."""
    async with LocalBackend(clef_fp32) as backend:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise error

        monkeypatch.setattr(clef_fp32, "encode", broken)
        with pytest.raises(BackendUnavailable) as info:
            await backend.decide(request(ticket_body(0)))
        monkeypatch.undo()
        assert (await backend.decide(request(ticket_body(0)))).answers  # the backend serves on
    assert info.value.reason == "inference_failed" and type(error).__name__ in str(info.value)
    assert info.value.__cause__ is error
    assert "encoding failed in 'clef-local'" in caplog.text


async def test_deadline_drops_a_queued_request(clef_fp32: ClefModel) -> None:
    async with LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_wait_ms=0)) as backend:
        long_running = await busy(backend)
        computed = backend.batcher.stats.batched_requests
        with pytest.raises(BackendTimeout, match="within 50 ms"):
            await backend.decide(request(ticket_body(1)), timeout=0.05)
        await long_running
    assert backend.batcher.stats.batched_requests == computed and backend.batcher.stats.expired == 1


async def test_full_queue_is_unavailable_with_retry_after(clef_fp32: ClefModel) -> None:
    config = BatcherConfig(max_batch=1, max_queue=1, max_wait_ms=0)
    async with LocalBackend(clef_fp32, batcher_config=config) as backend:
        long_running = await busy(backend)
        queued = asyncio.ensure_future(backend.decide(request(ticket_body(1))))
        while backend.batcher.queue_depth == 0:
            await asyncio.sleep(0.002)
        with pytest.raises(BackendUnavailable) as info:
            await backend.decide(request(ticket_body(2)))
        await asyncio.gather(long_running, queued)
    assert info.value.reason == "overloaded" and info.value.retry_after is not None and info.value.retry_after >= 1


async def test_closed_backend_is_unavailable_and_cannot_restart(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32)
    assert (await backend.decide(request(ticket_body(0)))).answers  # starts lazily
    await backend.aclose()
    await backend.aclose()
    with pytest.raises(BackendUnavailable, match="is closed") as info:
        await backend.decide(request(ticket_body(0)))
    assert info.value.reason == "closed"
    with pytest.raises(RuntimeError, match="is closed; create a new one"):
        await backend.start()


async def test_requests_waiting_for_an_encoding_thread_at_close_are_unavailable(
        clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the backend while more requests than encoding threads are being encoded: every caller gets
    ``BackendUnavailable(reason="closed")``, none a ``CancelledError`` (which would read as its own cancellation)."""
    backend = LocalBackend(clef_fp32)
    await backend.start()
    release = threading.Event()
    encode = clef_fp32.encode

    def held_encode(*args: Any, **kwargs: Any) -> Any:  # the real encoding, started once the backend is closing
        release.wait(10)
        return encode(*args, **kwargs)

    monkeypatch.setattr(clef_fp32, "encode", held_encode)
    calls = [asyncio.ensure_future(backend.decide(request(ticket_body(i)), timeout=30)) for i in range(6)]
    await asyncio.sleep(0.1)
    closing = asyncio.ensure_future(backend.aclose())
    await asyncio.sleep(0.05)
    release.set()
    await closing
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, BackendUnavailable) and o.reason == "closed" for o in outcomes), outcomes


def test_a_backend_belongs_to_the_event_loop_it_started_on(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32)
    body = request(ticket_body(0))
    assert asyncio.run(backend.decide(body)).answers
    with pytest.raises(RuntimeError, match="started on another event loop"):
        asyncio.run(backend.decide(body))


async def test_confidence_profile_and_validation(clef_fp32: ClefModel) -> None:
    body = request(golden_case("01-three-types")["request"])
    async with LocalBackend(clef_fp32, confidence_profile="workers-ai") as backend:
        answer = (await backend.decide(body)).answers["seating"]
    probabilities = list(answer.probabilities.values())
    assert answer.confidence == pytest.approx(confidence(probabilities, "choice", "workers-ai"))
    # part of cache keys: the weights, the code reading them out, the profile
    assert backend.model_revision == f"checkpoint@{clef_fp32.revision}+guard={installed_code_digest()}+confidence=workers-ai"
    with pytest.raises(ValueError, match="confidence_profile must be one of"):
        LocalBackend(clef_fp32, confidence_profile="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_length must be"):
        LocalBackend(clef_fp32, max_length=0)


def test_the_code_digest_moves_when_any_file_of_the_package_changes(tmp_path: Path) -> None:
    """Commits changed answers without touching the weights (the compact model's competence checks, the readout),
    and the revision named only the weights: during or after an upgrade, a replica served answers the older build
    had cached. The revision names a digest of the package's code and data; a copy with one file changed has
    another (the package itself is not edited)."""
    copy = tmp_path / "guard"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    installed = installed_code_digest()
    assert code_digest(copy) == code_digest() == installed and len(installed) == 12
    for name in ("compact/competence.py", "compact/model.py", "clef/encoding.py", "clef/head.py", "_english.py",
                 "data/english_words.txt", "policy/data/confusables.txt"):
        path = copy / name
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert code_digest(copy) != installed, name
        path.write_bytes(original)
    assert code_digest(copy) == installed
    (copy / "compact" / "readout.py").write_text("")  # a module added
    assert code_digest(copy) != installed


def test_the_code_digest_reads_compiled_modules_shipped_without_source_and_skips_links_to_nothing(
    tmp_path: Path,
) -> None:
    """An editor's lock file in an editable checkout (``.#cache.py``, a link to nothing) made ``code_digest`` raise
    FileNotFoundError, so no backend could be made; a sourceless install (``*.pyc`` where the ``*.py`` would be) was
    digested as its data files alone, so no code change moved it. The lock file is skipped and the compiled modules
    are read; ``__pycache__`` is not (the interpreter writes it as it goes)."""
    copy = tmp_path / "guard"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    (copy / "engine" / ".#cache.py").symlink_to("user@host.1234:1700000000")
    installed = installed_code_digest()
    assert code_digest(copy) == installed
    assert compileall.compile_dir(copy, quiet=1)  # __pycache__ next to the sources
    assert code_digest(copy) == installed
    assert compileall.compile_dir(copy, quiet=1, legacy=True)  # where the sources are, which go
    for source in copy.rglob("*.py"):
        source.unlink()
    sourceless = code_digest(copy)
    assert sourceless != installed
    compiled = copy / "engine" / "cache.pyc"
    compiled.write_bytes(compiled.read_bytes() + b"\0")
    assert code_digest(copy) != sourceless


def test_the_code_digest_names_each_file_by_its_posix_path_in_string_order(tmp_path: Path) -> None:
    """The order is that of the relative paths as text (``a-b.py`` before ``a/b.py``), the same on every platform;
    a folder with no code in it (a package imported from a zip archive) is refused, not digested as nothing."""
    for name, data in {"a/b.py": b"1", "a-b.py": b"2", "data/words.txt": b"3", "c.pyc": b"4",
                       "a/__pycache__/b.cpython-311.pyc": b"5"}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    want = hashlib.sha256()
    for part in (b"a-b.py", b"2", b"a/b.py", b"1", b"c.pyc", b"4", b"data/words.txt", b"3"):
        want.update(len(part).to_bytes(8, "big") + part)
    assert code_digest(tmp_path) == want.hexdigest()[:12]
    with pytest.raises(FileNotFoundError, match=r"no Python code \(\*\.py or \*\.pyc\) under .*zip archive"):
        code_digest(tmp_path / "data")


async def test_the_revision_names_a_max_length_other_than_the_default(clef_fp32: ClefModel) -> None:
    """Replicas with different ``max_length`` (``guard worker serve --max-length``) had one revision, so one cache
    key: the replica reading the whole state was served the other's answer to its head."""
    short, default, explicit = (LocalBackend(clef_fp32, max_length=n) for n in (600, None, 16384))
    assert short.model_revision == default.model_revision.replace("+guard=", "+max_length=600+guard=")
    assert "max_length" not in default.model_revision and explicit.model_revision == default.model_revision
    for backend in (short, default, explicit):
        await backend.aclose()


async def test_from_pretrained_bf16_matches_the_bf16_fixture(golden_checkpoint: Path) -> None:
    case = golden_case("01-three-types")
    backend = LocalBackend.from_pretrained(golden_checkpoint)
    assert backend.model.dtype == torch.bfloat16
    assert backend.model_revision == f"checkpoint@{backend.model.revision}+guard={installed_code_digest()}"
    assert "LocalBackend" in repr(backend)
    async with backend:
        got = (await backend.decide(request(case["request"]))).to_json()
    want = case["response_bf16"]
    assert got["answers"]["seating"]["choice"] == want["answers"]["seating"]["choice"]
    assert got["answers"]["needs_access"]["noul"] == pytest.approx(want["answers"]["needs_access"]["noul"], abs=2e-3)


async def test_start_warms_up_with_the_worker_self_test(clef_fp32: ClefModel) -> None:
    infos: list[BatchInfo] = []
    backend = LocalBackend(clef_fp32, on_batch=infos.append)
    await asyncio.gather(backend.start(), backend.start())  # concurrent callers share one warm-up
    self_test_tokens = len(clef_fp32.encode(SELF_TEST_REQUEST, max_length=backend.max_length).input_ids)
    # the well-formedness request, then each canary's two states and the self-test request with an 8x8 PNG (this
    # checkpoint reads images)
    warm_up = 1 + 2 * len(backend.canaries) + 1
    with_image = SELF_TEST_REQUEST.override(images=(_probe_image(),))
    image_tokens = len(clef_fp32.encode(with_image, max_length=backend.max_length).input_ids)
    assert len(backend.canaries) == 2 and len(infos) == warm_up
    assert (infos[0].size, infos[0].tokens) == (1, self_test_tokens) and all(i.size == 1 for i in infos)
    assert infos[-1].tokens == image_tokens
    await backend.start()  # idempotent: no second self-test
    assert len(infos) == warm_up
    async with backend:
        await backend.decide(request(ticket_body(0)), timeout=30)
    assert len(infos) == warm_up + 1


async def test_a_lazy_start_warms_up_before_the_first_request(clef_fp32: ClefModel) -> None:
    infos: list[BatchInfo] = []
    backend = LocalBackend(clef_fp32, on_batch=infos.append)
    body = request(ticket_body(0))
    await backend.decide(body)
    await backend.aclose()
    warm_up = 1 + 2 * len(backend.canaries) + 1  # the self-test, the canaries, the image canary
    assert len(infos) == warm_up + 1 and infos[-1].tokens == len(clef_fp32.encode(body).input_ids)


async def test_closing_while_the_self_test_runs_waits_for_it_quietly(clef_fp32: ClefModel) -> None:
    """A first caller gives up during the warm-up (its deadline passed) and the backend is closed at once: the
    self-test finishes, nothing is reported as a failed self-test or an exception never retrieved."""
    unhandled: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
    infos: list[BatchInfo] = []
    backend = LocalBackend(clef_fp32, on_batch=infos.append)
    first = asyncio.ensure_future(backend.start())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await backend.aclose()
    assert len(infos) == 1 + 2 * len(backend.canaries) + 1  # the whole self-test ran, the image canary included
    del first
    gc.collect()
    await asyncio.sleep(0)
    assert unhandled == []


async def test_a_failed_self_test_closes_the_backend_and_says_why(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, canaries=clef_canaries(margin=1.0, directional=True))  # no model is that sure
    with pytest.raises(BackendUnavailable, match="failed its startup self-test: CanaryFailed: canary 'guard") as info:
        await backend.start()
    assert info.value.reason == "self_test_failed"
    with pytest.raises(BackendUnavailable, match="is closed"):
        await backend.decide(request(ticket_body(0)))
    with pytest.raises(RuntimeError, match="is closed; create a new one"):
        async with backend:
            pass


async def test_a_max_length_below_the_self_test_request_asks_its_questions_apart(clef_fp32: ClefModel) -> None:
    case = golden_case("10-truncated-small-max-length")  # 420 tokens: the self-test request needs more
    infos: list[BatchInfo] = []
    async with LocalBackend(clef_fp32, max_length=case["max_length"], canaries=(), on_batch=infos.append) as backend:
        response = await backend.decide(request(case["request"]), timeout=30)
        await backend.probe_encoding(timeout=30)  # the image probe asks the first question alone too
    apart = [len(clef_fp32.encode(r, max_length=case["max_length"]).input_ids) for r in SELF_TEST_APART]
    first_with_image = SELF_TEST_APART[0].override(images=(_probe_image(),))
    image_tokens = len(clef_fp32.encode(first_with_image, max_length=case["max_length"]).input_ids)
    # the image canary asks the first question with the PNG, last of the start
    assert [(i.size, i.tokens) for i in infos[:4]] == [(1, tokens) for tokens in apart] + [(1, image_tokens)]
    want = case["response_fp32"]
    got = response.to_json()
    assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"] == case["max_length"]
    for qid, answer in want["answers"].items():
        for key in ("noul", "confidence", "choice"):
            if key in answer:
                assert got["answers"][qid][key] == pytest.approx(answer[key], abs=2e-4)


async def test_a_vision_tower_answering_nan_fails_the_start_with_the_questions_apart(clef_fp32: ClefModel) -> None:
    """At a max_length the self-test asks its questions apart, the image canary asks the first of them with the 8x8
    PNG, so a vision tower that turns every image into NaN fails the startup self-test."""
    visual = next(m for name, m in clef_fp32.backbone.named_modules() if name.endswith("visual"))

    def nan(value: Any) -> Any:
        return value * float("nan") if torch.is_tensor(value) and value.is_floating_point() else value

    def nan_pixels(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return tuple(nan(a) for a in args), {key: nan(value) for key, value in kwargs.items()}

    hook = visual.register_forward_pre_hook(nan_pixels, with_kwargs=True)
    try:
        backend = LocalBackend(clef_fp32, max_length=420, canaries=())
        with pytest.raises(BackendUnavailable, match="failed its startup self-test") as info:
            await backend.start()
    finally:
        hook.remove()
    assert len(backend._self_test_requests) == len(SELF_TEST_APART)
    assert info.value.reason == "self_test_failed"


@pytest.mark.parametrize(
    ("canaries", "needs"),
    [
        (None, "canary 'guard.prompt_injection' takes with its state"),
        ((), "the self-test's question 'churn_risk' with an 8x8 PNG takes before any state"),
    ],
)
async def test_a_max_length_too_short_for_the_self_test_is_refused_naming_the_least(
    clef_fp32: ClefModel, canaries: tuple[()] | None, needs: str
) -> None:
    with pytest.raises(ValueError, match=r"max_length \(--max-length\) 250 is below \d+, the tokens") as info:
        LocalBackend(clef_fp32, max_length=250, canaries=canaries)
    assert needs in str(info.value)
    least = int(re.search(r"is below (\d+)", str(info.value))[1])
    with pytest.raises(ValueError, match=f"is below {least}"):
        LocalBackend(clef_fp32, max_length=least - 1, canaries=canaries)
    async with LocalBackend(clef_fp32, max_length=least, canaries=canaries) as backend:  # the self-test passes
        await backend.probe_encoding(timeout=30)


def _attack_question(qid: str, repeats: int) -> QuestionV1:
    return QuestionV1(qid, "noul", "Is this an attack? " * repeats)  # about 10 tokens a repeat, 660 for 50


def _long_policy(policy_id: str, keys: dict[str, int]) -> str:
    questions = ", ".join(
        f"{key}: {{type: noul, instructions: '{'Is this an attack? ' * n}'}}" for key, n in keys.items()
    )
    first = next(iter(keys))
    return f"""
  - id: {policy_id}
    version: 1
    match: {{http: {{methods: [POST]}}}}
    state: {{text: body_text}}
    timeout_ms: 60000
    questions: {{{questions}}}
    rules: [{{id: r, when: '{first}.noul > 0.99', action: block}}]
"""


def test_explain_refuses_questions_past_the_prompt_limit(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, max_length=1024)
    short, fits, long = _attack_question("a", 1), _attack_question("b", 50), _attack_question("c", 100)
    assert backend.explain(short) is None and backend.explain(fits) is None
    assert "schema requires 12" in (backend.explain(long) or "") and "maximum is 1024" in (backend.explain(long) or "")
    assert backend.explain_questions([short, fits]) is None
    assert "maximum is 1024" in (backend.explain_questions([fits, _attack_question("d", 50)]) or "")


def test_a_policy_whose_schema_cannot_fit_is_a_load_error(clef_fp32: ClefModel, tmp_path: Path) -> None:
    """Before, such a policy loaded, the service reported ready, and every decision failed closed (503)."""
    from guard.engine import Guard
    from guard.errors import PolicyError

    backend = LocalBackend(clef_fp32, max_length=1024)
    path = tmp_path / "long.yaml"
    path.write_text("policies:" + _long_policy("fine", {"a": 1}) + _long_policy("long", {"ok": 1, "inj": 100}))
    with pytest.raises(PolicyError, match="cannot answer question 'inj'.*maximum is 1024") as caught:
        Guard.from_files(path, backends=backend)
    assert (caught.value.file, caught.value.line, caught.value.key) == (str(path), 15, "policies[1].questions.inj")
    path.write_text("policies:" + _long_policy("both", {"a": 50, "b": 50}))  # each fits, not together
    with pytest.raises(PolicyError, match="questions in one request: .*maximum is 1024") as caught:
        Guard.from_files(path, backends=backend)
    assert (caught.value.line, caught.value.key) == (2, "policies[0].questions")


async def test_policies_whose_questions_fit_only_apart_are_asked_apart(clef_fp32: ClefModel) -> None:
    """Two policies of about 660 schema tokens each went out in one request past the 1,024-token limit: every
    decision failed closed."""
    from guard.engine import Guard
    from guard.policy import load_text
    from guard.subject import HttpSubject

    infos: list[BatchInfo] = []
    backend = LocalBackend(clef_fp32, max_length=1024, on_batch=infos.append)
    policies = load_text("policies:" + _long_policy("one", {"a": 50}) + _long_policy("two", {"b": 50}))
    async with Guard(policies, backends=backend) as guard:
        before = sum(info.size for info in infos)
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/x", body={"t": "hi"}, body_text="hi"))
    assert sum(info.size for info in infos) - before == 2  # one request each
    assert verdict.error is None and verdict.action == "allow"
    assert [(c.policy_id, c.error) for c in verdict.contributions] == [("one", None), ("two", None)]


@pytest.mark.parametrize("questions", [
    [_attack_question("a", 1)],
    [_attack_question("a", 1), _attack_question("b", 40)],
    [QuestionV1("tone", "choice", "Tone?", {"calm": "calm", "angry": {"x": [1, 2]}}),
     QuestionV1("severity", "score", "How severe?", ["low", "mid", "high"]), _attack_question("a", 3)],
])  # fmt: skip
def test_state_room_is_what_a_request_keeps_of_its_state(clef_fp32: ClefModel, questions: list[QuestionV1]) -> None:
    from guard.clef.encoding import render

    backend = LocalBackend(clef_fp32, max_length=1024)
    room = backend.state_room(questions)
    state = ("please summarise this document. " * 400)[: 8 * (room + 256) - 8]  # tokenized whole: its count is exact
    record = clef_fp32.encode(SystemOneRequestV1(model="m", state=state, questions=tuple(questions)), max_length=1024)
    tokens = len(clef_fp32.processor.encode_texts([render(state)])[0])
    assert tokens > room and room == tokens - (record.untruncated_length - len(record.input_ids))
    assert backend.state_room(questions) == room  # remembered: the same answer
    assert backend.state_room([*questions, _attack_question("c", 100)]) < 0  # the schema alone does not fit


async def test_a_policy_whose_questions_would_leave_the_state_little_room_is_asked_apart(clef_fp32: ClefModel) -> None:
    """Policies were asked together whenever their schemas fit the prompt, however little of it that left the state:
    a policy with a short question, asked with another's 40-sentence one, read the head of a state it read whole
    alone (``state_tokens_dropped``) and answered otherwise. A request now keeps the state half the prompt."""
    from guard.engine import Guard
    from guard.policy import load_text
    from guard.subject import HttpSubject

    infos: list[BatchInfo] = []
    backend = LocalBackend(clef_fp32, max_length=1024, on_batch=infos.append)
    one, two = _attack_question("a", 1), _attack_question("b", 40)
    assert backend.explain_questions([one, two]) is None  # they fit the prompt together
    policies = load_text("policies:" + _long_policy("short", {"a": 1}) + _long_policy("long", {"b": 40}))
    text = "please summarise this document. " * 30  # about 500 tokens: more than the room left together, less than alone
    body = HttpSubject(method="POST", path="/x", body={"t": text}, body_text=text)
    async with Guard(policies, backends=backend) as guard:
        before = sum(info.size for info in infos)
        verdict = await guard.aevaluate(body)
    assert sum(info.size for info in infos) - before == 2  # one request each
    short = next(c for c in verdict.contributions if c.policy_id == "short")
    assert "state_tokens_dropped" not in short.flags
    alone_policies = load_text("policies:" + _long_policy("short", {"a": 1}))
    async with Guard(alone_policies, backends=LocalBackend(clef_fp32, max_length=1024)) as alone:
        # float32 answers of one state differ in the 7th digit by the batch it ran in (padding changes the products'
        # shapes): the two requests above share a batch or not as they happen to arrive
        assert (await alone.aevaluate(body)).answers["a"].noul == pytest.approx(short.answers["a"].noul, abs=1e-6)


def test_grouping_policies_tokenizes_each_question_once(clef_fp32: ClefModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """group_plans asked the backend to encode every candidate request whole, on the event loop, for each policy
    and group: 30 policies took 4 s, on the first request of each set of matching policies and after every reload.
    Each question's tokens are now counted once per place and remembered, also for a reloaded policy's equal
    question."""
    from guard.engine.plan import Plan, group_plans
    from guard.policy import load_text

    backend = LocalBackend(clef_fp32, max_length=4096)
    text = "policies:" + "".join(_long_policy(f"p{i}", {f"q{i}": 2}) for i in range(12))
    calls: list[int] = []
    encode_texts = clef_fp32.processor.encode_texts

    def counted(texts: Any) -> Any:
        calls.append(len(texts))
        return encode_texts(texts)

    monkeypatch.setattr(clef_fp32.processor, "encode_texts", counted)
    for reload in (False, True, True):
        calls.clear()
        plans = tuple(Plan(policy, backend, backend.model_revision) for policy in load_text(text))
        (group,) = group_plans(plans)
        assert len(group.questions) == 12
        assert len(calls) <= (0 if reload else 12 + 1), calls  # each question once, and the prompt's fixed text
