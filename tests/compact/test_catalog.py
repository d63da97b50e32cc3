from __future__ import annotations

import pytest

from guard.compact.catalog import CATALOG, HARM_SEVERITY_LEVELS, catalog_ids, catalog_question
from guard.systemone import QuestionV1, SystemOneRequestV1


def test_required_questions_and_types() -> None:
    expected = {"guard.prompt_injection": "noul", "guard.harmful_request": "noul", "guard.harm_severity": "score",
                "guard.tool_call_serves_task": "noul", "guard.refusal": "noul"}
    assert {qid: CATALOG[qid].type for qid in expected} == expected
    assert catalog_ids() == list(CATALOG)
    assert len(HARM_SEVERITY_LEVELS) == 5


def test_canonical_questions_are_valid_workers_ai_requests() -> None:
    body = {"model": "m", "state": "x", "questions": {qid: CATALOG[qid].to_json() for qid in catalog_ids()}}
    request = SystemOneRequestV1.from_json(body)
    assert [q.id for q in request.questions] == catalog_ids()
    for question in request.questions:
        assert CATALOG[question.id].matches(question) is None


def test_bare_id_matches_and_changes_are_named() -> None:
    entry = catalog_question("guard.prompt_injection")
    assert entry.matches(QuestionV1("guard.prompt_injection", "noul")) is None
    assert "instructions differ" in entry.matches(QuestionV1("guard.prompt_injection", "noul", "Is it spam?"))
    assert "type" in entry.matches(QuestionV1("guard.prompt_injection", "choice", criteria={"a": None, "b": None}))
    custom = QuestionV1("guard.prompt_injection", "noul", criteria={"true": "spam"})
    assert "true/false" in entry.matches(custom)
    severity = catalog_question("guard.harm_severity")
    assert "criteria differ" in severity.matches(QuestionV1("guard.harm_severity", "score", criteria=["a", "b"]))


def test_unknown_id_names_the_catalog() -> None:
    with pytest.raises(KeyError, match="guard.refusal"):
        catalog_question("is_urgent")
