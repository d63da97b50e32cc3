"""The decision worker: System One over HTTP from an in-process, micro-batched Clef (``guard worker serve``).

Routes:

* ``POST /v1/systemone``: the System One API (spec §5). With ``api_keys`` configured it needs ``Authorization:
  Bearer <key>`` (401 otherwise), sent once (400 ``repeated_header`` when sent twice, whichever copy is valid).
  Body capped (413, also after undoing a ``Content-Encoding`` of gzip, deflate, br or zstd; any other coding is a
  415), ``Content-Type`` ``application/json`` (or a ``+json`` type) or
  ``multipart/form-data`` with image parts named by ``assets`` (TypeSafe's SDK); any other or no type is a 415, so a
  browser page cannot post to it without a CORS preflight. Images are checked from their headers before decoding:
  more than ``max_image_pixels`` is a 413 ``image_too_large``, bytes of another format than declared a
  422; every image error names the asset (``assets.<name>``) when the image came as one. Strict JSON (400 for non-JSON, duplicate keys, NaN), validated with the ``workers-ai``
  profile by default (422 naming every bad field), answered through
  :class:`~guard.backends.local.LocalBackend` (batched with concurrent requests). The caller's deadline comes from
  the ``x-request-timeout-ms`` header (default 30 s; sent twice, a 400 ``repeated_header``); a request still queued at its deadline, or whose client
  disconnected, is dropped before compute. A full queue answers 429 (or 503) with ``Retry-After`` at once, before the
  body is read, and so does any request while the request bodies in memory (counted as their bytes arrive, held until
  the request is answered; a compressed body's decoded bytes from its decoding) are at ``max_pending_body_bytes``; a
  body whose bytes, or decoded bytes, would pass it is refused the same way, and so is a request whose images' pixel tensors, once encoded, would (counted from the images' headers before any
  is decoded, they count from then until the answer; a request alone may pass the limit, so one larger than it is
  still served). A body that
  sends nothing for ``body_idle_timeout_s`` is a 408 ``body_timeout``. At most
  :data:`INTAKE_THREADS` bodies are decoded and parsed at a time, and a JSON document of more than
  :data:`MAX_JSON_CONTAINERS` arrays and objects is a 400 ``invalid_json`` (json's parser holds the GIL: 8 MiB of
  ``[]`` stalled ``/healthz`` for seconds). A ``model``
  the worker does not serve is a 404 ``model_not_found``. A state cut to fit ``max_length`` is reported in
  ``usage.state_tokens_dropped`` (never silently).
* ``GET /v1/models``: TypeSafe Jev's ``{"models": [{"name", "description", "release_date", ...}]}`` and OpenAI's
  ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}`` in one body.
* ``GET /v1/models/{id}``: one model, both shapes' fields (404 ``model_not_found`` for another name).
* ``GET /healthz``: 200 while the process is alive (503 once loading the model or the self-test failed, or while the
  inference thread looks hung: :data:`HUNG_CANARY_RUNS` canary runs in a row unfinished within ``canary_timeout_s``
  with no forward pass finished).
* ``GET /readyz``: 200 only after the model loaded and the startup self-test passed (a fixed request answered with
  finite probabilities summing to 1, and the canaries' benign and attack states answered apart by their margin,
  :mod:`guard.backends.selftest`), and while the canaries, run again every ``canary_interval_s``, keep passing;
  503 ``canary_failed`` (and ``POST /v1/systemone`` answers 503) while they fail or the inference thread looks hung,
  or while the encoding fails: :data:`FAILED_ENCODINGS_TO_PROBE` requests in a row answered 503 ``unavailable``
  (counted apart for requests with images and without) have the worker encode a canary request live, and its failing takes the worker out until a canary run's live encoding
  passes; its passing runs the canaries at once (a forward pass that fails takes the worker out until a run passes).
* ``GET /metrics``: Prometheus text of the OpenTelemetry metrics (:mod:`guard.worker.metrics`).

Tracing: every ``POST /v1/systemone`` is a SERVER span (``POST /v1/systemone``) continuing the caller's W3C
``traceparent``, with ``gen_ai.operation.name`` ``text_completion`` (see :mod:`guard.engine.telemetry` for why),
``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``http.response.status_code`` and ``error.type`` on a refusal;
the forward pass that answers it is its child ``guard.batch`` span (:class:`~guard.backends.local.LocalBackend`).

A request with both ``Content-Length`` and ``Transfer-Encoding``, on any route, is a 400 ``ambiguous_length`` and its
connection is closed; one sending ``Content-Type`` more than once, on any route, is a 400 ``repeated_header``.

``/healthz``, ``/readyz`` and ``/metrics`` need no key (probes and scrapers). No input gets a 500: every refusal is a 4xx JSON ``{code, message, field, errors}``. Every response carries
``x-request-id``: the caller's (when it is 1 to 128 visible ASCII characters) or a new one.

Example:
    >>> app = create_app(lambda: LocalBackend.from_pretrained("/models/clef-flash", device="cuda"))  # doctest: +SKIP
    >>> uvicorn.run(app, host="0.0.0.0", port=8000)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from guard._body import BodyBytes, BodyShare, declared_length, read_body
from guard._close import CLOSE_TIMEOUT_S, close_within
from guard._headers import sole_header
from guard._json import loads
from guard._rootpath import route_path
from guard._tracecontext import quietly
from guard.backends.selftest import CanaryFailed
from guard.errors import (
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    BodyError,
    FieldError,
    GuardError,
    InvalidJson,
    MalformedAnswer,
    Overloaded,
    RequestValidationError,
)
from guard.systemone import MAX_IMAGE_PIXELS, MAX_IMAGES, SystemOneRequestV1, ValidationProfile
from guard.worker import _http, _intake
from guard.worker.metrics import PROMETHEUS_CONTENT_TYPE, WorkerMetrics

if TYPE_CHECKING:
    from guard.backends.batcher import BatchInfo
    from guard.backends.local import LocalBackend

__all__ = [
    "DEFAULT_BODY_IDLE_TIMEOUT_S",
    "DEFAULT_CANARY_INTERVAL_S",
    "DEFAULT_CANARY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PENDING_BODY_BYTES",
    "DEFAULT_TIMEOUT_S",
    "INTAKE_THREADS",
    "MAX_JSON_CONTAINERS",
    "MAX_TIMEOUT_S",
    "WorkerConfig",
    "WorkerPhase",
    "create_app",
]

logger = logging.getLogger("guard.worker")

#: Largest accepted request body (Workers AI documents 13 MiB; decision requests are far smaller).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Bytes of request bodies held in memory at once, from their arrival until their requests are answered, with the
#: pixel tensors of their images: the body cap plus 128 MiB, so one request of four images of 1,024 tokens (96 MiB of
#: tensors) is served beside other traffic (seventeen bodies at the default cap, thousands of typical ones).
DEFAULT_MAX_PENDING_BODY_BYTES = DEFAULT_MAX_BODY_BYTES + 128 * 1024 * 1024
#: Longest a request body may send nothing before it is a 408 (a stalled upload gives back what it holds).
DEFAULT_BODY_IDLE_TIMEOUT_S = 10.0
#: Deadline of a request that sends no ``x-request-timeout-ms``.
DEFAULT_TIMEOUT_S = 30.0
#: Longest deadline a caller may ask for.
MAX_TIMEOUT_S = 300.0
#: Seconds between canary runs once ready.
DEFAULT_CANARY_INTERVAL_S = 60.0
#: Seconds a periodic canary run (four short requests, one at a time) may take: a run that does not finish in time
#: counts towards a hung inference thread only when no forward pass finished meanwhile, so this bounds how long a
#: hang goes unseen, not how long a busy worker may take.
DEFAULT_CANARY_TIMEOUT_S = 10.0
#: Most arrays and objects a request's JSON may hold (brackets counted before parsing): a state has at most a few
#: thousand (the model reads 16,384 tokens at most); 8 MiB of ``[]`` hold 2.8 million and take the parser half a
#: second with the GIL held.
MAX_JSON_CONTAINERS = 65_536
#: Request bodies decoded and parsed at once (each on a thread); the others wait, within their deadline.
INTAKE_THREADS = 2
#: ``Retry-After`` while the model is loading.
NOT_READY_RETRY_AFTER_S = 5.0
#: Periodic canary runs in a row that do not finish, with no forward pass finished since the run before, after which
#: the inference thread counts as hung: the worker is unready and ``/healthz`` 503, so an orchestrator restarts it.
HUNG_CANARY_RUNS = 2
#: Requests in a row whose encoding or forward pass failed (503 ``unavailable`` or ``malformed_answer``; a client's
#: 4xx is not counted), with none answered between, counted apart for requests with images and without (a text
#: request answered says nothing of the image path), after which the worker encodes a canary request live
#: (``probe_encoding``): if that fails too, the worker is unready until a periodic canary run's live encoding passes;
#: if it passes, the canaries run at once (a failing forward pass makes the worker unready).
FAILED_ENCODINGS_TO_PROBE = 5
DEFAULT_DESCRIPTION = "Clef decision model (System One API) served by guard"

_PROFILES: tuple[str, ...] = get_args(ValidationProfile)


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker serves requests (the batching limits live in the backend's ``BatcherConfig``).

    Attributes:
        validation_profile: ``workers-ai`` (hosted limits, unknown fields refused) or ``reference``.
        max_body_bytes: largest request body; more is a 413.
        max_pending_body_bytes: most bytes of request bodies held in memory at once, counted as they arrive and held
            until the request is answered (parsed, it waits for encoding and compute holding as much memory or
            more; a compressed body counts its decoded size once decoded, in place of the bytes received when
            larger), with their images' pixel tensors; while they are at it a new request is refused as a full queue
            is, and so is a body whose next bytes, or decoded bytes, would pass it. At least ``max_body_bytes``; the worker logs a
            warning at start when it is below one request of four images at the largest size with its body at
            ``max_body_bytes``.
        body_idle_timeout_s: most seconds a request body may send nothing (408 ``body_timeout``).
        default_timeout_s: deadline when the request has no ``x-request-timeout-ms`` header.
        max_timeout_s: cap on the header's deadline.
        overload_status: 429 or 503, the status of a full queue (both with ``Retry-After``).
        model_name: the name listed by ``GET /v1/models`` (the checkpoint directory name when ``None``).
        model_aliases: other names requests may use for the model (listed too); any other name is a 404.
        description: its description there.
        release_date: ``YYYY-MM-DD`` listed as the model's release date (default: the date its weights were written,
            else the date the worker loaded it).
        api_keys: bearer keys accepted on ``/v1/*`` (empty: no authentication; ``guard worker serve`` refuses that
            on a non-loopback address unless ``--insecure-no-auth``).
        max_image_pixels: largest image (width x height) accepted, checked from the image header before decoding.
        canary_interval_s: seconds between canary runs once ready (0: only at start-up).
        canary_timeout_s: seconds one periodic canary run may take (the startup self-test has its own
            :data:`~guard.backends.selftest.SELF_TEST_TIMEOUT_S`); a hung inference thread is seen within 2 to 3 times
            ``canary_interval_s + canary_timeout_s``.

    Raises:
        ValueError: naming the field, the value and what is allowed.
    """

    validation_profile: ValidationProfile = "workers-ai"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending_body_bytes: int = DEFAULT_MAX_PENDING_BODY_BYTES
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    max_timeout_s: float = MAX_TIMEOUT_S
    body_idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S
    overload_status: int = 429
    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    description: str = DEFAULT_DESCRIPTION
    release_date: str | None = None
    api_keys: tuple[str, ...] = ()
    max_image_pixels: int = _intake.DEFAULT_MAX_IMAGE_PIXELS
    canary_interval_s: float = DEFAULT_CANARY_INTERVAL_S
    canary_timeout_s: float = DEFAULT_CANARY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.validation_profile not in _PROFILES:
            raise ValueError(
                f"WorkerConfig.validation_profile must be one of {_PROFILES}, got {self.validation_profile!r}"
            )
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"WorkerConfig.max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        pending = self.max_pending_body_bytes
        if isinstance(pending, bool) or not isinstance(pending, int) or pending < self.max_body_bytes:
            raise ValueError(f"WorkerConfig.max_pending_body_bytes must be an integer >= WorkerConfig.max_body_bytes "
                             f"({self.max_body_bytes}), got {pending!r}")
        for name in ("default_timeout_s", "max_timeout_s", "body_idle_timeout_s", "canary_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"WorkerConfig.{name} must be a finite number of seconds > 0, got {value!r}")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"WorkerConfig.default_timeout_s ({self.default_timeout_s:g}) exceeds max_timeout_s "
                f"({self.max_timeout_s:g})"
            )
        if isinstance(self.model_aliases, str) or not all(isinstance(a, str) and a for a in self.model_aliases):
            raise ValueError(
                f"WorkerConfig.model_aliases must be a tuple of non-empty names, got {self.model_aliases!r}"
            )
        if self.release_date is not None:
            try:
                datetime.date.fromisoformat(self.release_date)
            except (TypeError, ValueError):
                raise ValueError(
                    f"WorkerConfig.release_date must be a YYYY-MM-DD date, got {self.release_date!r}"
                ) from None
        if isinstance(self.api_keys, str) or not all(isinstance(k, str) and len(k) >= 16 for k in self.api_keys):
            raise ValueError("WorkerConfig.api_keys must be a tuple of keys of at least 16 characters each")
        if (
            isinstance(self.max_image_pixels, bool)
            or not isinstance(self.max_image_pixels, int)
            or (self.max_image_pixels < 1)
        ):
            raise ValueError(f"WorkerConfig.max_image_pixels must be an integer >= 1, got {self.max_image_pixels!r}")
        if self.max_image_pixels > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"WorkerConfig.max_image_pixels must be at most {MAX_IMAGE_PIXELS} (what the backend decodes), got "
                f"{self.max_image_pixels}"
            )
        interval = self.canary_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not math.isfinite(interval)
            or (interval < 0)
        ):
            raise ValueError(f"WorkerConfig.canary_interval_s must be a number of seconds >= 0, got {interval!r}")
        if self.overload_status not in (429, 503):
            raise ValueError(f"WorkerConfig.overload_status must be 429 or 503, got {self.overload_status!r}")


