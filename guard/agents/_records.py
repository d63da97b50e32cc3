"""Private agent state, decision records and the small message lookups both enforcement points share.

The middleware keeps one record per model turn under ``state["guard"][<middleware name>]``::

    {"turn": {"message_id": <AIMessage id>, "thread_id": ..., "output": <record or None>,
              "calls": {<tool_call_id>: <call record>}, "effects": {<tool name>: <declared effect>}},
     "inputs": {<message id>:<digest>: {"digest": <content SHA-256>, "status": "allowed" | "blocked"}},
     "relayed": {"flagged": <bool>, "seen": {<message id>: <bool>}, "system": [<digest>, ...]},
     "server": {<reply id>: [<block id>, ...]}}

(``inputs`` is kept by :class:`~guard.agents._turn.InputGate`, with the model request's system message under
``system:<digest>``; ``relayed`` by :meth:`~guard.agents._turn.TurnKeeper.summarized`: whether the conversation held
flagged tool results since the user's last message, for each ``agent`` message (a summary) whether it
summarizes flagged results, and the digests of the system messages the thread opened with when first seen (the only
ones trusted, :func:`opening_system`); ``server``, by :meth:`~guard.agents._turn.TurnKeeper.server_flagged`: the results
of tools a provider ran itself, inside each reply still in the thread, that the tool-result policy did not allow.)

A call record holds the verdict summary, the outcome (``allow``/``block``/``escalate``/``route``), the arguments
digest, and after review a ``status`` (``allowed``, ``approved``, ``edited``, ``blocked``, ``rejected``, ``malformed``)
with the exact call allowed to run (``run_tool``, ``run_arguments``, ``run_digest``). Records are plain JSON (but a
reply held for review, kept as its message) so any checkpointer can store them; only the latest turn is kept.

**Sealed.** The state is private only with respect to graph input: a client that resumes a thread with
``Command(update=..., goto=...)`` can write ``state["guard"]`` as well. So each part of a middleware's record
(``inputs``, ``turn``) carries a seal (:func:`seal_record`, HMAC-SHA256 of the part bound to the middleware's name, its
policies, the thread and the part's name, :mod:`guard._seal`), and a part whose seal does not check out
(:func:`open_part`) is not trusted: its messages and calls are judged again, never released by it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import os
import secrets
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, NotRequired, cast

from langchain.agents.middleware.types import AgentState, PrivateStateAttr
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.config import get_config
from pydantic import BaseModel

from guard._seal import STORE_KEY_ENV, Sealer
from guard.agents._content import message_text, server_blocks
from guard.agents._judge import Judgement
from guard.agents._memo import MessageMemo
from guard.agents._messages import MAX_CUT_CHARS, SOURCE, TOOL_ADDED
from guard.agents.decisions import TEXT_DECISIONS, TOOL_DECISIONS, PendingItem, pending_id
from guard.engine import verdicts
from guard.policy.provenance import is_code_tool, same_tool
from guard.subject import AgentEvent, TurnMessage, digest_of
from guard.verdict import Verdict

__all__ = [
    "HITL_EDITS_KEY",
    "RUNNABLE",
    "Everything",
    "GuardAgentState",
    "ai_message_for",
    "answered_ids",
    "conversation",
    "current_thread_id",
    "hitl_edit",
    "in_tool_call",
    "merge_guard_state",
    "open_part",
    "opening_system",
    "record_owner",
    "record_sealer",
    "relayed_ids",
    "running_tool",
    "seal_context",
    "seal_record",
    "server_key",
    "state_messages",
    "text_item",
    "tool_item",
    "user_text",
    "verdict_from_json",
    "verdict_json",
]

RUNNABLE = frozenset({"allowed", "approved", "edited"})
"""Call-record statuses that let the tool run."""


HITL_EDITS_KEY = "hitl_edited_tool_calls"
"""The state key where LangChain's ``HumanInTheLoopMiddleware`` (batched mode) keeps each edited call,
``{tool_call_id: {"name": ..., "args": ...}}``; its ``wrap_tool_call`` runs that call in place of the model's."""


def hitl_edit(state: Any, tool_call_id: str | None) -> Mapping[str, Any] | None:
    """The call a ``HumanInTheLoopMiddleware`` reviewer put in place of ``tool_call_id`` (``{"name", "args"}``), or
    ``None`` when there is none."""
    edits = state.get(HITL_EDITS_KEY) if isinstance(state, Mapping) and tool_call_id else None
    edit = edits.get(tool_call_id) if isinstance(edits, Mapping) else None
    return edit if isinstance(edit, Mapping) else None


