"""One agent turn for :class:`~guard.agents.GuardAgentMiddleware`, in the order the hooks run it: the input messages
judged before a model reads them (``before_model``, :class:`InputGate`); the model's reply held until it is judged
(``wrap_model_call``, :func:`~guard.agents._quiet.quiet_tokens` and :func:`screen`); the turn's records enforced after the model
(``after_model``, :class:`TurnKeeper`).

**Model input.** The record under ``state["guard"][<middleware name>]["inputs"]`` maps each input message to the
digest of its content and its outcome::

    {"<message id>:<digest>": {"digest": <SHA-256 of the content>, "status": "allowed" | "blocked"}}

A message is judged when it has no record, or when its content no longer matches the recorded digest: LangGraph's
``add_messages`` replaces a message that reuses an id, and the new content is judged, never waved through by the
old record. Every input message new since the last judged model call is judged, not only the latest one: any role,
and the model's replies and tool results too unless they carry this middleware's stamp (:meth:`TurnKeeper.stamp`,
:meth:`TurnKeeper.is_input`), so one a client wrote is judged; one subject per message, judged concurrently. Any ``block`` ends the run with a notice; otherwise the escalated messages
go to the reviewer together in one ``interrupt()`` (approve / reject). A blocked message stays in the thread, but
:meth:`InputGate.visible` leaves it out of every later model request (a blocked assistant or tool message is
replaced by a notice, so every tool call keeps an answer), so no model ever reads it. The model node judges the
request as the model reads it (:meth:`InputGate.requested`): an input message or system message (but the agent's own,
``create_agent(system_prompt=...)``) no record covers (``before_model`` skipped by a client's ``Command(goto=...)``, or
changed or added by a middleware listed before this one) is judged there (:meth:`InputGate.late`) and read by the model
only when allowed; a changed form of an allowed thread message, or a changed system message, not allowed ends the run
instead. A blocked message of the thread is left out under its id whatever its content there. Each form judged is
kept under its message id while the message is in the thread, and the system messages judged under
``system:<digest>``.

**Model output.** LangGraph's ``stream_mode="messages"`` sends the model's tokens while it generates them, before
any later hook can judge the reply. When a ``model_output`` policy applies, the middleware runs the model with
LangGraph's ``nostream`` tag, without the handlers that stream outputs, and with no new token for any other handler
but tracers (:func:`~guard.agents._quiet.quiet_tokens`), so no token is streamed; the reply is judged inside the model
node and only then leaves it, whole: as it was (allow), replaced by a notice with the same id (block), or as an empty
placeholder while a reviewer decides (escalate; the reply waits in the private state and replaces the placeholder
once approved).

**The turn's records.** The turn's verdicts are computed in the model node and stored in the private state
(``state["guard"][name]``, see ``_records.py``); :meth:`TurnKeeper.steps` then answers blocked and malformed calls
with error tool messages, asks the reviewer about every escalated item of the turn in one ``interrupt()``, judges
edits again, and marks what may run. It is a generator that yields the subjects it needs judged, so the sync and
async hooks share it (:func:`drive` / :func:`adrive`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from langchain.agents.middleware.types import ModelResponse
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    ToolMessage,
    add_notification_metadata,
    convert_to_messages,
)
from langgraph.types import interrupt

from guard._seal import Sealer
from guard.agents import _messages as msgs
from guard.agents._arguments import (
    arguments_digest,
    canonical_json,
    classify_arguments,
    parse_calls,
    plain_json,
    tool_effect,
    withhold_oversized,
)
from guard.agents._content import call_ids, call_positions, calls_by_id, input_text, message_text, server_blocks
from guard.agents._enforce import DEFAULT_MAX_REVIEW_ROUNDS, TOO_MANY_ROUNDS
from guard.agents._judge import Judge, Judgement
from guard.agents._memo import MessageMemo
from guard.agents._records import (
    Everything,
    answered_ids,
    conversation,
    current_thread_id,
    hitl_edit,
    open_part,
    opening_system,
    record_owner,
    relayed_ids,
    seal_context,
    seal_record,
    server_key,
    state_messages,
    text_item,
    tool_item,
    verdict_from_json,
    verdict_json,
)
from guard.agents.decisions import TOOL_DECISIONS, PendingItem, response_schema, review_request
from guard.policy.provenance import flagged_results
from guard.subject import AgentSubject, TurnMessage, digest_of
from guard.verdict import ACTION_RANK, Verdict

__all__ = [
    "HELD_SUFFIX",
    "InputGate",
    "PendingInput",
    "Steps",
    "TurnKeeper",
    "adrive",
    "answered_calls",
    "drive",
    "held_id",
    "input_digest",
    "input_subject",
    "output_text",
    "screen",
    "structured_ids",
]


# Model input ---------------------------------------------------------------------------------------------------------

REJECTED_REASON = "a reviewer rejected it"


def input_digest(message: AnyMessage) -> str:
    """SHA-256 (hex) of a message's exact content and the text judged from it (:func:`input_text`, tool calls
    included); an input record is bound to it."""
    return digest_of("model_input", canonical_json(message.content), input_text(message))


def input_subject(message: AnyMessage, thread_id: str | None) -> AgentSubject:
    """The subject that judges ``message`` as model input: all of its text (:func:`input_text`), as the text and as
    the user's message."""
    text = input_text(message)
    return AgentSubject(event="model_input", text=text, user_message=text, thread_id=thread_id)


def as_message(item: Any) -> AnyMessage:
    """A thread entry as the message a chat model reads: messages as they are; anything else (a plain mapping written
    with ``Overwrite``, which skips ``add_messages``) converted as LangChain converts it, or read as its text."""
    if isinstance(item, BaseMessage):
        return cast(AnyMessage, item)
    try:
        return convert_to_messages([item])[0]
    except (ValueError, TypeError, KeyError, NotImplementedError):
        return HumanMessage(str(item))


SYSTEM_KEY = "system:"
"""Prefix of the input record's key for a model request's system message (``system:<digest>``): it is not in the
thread, and the record keeps the latest one judged only."""


def _key(message: AnyMessage, digest: str) -> str:
    """The record key: the message id and its content digest (two messages may share an id when a client overwrites
    the list), or the digest alone for a message without an id."""
    return f"{message.id}:{digest}" if message.id else f"digest:{digest}"


def _message_id(key: str) -> str | None:
    """The message id of a record key (``<id>:<digest>``); ``None`` for a message without one and a system message."""
    if key.startswith((SYSTEM_KEY, "digest:")):
        return None
    return key.rsplit(":", 1)[0]