class WorkerPhase(enum.Enum):
    """Where the worker is: ``LOADING -> READY -> STOPPING``, or ``FAILED`` if loading or the self-test failed;
    ``UNREADY`` while a periodic canary run fails (back to ``READY`` when one passes)."""

    LOADING = "loading"
    READY = "ready"
    UNREADY = "unready"
    FAILED = "failed"
    STOPPING = "stopping"


def _unfinished(exc: BaseException) -> bool:
    """Whether a canary run ended without an answer for want of capacity (a full queue: ``Overloaded``, or the
    backend's ``BackendUnavailable`` with reason ``overloaded``; a time-out), which says nothing of the model."""
    if isinstance(exc, BackendUnavailable):
        return exc.reason == "overloaded"
    return isinstance(exc, Overloaded | BackendTimeout | TimeoutError)


class _Runtime:
    """The worker's state (held in ``app.state.worker``): backend, phase, metrics."""

    def __init__(
        self,
        source: LocalBackend | Callable[[], LocalBackend],
        config: WorkerConfig,
        metrics: WorkerMetrics,
        tracer_provider: Any = None,
    ) -> None:
        self.source = source
        self.config = config
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.tracer = trace.get_tracer("guard.worker", tracer_provider=tracer_provider)
        self.backend: LocalBackend | None = None
        self.phase = WorkerPhase.LOADING
        self.error: str | None = None
        self.canary_error: str | None = None
        self.canary_runs = 0
        self.passes = 0  # forward passes finished (or failed), counted by the batcher's on_batch hook
        self.stalled_runs = 0  # canary runs in a row that did not finish while no forward pass finished
        # requests in a row whose encoding or forward pass failed, none answered between, with images (True) and not
        self.model_failures = {False: 0, True: 0}
        self.encoding_broken = False  # a live encoding failed: unready until one passes
        self._probe: asyncio.Task[None] | None = None
        self.intake = asyncio.Semaphore(INTAKE_THREADS)  # bodies decoded and parsed at once
        self.body_bytes = BodyBytes(config.max_pending_body_bytes)  # request bodies in memory, until answered
        metrics.bind_body_bytes(lambda: self.body_bytes.held)
        self._passes_seen = 0
        self.loaded_on = datetime.datetime.now(datetime.UTC).date()

    async def boot(self) -> None:
        """Load the backend (on a thread) and start it (batcher and self-test, ``LocalBackend.start``); set the phase
        accordingly."""
        try:
            source = self.source
            backend = source if not callable(source) else await asyncio.to_thread(source)
            self.backend = backend
            self.loaded_on = datetime.datetime.now(datetime.UTC).date()
            self._attach_metrics(backend)
            await backend.start()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.phase = WorkerPhase.FAILED
            logger.error("worker failed to become ready: %s", self.error)
            logger.debug("the load failed here", exc_info=exc)
            return
        if self.phase is WorkerPhase.LOADING:
            self.phase = WorkerPhase.READY
            logger.info("worker ready: %s", backend.model_revision)
            self._warn_if_images_crowded(backend)
        if self.watched(backend):
            await self._watch(backend)

    def _warn_if_images_crowded(self, backend: LocalBackend) -> None:
        """Log a warning when ``max_pending_body_bytes`` is below what one request of :data:`MAX_IMAGES` images of
        the largest size the processor keeps holds (its body at the cap and its pixel tensors): such a request is
        then served only while no other request holds a byte, so never under steady traffic."""
        need = self.config.max_body_bytes + MAX_IMAGES * backend.model.processor.max_image_tensor_bytes()
        if need > self.config.max_pending_body_bytes:
            logger.warning(
                "max_pending_body_bytes (--max-pending-body-bytes) is %d bytes, below the %d one request of %d "
                "images at the largest size holds with its body at max_body_bytes: such requests are served only "
                "while no other request is in memory", self.config.max_pending_body_bytes, need, MAX_IMAGES,
            )

    def answered(self, images: bool) -> None:
        """A request (``images``: one with images) was answered: the encoding and forward pass of its kind work."""
        self.model_failures[images] = 0

    def failed(self, backend: LocalBackend, images: bool) -> None:
        """A request's (``images``: one with images) encoding or forward pass failed (not the client's fault): at
        :data:`FAILED_ENCODINGS_TO_PROBE` in a row of its kind, however many of the other kind were answered between,
        probe the encoding live and, that passing, run the canaries (a forward pass) at once, not at the next
        periodic run (one probe at a time, and only while canary runs go on, which probe it again while it is
        broken)."""
        self.model_failures[images] += 1
        if (
            self.model_failures[images] >= FAILED_ENCODINGS_TO_PROBE
            and (self._probe is None or self._probe.done())
            and self.watched(backend)
        ):
            self._probe = asyncio.ensure_future(self._probe_failures(backend))

    async def _probe_failures(self, backend: LocalBackend) -> None:
        """The probe after failed requests: the live encoding, then, if it works, one canary run (a forward pass that
        fails makes the worker unready now; one that passes leaves it ready)."""
        await self.probe_encoding(backend)
        if not self.encoding_broken:
            await self.check_canaries(backend, periodic=False)

    def watched(self, backend: LocalBackend) -> bool:
        """Whether canary runs go on once ready (``canary_interval_s`` > 0 and the backend has canaries)."""
        return self.config.canary_interval_s > 0 and bool(backend.canaries)

    async def probe_encoding(self, backend: LocalBackend) -> None:
        """Encode a canary request live within ``canary_timeout_s``
        (:meth:`~guard.backends.local.LocalBackend.probe_encoding`): a failure makes the worker unready (``encoding
        failed: <error type>: <message>``; the first of a run of failures logged with its traceback) until a probe
        passes; one that does not finish in time says nothing (a busy worker);
        one that passes forgets the failures counted (of both kinds)."""
        try:
            await backend.probe_encoding(timeout=self.config.canary_timeout_s)
        except TimeoutError:
            logger.warning("live encoding probe not completed within %g s; readiness unchanged",
                           self.config.canary_timeout_s)
        except BackendUnavailable as exc:
            cause = exc.__cause__ or exc
            if not self.encoding_broken:
                logger.error("live encoding probe failed", exc_info=cause)
            self.encoding_broken = True
            self._unready(f"encoding failed: {type(cause).__name__}: {cause}")
        else:
            self.model_failures = {False: 0, True: 0}
            self.encoding_broken = False

    async def _watch(self, backend: LocalBackend) -> None:
        """Run the backend's canaries every ``canary_interval_s``; a failure makes the worker ``UNREADY`` (no
        answers, ``/readyz`` 503) until a run passes."""
        self._passes_seen = self.passes
        while self.phase in (WorkerPhase.READY, WorkerPhase.UNREADY):
            await asyncio.sleep(self.config.canary_interval_s)
            await self.check_canaries(backend)

    @property
    def hung(self) -> bool:
        """Whether the inference thread looks hung (:data:`HUNG_CANARY_RUNS`)."""
        return self.stalled_runs >= HUNG_CANARY_RUNS

    async def check_canaries(self, backend: LocalBackend, *, periodic: bool = True) -> None:
        """One canary run, within ``canary_timeout_s``; sets the phase (``READY`` or ``UNREADY``) and
        ``canary_error``. Answers that fail the margin, and a model that cannot answer at all (a malformed answer such
        as NaN, a failed encoding or forward pass, any other error, logged with its traceback), make the worker
        unready. A run that does not finish (overloaded, timed out) says nothing while forward passes still finish (a
        busy worker); :data:`HUNG_CANARY_RUNS` periodic ones in a row with none finished make it unready and
        :attr:`hung`. A run that is not ``periodic`` (the probe's after failed requests, which may overlap a periodic
        one and see the same slow pass) that does not finish says nothing.
        The canaries' records (with a checkpoint that reads images, an image canary's too, which passes the vision
        tower) were encoded at start and go straight to the batcher
        (:meth:`~guard.backends.local.LocalBackend.run_canaries`), so a run that does not finish waited on the queue
        and the forward passes alone: clients' encodings (slow, or refused, computing nothing) never make a run late.
        While a live encoding failed (:meth:`probe_encoding`), each run probes it first and the worker stays unready
        until a probe passes.
        """
        if self.encoding_broken:
            await self.probe_encoding(backend)
        try:
            await backend.run_canaries(timeout=self.config.canary_timeout_s)
        except Exception as exc:  # whatever ends a run is seen: an error that escaped stopped the runs for good
            if _unfinished(exc) and not periodic:
                logger.warning("canary run after failed requests not completed (%s: %s); readiness unchanged",
                               type(exc).__name__, exc)
                return
            if _unfinished(exc):
                self.stalled_runs = 0 if self.passes != self._passes_seen else self.stalled_runs + 1
                if self.hung:
                    self._unready(
                        f"no forward pass finished during the last {self.stalled_runs} canary runs (the last ended "
                        f"in {exc!r}); the inference thread looks hung"
                    )
                else:
                    logger.warning("canary run not completed (%s: %s); readiness unchanged", type(exc).__name__, exc)
            else:
                self.stalled_runs = 0
                if not isinstance(exc, CanaryFailed | GuardError):
                    logger.error("canary run failed with an unexpected error", exc_info=exc)
                self._unready(str(exc) if isinstance(exc, CanaryFailed) else f"{type(exc).__name__}: {exc}")
        else:
            self.stalled_runs = 0
            if not self.encoding_broken:
                self.canary_error = None
                if self.phase is WorkerPhase.UNREADY:
                    logger.info("canary passed again; the worker is ready")
                    self.phase = WorkerPhase.READY
        self._passes_seen = self.passes
        self.canary_runs += 1

    def _unready(self, reason: str) -> None:
        self.canary_error = reason
        if self.phase is WorkerPhase.READY:
            logger.error("canary failed; the worker is unready: %s", reason)
            self.phase = WorkerPhase.UNREADY

    def _attach_metrics(self, backend: LocalBackend) -> None:
        """Count forward passes (:attr:`passes`) and feed the metrics from the batcher's hooks."""
        batcher = backend.batcher
        previous = batcher.on_batch
        observe = self.metrics.observe_batch

        def on_batch(info: BatchInfo) -> None:
            self.passes += 1
            observe(info)
            if previous is not None:
                previous(info)

        batcher.on_batch = on_batch
        self.metrics.bind_queue(lambda: batcher.queue_depth, lambda: batcher.in_flight)

    async def close(self) -> None:
        self.phase = WorkerPhase.STOPPING
        if self._probe is not None:
            self._probe.cancel()
        if self.backend is not None:
            await self.backend.aclose()  # finishes queued work first
        calls: dict[str, Callable[[], object]] = {"the worker's metrics shutdown": self.metrics.shutdown}
        provider = self.tracer_provider if self.tracer_provider is not None else trace.get_tracer_provider()
        flush = getattr(provider, "force_flush", None)  # the SDK's; the default no-op provider has none
        if flush is not None:  # the spans still queued leave now: uvicorn re-raises SIGTERM, so no exit hook runs
            calls["the trace flush"] = lambda: flush(int(CLOSE_TIMEOUT_S * 1000))
        await asyncio.to_thread(close_within, calls, CLOSE_TIMEOUT_S)  # at most CLOSE_TIMEOUT_S, collector or not

    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        return self.backend.model.model_id if self.backend is not None else ""

    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use: the listed name, the checkpoint's id, then the aliases (no repeats)."""
        ids = [self.model_name()]
        if self.backend is not None:
            ids.append(self.backend.model.model_id)
        return tuple(dict.fromkeys([*ids, *self.config.model_aliases]))

    def release_date(self) -> datetime.date:
        if self.config.release_date is not None:
            return datetime.date.fromisoformat(self.config.release_date)
        released = getattr(self.backend.model, "released", None) if self.backend is not None else None
        return released if isinstance(released, datetime.date) else self.loaded_on


