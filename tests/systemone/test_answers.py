"""The check every backend answer passes before rules see it, and the stored form the cache keeps
(guard/systemone/answers.py)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from guard.errors import MalformedAnswer
from guard.systemone import AnswerV1, QuestionV1, SystemOneRequestV1, SystemOneResponseV1, UsageV1, confidence
from guard.systemone.answers import decode_answers, encode_checked
from tests.systemone.test_wire import _remote_body, _remote_request


def test_an_answer_a_two_decimal_provider_may_send_is_also_accepted_by_the_stored_form_check() -> None:
    body = _remote_body()
    body["answers"]["team"]["probabilities"] = {"billing": 0.33, "technical": 0.33, "sales": 0.33}  # sums to 0.99
    body["answers"]["team"]["choice"] = "billing"
    body["answers"]["team"]["confidence"] = 0.33  # the top probability (the reference definition)
    response = SystemOneResponseV1.from_json(body, _remote_request(), decimals=2)
    stored, decoded = encode_checked(response, _remote_request())
    assert decode_answers(json.loads(json.dumps(stored)), _remote_request()) == decoded
    assert decoded.answers["team"].probabilities == response.answers["team"].probabilities


def test_a_probability_a_rounding_error_outside_0_1_is_clamped_and_accepted_by_the_stored_form_check() -> None:
    """1.0000000000000002 (a float artefact) passed the wire check and failed the stored-form one: every decision
    failed closed; a noul of -1e-10 read as p(false) = 1.0000000001."""
    body = _remote_body()
    body["answers"]["urgent"]["noul"] = -1e-10
    body["answers"]["team"].update(probabilities={"billing": 1.0000000000000002, "technical": 0.0, "sales": -5e-10},
                                   choice="billing", confidence=1.0000000000000002)  # fmt: skip
    response = SystemOneResponseV1.from_json(body, _remote_request())
    assert response.answers["urgent"].probabilities == {"true": 0.0, "false": 1.0}
    assert response.answers["team"].probabilities == {"billing": 1.0, "technical": 0.0, "sales": 0.0}
    assert response.answers["team"].confidence == 1.0
    _, decoded = encode_checked(response, _remote_request())
    assert decoded.answers == response.answers


@pytest.mark.parametrize(("confidence", "accepted"), [
    (0.34, True),  # reference: the top probability
    (0.0002, True),  # workers-ai: normalized purity (n * sum p^2 - 1) / (n - 1)
    (0.01, True),  # jev: (n * p_max - 1) / (n - 1)
    (1.0, False),  # what a rule such as `queue.confidence < 0.45` would read as certain
])  # fmt: skip
def test_a_reported_confidence_must_follow_from_the_probabilities(confidence: float, accepted: bool) -> None:
    body = _remote_body()
    body["answers"]["team"].update(probabilities={"billing": 0.34, "technical": 0.33, "sales": 0.33},
                                   choice="billing", confidence=confidence)  # fmt: skip
    if accepted:
        assert SystemOneResponseV1.from_json(body, _remote_request()).answers["team"].confidence == confidence
    else:
        with pytest.raises(MalformedAnswer, match="which no confidence definition"):
            SystemOneResponseV1.from_json(body, _remote_request())


@pytest.mark.parametrize(("probabilities", "reported"), [
    ([0.06, 0.47, 0.47], 0.11),  # the true mode is level 2: rounding tied it with level 1
    ([0.05, 0.26, 0.31, 0.08, 0.31], 0.0),
    ([0.11, 0.03, 0.02, 0.0, 0.17, 0.07, 0.14, 0.2, 0.05, 0.2], 0.0),
])  # fmt: skip
def test_jevs_score_confidence_is_read_from_any_level_rounding_may_have_made_the_mode(
    probabilities: list, reported: float
) -> None:
    """Jev's score confidence reads the most probable level; two levels apart by less than a rounding unit round to a
    tie, and the check took the first, so genuine answers (these, 8 to 19 in 5,000 at 2 decimals) were refused."""
    request = _score_request(len(probabilities))
    body = _score_body(probabilities, reported)
    assert SystemOneResponseV1.from_json(body, request, decimals=2, confidence_profile="jev")
    with pytest.raises(MalformedAnswer, match="which no confidence definition"):
        SystemOneResponseV1.from_json(_score_body(probabilities, 0.9), request, decimals=2)


def test_jevs_score_confidence_is_checked_within_what_rounding_each_probability_moves_it() -> None:
    """Each probability rounded by half a unit moves Jev's score confidence by up to half a unit times its level's
    distance from the mode over MAD_uniform: 0.054 here, past the flat 0.05 allowed, so a genuine answer was refused.
    Its rounded probabilities, sent as such, give it again; random answers at 2 decimals all pass."""
    probabilities = [0.04, 0.49, 0.01, 0.0, 0.1, 0.04, 0.05, 0.1, 0.14, 0.0]  # rounded: they sum to 0.97
    body = _score_body(probabilities, 0.01)
    assert SystemOneResponseV1.from_json(body, _score_request(10), decimals=2, confidence_profile="jev")
    generator = random.Random(3)
    for levels in (3, 5, 10):
        request = _score_request(levels)
        for _ in range(300):
            weights = [generator.gammavariate(generator.choice([0.3, 1, 3]), 1) for _ in range(levels)]
            exact = [w / sum(weights) for w in weights]
            body = _score_body([round(p, 2) for p in exact], round(confidence(exact, "score", "jev"), 2))
            body["answers"]["q"]["score"] = round(sum(level * p for level, p in enumerate(exact)), 2)
            SystemOneResponseV1.from_json(body, request, decimals=2, confidence_profile="jev")


def _score_request(levels: int) -> SystemOneRequestV1:
    question = QuestionV1("q", "score", "How severe?", [f"level {level}" for level in range(levels)])
    return SystemOneRequestV1(model="m", state="s", questions=(question,))


def _score_body(probabilities: list, reported: float) -> dict:
    score = round(sum(level * p for level, p in enumerate(probabilities)), 2)
    return {"answers": {"q": {"type": "score", "score": score, "confidence": round(reported, 2),
                              "probabilities": {str(level): p for level, p in enumerate(probabilities)}}}}


def test_stored_answers_are_in_prompt_order_and_read_back_in_each_callers_order() -> None:
    body = _remote_body()
    request = _remote_request()
    response = SystemOneResponseV1.from_json(body, request)
    stored, _ = encode_checked(response, request)
    team = next(q for q in request.questions if q.id == "team")
    by_id = response.answers["team"].probabilities
    assert stored["answers"]["team"]["p"] == [by_id[o] for o, _ in team.options()]  # sorted by option id
    relisted = dataclasses.replace(team, criteria=dict(reversed(list(team.criteria.items()))))
    other = request.override(questions=[relisted if q.id == "team" else q for q in request.questions])
    decoded = decode_answers(json.loads(json.dumps(stored)), other)
    assert list(decoded.answers["team"].probabilities) == relisted.option_ids()
    assert decoded.answers["team"].probabilities == by_id and decoded.answers["team"].choice == "technical"


@pytest.mark.parametrize(("question", "edit", "says"), [
    ("urgent", {"x": 0.0}, "noul is P"),  # p[true] stays 0.9906
    ("team", {"x": "billing"}, "the choice must be the most probable option"),
    ("severity", {"x": 0.5}, "expected level"),
    ("team", {"c": 1.0}, "which no confidence definition"),
])  # fmt: skip
def test_a_stored_headline_its_probabilities_do_not_give_is_refused(question: str, edit: dict, says: str) -> None:
    """A sealed value whose noul read 0.0 while its p[true] read 0.99 was a hit: rules read the headline, an allow
    where the model had said block. The stored form passes the check a remote answer passes
    (:func:`~guard.systemone.wire.check_readout`), with the coarsest provider's rounding."""
    request = _remote_request()
    stored, _ = encode_checked(SystemOneResponseV1.from_json(_remote_body(), request), request)
    stored["answers"][question].update(edit)
    with pytest.raises(MalformedAnswer, match=says):
        decode_answers(json.loads(json.dumps(stored)), request)


