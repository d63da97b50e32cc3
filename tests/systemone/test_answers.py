"""The check every backend answer passes before rules see it, and the stored form the cache keeps
(guard/systemone/answers.py)."""

from __future__ import annotations

import json

from guard.systemone import SystemOneResponseV1
from guard.systemone.answers import decode_answers, encode_checked
from tests.systemone.test_wire import _remote_body, _remote_request


def test_an_answer_a_two_decimal_provider_may_send_is_also_accepted_by_the_stored_form_check() -> None:
    body = _remote_body()
    body["answers"]["team"]["probabilities"] = {"billing": 0.33, "technical": 0.33, "sales": 0.33}  # sums to 0.99
    body["answers"]["team"]["choice"] = "billing"
    response = SystemOneResponseV1.from_json(body, _remote_request(), decimals=2)
    stored, decoded = encode_checked(response, _remote_request())
    assert decode_answers(json.loads(json.dumps(stored)), _remote_request()) == decoded
    assert decoded.answers["team"].probabilities == response.answers["team"].probabilities