# ---------------------------------------------------------------------------------------------------------- routes


def _runtime(request: Request) -> _Runtime:
    runtime: _Runtime = request.app.state.worker
    return runtime


def _not_ready(runtime: _Runtime) -> JSONResponse:
    if runtime.phase is WorkerPhase.UNREADY:
        return _http.error_response(
            503, _http.CANARY_FAILED, f"the worker's canary failed: {runtime.canary_error}", retry_after=1.0
        )
    reason = f": {runtime.error}" if runtime.error else ""
    return _http.error_response(
        503,
        _http.NOT_READY,
        f"the worker is {runtime.phase.value}{reason}",
        retry_after=NOT_READY_RETRY_AFTER_S,
    )


#: ``gen_ai.operation.name`` of the worker's server spans (the engine's decision spans use the same).
GEN_AI_OPERATION = "text_completion"


async def _systemone(request: Request) -> Response:
    """``POST /v1/systemone``: answer one System One request (see the module docstring for every status), in a
    server span continuing the caller's ``traceparent``."""
    runtime = _runtime(request)
    started = time.perf_counter()
    attributes = {"http.request.method": "POST", "url.path": "/v1/systemone", "gen_ai.operation.name": GEN_AI_OPERATION}
    with quietly():  # a malformed trace header is the caller's: OpenTelemetry's warnings would quote it
        parent = propagate.extract(request.headers)
    with runtime.tracer.start_as_current_span(
        "POST /v1/systemone", context=parent, kind=SpanKind.SERVER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,  # an exception's text may quote the request
    ) as span:
        try:
            response, outcome = await _answer(request, runtime)
        except Exception as exc:
            # answered by the exception handlers (500, with the traceback in the log; 499 for a client that left):
            # counted, and the span gets the exception's type only
            gone = isinstance(exc, ClientDisconnect)
            runtime.metrics.request_done("cancelled" if gone else "error", time.perf_counter() - started)
            if span.is_recording() and not gone:
                span.set_attributes({"http.response.status_code": 500, "error.type": "500"})
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        if span.is_recording():
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                span.set_attribute("error.type", str(response.status_code))
            if response.status_code >= 500:  # a server span's error (HTTP semantic conventions); 4xx is the caller's
                span.set_status(Status(StatusCode.ERROR))
    runtime.metrics.request_done(outcome, time.perf_counter() - started)
    return response


