"""The embedded default backend: the compact CPU model, answering only the questions it was trained for.

:meth:`CompactBackend.default` loads the weights shipped in ``guard/compact/weights/`` (the catalog questions of
``docs/catalog.md``) once per process. Routers trained with ``guard train --kind router`` are added with
:meth:`CompactBackend.from_checkpoints`. A question no loaded model was trained for is refused with
:class:`~guard.errors.UnsupportedQuestion` naming it, never answered; :meth:`CompactBackend.unsupported` lets a policy
loader find such questions at load time so a policy can route them to Clef or another System One backend.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from guard.backends.base import with_code, with_confidence
from guard.compact.catalog import catalog_ids
from guard.errors import BackendTimeout, UnsupportedQuestion
from guard.systemone import ConfidenceProfile, QuestionV1, SystemOneRequestV1, SystemOneResponseV1, require_request

__all__ = ["DEFAULT_WEIGHTS", "RUNTIME_ENV", "CompactBackend", "LoadProgress", "catalog_ids"]

#: The shipped catalog checkpoint.
DEFAULT_WEIGHTS = Path(__file__).resolve().parent.parent / "compact" / "weights"
#: Environment variable naming the catalog encoder's runtime when the caller names none (one of
#: :data:`guard.compact.runtime.RUNTIMES`; unset: ``auto``).
RUNTIME_ENV = "GUARD_COMPACT_RUNTIME"
#: ``progress(done, total, stage)`` while loading: stages ``"encoder"`` then one per checkpoint.
LoadProgress = Callable[[int, int, str], None]
#: What :meth:`CompactBackend.start` reads to warm up (two sentences, so sentence pieces run too).
WARM_UP_TEXT = "Please check the balance of my savings account. Then tell me when the next payment is due."
_BACKEND_NAME = "compact"
_DEFAULT_LOCK = threading.Lock()
_DEFAULT: CompactBackend | None = None


@functools.cache
def _compute_thread() -> ThreadPoolExecutor:
    """The one thread every compact model computes on: torch's OpenMP pool belongs to the thread that calls it, so
    answering on whichever executor thread is free would start a pool per thread and the pools would fight for the
    cores (about twice the latency on 2 cores)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-compact")