@dataclass(frozen=True)
class PendingInput:
    """One input message to judge: its record key, the message, its content digest and its subject. ``changed``: a
    form of a thread message, or a system message, that a middleware listed before this one changed or added in the
    model request (:meth:`InputGate.requested`): unless allowed, the run ends, since reading the request without it
    is not what the agent was built to read."""

    key: str
    message: AnyMessage
    digest: str
    subject: AgentSubject
    changed: bool = False


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
        """The input record: the sealed one, else (no record, or one whose seal fails) only the stored entries that
        say ``blocked``, which can keep a message from the model but never let one through."""
        record = self.turns.part(state, "inputs")
        if record is not None:
            return dict(record)
        stored = self.turns.stored(state).get("inputs")
        entries = stored.items() if isinstance(stored, Mapping) else ()
        return {key: entry for key, entry in entries
                if isinstance(entry, Mapping) and entry.get("status") == "blocked" and isinstance(entry.get("digest"), str)}

    def _inputs(self, items: Sequence[Any]) -> Iterator[tuple[AnyMessage, str, str]]:
        """The input messages among ``items`` (:meth:`TurnKeeper.is_input`), in order, each with its record key and
        content digest."""
        calls: dict[str, Any] = {}
        for item in items:
            message = as_message(item)
            input_message = self.turns.is_input(message, calls)
            answered_calls([message], calls)
            if input_message:
                digest = input_digest(message)
                yield message, _key(message, digest), digest

    def _judge(
        self,
        record: Mapping[str, Mapping[str, str]],
        inputs: Sequence[tuple[AnyMessage, str, str]],
        kept: dict[str, dict[str, str]],
        changed: Collection[str] = (),
    ) -> list[PendingInput]:
        """The messages of ``inputs`` that ``record`` does not cover (new, or changed since judged) and a policy
        judges; those it covers are added to ``kept``. ``changed``: the ids of thread messages allowed in another form, whose new forms are
        :attr:`PendingInput.changed`."""
        todo: list[PendingInput] = []
        thread_id = current_thread_id()
        for message, key, digest in inputs:
            entry = record.get(key)
            if entry is not None and entry.get("digest") == digest:
                kept[key] = dict(entry)
                continue
            subject = input_subject(message, thread_id)
            if self.judge.matches(subject):
                change = key.startswith(SYSTEM_KEY) or (message.id is not None and message.id in changed)
                todo.append(PendingInput(key, message, digest, subject, change))
        return todo

    def pending(self, state: Any) -> tuple[dict[str, dict[str, str]], list[PendingInput]]:
        """The input record pruned to the messages still in the thread, each with every form judged under its id (a
        middleware listed before this one may show the model another form, judged once in the model node), and the
        system message the model last read; and the input messages left to judge (new, or changed since judged), in
        thread order."""
        record = self._record(state)
        inputs = list(self._inputs(state["messages"]))
        ids = {message.id for message, _, _ in inputs if message.id}
        kept = {key: dict(entry) for key, entry in record.items()
                if key.startswith(SYSTEM_KEY) or _message_id(key) in ids}  # fmt: skip
        return kept, self._judge(record, inputs, kept)

    def requested(
        self, state: Any, messages: Sequence[Any], system: AnyMessage | None
    ) -> tuple[dict[str, dict[str, str]], list[PendingInput], frozenset[str]]:
        """What a model request holds, as a middleware listed before this one left it: the input record (the thread's
        entries, and those of the request's forms), the request's input messages and system message that it does not
        cover (new, or changed by that middleware) to judge now (:meth:`late`), and the ids of the thread's blocked
        messages, withheld from the request whatever their content there (:meth:`visible`). ``system``: the system
        message to judge with them (``None``: not judged, the agent's own configuration)."""
        record = self._record(state)
        kept: dict[str, dict[str, str]] = {}
        thread = list(self._inputs(state["messages"]))
        self._judge(record, thread, kept)  # only to collect the thread's entries: its messages are judged before
        blocked = {_message_id(key) for key, entry in kept.items() if entry.get("status") == "blocked"}
        allowed = {_message_id(key) for key, entry in kept.items() if entry.get("status") == "allowed"}
        inputs = [(m, key, d) for m, key, d in self._inputs(messages) if m.id is None or m.id not in blocked]
        if system is not None:
            digest = input_digest(system)
            inputs.append((system, f"{SYSTEM_KEY}{digest}", digest))
        todo = self._judge(record, inputs, kept, {i for i in allowed if i is not None})
        return kept, todo, frozenset(i for i in blocked if i is not None)

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
            items = [item for _, _, item in escalated]
            decisions = self.turns.ask(items, after_unanswered=self.turns.review_unanswered(state))
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

    def late(
        self, record: dict[str, dict[str, str]], todo: Sequence[PendingInput], judgements: Sequence[Judgement]
    ) -> tuple[dict[str, dict[str, str]], Judgement | None]:
        """The input record with the messages of a model request that no judgement covers (:meth:`requested`: a
        client's ``Command(goto=...)`` skipped ``before_model``, or a middleware listed before this one changed or
        added them) judged: ``allow`` is recorded as allowed, any other outcome as blocked (no interrupt can be raised
        there), so the model never reads them; and the first judgement, not ``allow``, of a
        :attr:`PendingInput.changed` message (the run ends on it: the model is not called), else ``None``."""
        record = dict(record)
        stop: Judgement | None = None
        for pending, judgement in zip(todo, judgements, strict=True):
            status = "allowed" if judgement.outcome == "allow" else "blocked"
            record[pending.key] = {"digest": pending.digest, "status": status}
            if status == "blocked" and pending.changed and stop is None:
                stop = judgement
        return record, stop

    @staticmethod
    def visible(
        messages: Sequence[Any], record: Mapping[str, Mapping[str, str]], blocked: Collection[str] = ()
    ) -> list[Any]:
        """``messages`` without the input messages whose record says ``blocked`` (for the same content) or whose id is
        in ``blocked`` (a blocked message of the thread, whatever its content in the request). A blocked assistant or
        tool message that a client wrote (:meth:`TurnKeeper.is_input`) stays in the request as a notice of the same
        role and id without its text (an assistant message without its tool calls, and the tool messages answering
        those calls left out: those whose call id's latest assistant message, the one :func:`answered_calls` binds
        them to, is withheld), so the request stays well formed."""
        if not blocked and not any(entry.get("status") == "blocked" for entry in record.values()):
            return list(messages)
        out: list[Any] = []
        withheld_calls: dict[str, bool] = {}  # call id -> whether the latest assistant message holding it is withheld
        for item in messages:
            message = as_message(item)
            digest = input_digest(message)
            entry = record.get(_key(message, digest))
            withheld = (message.id is not None and message.id in blocked) or (
                entry is not None and entry.get("digest") == digest and entry.get("status") == "blocked"
            )
            if isinstance(message, AIMessage):
                withheld_calls.update(dict.fromkeys(call_ids(message), withheld))
            elif isinstance(message, ToolMessage) and withheld_calls.get(message.tool_call_id):
                continue
            if not withheld:
                out.append(item)
            elif isinstance(message, (AIMessage, ToolMessage)):
                out.append(msgs.withheld_input(message))
        return out

    @staticmethod
    def system_visible(system: AnyMessage | None, record: Mapping[str, Mapping[str, str]]) -> bool:
        """Whether a model may read the request's system message: it has none, or its record does not say blocked."""
        if system is None:
            return True
        entry = record.get(f"{SYSTEM_KEY}{input_digest(system)}")
        return entry is None or entry.get("status") != "blocked"


