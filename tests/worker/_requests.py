"""Request bodies for worker and client tests."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import GOLDEN

QUEUES = {"technical_support": "Bugs and outages", "billing": "Charges and refunds", "other": None}
SUBJECTS = ("Card charged twice", "App crashes on login", "Change my address", "Refund not received", "Cancel now")


def ticket_body(i: int) -> dict[str, Any]:
    """A distinct request per ``i``: the state, its length and the question set all vary."""
    questions: dict[str, Any] = {
        "churn_risk": {"type": "noul", "instructions": "Does the customer threaten to leave?"},
    }
    if i % 2 == 0:
        questions["queue"] = {"type": "choice", "instructions": "Which queue should own this?", "criteria": QUEUES}
    if i % 3 == 0:
        questions["urgency"] = {
            "type": "score",
            "instructions": "How urgent is a reply?",
            "criteria": ["Can wait", "This week", "Today"],
        }
    body_text = f"Ticket {i}: {SUBJECTS[i % len(SUBJECTS)]}. " + "Please help. " * (i % 7)
    return {
        "model": "clef-flash",
        "state": {"ticket": {"id": i, "subject": SUBJECTS[i % len(SUBJECTS)], "body": body_text}},
        "questions": questions,
    }


def long_body(words: int = 500) -> dict[str, Any]:
    """A request with a long state, to keep the inference thread busy for a while (hundreds of ms on CPU)."""
    return {
        "model": "clef-flash",
        "state": "log line " * words,
        "questions": {"is_long": {"type": "noul", "instructions": "Is this a long log?"}},
    }


def golden_case(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((GOLDEN / "cases" / f"{name}.json").read_text(encoding="utf-8"))
    return result