class CompactBackend:
    """A :class:`~guard.backends.base.DecisionBackend` over one or more compact checkpoints.

    Example:
        >>> backend = CompactBackend.default()                                   # doctest: +SKIP
        >>> backend.unsupported(["guard.prompt_injection", "is_urgent"])         # doctest: +SKIP
        ['is_urgent']

    Args:
        models: loaded :class:`~guard.compact.model.CompactModel` objects; a question id is answered by the first
            model that knows it. ``None`` shares the models of :meth:`default` (the shipped catalog).
        confidence_profile: the ``confidence`` definition of choice and score answers (§4.1).
        revision: the weights' revision (defaults to a hash of the checkpoints); :attr:`model_revision` adds the
            code's and the confidence profile's.
    """

    name = _BACKEND_NAME

    def __init__(
        self,
        models: Sequence[Any] | None = None,
        *,
        confidence_profile: ConfidenceProfile = "reference",
        revision: str = "",
    ) -> None:
        if models is None:
            shared = CompactBackend.default()
            models, revision = shared.models, revision or shared._revision
        if not models:
            raise ValueError("CompactBackend needs at least one model")
        self.models = list(models)
        self.confidence_profile = confidence_profile
        self._revision = (
            revision
            or "compact-"
            + hashlib.sha256(
                "|".join(str(getattr(m, "meta", {}).get("revision", id(m))) for m in self.models).encode()
            ).hexdigest()[:16]
        )
        self._lock = threading.Lock()
        self._closed = False
        self._warm = False
        # read 2-3 times per decision: made once (the package's digest is read now, not in the first decision)
        self._model_revision = with_confidence(with_code(self._revision), confidence_profile)

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_checkpoints(
        cls, paths: Iterable[str | Path], *, progress: LoadProgress | None = None, runtime: str | None = None,
        **options: Any
    ) -> CompactBackend:
        """Load checkpoint directories (the first may be the catalog, others routers) sharing one encoder.

        ``runtime``: ``"auto"`` (ONNX Runtime int8), ``"onnx-int8"``, ``"onnx"`` (ONNX Runtime, float32) or ``"torch"``
        for the catalog encoder
        (:meth:`guard.compact.model.CompactModel.load`); ``None``: the :data:`RUNTIME_ENV` environment variable, else
        ``"auto"``.

        Raises:
            ValueError: an unknown runtime (naming the environment variable when it came from there).
        """
        from guard.compact.encoder import TextEncoder
        from guard.compact.model import CompactModel
        from guard.compact.runtime import RUNTIMES

        if runtime is None:
            runtime = os.environ.get(RUNTIME_ENV) or "auto"
            if runtime not in RUNTIMES:
                raise ValueError(f"{RUNTIME_ENV}={runtime!r}: expected one of {list(RUNTIMES)}")

        roots = [Path(p) for p in paths]
        total = len(roots) + 1
        if progress:
            progress(0, total, "encoder")
        encoder = TextEncoder.load()
        models = []
        digest = hashlib.sha256()
        for n, root in enumerate(roots, 1):
            if progress:
                progress(n, total, str(root))
            models.append(CompactModel.load(root, encoder=encoder, runtime=runtime))
            for name in ("compact_config.json", *sorted(p.name for p in root.glob("*.safetensors"))):
                digest.update((root / name).read_bytes())
        if progress:
            progress(total, total, "ready")
        # int8 answers differ from float32 ones beyond rounding (docs/compact-model.md#int8): another revision, so a
        # shared cache keeps them apart and reports name the runtime
        int8 = any(m.runtime is not None and m.runtime.runtime == "onnx-int8" for m in models)
        return cls(models, revision="compact-" + digest.hexdigest()[:16] + ("+int8" if int8 else ""), **options)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, progress: LoadProgress | None = None, runtime: str | None = None, **options: Any
    ) -> CompactBackend:
        """Load one checkpoint directory (``guard train`` output or the shipped weights)."""
        return cls.from_checkpoints([path], progress=progress, runtime=runtime, **options)

    @classmethod
    def default(cls, *, progress: LoadProgress | None = None) -> CompactBackend:
        """The shipped catalog model, loaded once per process (thread-safe); later calls return the same object."""
        global _DEFAULT
        with _DEFAULT_LOCK:
            if _DEFAULT is None or _DEFAULT._closed:
                _DEFAULT = cls.from_checkpoints([DEFAULT_WEIGHTS], progress=progress)
            return _DEFAULT

    # ---------------------------------------------------------------------------------------------------- support
    @property
    def model_revision(self) -> str:
        """The weights' revision, then ``+guard=<digest>`` (:func:`~guard.backends.base.with_code`: the code that reads
        the model out, competence checks included) and ``+confidence=<profile>`` when the confidence profile is not
        ``reference``. Part of the cache key: replicas running other weights, another build of guard or another
        profile never read each other's answers. Made when the backend is."""
        return self._model_revision

    def question_ids(self) -> list[str]:
        """Every question id some loaded model answers (catalog ids and router ids)."""
        return [qid for model in self.models for qid in model.questions]

    def trained_labels(self, question_id: str) -> tuple[str, ...]:
        """The labels a loaded router was trained on for ``question_id`` (its options, sorted); ``()`` for a catalog
        question or an id no loaded model answers."""
        for model in self.models:
            if question_id in model.questions:
                return model.questions[question_id].labels
        return ()

    def explain(self, question: QuestionV1 | Mapping[str, Any] | str) -> str | None:
        """``None`` when this backend answers ``question``; else the one-sentence reason it is refused.

        A bare id (``str``) is checked by id only; a ``Mapping`` is a wire question body with an ``id`` key.
        """
        if isinstance(question, str):
            found = any(question in model.questions for model in self.models)
            return None if found else self._not_known(None)
        if isinstance(question, Mapping):
            body = dict(question)
            question = QuestionV1(
                id=str(body.pop("id")),
                type=body.get("type", "noul"),
                instructions=body.get("instructions"),
                criteria=body.get("criteria"),
            )
        for model in self.models:
            known = model.questions.get(question.id)
            if known is not None:
                return known.mismatch(question)
        return self._not_known(question)

    def unsupported(self, questions: Iterable[QuestionV1 | Mapping[str, Any] | str]) -> list[str]:
        """The ids of the ``questions`` this backend would refuse (for a policy loader, at load time)."""
        out = []
        for question in questions:
            if self.explain(question) is not None:
                out.append(
                    question
                    if isinstance(question, str)
                    else str(question["id"])
                    if isinstance(question, Mapping)
                    else question.id
                )
        return out

    def check(self, request: SystemOneRequestV1) -> None:
        """Raise :class:`UnsupportedQuestion` for the first question of ``request`` this backend would refuse."""
        for question in request.questions:
            reason = self.explain(question)
            if reason is not None:
                raise UnsupportedQuestion(question.id, self.name, reason)

    def _not_known(self, question: QuestionV1 | None) -> str:
        """Why an id no loaded model answers is refused, and how to fix the usual cause: a trained router asked
        under the policy's question key (the wire id is the key unless the question sets ``id:``)."""
        reason = f"the compact model answers only {sorted(self.question_ids())}"
        routers = [q for model in self.models for q in model.questions.values() if q.labels]
        if question is not None:
            options = set(question.option_ids())
            fits = [r.id for r in routers if r.type == question.type and set(r.labels) == options]
            if fits:
                return (
                    f"{reason}; {question.id!r} has the options of the trained router {fits[0]!r}: set "
                    f"'id: {fits[0]}' on the question (a question's wire id is its key unless it sets 'id')"
                )
        if routers:
            return (
                f"{reason}; to ask a trained router, set 'id:' on the question to the router's id (e.g. 'id: "
                f"{routers[0].id}'), since a question's wire id is its key unless it sets 'id'; send free-form "
                "questions to a Clef or System One backend (see docs/catalog.md)"
            )
        return f"{reason}; send free-form questions to a Clef or System One backend (see docs/catalog.md)"

    # ----------------------------------------------------------------------------------------------------- decide
    def decide_sync(self, request: SystemOneRequestV1, *, deadline: float | None = None) -> SystemOneResponseV1:
        """Answer ``request`` in the calling thread (one request computes at a time; others wait their turn).

        Args:
            request: the request.
            deadline: ``time.monotonic()`` value after which the answer is no longer wanted: a request whose turn
                comes after it is dropped without computing, and one being computed stops at the next encoder call
                (so callers that gave up cost little, and a long text cannot hold the model past its deadline).

        Raises:
            UnsupportedQuestion: a question no loaded model was trained for (nothing is answered then).
            BackendTimeout: the deadline passed while the request waited for its turn or was computed.
            RuntimeError: after :meth:`aclose`.
        """
        if self._closed:
            raise RuntimeError("CompactBackend is closed")
        self.check(request)
        with self._lock:
            if deadline is not None and time.monotonic() >= deadline:
                raise BackendTimeout("the deadline passed before the compact model's turn came", backend=self.name)
            groups: dict[int, list[QuestionV1]] = {}
            for question in request.questions:
                owner = next(i for i, m in enumerate(self.models) if question.id in m.questions)
                groups.setdefault(owner, []).append(question)
            try:
                if len(groups) == 1:
                    ((owner, _),) = groups.items()
                    return self.models[owner].answer(request, confidence_profile=self.confidence_profile,
                                                     deadline=deadline)
                parts = [
                    self.models[i].answer(request.override(questions=qs), confidence_profile=self.confidence_profile,
                                          deadline=deadline)
                    for i, qs in groups.items()
                ]
            except TimeoutError as exc:
                raise BackendTimeout(str(exc), backend=self.name) from None
        return _merge(request, parts)

    async def decide(self, request: SystemOneRequestV1, *, timeout: float | None = None) -> SystemOneResponseV1:
        """Answer every question of ``request`` on the compact models' compute thread.

        Raises:
            UnsupportedQuestion: a question outside what the loaded models were trained for.
            BackendTimeout: no answer within ``timeout`` seconds; a request still waiting for its turn at its
                deadline is never computed.
            TypeError: ``request`` is not a :class:`~guard.systemone.SystemOneRequestV1`.
        """
        request = require_request(request, f"{self.name}: decide()")
        self.check(request)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            work = functools.partial(self.decide_sync, request, deadline=deadline)
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_compute_thread(), work), timeout)
        except TimeoutError as exc:
            raise BackendTimeout(f"compact model gave no answer within {timeout} s", backend=self.name) from exc

    async def start(self) -> None:
        """Warm up on the compute thread: every loaded model reads :data:`WARM_UP_TEXT` once, so the first decision
        does not pay for setting up kernels and thread pools (hundreds of ms; ``guard proxy``, the quickstart and
        ``GuardMiddleware`` at the application's startup call this through :func:`~guard.backends.start_backend`
        before serving). Once warm, a second call returns at once.

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        if self._closed:
            raise RuntimeError("CompactBackend is closed")
        await asyncio.get_running_loop().run_in_executor(_compute_thread(), self._warm_up)

    def _warm_up(self) -> None:
        with self._lock:
            if self._warm:
                return
            for model in self.models:
                if model.kind == "catalog":  # the whole answer path: the language check loads its model on first use
                    questions = tuple(q.to_question() for q in model.questions.values())
                    model.answer(SystemOneRequestV1(model=_BACKEND_NAME, state=WARM_UP_TEXT, questions=questions))
                else:
                    model.encode_states([WARM_UP_TEXT])
            self._warm = True

    async def aclose(self) -> None:
        """Mark the backend closed (idempotent); the process-wide default is reloaded on the next ``default()``."""
        self._closed = True


def _merge(request: SystemOneRequestV1, parts: Sequence[Any]) -> SystemOneResponseV1:
    """One response from the per-model responses, answers in request order, usage summed (the state once)."""
    import dataclasses

    from guard.compact.model import CompactResponseV1

    answers = {}
    for part in parts:
        answers.update(part.answers)
    first = parts[0].usage
    extra = sum(
        p.usage.input_tokens - (p.usage.state_tokens - p.usage.state_tokens_dropped + 2 * p.usage.windows)
        for p in parts[1:]
    )
    usage = dataclasses.replace(first, input_tokens=first.input_tokens + extra,
                                out_of_competence=max(p.usage.out_of_competence for p in parts))
    return CompactResponseV1(model=parts[0].model, answers={q.id: answers[q.id] for q in request.questions},
                             usage=usage)