async def _answer(request: Request, runtime: _Runtime) -> tuple[Response, str]:
    backend = runtime.backend
    if runtime.phase is not WorkerPhase.READY or backend is None:
        return _not_ready(runtime), "not_ready"
    config = runtime.config
    started = time.monotonic()
    try:  # a request the queue cannot take, or that finds the memory for bodies full, is refused before it is read
        backend.batcher.check_room()
        runtime.body_bytes.check_room()
    except Overloaded as exc:
        return _overloaded(config, str(exc), exc.retry_after), "overloaded"
    # the body's bytes count from their arrival until the answer: parsed, a request waiting for an encoding thread or
    # in the queue holds as much memory as its body did, or more
    with runtime.body_bytes.share() as held:
        return await _read_and_answer(request, runtime, backend, held, started)


async def _read_and_answer(
    request: Request, runtime: _Runtime, backend: LocalBackend, held: BodyShare, started: float
) -> tuple[Response, str]:
    """Read the body, counting its bytes in ``held`` (a stalled upload is cut at the idle timeout), parse it and
    answer it, within the request's deadline counted from ``started``."""
    config = runtime.config
    try:
        timeout = _http.parse_timeout(request.headers, config.default_timeout_s, config.max_timeout_s)
        content_type = request.headers.get("content-type", "")
        multipart = _intake.body_kind(content_type) == "multipart"
        declared = declared_length(request.headers.get("content-length", "").encode() or None)
        raw = await read_body(request.receive, config.max_body_bytes, declared, timeout_s=timeout,
                              idle_s=config.body_idle_timeout_s, held=held)
        if raw is None:
            return Response(status_code=499), "cancelled"
        # repeated Content-Encoding lines are one list, in order (RFC 9110 §5.3)
        codings = ", ".join(request.headers.getlist("content-encoding"))
        # off the event loop: decompression and the body checks let other requests run meanwhile (json's own C
        # parser still holds the GIL while it parses: MAX_JSON_CONTAINERS bounds that), a few bodies at a time
        async with asyncio.timeout(max(timeout - (time.monotonic() - started), 0.0)):
            await runtime.intake.acquire()
        try:
            if codings:
                decoded = await asyncio.to_thread(_intake.decode_content, raw, codings, config.max_body_bytes)
                # the decoded body (and the request parsed from it) is held until the answer: it counts in place of
                # the bytes received, once it is larger than they are (on the event loop, where the share is counted)
                held.add(max(len(decoded) - len(raw), 0))
                raw = decoded
            system_request, names = await asyncio.to_thread(_read_request, raw, content_type, multipart, config)
        finally:
            runtime.intake.release()
    except TimeoutError:
        message = f"the body was not parsed within the {timeout * 1000:g} ms deadline (the worker is busy reading others)"
        return _http.error_response(504, _http.TIMEOUT, message), "timeout"
    except BodyError as exc:
        return _http.error_response(exc.status, exc.code, exc.reason, field=exc.field), "invalid"
    except Overloaded as exc:
        return _overloaded(config, str(exc), exc.retry_after), "overloaded"
    except InvalidJson as exc:
        field = "body" if exc.path == "$" else exc.path.removeprefix("$.")
        return _http.error_response(400, _http.INVALID_JSON, str(exc), field=field), "invalid"
    except RequestValidationError as exc:
        errors = [e.to_json() for e in exc.errors]
        return _http.error_response(422, _http.INVALID_REQUEST, str(exc), errors=errors), "invalid"
    if system_request.model not in runtime.model_names():
        return _model_not_found(runtime, system_request.model, "model"), "invalid"
    span = trace.get_current_span()
    span.set_attribute("gen_ai.request.model", system_request.model)
    left = timeout - (time.monotonic() - started)  # one deadline: reading and parsing the body spent some
    if left <= 0:
        message = f"reading and parsing the body took longer than the {timeout * 1000:g} ms deadline"
        return _http.error_response(504, _http.TIMEOUT, message), "timeout"
    try:
        answer = await _http.unless_disconnected(
            request.receive, backend.decide(system_request, timeout=left, hold=held.add_held)
        )
    except _http.ClientGone:
        return Response(status_code=499), "cancelled"
    except BackendRejected as exc:
        status = exc.status_code if exc.status_code and 400 <= exc.status_code < 500 else 422
        errors = exc.detail if isinstance(exc.detail, list) else []
        message = str(exc)
        if names and errors:  # the backend's image errors name images[i]
            named = _intake.name_assets(RequestValidationError([FieldError(**e) for e in errors]), names)
            message, errors = str(named), [e.to_json() for e in named.errors]
        return _http.error_response(status, _http.INVALID_REQUEST, message, errors=errors), "invalid"
    except BackendTimeout as exc:
        return _http.error_response(504, _http.TIMEOUT, str(exc)), "timeout"
    except BackendUnavailable as exc:
        if exc.reason == "overloaded":
            return _overloaded(config, str(exc), exc.retry_after or 1.0), "overloaded"
        if exc.reason == "inference_failed":
            runtime.failed(backend, bool(system_request.images))
        return _http.error_response(503, _http.UNAVAILABLE, str(exc), retry_after=1.0), "unavailable"
    except MalformedAnswer as exc:
        logger.error("model produced a malformed answer: %s", exc)
        runtime.failed(backend, bool(system_request.images))  # enough in a row run the canaries at once
        return _http.error_response(503, _http.MALFORMED_ANSWER, str(exc)), "error"
    runtime.answered(bool(system_request.images))
    headers = {_http.MODEL_REVISION_HEADER: backend.model_revision}
    span.set_attribute("gen_ai.usage.input_tokens", answer.usage.input_tokens)
    return JSONResponse(answer.served_json(), headers=headers), "ok"