# Model output --------------------------------------------------------------------------------------------------------

HELD_SUFFIX = "-held"
"""Suffix of the placeholder's id: ``<reply id>-held``."""


def output_text(ai: AIMessage, turn: Mapping[str, Any]) -> str:
    """What a model-output policy judges of a reply: its text (:func:`~guard.agents._content.message_text`), then the
    arguments of its structured-output calls as JSON (``turn["structured_text"]``, when it has any)."""
    text = message_text(ai)
    structured = turn.get("structured_text")
    return f"{text}\n{structured}".strip() if structured else text


def held_id(message_id: str) -> str:
    return f"{message_id}{HELD_SUFFIX}"


def _placeholder(ai: AIMessage) -> AIMessage:
    message = AIMessage(content="", id=held_id(ai.id or ""))
    return add_notification_metadata(message, source=msgs.SOURCE, data={"outcome": "held"})  # type: ignore[arg-type,return-value]


def structured_ids(response: ModelResponse[Any], ai: AIMessage) -> frozenset[str]:
    """The ids of ``ai``'s calls the model node answered itself: the structured-output calls of a
    ``ToolStrategy`` response format (their arguments are the agent's answer, not a tool to run)."""
    own = {call.get("id") for call in ai.tool_calls}
    return frozenset(m.tool_call_id for m in response.result if isinstance(m, ToolMessage) and m.tool_call_id in own)


def screen(response: ModelResponse[Any], ai: AIMessage, turn: dict[str, Any]) -> ModelResponse[Any]:
    """The response as it may leave the model node: ``ai`` kept (allowed or not judged), replaced by a notice
    (blocked) or by a placeholder (escalated; ``turn["held"]`` keeps the reply). A structured response goes with
    the reply: dropped with it when blocked, held with it (``turn["held_structured"]``, and the model node's
    answers to its calls in ``turn["held_messages"]``) when escalated. Calls whose arguments are too deep
    or too large to store are moved to ``invalid_tool_calls`` (:func:`~guard.agents._arguments.withhold_oversized`;
    their records already say why they are malformed)."""
    stored = withhold_oversized(ai)
    if stored is not ai:
        result = [stored if message is ai else message for message in response.result]
        response, ai = ModelResponse(result=result, structured_response=response.structured_response), stored
    output = turn.get("output")
    if output is None or output["outcome"] == "allow":
        return response
    answers = [m for m in response.result if isinstance(m, ToolMessage) and m.tool_call_id in structured_ids(response, ai)]
    if output["outcome"] == "block":
        verdict = verdict_from_json(output["verdict"])
        reason = output.get("reason")
        replacement = msgs.assistant_notice(
            msgs.OUTPUT_BLOCKED_TEMPLATE, verdict, reason, message_id=ai.id, outcome="withheld", event="model_output"
        )
        turn["calls"] = {key: {**record, "status": "withheld"} for key, record in turn["calls"].items()}
    else:
        turn["held"] = ai
        if response.structured_response is not None or answers:
            turn["held_structured"] = response.structured_response
            turn["held_messages"] = answers
        replacement = _placeholder(ai)
    result = [replacement if message is ai else message for message in response.result if message not in answers]
    return ModelResponse(result=result, structured_response=None)


# The turn's records, after the model ---------------------------------------------------------------------------------

Steps = Generator[AgentSubject, Judgement, dict[str, Any] | None]
SERVER_CALL = "server:"
"""Prefix of a server tool call's key among a turn's subjects (:meth:`TurnKeeper.subjects`)."""


def _record(judgement: Judgement) -> dict[str, Any]:
    return {
        "outcome": "escalate" if judgement.outcome == "route" else judgement.outcome,
        "verdict": verdict_json(judgement.verdict),
        "reason": judgement.reason,
        "reviewer": judgement.reviewer,
    }


def drive(steps: Steps, judge: Callable[[AgentSubject], Judgement]) -> dict[str, Any] | None:
    """Run ``steps``, judging each subject it yields with ``judge`` (blocking); returns its state update."""
    try:
        subject = next(steps)
        while True:
            subject = steps.send(judge(subject))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def adrive(steps: Steps, judge: Callable[[AgentSubject], Awaitable[Judgement]]) -> dict[str, Any] | None:
    """Async twin of :func:`drive`."""
    try:
        subject = next(steps)
        while True:
            subject = steps.send(await judge(subject))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def answered_calls(messages: Sequence[Any], calls: dict[str, Any] | None = None) -> dict[str, Any]:
    """Call id -> call (as written) of the tool calls in ``messages``' assistant messages, in any form
    (:func:`~guard.agents._content.calls_by_id`; the latest message wins for an id used twice), added to ``calls``:
    what a tool message answering that id answers."""
    calls = {} if calls is None else calls
    for item in messages:
        message = as_message(item)
        if isinstance(message, AIMessage):
            calls.update(calls_by_id(message))
    return calls


def _unanswered(turn: Mapping[str, Any] | None) -> bool:
    """Whether ``turn`` (a turn record) asked a reviewer and was never enforced (new input superseded its interrupt),
    or asked for no review and followed such a turn."""
    if turn is None:
        return False
    output = turn.get("output")
    asks = (output is not None and output.get("outcome") == "escalate") or any(
        record.get("outcome") == "escalate" and not record.get("problem") for record in turn["calls"].values()
    )
    return not turn.get("enforced") if asks else bool(turn.get("after_unanswered_review"))


def _effect(
    turn: Mapping[str, Any], record: Mapping[str, Any], tool: str
) -> Literal["read_only", "side_effecting", "unknown"]:
    """The declared effect of ``tool`` for a call of ``turn`` (a turn record) whose record is ``record``: the call's
    own when the tool is the call's, else the one the turn recorded for that tool (``unknown`` when it has none)."""
    if tool == record.get("tool"):
        effect = record.get("effect")
    else:
        effects = turn.get("effects")
        effect = effects.get(tool) if isinstance(effects, Mapping) else None
    return effect if effect in ("read_only", "side_effecting") else "unknown"  # type: ignore[return-value]


