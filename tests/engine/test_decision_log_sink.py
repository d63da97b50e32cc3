"""The decision log's sink never fails a decision: whatever a sink raises, the record is dropped and counted."""

from __future__ import annotations

import logging

import pytest

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_text
from guard.subject import HttpSubject
from tests._backends import ScriptedBackend

POLICY = """
policies:
  - id: api
    version: 1
    match: {http: {paths: ["/v1/**"]}}
    state: {prompt: body:/prompt}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
"""


class ProducerError(Exception):
    pass


def test_a_sink_raising_anything_drops_the_record_not_the_decision(caplog: pytest.LogCaptureFixture) -> None:
    """A callable sink raising other than OSError or ValueError (a Kafka producer's own error) made the request 500."""
    def producer(line: str) -> None:
        raise ProducerError(f"queue full, could not send {line}")

    log = DecisionLog(producer)
    subject = HttpSubject(method="POST", path="/v1/chat", body={"prompt": "hello sk-live-0123456789"})
    with caplog.at_level(logging.ERROR), Guard(load_text(POLICY), backends=ScriptedBackend(), decision_log=log) as g:
        assert g.evaluate(subject).action == "allow"
    assert log.dropped == 1
    assert "write failed (1 dropped): ProducerError" in caplog.text and "sk-live" not in caplog.text