def _overloaded(config: WorkerConfig, message: str, retry_after: float) -> JSONResponse:
    """A full queue's answer: ``overload_status`` (429 or 503) ``overloaded`` with ``Retry-After``."""
    return _http.error_response(config.overload_status, _http.OVERLOADED, message, retry_after=retry_after)


def _read_request(
    raw: bytes, content_type: str, multipart: bool, config: WorkerConfig
) -> tuple[SystemOneRequestV1, list[str]]:
    """The validated request in a body whose ``Content-Encoding`` is undone (``multipart``: a ``multipart/form-data``
    one), and the asset names of its images (in order).

    Raises:
        BodyError: a bad multipart body or image (its status and field).
        InvalidJson: the JSON is not strict JSON.
        RequestValidationError: the request breaks the wire rules; an image sent as an asset is named
            ``assets.<name>``.
    """
    parts: dict[str, tuple[str, bytes]] = {}
    if multipart:
        raw, parts = _intake.split_multipart(raw, content_type)
    body = loads(raw, max_containers=MAX_JSON_CONTAINERS)
    names: list[str] = []
    if isinstance(body, dict):
        body, names = _intake.assets_to_images(body, parts)
        _intake.check_images(body, config.max_image_pixels, names)
    try:
        return SystemOneRequestV1.from_json(body, profile=config.validation_profile), names
    except RequestValidationError as exc:
        raise _intake.name_assets(exc, names) from None


