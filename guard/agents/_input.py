"""Model input for :class:`~guard.agents.GuardAgentMiddleware`: every user message is judged before a model reads it.

The record under ``state["guard"][<middleware name>]["inputs"]`` maps each human message to the digest of its
content and its outcome::

    {"<message id>": {"digest": <SHA-256 of the content>, "status": "allowed" | "blocked"}}

A message is judged when it has no record, or when its content no longer matches the recorded digest: LangGraph's
``add_messages`` replaces a message that reuses an id, and the new content is judged, never waved through by the
old record. Every human message new since the last judged model call is judged, not only the latest one (a client
can send several at once, or a whole conversation): one subject per message, judged concurrently. Any
``block`` ends the run with a notice; otherwise the escalated messages go to the reviewer together in one
``interrupt()`` (approve / reject). A blocked message stays in the thread (the client's history is not rewritten),
but :meth:`InputGate.visible` leaves it out of every later model request, so no model ever reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AnyMessage, HumanMessage

from guard.agents import _messages as msgs
from guard.agents._arguments import canonical_json
from guard.agents._content import message_text
from guard.agents._judge import Judge, Judgement
from guard.agents._records import current_thread_id, text_item
from guard.agents._turn import TurnKeeper
from guard.agents.decisions import PendingItem
from guard.subject import AgentSubject, digest_of
from guard.verdict import Verdict

__all__ = ["InputGate", "PendingInput", "input_digest"]

REJECTED_REASON = "a reviewer rejected it"


def input_digest(message: AnyMessage) -> str:
    """SHA-256 (hex) of a message's exact content and the text judged from it; an input record is bound to it."""
    return digest_of("model_input", canonical_json(message.content), message_text(message))


def _key(message: AnyMessage, digest: str) -> str:
    """The record key: the message id (``add_messages`` gives every message in a thread one), else its digest."""
    return message.id if message.id else f"digest:{digest}"


@dataclass(frozen=True)
class PendingInput:
    """One human message to judge: its record key, the message, its content digest and its subject."""

    key: str
    message: HumanMessage
    digest: str
    subject: AgentSubject


class InputGate:
    """Judges model input (``before_model``) and keeps blocked messages out of model requests (``wrap_model_call``).

    Args:
        turns: the instance's record keeper (``state["guard"][name]``) and interrupt helper.
        judge: evaluates subjects.
    """

    def __init__(self, turns: TurnKeeper, judge: Judge) -> None:
        self.turns = turns
        self.judge = judge

    def _record(self, state: Any) -> dict[str, dict[str, str]]:
        return dict(self.turns.mine(state).get("inputs") or {})

    def pending(self, state: Any) -> tuple[dict[str, dict[str, str]], list[PendingInput]]:
        """The input record pruned to the messages still in the thread, and the human messages left to judge (new,
        or changed since judged), in thread order."""
        record = self._record(state)
        kept: dict[str, dict[str, str]] = {}
        todo: list[PendingInput] = []
        thread_id = current_thread_id()
        for message in state["messages"]:
            if not isinstance(message, HumanMessage):
                continue
            digest = input_digest(message)
            key = _key(message, digest)
            entry = record.get(key)
            if entry is not None and entry.get("digest") == digest:
                kept[key] = entry
                continue
            text = message_text(message)
            subject = AgentSubject(event="model_input", text=text, user_message=text, thread_id=thread_id)
            if self.judge.matches(subject):
                todo.append(PendingInput(key, message, digest, subject))
        return kept, todo

    def _item(self, pending: PendingInput, judgement: Judgement) -> PendingItem:
        return text_item(
            judgement,
            thread_id=pending.subject.thread_id,
            event="model_input",
            message_id=pending.key,
            text=pending.subject.text or "",
            digest=pending.digest,
        )

    def settle(
        self,
        state: Any,
        record: dict[str, dict[str, str]],
        todo: Sequence[PendingInput],
        judgements: Sequence[Judgement],
    ) -> dict[str, Any] | None:
        """Carry out the judgements of :meth:`pending`: record allowed messages, end the run on a block, ask the
        reviewer about escalated ones (one interrupt). Returns the state update (``None`` when nothing changed)."""
        record = dict(record)
        blocked: tuple[Verdict, str | None] | None = None
        escalated: list[tuple[PendingInput, Judgement, PendingItem]] = []
        for pending, judgement in zip(todo, judgements, strict=True):
            if judgement.outcome == "allow":
                record[pending.key] = {"digest": pending.digest, "status": "allowed"}
            elif judgement.outcome == "block":
                record[pending.key] = {"digest": pending.digest, "status": "blocked"}
                blocked = blocked or (judgement.verdict, judgement.reason)
            else:
                escalated.append((pending, judgement, self._item(pending, judgement)))
        if escalated and blocked is None:  # with a block the run ends anyway; the others are judged next time
            decisions = self.turns.ask([item for _, _, item in escalated])
            for pending, judgement, item in escalated:
                decision = decisions[item["id"]]
                status = "allowed" if decision["type"] == "approve" else "blocked"
                record[pending.key] = {"digest": pending.digest, "status": status}
                if status == "blocked":
                    blocked = blocked or (judgement.verdict, decision.get("message") or REJECTED_REASON)
        if record == self._record(state) and blocked is None:
            return None
        update = self.turns.update(state, inputs=record)
        if blocked is None:
            return update
        notice = msgs.assistant_notice(
            msgs.INPUT_BLOCKED_TEMPLATE, blocked[0], blocked[1], outcome="blocked", event="model_input"
        )
        return {"messages": [notice], "jump_to": "end", **update}

    def visible(self, state: Any, messages: Sequence[AnyMessage]) -> list[AnyMessage]:
        """``messages`` without the human messages whose record says ``blocked`` (for the same content)."""
        record = self._record(state)
        if not any(entry.get("status") == "blocked" for entry in record.values()):
            return list(messages)
        out: list[AnyMessage] = []
        for message in messages:
            if isinstance(message, HumanMessage):
                digest = input_digest(message)
                entry = record.get(_key(message, digest))
                if entry is not None and entry.get("digest") == digest and entry.get("status") == "blocked":
                    continue
            out.append(message)
        return out
