"""In-process Clef behind the micro-batcher: the :class:`~guard.backends.base.DecisionBackend` with no HTTP hop.

Each ``decide`` encodes its request on one of the backend's encoding threads (tokenization, CPU), then waits in a
:class:`~guard.backends.batcher.MicroBatcher` whose single inference thread runs one batched prefill + head
(:meth:`ClefModel.forward_records`) for every batch and the readout (:meth:`ClefModel.answer`) for each record. The
event loop never runs torch. The decision worker (``guard worker serve``) serves exactly this object over HTTP.

Example:
    >>> backend = LocalBackend.from_pretrained("tests/fixtures/clef-golden/checkpoint")  # doctest: +SKIP
    >>> async with backend:  # doctest: +SKIP
    ...     response = await backend.decide(request, timeout=2.0)
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind

from guard._logevery import LogEvery
from guard.backends.base import with_code, with_confidence
from guard.backends.batcher import BatcherConfig, BatcherState, BatchInfo, MicroBatcher
from guard.backends.selftest import (
    SELF_TEST_APART,
    SELF_TEST_REQUEST,
    SELF_TEST_TIMEOUT_S,
    Canary,
    CanaryResult,
    canary_requests,
    check_answers,
    clef_canaries,
    judge_canaries,
    run_self_test,
)
from guard.errors import (
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    GuardError,
    Overloaded,
    RequestValidationError,
)
from guard.systemone import (
    CONFIDENCE_PROFILES,
    ConfidenceProfile,
    QuestionV1,
    SystemOneRequestV1,
    SystemOneResponseV1,
    require_request,
)

if TYPE_CHECKING:
    import torch

    from guard.clef.encoding import EncodedRecord, SchemaRoom
    from guard.clef.model import ClefModel

__all__ = ["DEFAULT_LOCAL_BACKEND_NAME", "LocalBackend"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: ``name`` of a :class:`LocalBackend` unless one is given.
DEFAULT_LOCAL_BACKEND_NAME = "clef-local"
#: Threads that encode requests (tokenization, image decoding): their own pool, so long encodings never take the
#: threads of asyncio's default executor, and at most this many run at once.
ENCODE_THREADS = 4
#: Seconds between the tracebacks logged for failed encodings; the failures between are counted in the next one.
ENCODE_ERROR_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class _Job:
    """What the batcher carries for one request: the request (for the readout), its encoded record and the span
    context it was submitted in (the batch span's parent or link)."""

    request: SystemOneRequestV1
    record: EncodedRecord
    context: SpanContext


def _job_tokens(job: _Job) -> int:
    return len(job.record.input_ids)


class LocalBackend:
    """A loaded :class:`~guard.clef.model.ClefModel` answering System One requests through a micro-batcher.

    Args:
        model: the loaded model (any dtype/device).
        batcher_config: batching limits (:class:`~guard.backends.batcher.BatcherConfig` defaults when ``None``).
        confidence_profile: which ``confidence`` to report (spec §4.1): ``reference`` (top probability),
            ``workers-ai`` or ``jev``.
        max_length: prompt limit in tokens (the model's ``max_length``, 16,384 by default, when ``None``).
        name: the backend's name in errors, logs and verdicts.
        on_batch: called after every forward pass with its :class:`~guard.backends.batcher.BatchInfo` (metrics).
        canaries: the self-test's canaries (:func:`guard.backends.selftest.clef_canaries` when ``None``: the
            answers must depend on the state; ``()`` checks only that answers are well formed).
        tracer_provider: where the ``guard.batch`` spans go (one per forward pass, child of the first request's
            span, linked to the others'); ``None``: the global provider.

    ``start()`` / ``async with`` starts the batcher and warms the model up with a self-test (``decide`` does it on
    first use); the backend is then bound to that event loop.

    Raises:
        ValueError: for an unknown confidence profile, a ``max_length`` below 1, or one below the tokens a question
            of the startup self-test or a canary needs before any state (the message names ``max_length``, the
            least it must be and what needs it).
    """

    def __init__(
        self,
        model: ClefModel,
        *,
        batcher_config: BatcherConfig | None = None,
        confidence_profile: ConfidenceProfile = "reference",
        max_length: int | None = None,
        name: str = DEFAULT_LOCAL_BACKEND_NAME,
        on_batch: Callable[[BatchInfo], None] | None = None,
        canaries: Sequence[Canary] | None = None,
        tracer_provider: Any = None,
    ) -> None:
        if confidence_profile not in CONFIDENCE_PROFILES:
            raise ValueError(f"confidence_profile must be one of {CONFIDENCE_PROFILES}, got {confidence_profile!r}")
        if max_length is not None and (isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
        self.name = name
        self.model = model
        self.confidence_profile: ConfidenceProfile = confidence_profile
        self.max_length = max_length if max_length is not None else model.max_length
        self.batcher: MicroBatcher[_Job, SystemOneResponseV1] = MicroBatcher(
            self._run_batch, tokens=_job_tokens, config=batcher_config, on_batch=on_batch, name=f"{name} queue"
        )
        self.canaries: tuple[Canary, ...] = tuple(clef_canaries() if canaries is None else canaries)
        self._self_test_requests = self._fitting_self_test()
        self._tracer = trace.get_tracer("guard.backends.local", tracer_provider=tracer_provider)
        self._warmup: asyncio.Future[None] | None = None
        self._encoder = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix=f"{name} encode")
        self._prober = ThreadPoolExecutor(1, thread_name_prefix=f"{name} probe")  # probe_encoding's own thread
        self._errors_log = LogEvery(ENCODE_ERROR_LOG_INTERVAL_S)
        self._room: SchemaRoom | None = None  # made on first use (state_room)
        self._canary_jobs: list[tuple[SystemOneRequestV1, EncodedRecord]] = []  # encoded at start
        self._image_canary: tuple[SystemOneRequestV1, EncodedRecord] | None = None  # encoded at start, if any
        from guard.clef.encoding import DEFAULT_MAX_LENGTH  # loaded with the model: no torch import for this module

        # the revision travels in a response header (the worker's), which holds Latin-1 only: a directory name in
        # another script is written with backslash escapes
        model_id = model.model_id.encode("ascii", "backslashreplace").decode("ascii")
        weights = f"{model_id}@{model.revision}"
        if self.max_length != DEFAULT_MAX_LENGTH:
            weights += f"+max_length={self.max_length}"
        # read 2-3 times per decision: made once (the package's digest is read now, not in the first decision)
        self._model_revision = with_confidence(with_code(weights), confidence_profile)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str = "cpu",
        batcher_config: BatcherConfig | None = None,
        confidence_profile: ConfidenceProfile = "reference",
        max_length: int | None = None,
        name: str = DEFAULT_LOCAL_BACKEND_NAME,
        on_batch: Callable[[BatchInfo], None] | None = None,
        canaries: Sequence[Canary] | None = None,
    ) -> LocalBackend:
        """Load a checkpoint directory with :meth:`ClefModel.from_pretrained` and wrap it.

        Args:
            path: the release (or tiny) checkpoint directory.
            dtype: ``torch.bfloat16`` (the reference; default) or ``torch.float32``.
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            batcher_config, confidence_profile, max_length, name, on_batch, canaries: as for the constructor.

        Raises:
            FileNotFoundError: when ``path`` is not a checkpoint directory.
            ValueError: for an unsupported dtype.
        """
        import torch

        from guard.clef.model import ClefModel

        kwargs: dict[str, Any] = {"dtype": dtype if dtype is not None else torch.bfloat16, "device": device}
        if max_length is not None:
            kwargs["max_length"] = max_length
        model = ClefModel.from_pretrained(path, **kwargs)
        return cls(
            model,
            batcher_config=batcher_config,
            confidence_profile=confidence_profile,
            max_length=max_length,
            name=name,
            on_batch=on_batch,
            canaries=canaries,
        )

    def _fitting_self_test(self) -> tuple[SystemOneRequestV1, ...]:
        """The startup self-test's requests within :attr:`max_length`:
        :data:`~guard.backends.selftest.SELF_TEST_REQUEST` when it fits, else its questions one per request
        (:data:`~guard.backends.selftest.SELF_TEST_APART`); for a checkpoint that reads images the first of them must
        fit with the 8x8 PNG of :meth:`probe_encoding` too.

        Raises:
            ValueError: ``max_length`` is below what a request of ``SELF_TEST_APART`` needs before any state, or
                what a canary's request needs with its state whole (a canary's states cut to their head would no
                longer be the benign and the attack one), naming the least ``max_length`` and what needs it.
        """
        from guard.clef.encoding import DEFAULT_MAX_LENGTH, encode_record  # no torch import for this module

        processor = self.model.processor

        def tokens(request: SystemOneRequestV1, state: int | None = 0) -> int:  # with at most ``state`` of its state
            record = encode_record(request, processor, max_length=DEFAULT_MAX_LENGTH, max_state_tokens=state)
            return len(record.input_ids)

        image, with_image = 0, ""  # the probe's PNG, counted from its header (nothing is decoded)
        if processor.image_processor is not None:
            image = processor.image_block_tokens(processor.image_pads((_probe_image(),)))
            with_image = " with an 8x8 PNG"
        needs = []
        for index, request in enumerate(SELF_TEST_APART):  # the probe's PNG goes with the first
            extra, shown = (image, with_image) if index == 0 else (0, "")
            what = f"the self-test's question {request.questions[0].id!r}{shown} takes before any state"
            needs.append((tokens(request) + extra, what))
        for canary in self.canaries:
            what = f"canary {canary.question.id!r} takes with its state"
            needs += [(tokens(request, None), what) for request in canary_requests((canary,))]
        least, what = max(needs)
        if least > self.max_length:
            raise ValueError(
                f"max_length (--max-length) {self.max_length} is below {least}, the tokens {what} in the startup "
                "self-test"
            )
        if tokens(SELF_TEST_REQUEST) + image <= self.max_length:
            return (SELF_TEST_REQUEST,)
        return SELF_TEST_APART

    def __repr__(self) -> str:
        return f"LocalBackend(name={self.name!r}, model={self.model_revision!r}, batcher={self.batcher!r})"

    @property
    def model_revision(self) -> str:
        """``<model_id>@<checkpoint hash>``, then ``+max_length=<tokens>`` when :attr:`max_length` is not the default
        16,384 (a shorter limit reads only the state's head), ``+guard=<digest>``
        (:func:`~guard.backends.base.with_code`: the Clef rendering and readout code) and ``+confidence=<profile>``
        when the confidence profile is not ``reference``: identifies everything an answer depends on (part of the
        cache key, and sent by the worker as ``x-guard-model-revision``). Made when the backend is."""
        return self._model_revision

    def explain(self, question: QuestionV1) -> str | None:
        """``None`` when a request asking ``question`` alone fits :attr:`max_length`; else why not, as the encoder
        refuses it (``questions.<id>.instructions: schema requires at least N tokens before state; maximum is M``).
        :class:`~guard.engine.Guard` asks it for every policy question at load and reload, so a question this model
        cannot read is a policy error (file, line, key), not a refused request on every decision."""
        return self.explain_questions((question,))

    def state_room(self, questions: Sequence[QuestionV1]) -> int:
        """Tokens of state one request asking ``questions`` together (no images) has room for within
        :attr:`max_length`: the most of its state the model reads. Below 0 when the schema alone does not fit. Each
        question's tokens are counted once and remembered (:class:`~guard.clef.encoding.SchemaRoom`), so
        :func:`~guard.engine.plan.group_plans`, weighing the policies matching a request together, tokenizes no
        question twice."""
        room = self._room
        if room is None:
            from guard.clef.encoding import SchemaRoom  # loaded with the model: no torch import for this module

            room = self._room = SchemaRoom(self.model.processor, self.max_length)
        return room(questions)

    def explain_questions(self, questions: Sequence[QuestionV1]) -> str | None:
        """``None`` when one request asking ``questions`` together fits :attr:`max_length` (its schema and the
        prompt's fixed text; the state is cut to the room left); else why not (:meth:`explain`). The schema is
        tokenized only as far as the limit needs (:func:`~guard.clef.encoding.schema_ids`). Asked for a policy's
        questions at load; :func:`~guard.engine.plan.group_plans` weighs policies together by :meth:`state_room`."""
        request = SystemOneRequestV1(model="", state="", questions=tuple(questions))
        try:
            self.model.encode(request, max_length=self.max_length)
        except RequestValidationError as exc:
            return str(exc)
        return None

    # ---------------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the batcher on the running event loop, then warm up with the decision worker's startup self-test
        (:func:`guard.backends.selftest.run_self_test`: one fixed request with a noul, a choice and a score question,
        each in a request of its own where :attr:`max_length` is too short for them together, must come back with
        finite probabilities summing to 1, then every canary's benign and attack states must be
        answered apart by its margin, so a degenerate model, such as a zeroed head answering 0.5 to everything, never
        starts). The first forward pass sets up kernels and
        allocators and can take seconds, so start the backend before timing decisions; ``decide`` starts it on first
        use, inside that call's deadline. Idempotent while open; concurrent callers wait for the same warm-up.

        Raises:
            BackendUnavailable: the self-test failed (``reason="self_test_failed"``; the message names the question
                and, for a canary, both values and the margin); the backend is closed.
            RuntimeError: when the backend was closed.
        """
        if self.batcher.state is BatcherState.UNOPENED:
            await self.batcher.start()
            self._warmup = asyncio.ensure_future(self._self_test())
        elif self.batcher.state is not BatcherState.RUNNING:
            raise RuntimeError(f"LocalBackend {self.name!r} is closed; create a new one.")
        if self._warmup is not None:
            await asyncio.shield(self._warmup)

    async def _self_test(self) -> None:
        try:
            self._canary_jobs = [(request, await self._encode(request, SELF_TEST_TIMEOUT_S))
                                 for request in canary_requests(self.canaries)]
            self._image_canary = await self._encode_image_canary()
            await run_self_test(self, requests=self._self_test_requests)
            await self.run_canaries(timeout=SELF_TEST_TIMEOUT_S)
        except Exception as exc:
            await self.batcher.aclose()
            raise BackendUnavailable(
                f"backend {self.name!r} failed its startup self-test: {type(exc).__name__}: {exc}",
                backend=self.name,
                reason="self_test_failed",
            ) from exc

    async def _encode_image_canary(self) -> tuple[SystemOneRequestV1, EncodedRecord] | None:
        """For a checkpoint that reads images, the first of the startup self-test's requests with one 8x8 PNG
        (:func:`_probe_image`) and its record, encoded at start for :meth:`run_canaries` and :meth:`probe_encoding`;
        ``None`` for one that reads none. :meth:`_fitting_self_test` made sure it fits :attr:`max_length`."""
        if self.model.processor.image_processor is None:
            return None
        request = self._self_test_requests[0].override(images=(_probe_image(),))
        return request, await self._encode(request, SELF_TEST_TIMEOUT_S)

    async def aclose(self) -> None:
        """Let a startup self-test still running finish (its outcome went to whoever awaited :meth:`start`), finish
        queued requests, then stop the inference thread and the encoding threads (an encoding still running finishes
        on its own). Idempotent. The model stays loaded."""
        if self._warmup is not None:
            await asyncio.gather(self._warmup, return_exceptions=True)
        await self.batcher.aclose()
        self._encoder.shutdown(wait=False)  # queued encodings still run, then meet the closed batcher
        self._prober.shutdown(wait=False)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def run_canaries(self, *, timeout: float) -> list[CanaryResult]:
        """Ask :attr:`canaries` as :func:`~guard.backends.selftest.run_canaries` does, one request at a time within
        ``timeout`` seconds in all, from records encoded once at start: each goes straight to the batcher, so a run
        waits only for the queue and the forward passes, never for an encoding thread behind clients' encodings. With
        a checkpoint that reads images, the first self-test request with an 8x8 PNG (encoded at start too) is asked last,
        its answer checked as the self-test's is (:func:`~guard.backends.selftest.check_answers`), so a vision tower
        that fails fails the run.

        Raises:
            CanaryFailed: a canary did not pass.
            ValueError: the image canary's answer is not a distribution per question.
            BackendError: as :meth:`decide` raises it.
        """
        async with asyncio.timeout(timeout):
            answers = [await self._submit(request, record, timeout, timeout) for request, record in self._canary_jobs]
            if self._image_canary is not None:
                request, record = self._image_canary
                check_answers(request, await self._submit(request, record, timeout, timeout))
        return judge_canaries(self.canaries, answers)

    async def probe_encoding(self, *, timeout: float) -> None:
        """Encode the startup self-test's requests now (:data:`~guard.backends.selftest.SELF_TEST_REQUEST`, or its
        questions apart where :attr:`max_length` is too short for them together), and with a checkpoint that reads
        images the first of them with one 8x8 PNG (:func:`_probe_image`, the image canary's request), within
        ``timeout`` seconds, on a thread of its own (never one of the clients' encoding threads, which slow or failing
        requests may hold): whether the tokenizer and processor, its image path included, still work, which :meth:`run_canaries`, from records encoded
        at start, does not tell. A probe still running when the next starts holds the thread: the next waits for it.

        Raises:
            BackendUnavailable: the encoding failed (``reason="inference_failed"``; the error is its cause).
            TimeoutError: it did not finish within ``timeout``.
        """
        requests = list(self._self_test_requests)
        if self._image_canary is not None:
            requests.append(self._image_canary[0])

        def encode() -> None:
            try:
                for request in requests:
                    self.model.encode(request, max_length=self.max_length)
            except BaseException as exc:  # a tokenizer panic included (a BaseException)
                raise BackendUnavailable(
                    f"encoding failed in {self.name!r}: {type(exc).__name__}", backend=self.name,
                    reason="inference_failed",
                ) from exc

        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._prober, encode), timeout)

    def _log_encoding_error(self, exc: BaseException) -> None:
        """Log a failed encoding's traceback, at most one every :data:`ENCODE_ERROR_LOG_INTERVAL_S` (the next one
        counts those left out), so a model whose every encoding fails does not flood the log."""
        unlogged = self._errors_log.due()
        if unlogged is None:
            return
        logger.error("encoding failed in %r (%d more failed since the last one logged)", self.name, unlogged,
                     exc_info=exc)

    # -------------------------------------------------------------------------------------------------------- decide

    async def decide(
        self, request: SystemOneRequestV1, *, timeout: float | None = None, hold: Callable[[int], None] | None = None
    ) -> SystemOneResponseV1:
        """Answer every question of ``request`` (spec §2-§4), batched with concurrent callers.

        Args:
            request: a validated request.
            timeout: seconds for encoding, queueing and compute together; ``None`` waits for the answer.
            hold: called with the bytes the request's media tensors will hold
                (:attr:`~guard.clef.encoding.EncodedRecord.media_bytes`; 4 images of 1,024 tokens are 96 MiB of
                ``pixel_values``), counted from the images' headers before any is decoded or the encoding is
                dispatched, and held until answered; an :class:`~guard.errors.Overloaded` it raises refuses the
                request as a full queue does, before any decoding (the worker counts them with the request bodies in
                memory).

        Returns:
            The response: ``model`` echoed from the request, answers in request order (unrounded; the wire rounds),
            ``usage.input_tokens`` = prompt length.

        Raises:
            BackendRejected: the request cannot be encoded (its schema alone exceeds ``max_length``, or an image
                cannot be decoded); ``status_code`` 422 and ``detail`` the field errors.
            BackendTimeout: no answer within ``timeout``; a request still queued at its deadline is never computed.
            BackendUnavailable: the queue is full or ``hold`` refused (``reason="overloaded"``, ``retry_after``
                set), the backend is closed (``reason="closed"``), or the encoding or the forward pass failed
                (``reason="inference_failed"``).
            MalformedAnswer: the model produced a non-finite probability.
            RuntimeError: called from another event loop than the one the backend started on.
            TypeError: ``request`` is not a :class:`~guard.systemone.SystemOneRequestV1`.
        """
        request = require_request(request, f"{self.name}: decide()")
        started = time.monotonic()
        if self.batcher.state is BatcherState.UNOPENED:
            await self.start()
        elif self.batcher.state is not BatcherState.RUNNING:
            raise BackendUnavailable(f"backend {self.name!r} is closed", backend=self.name, reason="closed")
        if self.batcher.loop is not asyncio.get_running_loop():
            raise RuntimeError(
                f"LocalBackend {self.name!r} was started on another event loop; use one backend per event loop."
            )
        record = await self._encode(
            request, None if timeout is None else timeout - (time.monotonic() - started), hold
        )
        remaining = None
        if timeout is not None:
            remaining = timeout - (time.monotonic() - started)
            if remaining <= 0:
                raise BackendTimeout(f"encoding took longer than the {timeout * 1000:g} ms deadline", backend=self.name)
        return await self._submit(request, record, remaining, timeout)

    async def _submit(
        self,
        request: SystemOneRequestV1,
        record: EncodedRecord,
        remaining: float | None,
        timeout: float | None,
    ) -> SystemOneResponseV1:
        """Queue ``record`` for the forward pass and its readout, within ``remaining`` seconds (of the call's
        ``timeout``, which errors name); the batcher's and the model's errors as :meth:`decide` raises them."""
        try:
            job = _Job(request, record, trace.get_current_span().get_span_context())
            return await self.batcher.submit(job, timeout=remaining)
        except Overloaded as exc:
            raise BackendUnavailable(
                str(exc), backend=self.name, reason="overloaded", retry_after=exc.retry_after
            ) from exc
        except BackendTimeout as exc:
            raise BackendTimeout(
                f"no answer from {self.name!r} within {(timeout or 0.0) * 1000:g} ms", backend=self.name
            ) from exc
        except GuardError:
            raise
        except RuntimeError as exc:
            if self.batcher.state is not BatcherState.RUNNING:
                raise BackendUnavailable(
                    f"backend {self.name!r} closed before answering", backend=self.name, reason="closed"
                ) from exc
            raise BackendUnavailable(
                f"inference failed in {self.name!r}: {exc}", backend=self.name, reason="inference_failed"
            ) from exc
        except Exception as exc:
            raise BackendUnavailable(
                f"inference failed in {self.name!r}: {type(exc).__name__}: {exc}",
                backend=self.name,
                reason="inference_failed",
            ) from exc

    async def _encode(
        self, request: SystemOneRequestV1, remaining: float | None, hold: Callable[[int], None] | None = None
    ) -> EncodedRecord:
        """Tokenize on an encoding thread within ``remaining`` seconds (``None``: no limit), once ``hold`` took, on the
        event loop, the bytes its images' tensors will hold (counted first on an encoding thread from their headers,
        after checking that the images fit the prompt beside the request's schema, :meth:`state_room`); turn the
        model's refusals into ``BackendRejected``.

        Raises:
            BackendRejected: an image's header cannot be read, the images take more tokens than the prompt has room
                for beside the schema (before ``hold``), or the model refused the request (422).
            BackendTimeout: the encoding did not finish in time; the caller is answered now (a thread already
                encoding runs on, one not yet started never does).
            BackendUnavailable: the encoding failed otherwise (``reason="inference_failed"``): a tokenizer panic
                (pyo3's ``PanicException`` is a ``BaseException``), ``MemoryError``, a bug; logged with its traceback
                (at most one every :data:`ENCODE_ERROR_LOG_INTERVAL_S`); or ``hold`` refused the images' bytes
                (``reason="overloaded"``).
        """
        started = threading.Event()

        def on_thread(work: Callable[[], _T]) -> _T:
            started.set()
            try:
                return work()
            except ValueError:  # the request's fault (RequestValidationError is one): refused below
                raise
            except BaseException as exc:  # on this thread no signal or cancellation arrives: only the model's errors
                self._log_encoding_error(exc)
                raise BackendUnavailable(
                    f"encoding failed in {self.name!r}: {type(exc).__name__}", backend=self.name,
                    reason="inference_failed",
                ) from exc

        loop = asyncio.get_running_loop()
        try:
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                if hold is not None and request.images:
                    size = await loop.run_in_executor(self._encoder, on_thread, lambda: self._image_bytes(request))
                    if size is not None:
                        hold(size)
                return await loop.run_in_executor(
                    self._encoder, on_thread, lambda: self.model.encode(request, max_length=self.max_length)
                )
        except TimeoutError:
            doing = "encoding the state" if started.is_set() else f"waiting for one of the {ENCODE_THREADS} encoding threads"
            raise BackendTimeout(f"the deadline passed while {doing}", backend=self.name) from None
        except Overloaded as exc:
            raise BackendUnavailable(
                str(exc), backend=self.name, reason="overloaded", retry_after=exc.retry_after
            ) from exc
        except RequestValidationError as exc:
            raise BackendRejected(
                str(exc), backend=self.name, status_code=422, detail=[e.to_json() for e in exc.errors]
            ) from exc
        except ValueError as exc:
            raise BackendRejected(
                f"request cannot be encoded: {exc}",
                backend=self.name,
                status_code=422,
                detail=[{"field": "body", "message": str(exc)}],
            ) from exc

    def _image_bytes(self, request: SystemOneRequestV1) -> int | None:
        """The bytes the tensors of ``request``'s images will hold, counted from their headers, once the images are
        known to fit the prompt beside the schema (images that never can are a 422 here, not a 429 from the hold);
        ``None`` for a schema that does not fit, which holds nothing, the encoding refusing it before any image is
        decoded. Tokenizes the questions (:meth:`state_room`): run on an encoding thread."""
        room = self.state_room(request.questions)
        if room < 0:
            return None
        processor = self.model.processor
        pads = processor.image_pads(request.images)
        processor.check_image_room(pads, room)
        return processor.image_tensor_bytes(pads)

    def _run_batch(self, jobs: Sequence[_Job]) -> list[SystemOneResponseV1]:
        """On the inference thread: one batched forward for ``jobs``, then each record's readout (in a
        ``guard.batch`` span when a request was traced)."""
        traced = [job.context for job in jobs if job.context.is_valid]
        if not traced:
            return self._forward(jobs)
        parent = trace.set_span_in_context(NonRecordingSpan(traced[0]))
        attributes = {"guard.batch.size": len(jobs), "guard.batch.tokens": sum(len(j.record.input_ids) for j in jobs)}
        with self._tracer.start_as_current_span(
            "guard.batch", context=parent, kind=SpanKind.INTERNAL, links=[Link(c) for c in traced[1:]],
            attributes=attributes,
        ):  # fmt: skip
            return self._forward(jobs)

    def _forward(self, jobs: Sequence[_Job]) -> list[SystemOneResponseV1]:
        logits = self.model.forward_records([job.record for job in jobs])
        return [
            self.model.answer(job.request, job.record, per_question, confidence_profile=self.confidence_profile)
            for job, per_question in zip(jobs, logits, strict=True)
        ]


@functools.cache
def _probe_image() -> dict[str, str]:
    """One 8x8 PNG as clients send images (``{content_type, base64}``): the image of the image canary and of the live
    encoding probe (:meth:`LocalBackend.probe_encoding`) for a checkpoint that reads images."""
    from PIL import Image  # only for a checkpoint with an image processor

    out = io.BytesIO()
    Image.new("RGB", (8, 8), "gray").save(out, format="PNG")
    return {"content_type": "image/png", "base64": base64.b64encode(out.getvalue()).decode()}