def _model_not_found(runtime: _Runtime, name: str, field: str) -> JSONResponse:
    served = ", ".join(runtime.model_names())
    return _http.error_response(
        404, _http.MODEL_NOT_FOUND, f"model {name[:80]!r} is not served here; this worker serves {served}", field=field
    )


def _model_entry(runtime: _Runtime, backend: LocalBackend, name: str) -> dict[str, Any]:
    """One model in both shapes: OpenAI's ``id, object, created, owned_by`` and Jev's ``name, description,
    release_date`` plus guard's serving details."""
    released = runtime.release_date()
    created = int(datetime.datetime.combine(released, datetime.time(), tzinfo=datetime.UTC).timestamp())
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "guard",
        "name": name,
        "description": runtime.config.description,
        "release_date": released.isoformat(),
        "revision": backend.model_revision,
        "max_input_tokens": backend.max_length,
        "dtype": str(backend.model.dtype).removeprefix("torch."),
        "device": str(backend.model.device),
        "confidence_profile": backend.confidence_profile,
        "validation_profile": runtime.config.validation_profile,
    }


async def _models(request: Request) -> Response:
    """``GET /v1/models``: every name the worker answers to, in Jev's and OpenAI's list shapes at once."""
    runtime = _runtime(request)
    backend = runtime.backend
    if runtime.phase is not WorkerPhase.READY or backend is None:
        return _not_ready(runtime)
    entries = [_model_entry(runtime, backend, name) for name in runtime.model_names()]
    return JSONResponse({"object": "list", "data": entries, "models": entries})


