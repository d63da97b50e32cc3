"""A backend that answers from hand-written specs (:class:`FixtureBackend`), and the specs themselves: turn a short
spec into an :class:`~guard.systemone.AnswerV1` for one question (:func:`answer_from_spec`).

Used by policy fixture tests (``guard policy test``), ``guard policy explain --answers`` and test backends, so a
policy's rules can be exercised without a model. Specs:

* noul: a number, P(true) (``0.93``), or ``{"true": 0.93, "false": 0.07}`` (quoted in YAML: a plain ``true`` key is
  refused);
* choice: ``{option_id: probability, ...}`` covering every option, or an option id alone (probability 1);
* score: a list of level probabilities, lowest level first, or ``{"0": p, "1": p, ...}``.

Probabilities must be finite, in [0, 1] and sum to 1 (within :func:`~guard.systemone.sum_tolerance`, as a model's
answers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from guard.errors import BackendRejected, BackendTimeout, BackendUnavailable, MalformedAnswer
from guard.systemone import (
    AnswerV1,
    QuestionV1,
    SystemOneRequestV1,
    SystemOneResponseV1,
    UsageV1,
    answer_question,
    sum_tolerance,
)

__all__ = ["FixtureBackend", "answer_from_spec"]

def answer_from_spec(question: QuestionV1, spec: Any) -> AnswerV1:
    """Build the answer a model would give from a hand-written spec (see the module docstring).

    Raises:
        ValueError: when the spec does not fit the question (wrong shape, unknown or missing options, probabilities
            not finite, outside [0, 1] or not summing to 1).
    """
    by_option = _by_option(question, spec)
    values = list(by_option.values())
    if not all(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) for p in values):
        raise ValueError(f"question {question.id!r}: probabilities must be numbers, got {spec!r}")
    if any(p < 0 or p > 1 for p in values) or abs(math.fsum(values) - 1.0) > sum_tolerance(len(values)):
        raise ValueError(f"question {question.id!r}: probabilities must be in [0, 1] and sum to 1, got {spec!r}")
    prompt_order = [float(by_option[option_id]) for option_id, _ in question.options()]
    return answer_question(question, prompt_order)


def _by_option(question: QuestionV1, spec: Any) -> dict[str, Any]:
    options = question.option_ids()
    if question.type == "noul" and isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return {"true": spec, "false": 1.0 - spec}
    if question.type == "choice" and isinstance(spec, str):
        if spec not in options:
            raise ValueError(f"question {question.id!r}: {spec!r} is not one of its options {options}")
        return {option: 1.0 if option == spec else 0.0 for option in options}
    if question.type == "score" and isinstance(spec, list):
        if len(spec) != len(options):
            raise ValueError(f"question {question.id!r} has {len(options)} levels; got {len(spec)} probabilities")
        return dict(zip(options, spec, strict=True))
    if isinstance(spec, Mapping):
        keys = [str(k) for k in spec]
        if sorted(keys) != sorted(options):
            raise ValueError(f"question {question.id!r}: give a probability for each of {options}, got {keys}")
        return {str(k): v for k, v in spec.items()}
    raise ValueError(f"question {question.id!r} ({question.type}): cannot read an answer from {spec!r}; "
                     f"expected {_SHAPES[question.type].format(options=options)}")


_SHAPES = {
    "noul": "P(true) as a number (0.93) or {{'true': p, 'false': p}}",
    "choice": "an option id alone or {{option_id: p}} over every option of {options}",
    "score": "a list of one probability per level, lowest first, or {{level: p}} over {options}",
}


class FixtureBackend:
    """A backend that answers from hand-written specs keyed by wire question id (for policy tests and
    ``guard policy explain --answers``), or fails the way a case asks."""

    name = "fixture"
    model_revision = "fixture"

    def __init__(self, answers: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        self.answers = dict(answers or {})
        self.error = error
        self.calls = 0

    async def decide(self, request: SystemOneRequestV1, *, timeout: float | None = None) -> SystemOneResponseV1:
        self.calls += 1
        if self.error == "timeout":
            raise BackendTimeout("fixture: simulated timeout", backend=self.name)
        if self.error == "unavailable":
            raise BackendUnavailable("fixture: simulated backend outage", backend=self.name, reason="http_503")
        if self.error == "rejected":
            raise BackendRejected("fixture: simulated 400 from the backend", backend=self.name, status_code=400)
        if self.error == "malformed":
            raise MalformedAnswer("fixture: simulated malformed answer", backend=self.name)
        answers = {}
        for question in request.questions:
            spec = self.answers.get(question.id)
            if spec is None:
                n = len(question.option_ids())
                spec = 0.5 if question.type == "noul" else dict.fromkeys(question.option_ids(), 1.0 / n)
            answers[question.id] = answer_from_spec(question, spec)
        return SystemOneResponseV1(model="fixture", answers=answers, usage=UsageV1(0))

    async def aclose(self) -> None:
        return None
