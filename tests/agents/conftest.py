"""Fixtures for agent tests: a real Guard over the test policies with a ScriptedBackend, counting tools, and thread
configs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_files
from tests._backends import ScriptedBackend
from tests.agents._fakes import Runs, answer, counting_tools

POLICIES = Path(__file__).parent / "policies" / "agent_test.yaml"


class Harness:
    """A Guard over the test policies, its backend, its decision records, and counting tools."""

    def __init__(self, **backend_options: Any) -> None:
        self.backend = ScriptedBackend(backend_options.pop("answer", answer), **backend_options)
        self.lines: list[str] = []
        self.guard = Guard(load_files(POLICIES), backends=self.backend, decision_log=DecisionLog(self.lines.append))
        self.runs = Runs()
        self.tools = counting_tools(self.runs)

    def decisions(self) -> list[dict[str, Any]]:
        """The decision records (the log's ``review`` records left out: :meth:`reviews`)."""
        return [record for record in map(json.loads, self.lines) if "kind" not in record]

    def reviews(self) -> list[dict[str, Any]]:
        """The records of the reviewers' decisions (``kind: review``)."""
        return [record for record in map(json.loads, self.lines) if record.get("kind") == "review"]

    def close(self) -> None:
        self.guard.close()


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(**options: Any) -> Harness:
        h = Harness(**options)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


@pytest.fixture
def thread() -> Callable[[], dict[str, Any]]:
    return lambda: {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}