STAMPS_KEY = "guard_stamps"
"""The ``response_metadata`` key of the stamps on the messages the agent's model and tools wrote
(:meth:`TurnKeeper.stamp`), one per middleware instance name."""


class TurnKeeper:
    """The records one middleware instance keeps in ``state["guard"][name]``, and the enforcement of a model turn
    (``after_model``): blocked and malformed calls answered, escalated items reviewed in one interrupt, edits judged.

    Args:
        name: the middleware instance's name (its key in ``state["guard"]``).
        judge: evaluates subjects.
        sealer: seals the records and stamps the messages (``owner``: the name and the guard's policies,
            :func:`~guard.agents._records.record_owner`).
    """

    def __init__(self, name: str, judge: Judge, sealer: Sealer) -> None:
        self.name = name
        self.judge = judge
        self.sealer = sealer
        self._owner: tuple[Any, str] = ((), "")
        self._stamp_context: tuple[tuple[str, str | None] | None, str] = (None, "")
        self._verified = MessageMemo()  # the stamps checked, by message object (is_input)
        self._texts = MessageMemo()  # the messages' texts, by message object (conversation)

    @property
    def owner(self) -> str:
        """Whose records and stamps these are (:func:`~guard.agents._records.record_owner`), for the policies loaded
        now: a reload that changes a policy's version changes it."""
        policies = self.judge.guard.policies.policies
        cached_for, owner = self._owner
        if policies is not cached_for:
            owner = record_owner(self.name, policies)
            self._owner = (policies, owner)
        return owner

    def stored(self, state: Any) -> Mapping[str, Any]:
        """This instance's record in ``state`` as stored, seals unchecked (``{}`` when there is none)."""
        guard_state = state.get("guard") if isinstance(state, Mapping) else None
        stored = guard_state.get(self.name) if isinstance(guard_state, Mapping) else None
        return stored if isinstance(stored, Mapping) else {}

    def part(self, state: Any, part: str) -> Any:
        """Part ``part`` (``inputs``, ``turn``) of this instance's record when its seal checks out, else ``None``."""
        return open_part(self.sealer, self.owner, current_thread_id(), self.stored(state), part)

    def update(self, state: Any, **changes: Any) -> dict[str, Any]:
        """The state update that writes the parts in ``changes`` of this instance's record, each sealed, and the
        ``relayed`` part (:meth:`summarized`) when it is not up to date with ``state``; a ``turn`` whose reply holds
        server tool results not allowed (``turn["server_flagged"]``) adds them to the ``server`` part
        (:meth:`server_flagged`)."""
        turn = changes.get("turn")
        flagged = turn.get("server_flagged") if isinstance(turn, Mapping) else None
        if flagged:
            server = self._server_record(state)
            if server is not None:
                changes = {**changes, "server": {**server, turn["message_id"]: sorted(flagged)}}
        return self._write(state, {**self._relayed_change(state), **changes})

    def _server_record(self, state: Any) -> dict[str, list[str]] | None:
        """The ``server`` part pruned to the replies still in ``state``; ``None`` when a stored part's seal fails."""
        part = self.part(state, "server")
        if part is None:
            return None if "server" in self.stored(state) else {}
        ids = {getattr(message, "id", None) for message in state_messages(state)}
        return {message_id: list(blocks) for message_id, blocks in part.items() if message_id in ids}

    def server_flagged(self, state: Any) -> Collection[str]:
        """The keys (:func:`~guard.agents._records.server_key`) of the results of tools a provider ran itself, in the
        replies of ``state``, that the tool-result policy did not allow when their reply was judged (the ``server``
        part): every later call reads them withheld, as it reads a client tool's withheld result. A part whose seal
        fails counts every server result as not allowed."""
        record = self._server_record(state)
        if record is None:
            return Everything()
        return frozenset(server_key(message_id, block) for message_id, blocks in record.items() for block in blocks)

    def refresh(self, state: Any) -> dict[str, Any] | None:
        """The state update that brings the ``relayed`` part up to date with ``state`` (``None`` when it is)."""
        change = self._relayed_change(state)
        return self._write(state, change) if change else None

    def _write(self, state: Any, changes: Mapping[str, Any]) -> dict[str, Any]:
        entry = seal_record(self.sealer, self.owner, current_thread_id(), self.stored(state), changes)
        return {"guard": {self.name: entry}}

    def _relayed_record(self, state: Any) -> dict[str, Any]:
        """The ``relayed`` part as recorded: ``flagged``, whether the conversation held flagged tool results since
        the user's last message when it was written; ``seen``, each ``agent`` message then in the thread and whether
        it summarizes flagged results; ``system``, the digests of the system messages the thread opened with when this
        instance first saw it (:func:`~guard.agents._records.opening_system`), ``None`` when not known. No record at
        all: nothing flagged (not seen yet); a part whose seal fails, or a record without one: flagged (what it said
        is unknown). Without digests (no record, a seal that fails, a record that kept none) the system messages that
        open the thread are trusted by their place."""
        part = self.part(state, "relayed")
        if isinstance(part, Mapping) and isinstance(part.get("seen"), Mapping):
            system = part.get("system")
            return {"flagged": part.get("flagged") is True, "seen": dict(part["seen"]),
                    "system": list(system) if isinstance(system, list) else None}  # fmt: skip
        return {"flagged": "relayed" in self.stored(state), "seen": {}, "system": None}

    def _relayed(self, state: Any) -> tuple[dict[str, Any], list[str], list[str], frozenset[str]]:
        """The ``relayed`` part as recorded (:meth:`_relayed_record`, read once), the digests of the trusted system
        messages (:meth:`trusted_system`), the ids of the ``agent`` messages in ``state`` and those of them that
        summarize flagged results (:meth:`summarized`)."""
        record = self._relayed_record(state)
        system = opening_system(state) if record["system"] is None else record["system"]
        trust, subagent = self.judge.options.trust_subagent_input, self.judge.options.subagent
        ids = relayed_ids(state, trust_subagent_input=trust, subagent=subagent, trusted_system=system)
        summarized = frozenset(message_id for message_id in ids if record["seen"].get(message_id, record["flagged"]) is True)
        return record, system, ids, summarized

    def trusted_system(self, state: Any) -> list[str]:
        """The digests of the thread's trusted system messages: those it opened with when this instance first saw it,
        as recorded; while that is not known (not seen yet, or a record that cannot be read, as after a restart
        without ``state_key``), those that open ``state`` (:func:`~guard.agents._records.opening_system`). A system
        message whose text is not among them is role ``agent`` wherever it stands (a summary written as one)."""
        return self._relayed(state)[1]

    def summarized(self, state: Any) -> frozenset[str]:
        """The ids of the ``agent`` messages in ``state`` (:func:`~guard.agents._records.turn_history`: a summary, a
        parent agent's task) that summarize flagged tool results: as recorded when first seen; one not seen yet does
        when the conversation last recorded held flagged results (a summary replaces the messages it summarizes, so
        only the record still knows of them)."""
        return self._relayed(state)[3]

    def _relayed_change(self, state: Any) -> dict[str, Any]:
        """``{"relayed": part}`` with the part as it stands for ``state`` when the record differs, else ``{}``."""
        record, system, ids, summarized = self._relayed(state)
        trust, subagent = self.judge.options.trust_subagent_input, self.judge.options.subagent
        _, history = conversation(state, trust_subagent_input=trust, subagent=subagent, summarized=summarized,
                                  server_flagged=self.server_flagged(state), texts=self._texts,
                                  trusted_system=system)  # fmt: skip
        seen = {message_id: message_id in summarized for message_id in ids}
        now = {"flagged": flagged_results(history) > 0, "seen": seen, "system": system}
        return {} if now == record else {"relayed": now}

    def conversation(self, state: Any) -> tuple[str | None, tuple[TurnMessage, ...]]:
        """The task and the history a tool call of ``state`` is judged with
        (:func:`~guard.agents._records.conversation`, with :meth:`summarized`)."""
        _, system, _, summarized = self._relayed(state)
        trust, subagent = self.judge.options.trust_subagent_input, self.judge.options.subagent
        return conversation(state, trust_subagent_input=trust, subagent=subagent, summarized=summarized,
                            server_flagged=self.server_flagged(state), texts=self._texts,
                            trusted_system=system)  # fmt: skip

    def _stamped(self, fields: list[Any]) -> tuple[str, bytes, bytes]:
        """What a stamp covers (context, data as stored, data exactly): a message's :meth:`_fields` as JSON
        (:func:`~guard.agents._arguments.plain_json`), bound to this instance's owner
        (:func:`~guard.agents._records.record_owner`) and the thread (:meth:`_context`). A lone surrogate (a non-UTF-8
        file name) is "?" in the stored form, as LangGraph's checkpointer stores it, and itself in the exact one;
        without one the two are equal."""
        text = canonical_json(fields, plain_json)
        return self._context(), text.encode("utf-8", "replace"), text.encode("utf-8", "surrogatepass")

    @staticmethod
    def _fields(message: BaseMessage, calls: Mapping[str, Any]) -> list[Any]:
        """What a stamp covers of a message: its type, id, name, content and ``additional_kwargs`` (everything
        :func:`input_text` reads); an assistant message's tool calls; a tool message's call id and the call it answers
        (``calls[tool_call_id]``, :func:`answered_calls`: its name and arguments, so a result cannot be moved under
        another call)."""
        fields = [message.type, message.id, message.name, message.content, message.additional_kwargs]
        if isinstance(message, ToolMessage):
            fields += [message.tool_call_id, calls.get(message.tool_call_id)]
        if isinstance(message, AIMessage):
            fields += [message.tool_calls, message.invalid_tool_calls]
        return fields

    def _context(self) -> str:
        """The context of this instance's stamps in the running thread (its owner and the thread id)."""
        owner, thread_id = self.owner, current_thread_id()
        cached_for, context = self._stamp_context
        if cached_for != (owner, thread_id):
            context = seal_context("stamp", owner, thread_id)
            self._stamp_context = ((owner, thread_id), context)
        return context

    def stamp(self, message: BaseMessage, calls: Mapping[str, Any]) -> BaseMessage:
        """``message`` (a copy) stamped as written by this agent's model, its tools or this middleware: an
        HMAC-SHA256 seal of :meth:`_stamped`'s stored form (for a message holding a lone surrogate, ``:`` and the
        exact form's seal follow) in ``response_metadata["guard_stamps"][name]``, which integrations never
        send to a model. ``calls``: :func:`answered_calls` of the thread the message joins. Other message types are
        returned as they are; a message without an id gets one first, since the stamp is bound to it."""
        if not isinstance(message, (AIMessage, ToolMessage)):
            return message
        message = message.model_copy(update={"id": message.id or f"lc_guard_{uuid.uuid4().hex}"})
        context, stored, exact = self._stamped(self._fields(message, calls))
        stamp = self.sealer.seal(context, stored)
        if exact != stored:  # a lone surrogate: the stored form's seal, and the exact one's for before it is stored
            stamp = f"{stamp}:{self.sealer.seal(context, exact)}"
        stamps = message.response_metadata.get(STAMPS_KEY)
        stamps = {**(stamps if isinstance(stamps, Mapping) else {}), self.name: stamp}
        message.response_metadata = {**message.response_metadata, STAMPS_KEY: stamps}
        return message

    def stamper(self, thread: Sequence[Any]) -> Callable[[Any], Any]:
        """A function that stamps (:meth:`stamp`) the messages joining ``thread``, called on them in order: each
        tool message is bound to the call it answers among ``thread`` and the messages stamped before it, the rule
        :meth:`InputGate.pending` checks with."""
        calls = answered_calls(thread)

        def stamp(message: Any) -> Any:
            stamped = self.stamp(message, calls) if isinstance(message, BaseMessage) else message
            answered_calls([message], calls)
            return stamped

        return stamp

    def stamp_all(self, messages: Sequence[Any], thread: Sequence[Any]) -> list[Any]:
        """``messages`` (joining ``thread``) with every model reply and tool message stamped (:meth:`stamper`)."""
        stamp = self.stamper(thread)
        return [stamp(message) for message in messages]

    def stamp_update(self, state: Any, update: dict[str, Any] | None) -> dict[str, Any] | None:
        """A hook's state update with every model reply and tool message in its ``messages`` stamped (:meth:`stamp`)."""
        if not update or not isinstance(update.get("messages"), list):
            return update
        return {**update, "messages": self.stamp_all(update["messages"], state["messages"])}

    def is_input(self, message: BaseMessage, calls: Mapping[str, Any]) -> bool:
        """Whether ``message`` is model input to judge: every message but the model's replies and tool results that
        carry this instance's valid stamp (:meth:`stamp`; the model node, the tools node and this middleware's hooks
        stamp what they write). A client writes a thread's messages in any role (user, system, developer, a
        ``ChatMessage`` of any role, and assistant or tool messages too, with ``Command(update=...)`` or a role of its
        input), so an unstamped reply or tool result speaks for no one guard judged and is judged as input.
        ``calls``: :func:`answered_calls` of the messages before this one."""
        if not isinstance(message, (AIMessage, ToolMessage)) or message.id is None:
            return True
        stamps = message.response_metadata.get(STAMPS_KEY)
        stamp = stamps.get(self.name) if isinstance(stamps, Mapping) else None
        if not isinstance(stamp, str):
            return True
        fields = self._fields(message, calls)
        inputs = (self._context(), stamp, fields)
        if self._verified.get(message, "stamp", inputs):
            return False
        context, stored, exact = self._stamped(fields)
        seals = stamp.split(":")
        if exact != stored:  # only the exact form's seal: "?" made into surrogates is not what was stamped
            valid = len(seals) == 2 and self.sealer.check(context, exact, seals[1])
        else:
            valid = self.sealer.check(context, stored, seals[0])
        if valid:
            self._verified.put(message, "stamp", inputs, True)
        return not valid

    def ask(self, items: list[PendingItem], *, after_unanswered: bool) -> dict[str, dict[str, Any]]:
        """The reviewer's decisions on ``items`` (one ``interrupt()``), by item id, each recorded
        (:meth:`~guard.agents._judge.Judge.reviewed`). A list of decisions in LangChain's order is accepted unless the
        options refuse it or ``after_unanswered`` (:meth:`review_unanswered`)."""
        positional = self.judge.options.decisions_by_position and not after_unanswered
        request = review_request(items, positional=positional)
        answer = interrupt(request, response_schema=response_schema(items, exact=True, positional=positional))
        decisions: dict[str, dict[str, Any]] = answer["decisions"]
        for item in items:
            self.judge.reviewed(item, decisions[item["id"]])
        return decisions

    def review_unanswered(self, state: Any) -> bool:
        """Whether a reviewer may hold an interrupt of this thread that was never answered: the last model turn asked
        for a review and new input came before its answer, or a turn since asked for none. Decisions by position are
        refused then, since they could be meant for the items of that interrupt."""
        return _unanswered(self.part(state, "turn"))

    def server_results(self, ai: AIMessage, state: Any) -> list[AgentSubject]:
        """The ``tool_result`` subjects of the results of the tools the provider ran itself inside ``ai``
        (:func:`~guard.agents._content.server_blocks`) that a policy judges, in order; :meth:`subjects` reads their
        judgements. A result holding content guard cannot read (``unread``) is left to :meth:`subjects`."""
        results = [block for block in server_blocks(ai) if block.kind == "result" and block.value and not block.unread]
        if not results:
            return []
        task, _ = self.conversation(state)
        subjects = [AgentSubject(event="tool_result", tool_name=block.name, tool_call_id=block.id,
                                 tool_result=block.value, user_message=task, thread_id=current_thread_id())
                    for block in results]  # fmt: skip
        return [subject for subject in subjects if self.judge.matches(subject)]

    def subjects(
        self,
        ai: AIMessage,
        state: Any,
        tools: Sequence[Any] = (),
        structured: frozenset[str] = frozenset(),
        results: Sequence[tuple[AgentSubject, Judgement]] = (),
    ) -> tuple[dict[str, Any], list[tuple[str, AgentSubject]]]:
        """The turn record with malformed calls already decided, and the subjects left to judge (key, subject).

        The reply's subject holds all of its text (:func:`~guard.agents._content.message_text`: text, reasoning and
        every other block but tool calls), each tool call one subject of its own; ``tools`` (the model request's)
        let calls with empty arguments be checked against their required parameters, and give each call its tool's
        declared effect (:func:`~guard.agents._arguments.tool_effect`). The calls in ``structured`` (a response
        format's, :func:`structured_ids`) are the agent's answer: their arguments join the reply's text, judged as
        model output, and they are not tool calls.

        A tool the provider ran itself (:func:`~guard.agents._content.server_blocks`) is judged after the fact: its
        call as a tool call (key ``server:<id>``, :meth:`store` folds its verdict into the reply's), its result
        before, by the tool-result policy (``results``: :meth:`server_results` with their judgements); a result
        holding content guard cannot read (a fetched PDF, Anthropic's ``encrypted_content``) is not allowed where an
        enforced tool-result policy matches it (:meth:`~guard.agents._judge.Judge.unread`), as a client tool's is.
        Every call the reply makes after a server result reads it in its history: as a withheld result when its
        judgement is not ``allow`` (all its text flagged, ``after-injection``), else as an ordinary tool result.
        """
        if ai.id is None:
            ai.id = f"lc_guard_{uuid.uuid4().hex}"
        thread_id = current_thread_id()
        task, history = self.conversation(state)
        turn: dict[str, Any] = {"message_id": ai.id, "thread_id": thread_id, "output": None, "calls": {}}
        names = [getattr(tool, "name", None) for tool in tools if not isinstance(tool, dict)]
        if names and all(isinstance(name, str) for name in names):  # a reviewer's edit may name only these
            turn["tools"] = sorted(set(names))
        # what each tool declares it does: a reviewer's edit that renames a call is judged with its new tool's effect
        turn["effects"] = {tool.name: tool_effect(tool) for tool in tools
                           if isinstance(getattr(tool, "name", None), str)}  # fmt: skip
        previous = self.part(state, "turn")
        if previous is not None and previous.get("message_id") != ai.id and _unanswered(previous):
            turn["after_unanswered_review"] = True
        todo: list[tuple[str, AgentSubject]] = []
        if structured:
            turn["structured_text"] = json.dumps(
                [call.get("args") for call in ai.tool_calls if call.get("id") in structured], ensure_ascii=False
            )
        text = output_text(ai, turn)
        turn["text_digest"] = digest_of("model_output", text)
        if text.strip():
            subject = AgentSubject(event="model_output", text=text, user_message=task, thread_id=thread_id)
            if self.judge.matches(subject):
                todo.append(("", subject))
        blocks = server_blocks(ai)
        outcomes = {(s.tool_call_id, s.tool_result): j.outcome for s, j in results}
        for block in blocks:
            if block.kind == "result" and block.unread:
                subject = AgentSubject(event="tool_result", tool_name=block.name, tool_call_id=block.id,
                                       tool_result=block.value, user_message=task, thread_id=thread_id)  # fmt: skip
                verdict = self.judge.unread(subject, block.unread)
                outcomes[(block.id, block.value)] = "allow" if verdict is None else verdict.action
        flagged = sorted({call_id or "" for (call_id, _), outcome in outcomes.items() if outcome != "allow"})
        if flagged:
            turn["server_flagged"] = flagged
        called = {block.id: block.value for block in blocks if block.kind == "call"}
        read = [(block.position, TurnMessage("tool", block.value, block.name, block.id,
                                             "withheld" if outcomes.get((block.id, block.value), "allow") != "allow"
                                             else None, arguments=called.get(block.id)))
                for block in blocks if block.kind == "result" and (block.value or block.unread)]  # fmt: skip
        positions = call_positions(ai)
        end = len(ai.content) if isinstance(ai.content, list) else 0

        def before(position: int) -> tuple[TurnMessage, ...]:
            """The history of a call at ``position`` in the reply: the thread's, then the server results before it."""
            return (*history, *(message for at, message in read if at < position))

        for block in blocks:
            if block.kind == "call":
                todo.append((f"{SERVER_CALL}{block.id}", AgentSubject(
                    event="tool_call", tool_name=block.name, tool_call_id=block.id, arguments=block.value,
                    user_message=task, thread_id=thread_id, history=before(block.position))))  # fmt: skip
        by_name = {getattr(tool, "name", None): tool for tool in tools}
        for call in parse_calls(ai, tools):
            if call.id in structured:
                continue
            subject = AgentSubject(
                event="tool_call",
                tool_name=call.name,
                tool_call_id=call.id,
                arguments=call.arguments,
                user_message=task,
                thread_id=thread_id,
                history=before(positions.get(call.id or "", end)),
                tool_effect=tool_effect(by_name.get(call.name)),
            )
            if not call.id:
                self.judge.malformed(subject, call.problem or "the tool call has no id", call.raw)
                continue
            record: dict[str, Any] = {
                "tool": call.name,
                "arguments": call.arguments,
                "problem": call.problem,
                "effect": subject.tool_effect,
            }
            if call.problem is not None:
                verdict = self.judge.malformed(subject, call.problem, call.raw)
                record.update(outcome="block", verdict=verdict_json(verdict), reason=call.problem, digest=None)
            else:
                record["digest"] = arguments_digest(call.name, call.arguments or {})
                todo.append((call.id, subject))
            turn["calls"].setdefault(call.id, record)
        return turn, todo

    def store(self, turn: dict[str, Any], todo: list[tuple[str, AgentSubject]], judgements: list[Judgement]) -> None:
        """Put the judgements of :meth:`subjects`' subjects in ``turn``: the reply's as its ``output``, each call's in
        its record, and each server tool call's into the reply's (the worst of them: ``block`` withholds the reply,
        ``escalate`` holds it for a reviewer, since the provider already ran the call)."""
        for (key, subject), judgement in zip(todo, judgements, strict=True):
            if key == "":
                turn["output"] = {"text_digest": digest_of("model_output", subject.text or ""), **_record(judgement)}
            elif not key.startswith(SERVER_CALL):
                turn["calls"][key].update(_record(judgement))
        for (key, _), judgement in zip(todo, judgements, strict=True):
            record = _record(judgement)
            shown = (turn["output"] or {}).get("outcome", "allow")
            # a server tool call's outcome stops the reply where it is stronger than the reply's own
            if key.startswith(SERVER_CALL) and ACTION_RANK[record["outcome"]] < ACTION_RANK[shown]:
                turn["output"] = {"text_digest": turn["text_digest"], **record}

    def steps(self, state: Any) -> Steps:
        ai = next((m for m in reversed(state["messages"]) if isinstance(m, AIMessage)), None)
        if ai is None:
            return None
        turn = self.part(state, "turn")
        stored_turn = self.stored(state).get("turn")
        # A held reply under a turn whose seal fails (another key, or a client wrote it) is judged again, as model
        # output and as model input, before it is released (and stamped).
        sealed = turn is not None
        held = (turn or (stored_turn if isinstance(stored_turn, Mapping) else {})).get("held")
        placeholder: AIMessage | None = None
        if isinstance(held, AIMessage) and ai.id == held_id(held.id or ""):
            placeholder, ai = ai, held  # the reply waits for its reviewer outside the message list
        if not turn or turn.get("message_id") != ai.id:  # no record from the model node: judge now
            results = []
            for result in self.server_results(ai, state):
                results.append((result, (yield result)))
            turn, todo = self.subjects(ai, state, results=results)
            judgements = []
            for _, subject in todo:
                judgements.append((yield subject))
            self.store(turn, todo, judgements)
        turn = cast(dict[str, Any], turn)
        if placeholder is not None and not sealed:
            subject = input_subject(ai, current_thread_id())
            if self.judge.matches(subject):
                judgement = yield subject
                if judgement.outcome != "allow":  # no interrupt for it: withheld, as the late input check does
                    output = {"verdict": verdict_json(judgement.verdict), "reason": judgement.reason}
                    return self._withhold(state, ai, turn, output, None, placeholder)
        structured = {"structured_response": turn["held_structured"]} if "held_structured" in turn else {}
        held_messages = turn.get("held_messages") or []
        turn = {key: value for key, value in turn.items() if key not in ("held_structured", "held_messages")}
        turn["held"] = None
        thread_id = turn["thread_id"]
        calls = {key: dict(record) for key, record in turn["calls"].items()}
        answered = answered_ids(state, ai) if placeholder is None else set()
        out: list[Any] = []  # tool messages, and the placeholder's RemoveMessage
        if placeholder is not None:
            out += [RemoveMessage(id=placeholder.id or ""), ai, *held_messages]
        items: list[PendingItem] = []
        output = turn.get("output")
        if output is not None and output["outcome"] == "block":
            return self._withhold(state, ai, turn, output, None, placeholder)
        if output is not None and output["outcome"] == "escalate":
            items.append(
                text_item(
                    Judgement("escalate", verdict_from_json(output["verdict"]), output.get("reason")),
                    thread_id=thread_id,
                    event="model_output",
                    message_id=ai.id or "",
                    text=output_text(ai, turn),
                    digest=output["text_digest"],
                    answers=output["verdict"]["probabilities"],
                )
            )
        for call_id, record in calls.items():
            if call_id in answered:
                continue
            edit = hitl_edit(state, call_id)
            if edit is not None and not record.get("problem") and not record.get("hitl_edit"):
                yield from self._judge_hitl_edit(state, turn, record, call_id, edit)
            verdict = verdict_from_json(record["verdict"])
            if record.get("problem") and record.get("hitl_edit"):  # the model's call was fine; the reviewer's edit is not
                record["status"] = "malformed"
                model_tool = next((c["name"] for c in ai.tool_calls if c.get("id") == call_id), record["tool"])
                reason = f"the HumanInTheLoopMiddleware reviewer's edit cannot run: {record['problem']}"
                out.append(msgs.rejected(model_tool, call_id, verdict, reason, ""))
            elif record.get("problem"):
                record["status"] = "malformed"
                out.append(msgs.malformed(record["tool"], call_id, record["problem"], verdict))
            elif record["outcome"] == "allow":
                self._runnable(record, "allowed", record["tool"], record["arguments"])
            elif record["outcome"] == "block":
                record["status"] = "blocked"
                out.append(msgs.blocked(record["tool"], call_id, verdict, record.get("reason")))
            else:
                items.append(self._call_item(record, call_id, thread_id, ai.id, verdict, turn.get("tools")))
        for _ in range(DEFAULT_MAX_REVIEW_ROUNDS + 1):
            if not items:
                break
            decisions = self.ask(items, after_unanswered=bool(turn.get("after_unanswered_review")))
            next_items: list[PendingItem] = []
            for item in items:
                decision = decisions[item["id"]]
                if item["event"] == "model_output":
                    if decision["type"] == "reject":
                        reason = decision.get("message") or "a reviewer rejected it"
                        return self._withhold(state, ai, turn, output, reason, placeholder)
                    continue
                call_id = item["tool_call_id"] or ""
                record = calls[call_id]
                if decision["type"] == "approve":
                    self._runnable(
                        record,
                        "approved" if not record.get("run_tool") else "edited",
                        item["tool"] or "",
                        item["arguments"] or {},
                    )
                elif decision["type"] == "reject":
                    record["status"] = "rejected"
                    out.append(
                        msgs.rejected(
                            record["tool"],
                            call_id,
                            verdict_from_json(record["verdict"]),
                            decision.get("message"),
                            item["id"],
                        )
                    )
                else:
                    tool = decision.get("tool") or item["tool"] or record["tool"]
                    arguments = decision["arguments"]
                    task, history = self.conversation(state)
                    subject = AgentSubject(
                        event="tool_call",
                        tool_name=tool,
                        tool_call_id=call_id,
                        arguments=arguments,
                        user_message=task,
                        thread_id=thread_id,
                        history=history,
                        tool_effect=_effect(turn, record, tool),
                    )
                    judgement = yield subject
                    record["run_tool"] = tool  # marks the record as edited for a later approval
                    if judgement.outcome == "allow":
                        self._runnable(record, "edited", tool, arguments)
                    elif judgement.outcome == "block":
                        record["status"] = "blocked"
                        out.append(msgs.blocked(tool, call_id, judgement.verdict, judgement.reason))
                    else:
                        record.update(_record(judgement), tool_edit=tool, arguments_edit=arguments)
                        next_items.append(
                            tool_item(
                                judgement,
                                thread_id=thread_id,
                                message_id=ai.id,
                                tool_call_id=call_id,
                                tool=tool,
                                arguments=arguments,
                                digest=arguments_digest(tool, arguments),
                                tools=turn.get("tools"),
                            )
                        )
            items = next_items
        for item in items:  # still escalated after the last round
            record = calls[item["tool_call_id"] or ""]
            record["status"] = "blocked"
            reason = TOO_MANY_ROUNDS.format(rounds=DEFAULT_MAX_REVIEW_ROUNDS)
            out.append(
                msgs.blocked(
                    item["tool"] or "", item["tool_call_id"] or "", verdict_from_json(record["verdict"]), reason
                )
            )
        update = {**self.update(state, turn={**turn, "calls": calls, "enforced": True}), **structured}
        return {"messages": out, **update} if out else update

    def _judge_hitl_edit(
        self, state: Any, turn: Mapping[str, Any], record: dict[str, Any], call_id: str, edit: Mapping[str, Any]
    ) -> Generator[AgentSubject, Judgement, None]:
        """Put a ``HumanInTheLoopMiddleware`` reviewer's edit of the call (an HITL middleware listed after this one
        made it, and swaps it in when the tool runs) in the record in place of the model's call, judged."""
        name = edit.get("name")
        arguments, problem = classify_arguments(edit.get("args"))
        if not isinstance(name, str) or not name:
            problem = "it names no tool"
        if problem is None and arguments_digest(name, arguments or {}) == record["digest"]:
            return  # the edit changed nothing
        tool = name if isinstance(name, str) else ""
        effect = _effect(turn, record, tool)
        record.update(tool=tool, arguments=arguments, hitl_edit=True, effect=effect)
        task, history = self.conversation(state)
        subject = AgentSubject(
            event="tool_call",
            tool_name=tool,
            tool_call_id=call_id,
            arguments=arguments if problem is None else None,
            user_message=task,
            thread_id=turn["thread_id"],
            history=history,
            tool_effect=effect,
        )
        if problem is not None:
            verdict = self.judge.malformed(subject, problem, None)
            record.update(problem=problem, outcome="block", verdict=verdict_json(verdict), reason=problem, digest=None)
            return
        record["digest"] = arguments_digest(record["tool"], arguments or {})
        record.update(_record((yield subject)))

    @staticmethod
    def _runnable(record: dict[str, Any], status: str, tool: str, arguments: dict[str, Any]) -> None:
        record.update(
            status=status, run_tool=tool, run_arguments=arguments, run_digest=arguments_digest(tool, arguments)
        )

    @staticmethod
    def _call_item(
        record: dict[str, Any],
        call_id: str,
        thread_id: str | None,
        message_id: str | None,
        verdict: Any,
        tools: list[str] | None = None,
    ) -> PendingItem:
        judgement = Judgement("escalate", verdict, record.get("reason"), reviewer=record.get("reviewer"))
        return tool_item(
            judgement,
            thread_id=thread_id,
            message_id=message_id,
            tool_call_id=call_id,
            tool=record["tool"],
            arguments=record["arguments"],
            digest=record["digest"],
            answers=record["verdict"]["probabilities"],
            # an HITL middleware after this one swaps its own edit in at run time, so a second edit could not run
            decisions=("approve", "reject") if record.get("hitl_edit") else TOOL_DECISIONS,
            tools=tools,
        )

    def _withhold(
        self,
        state: Any,
        ai: AIMessage,
        turn: dict[str, Any],
        output: dict[str, Any] | None,
        reason: str | None,
        placeholder: AIMessage | None,
    ) -> dict[str, Any]:
        verdict = verdict_from_json(output["verdict"]) if output else None
        notice = msgs.assistant_notice(
            msgs.OUTPUT_BLOCKED_TEMPLATE,
            verdict,
            reason or (output or {}).get("reason"),
            message_id=ai.id,
            outcome="withheld",
            event="model_output",
        )
        calls = {key: {**record, "status": "withheld"} for key, record in turn["calls"].items()}
        messages: list[Any] = [notice] if placeholder is None else [RemoveMessage(id=placeholder.id or ""), notice]
        turn = {**turn, "calls": calls, "enforced": True}
        return {"messages": messages, "jump_to": "end", **self.update(state, turn=turn)}