async def _model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one served model (404 ``model_not_found`` for any other name; ``/v1/models/``, with
    no name, is an unknown route: 404 ``not_found``)."""
    if not request.path_params["model_id"]:  # the path convertor matches an empty name too
        raise HTTPException(404)
    runtime = _runtime(request)
    backend = runtime.backend
    if runtime.phase is not WorkerPhase.READY or backend is None:
        return _not_ready(runtime)
    name = request.path_params["model_id"]
    if name not in runtime.model_names():
        return _model_not_found(runtime, name, "path.model_id")
    return JSONResponse(_model_entry(runtime, backend, name))


async def _healthz(request: Request) -> Response:
    """``GET /healthz``: 200 while alive; 503 when loading or the self-test failed, or the inference thread looks hung
    (restart me)."""
    runtime = _runtime(request)
    if runtime.phase is WorkerPhase.FAILED:
        return _http.error_response(503, _http.UNAVAILABLE, f"the worker failed to start: {runtime.error}")
    if runtime.hung:
        return _http.error_response(503, _http.UNAVAILABLE, f"restart the worker: {runtime.canary_error}")
    return JSONResponse({"status": "ok", "phase": runtime.phase.value})


async def _readyz(request: Request) -> Response:
    """``GET /readyz``: 200 only when the model is loaded and the self-test passed."""
    runtime = _runtime(request)
    if runtime.phase is not WorkerPhase.READY or runtime.backend is None:
        return _not_ready(runtime)
    batcher = runtime.backend.batcher
    return JSONResponse(
        {
            "status": "ready",
            "model": runtime.backend.model_revision,
            "queue_depth": batcher.queue_depth,
            "body_bytes": runtime.body_bytes.held,
            "canaries": len(runtime.backend.canaries),
        }
    )


async def _metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text exposition."""
    return Response(_runtime(request).metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""What an orchestrator and a metrics scraper read without a key; they carry no decisions."""


class _ApiKeys:
    """ASGI middleware: every path but the probes (:data:`_OPEN_PATHS`) needs ``Authorization: Bearer <key>`` with
    one of ``keys`` (401 otherwise), sent once: a request sending ``Authorization`` more than once is answered 400
    ``repeated_header`` (field ``headers.authorization``; :func:`~guard._headers.sole_header` says why not 401)
    before any key is compared, whichever copy holds a valid key. The path is read as routing reads it
    (:func:`~guard._rootpath.route_path`: below ``root_path``), so the app served under a prefix or mounted in
    another app keeps the check."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or route_path(scope) in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            given = sole_header(scope["headers"], "authorization") or b""
        except BodyError as exc:  # two credentials: which one a front proxy checked is unknown
            response = _http.error_response(exc.status, exc.code, exc.reason, field=f"headers.{exc.field}")
            await response(scope, receive, send)
            return
        scheme, _, token = given.partition(b" ")
        token = token.strip()
        # compare with every key (no early exit) so the time taken does not say which key was close
        matched = [hmac.compare_digest(token, key) for key in self.keys]
        if scheme.lower() == b"bearer" and any(matched):
            await self.app(scope, receive, send)
            return
        message = "this worker needs Authorization: Bearer <api key>" if not given else "the API key is not valid"
        response = _http.error_response(401, _http.UNAUTHORIZED, message, field="headers.authorization")
        response.headers["www-authenticate"] = 'Bearer realm="guard-worker"'
        await response(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = (
        _http.NOT_FOUND if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
    )
    response = _http.error_response(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}")
    response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 section 15.5.6)
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _http.error_response(500, _http.INTERNAL_ERROR, "internal error; see the worker log")


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def create_app(
    backend: LocalBackend | Callable[[], LocalBackend],
    *,
    config: WorkerConfig | None = None,
    metrics: WorkerMetrics | None = None,
    tracer_provider: Any = None,
) -> Starlette:
    """Build the worker app.

    Args:
        backend: a :class:`~guard.backends.local.LocalBackend`, or a callable that loads one (called on a thread at
            startup, so ``/healthz`` answers while the weights load). The app owns it: shutdown closes it after
            finishing queued work.
        config: serving options (:class:`WorkerConfig` defaults when ``None``).
        metrics: where metrics go (a private Prometheus-backed :class:`WorkerMetrics` when ``None``).
        tracer_provider: where the server spans go (``None``: the global provider; a no-op until one is set).

    Returns:
        A Starlette app; run it with uvicorn. ``app.state.worker`` holds the runtime (``phase``, ``backend``).
    """
    runtime = _Runtime(backend, config or WorkerConfig(), metrics or WorkerMetrics(), tracer_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        boot = asyncio.ensure_future(runtime.boot())
        try:
            yield
        finally:
            if not boot.done():
                boot.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await boot
            await runtime.close()

    routes = [
        Route("/v1/systemone", _systemone, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", _model, methods=["GET"]),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", _readyz, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    handlers = {HTTPException: _http_error, ClientDisconnect: _client_disconnect, Exception: _internal_error}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[
            Middleware(_http.RequestIdMiddleware),
            Middleware(_http.FramingMiddleware),
            Middleware(_ApiKeys, keys=runtime.config.api_keys),
        ],
    )
    # a path with a slash added is an unknown path (404), not a redirect: Starlette's would name the request's own
    # Host in its Location
    app.router.redirect_slashes = False
    app.state.worker = runtime
    return app
