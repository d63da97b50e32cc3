"""The stored form of a System One response (answers, model, usage) and its shape check, for the probability cache.

Probabilities are stored in each question's prompt order (a choice's options sorted by id), the order its cache key
uses, so policies that list the same options differently share an entry; decoding reports them in the caller's order.

The same check validates every fresh backend response before rules see it, so "a malformed model answer is an error,
never an allow" and "a cached value of the wrong shape is ignored" are one piece of code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from guard.errors import MalformedAnswer
from guard.systemone.wire import (
    COARSEST_DECIMALS,
    AnswerV1,
    SystemOneRequestV1,
    SystemOneResponseV1,
    UsageV1,
    check_readout,
    parse_usage,
    sum_tolerance,
)

__all__ = ["VALUE_VERSION", "decode_answers", "encode_checked"]

#: Bump when the stored value changes; values of another version are treated as corrupt and overwritten.
VALUE_VERSION = 1


def _probability(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1


def encode_checked(
    response: SystemOneResponseV1, request: SystemOneRequestV1
) -> tuple[dict[str, Any], SystemOneResponseV1]:
    """Check ``response`` against ``request``; return its stored form and that form decoded (what a later cache hit
    reads back: :func:`decode_answers` of the stored form, so an in-process cache can keep it without a round trip).

    Raises:
        MalformedAnswer: a missing or extra answer, a wrong type, a non-finite probability, probabilities that do
            not sum to 1, a choice/score outside its options, a headline (noul, choice, score) or confidence its
            probabilities do not give (:func:`~guard.systemone.wire.check_readout`), or a usage count that is not a
            whole number >= 0 or is over its bound (:func:`~guard.systemone.wire.parse_usage`).
    """
    usage = parse_usage(response.usage, MalformedAnswer)
    answers: dict[str, Any] = {}
    for question in request.questions:
        answer = response.answers.get(question.id)
        if answer is None:
            raise MalformedAnswer(f"answer for question {question.id!r} is missing")
        if answer.type != question.type:
            raise MalformedAnswer(f"answer for {question.id!r} has type {answer.type!r}, expected {question.type!r}")
        option_ids = question.option_ids()
        if list(answer.probabilities) != option_ids and set(answer.probabilities) != set(option_ids):
            raise MalformedAnswer(f"answer for {question.id!r} has options {list(answer.probabilities)}")
        probabilities = [answer.probabilities[o] for o, _ in question.options()]  # prompt order, as the key
        entry: dict[str, Any] = {"t": answer.type, "p": probabilities}
        if answer.type == "noul":
            entry["x"] = answer.noul
        elif answer.type == "choice":
            entry["x"], entry["c"] = answer.choice, answer.confidence
        else:
            entry["x"], entry["c"] = answer.score, answer.confidence
        answers[question.id] = entry
    extra = [qid for qid in response.answers if qid not in answers]
    if extra:
        raise MalformedAnswer(f"response answers unknown questions {extra}")
    value = {
        "v": VALUE_VERSION,
        "model": response.model,
        "usage": [usage.input_tokens, usage.output_tokens],
        "answers": answers,
    }
    if usage.state_tokens_dropped > 0:
        # Optional and only when non-zero: values without it read as 0, so the value version stays (a replica that
        # does not know the key ignores it).
        value["dropped"] = usage.state_tokens_dropped
    if usage.out_of_competence > 0:
        value["ooc"] = usage.out_of_competence
    return value, decode_answers(value, request)  # one shape check for fresh and cached answers


def decode_answers(value: Any, request: SystemOneRequestV1) -> SystemOneResponseV1:
    """Rebuild a response from its stored form, checking the shape against ``request``.

    Raises:
        MalformedAnswer: when the value does not have exactly the shape :func:`encode_checked` writes for this
            request (another schema version, a string, missing or extra questions, bad numbers), or a headline or
            confidence its probabilities do not give within the coarsest provider's rounding
            (:func:`~guard.systemone.wire.check_readout`).
    """
    if not isinstance(value, Mapping) or value.get("v") != VALUE_VERSION:
        raise MalformedAnswer("stored answers have another shape or version")
    raw_answers, usage, model = value.get("answers"), value.get("usage"), value.get("model")
    if not isinstance(raw_answers, Mapping) or set(raw_answers) != {q.id for q in request.questions}:
        raise MalformedAnswer("stored answers do not cover exactly the request's questions")
    if not isinstance(model, str) or not (isinstance(usage, list) and len(usage) == 2):
        raise MalformedAnswer("stored answers lack model or usage")
    dropped, ooc = value.get("dropped", 0), value.get("ooc", 0)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*usage, dropped, ooc)):
        raise MalformedAnswer("stored usage is not two token counts (and the dropped state tokens)")
    answers: dict[str, AnswerV1] = {}
    for question in request.questions:
        entry = raw_answers[question.id]
        if not isinstance(entry, Mapping) or entry.get("t") != question.type:
            raise MalformedAnswer(f"answer for {question.id!r} is not a {question.type} answer")
        option_ids = question.option_ids()
        probabilities = entry.get("p")
        if not isinstance(probabilities, list) or len(probabilities) != len(option_ids):
            raise MalformedAnswer(f"answer for {question.id!r} has no probability per option")
        if not all(_probability(p) for p in probabilities):
            raise MalformedAnswer(f"answer for {question.id!r} has a probability that is not finite in [0, 1]")
        total = math.fsum(probabilities)
        if abs(total - 1.0) > sum_tolerance(len(option_ids), COARSEST_DECIMALS):
            raise MalformedAnswer(f"probabilities for {question.id!r} sum to {total:.6f}, not 1")
        stored = {o: float(p) for (o, _), p in zip(question.options(), probabilities, strict=True)}
        by_id = {o: stored[o] for o in option_ids}  # reported in the caller's order
        headline: Any = entry.get("x")
        conf: Any = entry.get("c")
        if question.type == "noul":
            if not _probability(headline):
                raise MalformedAnswer(f"answer for {question.id!r} has noul={headline!r}")
            check_readout(question, by_id, headline, None, COARSEST_DECIMALS, MalformedAnswer)
            answers[question.id] = AnswerV1(question.id, "noul", by_id, noul=float(headline))
            continue
        if not _probability(conf):
            raise MalformedAnswer(f"answer for {question.id!r} has confidence={conf!r}")
        if question.type == "choice":
            if not isinstance(headline, str) or headline not in by_id:  # a list is no option (and unhashable)
                raise MalformedAnswer(f"answer for {question.id!r} chose {headline!r}, not one of its options")
            check_readout(question, by_id, headline, conf, COARSEST_DECIMALS, MalformedAnswer)
            answers[question.id] = AnswerV1(question.id, "choice", by_id, choice=headline, confidence=float(conf))
            continue
        levels = len(option_ids)
        if not (isinstance(headline, (int, float)) and not isinstance(headline, bool) and math.isfinite(headline)):
            raise MalformedAnswer(f"answer for {question.id!r} has score={headline!r}")
        if not -1e-6 <= headline <= levels - 1 + 1e-6:
            raise MalformedAnswer(f"answer for {question.id!r} has score {headline!r}; expected 0 to {levels - 1}")
        check_readout(question, by_id, headline, conf, COARSEST_DECIMALS, MalformedAnswer)
        legend = {str(level): criterion for level, criterion in enumerate(question.criteria)}
        answers[question.id] = AnswerV1(
            question.id, "score", by_id, score=float(headline), confidence=float(conf), legend=legend
        )
    return SystemOneResponseV1(
        model=model, answers=answers, usage=UsageV1(int(usage[0]), int(usage[1]), state_tokens_dropped=int(dropped),
                                                   out_of_competence=int(ooc))
    )

