"""A small, honest ``DecisionBackend`` for deterministic tests of rules, fail modes, caching and enforcement points.

``ScriptedBackend(answer)`` answers each request with ``answer(request)``: a mapping ``{question_id: spec}`` in the
hand-written answer format of ``guard.backends.fixture`` (noul: P(true); choice: ``{option: p}`` or an option id;
score: level probabilities). It counts calls, keeps the requests, and can be slow or fail on purpose. Its answers go
through the same readout (``guard.systemone.answer_question``) as a real model's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from typing import Any

from guard.backends.fixture import answer_from_spec
from guard.errors import BackendTimeout, UnsupportedQuestion
from guard.systemone import QuestionV1, SystemOneRequestV1, SystemOneResponseV1, UsageV1

__all__ = ["ScriptedBackend", "constant"]

AnswerFn = Callable[[SystemOneRequestV1], Mapping[str, Any]]


def constant(**specs: Any) -> AnswerFn:
    """An answer function giving the same spec per question id every time (``constant(spam=0.9)``)."""
    return lambda request: specs


class ScriptedBackend:
    """A ``DecisionBackend`` whose answers come from a function of the request.

    Args:
        answer: request -> ``{question_id: spec}``; questions it leaves out get an even split (noul 0.5).
        delay: seconds to sleep before answering.
        honour_timeout: when true (default) a ``delay`` longer than the ``timeout`` argument raises
            ``BackendTimeout`` after ``timeout`` seconds, like a real client; when false the backend ignores it (a hung
            backend), so the engine's own deadline must cut it off.
        fail: an exception to raise on every call, or a function ``(call_number) -> exception | None``.
        name: backend name; revision: ``model_revision``; model: the model id it reports.
        answers_override: replace the built response (to return malformed answers on purpose).
        refuse: question ids it cannot answer, like the compact model: ``explain`` names them (the engine checks at
            construction) and ``decide`` raises ``UnsupportedQuestion``.
    """

    def __init__(
        self,
        answer: AnswerFn | None = None,
        *,
        delay: float = 0.0,
        honour_timeout: bool = True,
        fail: BaseException | Callable[[int], BaseException | None] | None = None,
        name: str = "scripted",
        revision: str = "scripted-r1",
        model: str = "scripted-model",
        answers_override: Callable[[SystemOneResponseV1], SystemOneResponseV1] | None = None,
        refuse: Collection[str] = (),
    ) -> None:
        self.name = name
        self._revision = revision
        self._answer = answer or (lambda request: {})
        self.delay = delay
        self.honour_timeout = honour_timeout
        self.fail = fail
        self.model = model
        self.answers_override = answers_override
        self.refuse = frozenset(refuse)
        self.calls = 0
        self.requests: list[SystemOneRequestV1] = []
        self.closed = False

    @property
    def model_revision(self) -> str:
        return self._revision

    def explain(self, question: QuestionV1) -> str | None:
        """``None`` when this backend answers ``question``, else why not (the compact backend's interface)."""
        return f"{self.name} does not answer {question.id!r}" if question.id in self.refuse else None

    async def decide(self, request: SystemOneRequestV1, *, timeout: float | None = None) -> SystemOneResponseV1:
        for question in request.questions:
            reason = self.explain(question)
            if reason is not None:
                raise UnsupportedQuestion(question.id, self.name, reason)
        self.calls += 1
        self.requests.append(request)
        call = self.calls
        if self.delay:
            if self.honour_timeout and timeout is not None and timeout < self.delay:
                await asyncio.sleep(timeout)
                raise BackendTimeout(f"scripted backend took longer than {timeout:.3f} s", backend=self.name)
            await asyncio.sleep(self.delay)
        failure = self.fail(call) if callable(self.fail) else self.fail
        if failure is not None:
            raise failure
        specs = self._answer(request)
        answers = {}
        for question in request.questions:
            spec = specs.get(question.id)
            if spec is None:
                n = len(question.option_ids())
                spec = 0.5 if question.type == "noul" else [1.0 / n] * n if question.type == "score" else {
                    o: 1.0 / n for o in question.option_ids()
                }
            answers[question.id] = answer_from_spec(question, spec)
        response = SystemOneResponseV1(model=self.model, answers=answers, usage=UsageV1(input_tokens=10))
        if self.answers_override is not None:
            response = self.answers_override(response)
        return response

    async def aclose(self) -> None:
        self.closed = True