SEALS_KEY = "seals"
"""The key of a middleware's record that holds the seal of each of its parts (``inputs``, ``turn``)."""
_PROCESS_KEY = secrets.token_bytes(32)
"""The record key of this process when none is configured (records then hold only within the process)."""
logger = logging.getLogger("guard.agents")


def record_sealer(key: bytes | str | None) -> Sealer:
    """The sealer of a middleware's records: ``key`` (``state_key``), else ``$GUARD_STORE_KEY``, else a random key of
    this process (logged once per process: records then hold only within it).

    Raises:
        ValueError: a key shorter than :data:`guard._seal.MIN_KEY_BYTES`, naming where it came from.
    """
    source = "state_key"
    if key is None and os.environ.get(STORE_KEY_ENV):
        key, source = os.environ[STORE_KEY_ENV], f"${STORE_KEY_ENV}"
    if key is None:
        _warn_process_key()
        return Sealer(_PROCESS_KEY)
    try:
        return Sealer(key)
    except ValueError as exc:
        raise ValueError(f"GuardAgentMiddleware's {source}: {exc} (for example `openssl rand -hex 32`)") from None


@functools.cache
def _warn_process_key() -> None:
    logger.warning("guard: GuardAgentMiddleware has no state_key and $%s is unset, so its records are sealed with a "
                   "key of this process: fine for one process; a thread resumed after a restart or on another replica "
                   "has its pending turn judged again", STORE_KEY_ENV)