def test_an_in_process_answer_whose_noul_is_not_its_p_true_is_refused() -> None:
    response = SystemOneResponseV1.from_json(_remote_body(), _remote_request())
    contradicted = AnswerV1("urgent", "noul", {"true": 0.99, "false": 0.01}, noul=0.01)
    with pytest.raises(MalformedAnswer, match="noul 0.01 but P"):
        encode_checked(dataclasses.replace(response, answers={**response.answers, "urgent": contradicted}),
                       _remote_request())


@pytest.mark.parametrize(("usage", "error"), [
    (UsageV1(346, state_tokens_dropped="1200"), "usage.state_tokens_dropped is a JSON string"),  # type: ignore[arg-type]
    (UsageV1(346, state_tokens_dropped=-5), "usage.state_tokens_dropped is -5"),
    (UsageV1(346.5), "usage.input_tokens is 346.5"),  # type: ignore[arg-type]
    (UsageV1(346, out_of_competence=None), None),  # type: ignore[arg-type]
    (UsageV1(346.0, state_tokens_dropped=1200.0, out_of_competence=True), None),  # type: ignore[arg-type]
])
def test_an_in_process_backends_usage_is_checked_by_the_wires_rules(usage: UsageV1, error: str | None) -> None:
    """A string count from an in-process backend raised TypeError (a fail mode logged as internal_error with a
    traceback) instead of a malformed answer; counts follow the rules of a server's JSON usage."""
    response = dataclasses.replace(SystemOneResponseV1.from_json(_remote_body(), _remote_request()), usage=usage)
    if error is not None:
        with pytest.raises(MalformedAnswer, match=error):
            encode_checked(response, _remote_request())
        return
    stored, decoded = encode_checked(response, _remote_request())
    assert decoded.usage == UsageV1(346, 0, int(usage.state_tokens_dropped), int(usage.out_of_competence or 0))
    assert decode_answers(json.loads(json.dumps(stored)), _remote_request()) == decoded
