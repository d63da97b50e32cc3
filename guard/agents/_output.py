"""Model output that is not judged yet never leaves the model node.

LangGraph's ``stream_mode="messages"`` sends the model's tokens while it generates them, before any later hook can
judge the reply. When a ``model_output`` policy applies, the middleware runs the model with LangGraph's ``nostream``
tag (:func:`quiet_tokens`), so no token is streamed; the reply is judged inside the model node and only then leaves
it, whole: as it was (allow), replaced by a notice with the same id (block), or as an empty placeholder while a
reviewer decides (escalate; the reply waits in the private state and replaces the placeholder once approved).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from langchain.agents.middleware.types import ModelResponse
from langchain_core.messages import AIMessage, add_notification_metadata
from langchain_core.runnables.config import ensure_config, var_child_runnable_config
from langgraph.constants import TAG_NOSTREAM

from guard.agents import _messages as msgs
from guard.agents._records import verdict_from_json

__all__ = ["HELD_SUFFIX", "held_id", "quiet_tokens", "screen"]

HELD_SUFFIX = "-held"
"""Suffix of the placeholder's id: ``<reply id>-held``."""


@contextmanager
def quiet_tokens(enabled: bool) -> Iterator[None]:
    """Within the block, chat model runs carry the ``nostream`` tag (their tokens are not streamed)."""
    if not enabled:
        yield
        return
    config = ensure_config()
    token = var_child_runnable_config.set({**config, "tags": [*(config.get("tags") or []), TAG_NOSTREAM]})
    try:
        yield
    finally:
        var_child_runnable_config.reset(token)


def held_id(message_id: str) -> str:
    return f"{message_id}{HELD_SUFFIX}"


def _placeholder(ai: AIMessage) -> AIMessage:
    message = AIMessage(content="", id=held_id(ai.id or ""))
    return add_notification_metadata(message, source=msgs.SOURCE, data={"outcome": "held"})  # type: ignore[arg-type,return-value]


def screen(response: ModelResponse[Any], ai: AIMessage, turn: dict[str, Any]) -> ModelResponse[Any]:
    """The response as it may leave the model node: ``ai`` kept (allowed or not judged), replaced by a notice
    (blocked) or by a placeholder (escalated; ``turn["held"]`` keeps the reply)."""
    output = turn.get("output")
    if output is None or output["outcome"] == "allow":
        return response
    if output["outcome"] == "block":
        verdict = verdict_from_json(output["verdict"])
        reason = output.get("reason")
        replacement = msgs.assistant_notice(
            msgs.OUTPUT_BLOCKED_TEMPLATE, verdict, reason, message_id=ai.id, outcome="withheld", event="model_output"
        )
        turn["calls"] = {key: {**record, "status": "withheld"} for key, record in turn["calls"].items()}
    else:
        turn["held"] = ai
        replacement = _placeholder(ai)
    result = [replacement if message is ai else message for message in response.result]
    return ModelResponse(result=result, structured_response=response.structured_response)