def _tagged(value: Any) -> Any:
    """``value`` as JSON in which a message cannot be mimicked by a mapping: mappings ``["d", {...}]``, lists ``["l",
    [...]]``, messages ``["m", type, fields]`` (every field of ``model_dump``); other pydantic models and dataclasses
    (a structured response, which a strict checkpoint serializer may hand back as a mapping) as the mapping of their
    fields; any other object ``["o", type]``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, BaseMessage):
        return ["m", type(value).__qualname__, _tagged(value.model_dump())]
    if isinstance(value, BaseModel):
        return _tagged(value.model_dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _tagged(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return ["d", {str(key): _tagged(item) for key, item in value.items()}]
    if isinstance(value, (list, tuple)):
        return ["l", [_tagged(item) for item in value]]
    return ["o", type(value).__qualname__]


def _sealed_bytes(value: Any) -> bytes:
    """What a seal covers: ``value`` as plain JSON when it is plain JSON (the input record), else as tagged JSON
    (:func:`_tagged`: a turn holding a reply kept for review); a prefix keeps the two forms apart."""
    try:
        plain = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        plain, prefix = json.dumps(_tagged(value), sort_keys=True, ensure_ascii=False, separators=(",", ":")), b"t"
    else:
        prefix = b"j"
    # a lone surrogate (a non-UTF-8 file name) is sealed as itself: a checkpointer stores "?", so such a record
    # does not check after a reload and its turn is judged again
    return prefix + plain.encode("utf-8", "surrogatepass")


def seal_context(kind: str, owner: str, thread_id: str | None, *more: str) -> str:
    """The context a seal of ``kind`` is bound to: the owner (:func:`record_owner`), the thread and ``more``, as a
    JSON list, so no two (owner, thread) pairs share one whatever characters a thread id holds."""
    return json.dumps([f"guard.agents.{kind}", owner, thread_id or "", *more], ensure_ascii=False)


def _context(owner: str, thread_id: str | None, part: str) -> str:
    return seal_context("record", owner, thread_id, part)


def seal_record(
    sealer: Sealer, owner: str, thread_id: str | None, stored: Any, changes: Mapping[str, Any]
) -> dict[str, Any]:
    """The record ``stored`` with the parts in ``changes`` replaced, each sealed (HMAC-SHA256 of the part, bound to
    ``owner``, :func:`record_owner`, the thread and the part's name). Parts not changed are kept as stored, with their
    own seals."""
    entry = dict(stored) if isinstance(stored, Mapping) else {}
    seals = dict(entry.get(SEALS_KEY)) if isinstance(entry.get(SEALS_KEY), Mapping) else {}
    for part, value in changes.items():
        entry[part] = value
        seals[part] = sealer.seal(_context(owner, thread_id, part), _sealed_bytes(value))
    entry[SEALS_KEY] = seals
    return entry


def open_part(sealer: Sealer, owner: str, thread_id: str | None, stored: Any, part: str) -> Any:
    """Part ``part`` of the record ``stored`` when its seal checks out for ``owner`` and the thread, else ``None``
    (logged as a warning when the part is there: written by a client, by another agent or policy set, sealed with
    another key, or edited)."""
    value = stored.get(part) if isinstance(stored, Mapping) else None
    if value is None:
        return None
    seals = stored.get(SEALS_KEY)
    seal = seals.get(part) if isinstance(seals, Mapping) else None
    if isinstance(seal, str) and sealer.check(_context(owner, thread_id, part), _sealed_bytes(value), seal):
        return value
    logger.warning("guard: the %s record of %s in thread %s has no valid seal, so it is judged again: sealed with "
                   "another key (each process has its own unless state_key or $%s is set), by another agent or "
                   "policy set, or written by a client", part, owner.split("\0", 1)[0], thread_id, STORE_KEY_ENV)
    return None


def record_owner(name: str, policies: Iterable[Any]) -> str:
    """Whose records these are: the middleware's name and every policy's id and version, so a record one agent
    sealed does not hold in an agent with other policies (or after a policy changes version)."""
    return "\0".join([name, *(f"{policy.id}@{policy.version}" for policy in policies)])


def merge_guard_state(left: Mapping[str, Any] | None, right: Mapping[str, Any] | None) -> dict[str, Any]:
    """Reducer for ``state["guard"]``: each middleware instance replaces only its own entry."""
    merged = dict(left or {})
    merged.update(right or {})
    return merged


class GuardAgentState(AgentState[Any]):
    """State schema of :class:`~guard.agents.GuardAgentMiddleware`: ``guard`` is private (not in input or output)."""

    guard: NotRequired[Annotated[dict[str, Any], PrivateStateAttr, merge_guard_state]]


def current_thread_id() -> str | None:
    """The LangGraph ``thread_id`` of the running graph, ``None`` outside one."""
    try:
        configurable = get_config().get("configurable") or {}
    except RuntimeError:
        return None
    thread = configurable.get("thread_id")
    return str(thread) if thread is not None else None


def verdict_json(verdict: Verdict) -> dict[str, Any]:
    """The part of a verdict a record keeps (JSON-safe)."""
    return {
        "decision_id": verdict.decision_id,
        "action": verdict.action,
        "policy": verdict.policy_id,
        "policy_version": verdict.policy_version,
        "rule": verdict.rule,
        "message": verdict.message,
        "handoff": verdict.handoff,
        "fail_mode": verdict.fail_mode,
        "error": verdict.error,
        "probabilities": verdict.probabilities(),
    }


def verdict_from_json(data: Mapping[str, Any]) -> Verdict:
    """A verdict rebuilt from :func:`verdict_json` (answers left out), for message templates."""
    return verdicts.copy_from_json(data)


def state_messages(state: Any, messages_key: str = "messages") -> Sequence[AnyMessage]:
    """The conversation in a graph state: ``state[messages_key]`` of a mapping, the attribute ``messages_key`` of
    another object, or ``state`` itself when it is a message list; ``()`` for no state (``None``, or the empty
    mapping a ``ToolNode`` invoked with tool calls outside a graph reads) or an empty conversation.

    Raises:
        ValueError: the state is a non-empty mapping without ``messages_key``, or an object without that attribute
            (``messages_key`` is not where this graph keeps its conversation: reading nothing there would judge
            calls without the user's task and history). The message names the key and the state's keys.
    """
    if state is None or (isinstance(state, Mapping) and not state):
        return ()
    if isinstance(state, list):
        return state
    if isinstance(state, Mapping):
        if messages_key in state:
            return state[messages_key] or ()
        keys = list(state)
    elif hasattr(state, messages_key):
        return getattr(state, messages_key) or ()
    else:
        keys = list(getattr(state, "__dict__", {}))
    raise ValueError(
        f"the graph state has no {messages_key!r} (its keys: {', '.join(map(repr, keys)) or 'none'}): pass the "
        f"state key of the conversation, the ToolNode's messages_key, to guard (guarded_tool_node, GuardToolWrapper "
        f"and send_tool_calls take messages_key=...)"
    )


def ai_message_for(state: Any, tool_call_id: str | None, *, messages_key: str = "messages") -> AIMessage | None:
    """The latest model turn under ``messages_key`` that holds ``tool_call_id`` (as a valid or an invalid call)."""
    for message in reversed(state_messages(state, messages_key)):
        if isinstance(message, AIMessage) and tool_call_id is not None:
            ids = [c.get("id") for c in message.tool_calls] + [c.get("id") for c in message.invalid_tool_calls]
            if tool_call_id in ids:
                return message
    return None


def answered_ids(state: Any, message: AIMessage | None, *, messages_key: str = "messages") -> set[str]:
    """``tool_call_id`` of every tool message under ``messages_key`` after ``message`` (all of them when ``message``
    is ``None``)."""
    messages = list(state_messages(state, messages_key))
    start = 0
    if message is not None:
        for index in range(len(messages) - 1, -1, -1):
            if messages[index] is message or (message.id is not None and messages[index].id == message.id):
                start = index + 1
                break
    return {m.tool_call_id for m in messages[start:] if isinstance(m, ToolMessage)}


_IN_TOOL: contextvars.ContextVar[bool] = contextvars.ContextVar("guard_in_tool", default=False)
#: The node name LangChain's ``create_agent`` (and LangGraph's prebuilt agents) give the node that runs the tools.
TOOLS_NODE = "tools"


@contextlib.contextmanager
def running_tool() -> Iterator[None]:
    """Within the block a tool runs under guard: an agent invoked inside it is a sub-agent (:func:`in_tool_call`)."""
    token = _IN_TOOL.set(True)
    try:
        yield
    finally:
        _IN_TOOL.reset(token)


def in_tool_call() -> bool:
    """Whether this graph runs inside another graph's tool call, as a sub-agent: inside a tool guard runs
    (:func:`running_tool`), or under a parent graph's node named ``tools`` (the LangGraph ``checkpoint_ns`` names the
    parent tasks before this graph's own, ``tools:<task id>|model:<task id>``)."""
    if _IN_TOOL.get():
        return True
    try:
        namespace = get_config().get("configurable", {}).get("checkpoint_ns") or ""
    except RuntimeError:  # not inside a graph run
        return False
    parents = str(namespace).split("|")[:-1]
    return any(segment.split(":", 1)[0] == TOOLS_NODE for segment in parents)


def _relayed(message: Any, subagent: bool) -> bool:
    """Whether a human message no tool added was not written by the user: LangChain's notification metadata says a
    feature added it (``lc_source``: a ``SummarizationMiddleware`` summary, a background task's update), or, with
    ``subagent`` (this agent runs as a sub-agent and its input is not trusted), it came in the agent's input, from the
    parent agent's tool call."""
    extra = getattr(message, "additional_kwargs", None)
    return subagent or (isinstance(extra, Mapping) and isinstance(extra.get("lc_source"), str))


def _system_digest(message: Any) -> str:
    """SHA-256 (hex) of a system message's text (:func:`~guard.agents._content.message_text`): what marks it as one
    of the thread's trusted system messages (:func:`opening_system`)."""
    return digest_of("system_message", message_text(message))


def _relayed_system(message: Any, started: bool, trusted: Collection[str] | None) -> bool:
    """Whether a system message is not trusted configuration: it comes after the conversation's first message of
    another type (``started``: a summary or relayed text an agent wrote there), LangChain's notification metadata
    says a feature added it (``lc_source``), or ``trusted`` (the digests of the system messages the thread opened with
    when first seen, :func:`opening_system`; ``None``: not known) does not hold its text (an agent wrote it later,
    even first in the list)."""
    extra = getattr(message, "additional_kwargs", None)
    return (started or (isinstance(extra, Mapping) and isinstance(extra.get("lc_source"), str))
            or (trusted is not None and _system_digest(message) not in trusted))  # fmt: skip


def opening_system(state: Any, *, messages_key: str = "messages") -> list[str]:
    """The digests (:func:`_system_digest`) of the system messages that open the conversation under ``messages_key``,
    but those marked ``lc_source``: trusted configuration, recorded when a thread is first seen."""
    digests: list[str] = []
    for message in state_messages(state, messages_key):
        if not isinstance(message, SystemMessage):
            break
        if not _relayed_system(message, False, None):
            digests.append(_system_digest(message))
    return digests


def _agent_messages(messages: Iterable[Any], subagent: bool, trusted: Collection[str] | None) -> Iterator[Any]:
    """The messages of ``messages`` that are role ``agent`` in :func:`turn_history`, in order: a human message no tool
    added that the user did not write (:func:`_relayed`), a system message that is not trusted configuration
    (:func:`_relayed_system`, with ``trusted``)."""
    started = False
    for message in messages:
        if isinstance(message, SystemMessage):
            if _relayed_system(message, started, trusted):
                yield message
            continue
        started = True
        if isinstance(message, HumanMessage) and _added_by(message) is None and _relayed(message, subagent):
            yield message


def _subagent(trust_subagent_input: bool, subagent: bool) -> bool:
    """Whether the input of this graph came from a parent agent, not the user: the agent is built as a sub-agent
    (``subagent``), or it runs inside another graph's tool call (:func:`in_tool_call`) and its input is not trusted."""
    return subagent or (not trust_subagent_input and in_tool_call())


def relayed_ids(
    state: Any,
    *,
    messages_key: str = "messages",
    trust_subagent_input: bool = False,
    subagent: bool = False,
    trusted_system: Collection[str] | None = None,
) -> list[str]:
    """The ids of the messages under ``messages_key`` that are role ``agent`` in :func:`conversation`'s history, in
    order (those without an id left out); ``subagent``, ``trust_subagent_input``, ``trusted_system``: as for
    :func:`conversation`."""
    subagent = _subagent(trust_subagent_input, subagent)
    messages = state_messages(state, messages_key)
    return [message.id for message in _agent_messages(messages, subagent, trusted_system) if message.id]


def user_text(state: Any, *, messages_key: str = "messages", subagent: bool = False) -> str | None:
    """All the text of the latest human message under ``messages_key`` (:func:`~guard.agents._content.message_text`)
    the user wrote (no tool added it, and it is not an ``agent`` message: :func:`turn_history`): the task the agent is
    serving. ``subagent``: this agent runs as a sub-agent whose input is not trusted (it has no user message)."""
    for message in reversed(state_messages(state, messages_key)):
        if isinstance(message, HumanMessage) and _added_by(message) is None and not _relayed(message, subagent):
            return message_text(message)
    return None


def _added_by(message: Any) -> tuple[str | None, str | None] | None:
    """The ``(tool, tool_call_id)`` that added ``message`` (:data:`~guard.agents._messages.TOOL_ADDED`), or None (for
    a thread entry that is not a message too)."""
    extra = getattr(message, "additional_kwargs", None)
    origin = extra.get(TOOL_ADDED) if isinstance(extra, Mapping) else None
    if not isinstance(origin, Mapping):
        return None
    tool, call_id = origin.get("tool"), origin.get("tool_call_id")
    return (tool if isinstance(tool, str) else None, call_id if isinstance(call_id, str) else None)


#: ``lc_data["outcome"]`` of the tool messages guard writes in place of a flagged result.
FLAGGED_RESULT_OUTCOMES = frozenset({"withheld", "quoted", "stripped"})


class Everything:
    """A collection that holds everything: the flagged server results when their record cannot be trusted."""

    def __contains__(self, item: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def server_key(message_id: str | None, block_id: str | None) -> str:
    """The key of a server tool's result among the flagged ones (:func:`turn_history`): the reply's id and the block's,
    as JSON, so no two pairs share one whatever characters the ids hold."""
    return json.dumps([message_id or "", block_id or ""], ensure_ascii=False)


def _text(message: Any, texts: MessageMemo | None) -> str:
    """:func:`~guard.agents._content.message_text` of ``message``, kept in ``texts`` (when given) for the next call."""
    if texts is None:
        return message_text(message)
    return cast(str, texts.computed(message, "text", (message.content, message.additional_kwargs), message_text))


def turn_history(
    state: Any,
    *,
    messages_key: str = "messages",
    subagent: bool = False,
    summarized: Collection[str] = (),
    server_flagged: Collection[str] = (),
    texts: MessageMemo | None = None,
    trusted_system: Collection[str] | None = None,
) -> tuple[TurnMessage, ...]:
    """The conversation under ``messages_key`` as argument provenance reads it (:class:`~guard.subject.TurnMessage`),
    oldest first: system, user, assistant text and tool results; a tool message guard wrote for a flagged result
    carries what guard did (``flagged``: withheld, quoted or stripped). A message a tool added in another role (a
    ``HumanMessage`` in its ``Command``: :data:`~guard.agents._messages.TOOL_ADDED`) is that tool's result. A human
    message the user did not write (LangChain's notification metadata, ``lc_source``: a conversation summary; with
    ``subagent``, every one in the input of an agent that runs as a sub-agent) is role ``agent``, flagged
    ``summarized`` when its id is in ``summarized`` (it summarizes flagged tool results); so is a system message
    after the conversation's first message of another type, marked ``lc_source``, or whose text is not among
    ``trusted_system`` (the digests of the system messages the thread opened with when first seen,
    :func:`opening_system`; ``None``: not known): a summary an agent wrote as a system message, even first in the
    list; the other system messages that open the conversation are role ``system``. The results of tools a
    provider ran itself inside a reply (:func:`~guard.agents._content.server_blocks`) follow its text as tool
    results, flagged ``withheld`` when their key (:func:`server_key`) is in ``server_flagged`` (the tool-result
    policy did not allow them when the reply was judged). ``texts``: where each message's text is kept for the next
    step (:func:`~guard.agents._content.message_text`, worked out again for a message changed since). Each tool
    result carries the arguments of the call it answers (``arguments``), from the model turn that made it, and the
    name of the tool that call named (:func:`_answered`: the message's own ``name`` only when no call has its id,
    OpenAI's tool messages carry none; no tool when calls that share its id leave it open), and its own name
    (``result_name``: a router's result named after the inner tool gives evidence only where both names do)."""
    out: list[TurnMessage] = []
    calls: dict[str | None, list[tuple[str, Any]]] = {}  # tool_call_id -> (tool name, arguments) of each call with it
    messages = state_messages(state, messages_key)
    relayed = {id(message) for message in _agent_messages(messages, subagent, trusted_system)}
    for message in messages:
        added = _added_by(message)
        if isinstance(message, ToolMessage) or added is not None:
            extra = message.additional_kwargs
            data = extra.get("lc_data") if extra.get("lc_source") == SOURCE else None
            outcome = data.get("outcome") if isinstance(data, Mapping) else None
            flagged = outcome if outcome in FLAGGED_RESULT_OUTCOMES else None
            cut = data.get("cut") if flagged == "stripped" and isinstance(data, Mapping) else None
            cut = cut[:MAX_CUT_CHARS] if isinstance(cut, str) else ""  # guard writes no more (a tool's own copy may)
            named, call_id = (message.name, message.tool_call_id) if isinstance(message, ToolMessage) else added
            tool, arguments = _answered(calls.get(call_id), named)
            out.append(TurnMessage("tool", _text(message, texts), tool, call_id, flagged, cut, arguments, named or None))
        elif id(message) in relayed:
            summary = message.id is not None and message.id in summarized
            out.append(TurnMessage("agent", _text(message, texts), flagged="summarized" if summary else None))
        elif isinstance(message, HumanMessage):
            out.append(TurnMessage("user", _text(message, texts)))
        elif isinstance(message, SystemMessage):
            out.append(TurnMessage("system", _text(message, texts)))
        elif isinstance(message, AIMessage):
            text = _text(message, texts)
            if text:
                out.append(TurnMessage("assistant", text))
            made: dict[str | None, list[tuple[str, Any]]] = {}
            for call in message.tool_calls:
                made.setdefault(call["id"], []).append((call["name"], call["args"]))
            calls.update(made)  # an id the model gives again in a later turn names that turn's calls
            blocks = server_blocks(message)
            called = {block.id: block.value for block in blocks if block.kind == "call"}
            out += [TurnMessage("tool", block.value, block.name, block.id,
                                "withheld" if server_key(message.id, block.id) in server_flagged else None,
                                arguments=called.get(block.id))
                    for block in blocks if block.kind == "result" and (block.value or block.unread)]  # fmt: skip
    return tuple(out)


def _answered(made: list[tuple[str, Any]] | None, name: str | None) -> tuple[str | None, Any]:
    """The tool and arguments of the call a tool result answers, from ``made`` (the name and arguments of each call
    the model made with the result's id; ``None``: none) and the result's own ``name`` (``None`` or ``""``: it has
    none), names compared as :func:`~guard.policy.provenance.same_tool` does (``Get_IBAN``, ``bank.get_iban``): the
    one call when there is one and the names agree, the result has none, or neither is a code tool
    (:func:`~guard.policy.provenance.is_code_tool`); else the one call of that name; the result's own name and no
    arguments when no call has its id; else ``(None, None)``, not known (calls that share the id, some servers number
    every call ``0``, and the name does not tell them apart, or a name no call with the id has, where a code tool is
    one of the two), so the result is no evidence."""
    name = name or None
    if not made:
        return name, None
    if name is None or (len(made) == 1 and not is_code_tool(name) and not is_code_tool(made[0][0])):
        matching = made
    else:
        matching = [call for call in made if same_tool(call[0], name)]
    return matching[0] if len(matching) == 1 else (None, None)


def conversation(
    state: Any,
    *,
    messages_key: str = "messages",
    trust_subagent_input: bool = False,
    subagent: bool = False,
    summarized: Collection[str] = (),
    server_flagged: Collection[str] = (),
    texts: MessageMemo | None = None,
    trusted_system: Collection[str] | None = None,
) -> tuple[str | None, tuple[TurnMessage, ...]]:
    """The task (:func:`user_text`) and the history (:func:`turn_history`) a tool call is judged with. When the agent
    is built as a sub-agent (``subagent``), or this graph runs inside another graph's tool call (:func:`in_tool_call`)
    and not ``trust_subagent_input``, its input came from the parent agent: no task, and role ``agent``.
    ``summarized``: the ids of the ``agent`` messages that summarize flagged tool results; ``server_flagged``: the keys
    of the server tool results not allowed (:func:`server_key`); ``texts``: where the messages' texts are kept for the
    next step (:func:`turn_history`); ``trusted_system``: the digests of the thread's trusted system messages
    (:func:`opening_system`, as the record keeps them; ``None``: only their place counts)."""
    subagent = _subagent(trust_subagent_input, subagent)
    return (
        user_text(state, messages_key=messages_key, subagent=subagent),
        turn_history(
            state,
            messages_key=messages_key,
            subagent=subagent,
            summarized=summarized,
            server_flagged=server_flagged,
            texts=texts,
            trusted_system=trusted_system,
        ),
    )


def _item_base(
    judgement: Judgement, item_id: str, thread_id: str | None, answers: dict[str, dict[str, float]] | None
) -> dict[str, Any]:
    verdict = judgement.verdict
    return {
        "id": item_id,
        "thread_id": thread_id,
        "decision_id": verdict.decision_id,
        "policy": verdict.policy_id,
        "policy_version": verdict.policy_version,
        "rule": verdict.rule,
        "message": judgement.reason or verdict.message,
        "answers": answers if answers is not None else verdict.probabilities(),
        "fail_mode": verdict.fail_mode,
        "error": verdict.error,
    }


def tool_item(
    judgement: Judgement,
    *,
    thread_id: str | None,
    message_id: str | None,
    tool_call_id: str,
    tool: str,
    arguments: dict[str, Any],
    digest: str,
    answers: dict[str, dict[str, float]] | None = None,
    decisions: tuple[str, ...] = TOOL_DECISIONS,
    tools: Iterable[str] | None = None,
) -> PendingItem:
    """The pending item for one escalated tool call; its id binds thread, turn, call id and arguments digest.
    ``decisions`` are the decision types it allows (all three by default); ``tools``, the names of the tools the agent
    can run, when known: an edit naming another tool is then refused at the resume (the item's ``tools``)."""
    item_id = pending_id(thread_id=thread_id, scope=f"tool_call:{message_id or ''}", key=tool_call_id, digest=digest)
    item = {
        "event": "tool_call",
        "tool": tool,
        "tool_call_id": tool_call_id,
        "arguments": arguments,
        "text": None,
        "digest": digest,
        "allowed_decisions": list(decisions),
        **_item_base(judgement, item_id, thread_id, answers),
    }
    if tools is not None:
        item["tools"] = sorted(set(tools))
    return cast(PendingItem, item)


def text_item(
    judgement: Judgement,
    *,
    thread_id: str | None,
    event: AgentEvent,
    message_id: str,
    text: str,
    digest: str,
    answers: dict[str, dict[str, float]] | None = None,
) -> PendingItem:
    """The pending item for an escalated model input or output (``answers`` given when the verdict was rebuilt
    from a record)."""
    item_id = pending_id(thread_id=thread_id, scope=event, key=message_id, digest=digest)
    item = {
        "event": event,
        "tool": None,
        "tool_call_id": None,
        "arguments": None,
        "text": text,
        "digest": digest,
        "allowed_decisions": list(TEXT_DECISIONS),
        **_item_base(judgement, item_id, thread_id, answers),
    }
    return cast(PendingItem, item)
