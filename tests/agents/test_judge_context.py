"""The blocking judge runs each of a turn's subjects in a copy of the caller's context: the caller's trace span and
LangGraph config reach every decision, however many are judged at once."""

from __future__ import annotations

import contextvars

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from guard.agents._judge import AgentOptions, Judge
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog, Telemetry
from guard.policy import load_files
from guard.subject import AgentSubject
from tests._backends import ScriptedBackend
from tests.agents._fakes import answer
from tests.agents.conftest import POLICIES

CALLER = contextvars.ContextVar("caller", default="")


def test_every_parallel_judgement_runs_in_the_callers_context() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    seen: list[str] = []

    def scripted(request: object) -> dict[str, float]:
        seen.append(CALLER.get())
        return answer(request)

    lines: list[str] = []
    guard = Guard(load_files(POLICIES), backends=ScriptedBackend(scripted),
                  telemetry=Telemetry(tracer_provider=provider), decision_log=DecisionLog(lines.append))  # fmt: skip
    judge = Judge(AgentOptions.checked(guard=guard))
    subjects = [AgentSubject(event="tool_call", tool_name="read_file", tool_call_id=f"c{i}", arguments={"path": f"/{i}"},
                             user_message="read them") for i in range(3)]  # fmt: skip
    CALLER.set("agent run")
    with provider.get_tracer("app").start_as_current_span("agent-request") as root:
        judgements = judge.judge_all(subjects)
    guard.close()
    assert len(judgements) == 3 and seen == ["agent run"] * 3
    trace = format(root.get_span_context().trace_id, "032x")
    assert [line.count(trace) for line in lines] == [1, 1, 1]  # every decision carries the agent's trace id
