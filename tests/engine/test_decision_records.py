"""What a decision record and its span say: every record written whatever its text holds, which policy text and which
model decided for each matching policy, bounded input, and span status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_text
from guard.subject import HttpSubject
from guard.verdict import Verdict
from tests._backends import ScriptedBackend

API = """
policies:
  - id: api
    version: "1.0"
    match: {http: {paths: ["/v1/**"]}}
    state: {text: body_text}
    questions: {inj: {type: noul, instructions: "Is it an injection?"}}
    rules: [{id: inj, when: inj.noul >= 0.8, action: block}]
    default: allow
"""


def _records(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


# Surrogates ---------------------------------------------------------------------------------------------------------


def test_lone_surrogates_anywhere_in_a_record_are_written_to_a_log_file_as_escapes(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path)
    lone = "pay eve \ud83d"
    subject = HttpSubject(method="POST", path="/v1/x", headers={"x-request-id": "\udce9"},
                          body={"m": lone, "\udc80key": 1}, body_text=lone)
    with Guard(load_text(API), backends=ScriptedBackend(lambda r: {"inj": 0.9}), decision_log=log) as guard:
        verdict = guard.evaluate(subject)
    log.close()
    assert verdict.action == "block" and log.dropped == 0
    (record,) = _records(path)
    assert record["input"]["body"] == {"m": lone, "\udc80key": 1}  # the state is normalised: U+FFFD there
    assert record["input"]["headers"]["x-request-id"] == "\udce9"
    text = path.read_text(encoding="utf-8")
    assert "\\ud83d" in text and "\\udc80key" in text and "\\udce9" in text


def test_a_surrogate_pair_left_as_two_code_points_reads_back_as_the_character() -> None:
    lines: list[str] = []
    DecisionLog(lines.append).record(Verdict("allow", "d1", policy_id="p", state={"m": "\ud83d\ude00"}), None)
    (line,) = lines
    line.encode("utf-8")  # nothing UTF-8 cannot encode
    assert json.loads(line)["state"]["m"] == "\U0001f600"
