"""The worker's startup self-test: one fixed request must come back with finite probabilities that sum to 1."""

from __future__ import annotations

import math

from guard.backends.base import DecisionBackend
from guard.systemone import SystemOneRequestV1, SystemOneResponseV1, sum_tolerance

__all__ = ["SELF_TEST_REQUEST", "SELF_TEST_TIMEOUT_S", "check_answers", "run_self_test"]

#: Seconds the self-test may take (the first forward pass also warms up kernels and allocators).
SELF_TEST_TIMEOUT_S = 120.0
#: How far a question's unrounded probabilities may sum from 1.

#: One request with each question type (spec §5.8a's minimal request).
SELF_TEST_REQUEST = SystemOneRequestV1.from_json(
    {
        "model": "self-test",
        "state": {"ticket": {"subject": "Card charged twice", "body": "Refund today or I cancel."}},
        "questions": {
            "churn_risk": {
                "type": "noul",
                "instructions": "Does the customer threaten to leave?",
                "criteria": {"true": "Explicit threat to cancel or leave."},
            },
            "queue": {
                "type": "choice",
                "instructions": "Which queue should own this?",
                "criteria": {"technical_support": "Bugs and outages", "billing": "Charges and refunds", "other": None},
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent is a reply?",
                "criteria": ["Can wait", "This week", "Today"],
            },
        },
    }
)


def check_answers(request: SystemOneRequestV1, response: SystemOneResponseV1) -> None:
    """Check that every question is answered with finite probabilities summing to 1 (within
    :func:`~guard.systemone.sum_tolerance` of the backend's own, unrounded answers).

    Raises:
        ValueError: naming the question and what is wrong.
    """
    for question in request.questions:
        answer = response.answers.get(question.id)
        if answer is None:
            raise ValueError(f"question {question.id!r} was not answered")
        values = list(answer.probabilities.values())
        if len(values) != len(question.option_ids()) or not all(math.isfinite(p) for p in values):
            raise ValueError(f"question {question.id!r} has probabilities {values}; expected one finite value each")
        total = math.fsum(values)
        if abs(total - 1.0) > sum_tolerance(len(values)):
            raise ValueError(f"question {question.id!r} probabilities sum to {total:.6f}; expected 1")
    if response.usage.input_tokens < 1:
        raise ValueError(f"usage.input_tokens is {response.usage.input_tokens}; expected the prompt length")


async def run_self_test(backend: DecisionBackend, *, timeout: float = SELF_TEST_TIMEOUT_S) -> SystemOneResponseV1:
    """Answer :data:`SELF_TEST_REQUEST` through ``backend`` and check it.

    Raises:
        ValueError: the answer is not a valid distribution per question.
        BackendError: the backend failed to answer.
    """
    response = await backend.decide(SELF_TEST_REQUEST, timeout=timeout)
    check_answers(SELF_TEST_REQUEST, response)
    return response
