"""Run a compiled graph in one of the four modes and return what the thread holds afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langgraph.types import Interrupt

SYNC_MODES = ("invoke", "stream")
ASYNC_MODES = ("ainvoke", "astream")


@dataclass
class Outcome:
    """The thread after a run: its messages, pending interrupts, and (stream modes) the run count seen when the
    model's first tool-call chunk arrived."""

    messages: list[BaseMessage]
    interrupts: tuple[Interrupt, ...]
    values: dict[str, Any]
    runs_at_first_call_chunk: list[int] = field(default_factory=list)

    def tool_messages(self) -> dict[str, ToolMessage]:
        return {m.tool_call_id: m for m in self.messages if isinstance(m, ToolMessage)}

    def items(self) -> list[dict[str, Any]]:
        return [item for i in self.interrupts for item in i.value["items"]]

    def last_ai(self) -> AIMessage:
        return next(m for m in reversed(self.messages) if isinstance(m, AIMessage))


def _outcome(graph: Any, config: dict[str, Any], seen: list[int]) -> Outcome:
    state = graph.get_state(config)
    return Outcome(list(state.values.get("messages", [])), tuple(state.interrupts), dict(state.values), seen)


def _watch(chunk: Any, runs: Any, seen: list[int]) -> None:
    """Note the run count when the client first sees a tool call: a streamed chunk, or the whole reply when the
    middleware holds tokens back until the output verdict."""
    if isinstance(chunk, tuple) and len(chunk) == 2 and chunk[0] == "messages":
        message = chunk[1][0]
        carries_call = (isinstance(message, AIMessageChunk) and message.tool_call_chunks) or (
            isinstance(message, AIMessage) and message.tool_calls
        )
        if carries_call and not seen:
            seen.append(runs.count())


def drive(graph: Any, value: Any, config: dict[str, Any], mode: str, runs: Any = None) -> Outcome:
    """Run synchronously (``invoke`` or ``stream`` with messages+updates)."""
    seen: list[int] = []
    if mode == "invoke":
        graph.invoke(value, config)
    else:
        for chunk in graph.stream(value, config, stream_mode=["messages", "updates"]):
            if runs is not None:
                _watch(chunk, runs, seen)
    return _outcome(graph, config, seen)


async def adrive(graph: Any, value: Any, config: dict[str, Any], mode: str, runs: Any = None) -> Outcome:
    """Run asynchronously (``ainvoke`` or ``astream`` with messages+updates)."""
    seen: list[int] = []
    if mode == "ainvoke":
        await graph.ainvoke(value, config)
    else:
        async for chunk in graph.astream(value, config, stream_mode=["messages", "updates"]):
            if runs is not None:
                _watch(chunk, runs, seen)
    state = await graph.aget_state(config)
    return Outcome(list(state.values.get("messages", [])), tuple(state.interrupts), dict(state.values), seen)
