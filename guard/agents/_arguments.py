"""Tool-call arguments: find malformed calls before anything runs, and digest well-formed ones.

A model can emit arguments that are not valid JSON (``{"{"a":1}``), ``null``, a list, a string, or an object cut
off mid-way. LangChain keeps some of these in ``AIMessage.invalid_tool_calls``, but its streaming merge repairs
others silently: ``parse_partial_json`` turns ``{"{"a":1}`` into ``{}`` and a truncated ``{"path": "/etc/pas``
into ``{"path": "/etc/pas"}``. Where the raw argument text survives (OpenAI-style ``additional_kwargs["tool_calls"]``,
``tool_call_chunks`` of a chunk, or a finish reason saying the output was cut off), this module checks it strictly,
so a repaired call is treated as what it is: malformed. Malformed calls are never executed and never coerced to
``{}``; each sibling in the same turn is judged on its own. Empty arguments are "no arguments" only for a tool that
has no required parameters, and never for the last call of a cut-off turn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.tools import BaseTool
from pydantic import BaseModel

from guard._json import DEFAULT_MAX_DEPTH
from guard._json import loads as strict_loads
from guard.errors import InvalidJson
from guard.subject import digest_of

__all__ = [
    "CUT_OFF_REASONS",
    "EFFECT_METADATA_KEY",
    "MAX_ARGUMENT_DEPTH",
    "MAX_ARGUMENT_VALUES",
    "SURROGATE_KEY",
    "ParsedCall",
    "arguments_digest",
    "canonical_json",
    "classify_arguments",
    "cut_off",
    "empty_arguments_problem",
    "guard_effect",
    "parse_calls",
    "required_parameters",
    "shape_problem",
    "tool_effect",
    "withhold_oversized",
]

CUT_OFF_REASONS = frozenset(
    {"length", "max_tokens", "max_output_tokens", "model_context_window_exceeded", "content_filter"}
)
"""Stop reasons (compared lower-case) saying the output ended before the model finished it: its output limit
(OpenAI, Mistral, Ollama ``length``; Anthropic, Bedrock ``max_tokens``; Gemini ``MAX_TOKENS``; OpenAI Responses
``max_output_tokens``), the context window (Anthropic, Bedrock ``model_context_window_exceeded``), or a content filter
that stopped it (``content_filter``)."""
MAX_ARGUMENT_DEPTH = DEFAULT_MAX_DEPTH
"""Deepest nesting of objects and arrays accepted in a call's arguments (the arguments object is level 1), the same
limit raw argument text gets from :func:`guard._json.loads`."""
MAX_ARGUMENT_VALUES = 100_000
"""Most values (members and elements, at every level) accepted in a call's arguments."""
INTEGER_RANGE = (-(2**63), 2**64 - 1)
"""Integers accepted in a call's arguments: what LangGraph's checkpoint serializer (msgpack) can store."""
_SURROGATE = re.compile("[\\ud800-\\udfff]")
"""A UTF-16 surrogate code point (U+D800-U+DFFF): LangGraph's checkpoint serializer (msgpack) refuses a mapping key
holding one (the whole message fails to store), though it stores a value holding one as ``?``."""
SURROGATE_KEY = "arguments hold a mapping key with a UTF-16 surrogate (U+D800-U+DFFF), which a checkpoint cannot store"
_REASON_KEYS = ("finish_reason", "stop_reason", "stopReason", "done_reason")
"""``response_metadata`` keys that hold a stop reason (OpenAI/Gemini/Mistral, Anthropic, Bedrock, Ollama)."""


@dataclass(frozen=True)
class ParsedCall:
    """One tool call of a model turn, checked.

    Attributes:
        id: the call's id (``None`` when the model gave none).
        name: the tool name the model asked for (``""`` when missing).
        arguments: the arguments object when well-formed, else ``None`` (never a coerced ``{}``).
        problem: why the call is malformed (one phrase, e.g. ``"arguments are null"``), ``None`` when well-formed.
        raw: the raw argument text when the model's message kept it, for the decision record.
    """

    id: str | None
    name: str
    arguments: dict[str, Any] | None
    problem: str | None = None
    raw: str | None = None

    @property
    def malformed(self) -> bool:
        return self.problem is not None


def canonical_json(value: Any, default: Callable[[Any], Any] = repr) -> str:
    """Key-sorted, compact JSON (non-ASCII kept) used for digests and seals; values JSON cannot hold are written with
    ``default`` (``repr``) so that two different values never share a digest by accident. A mapping whose keys
    cannot be sorted together (``1`` and ``"a"``) has each key that is not a string written as ``<type>:<key>``."""
    try:
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default)
        except TypeError:
            return json.dumps(_string_keys(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              default=default)
    except RecursionError:
        raise ValueError("a value is nested too deeply to digest (more levels than Python's recursion limit)") from None


def _string_keys(value: Any) -> Any:
    """``value`` with every mapping key written as ``<type>:<key>`` (:func:`canonical_json`), strings included, so no
    two keys merge; other values as they are."""
    if isinstance(value, Mapping):
        return {f"{type(key).__name__}:{key}": _string_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(item) for item in value]
    return value


def plain_json(value: Any) -> Any:
    """A value JSON cannot hold, as a checkpoint serializer hands it back: a pydantic model or a dataclass as the
    mapping of its fields (so a seal over it still checks out after a round trip), anything else as its ``repr``.
    A ``default`` for :func:`canonical_json`."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)


def arguments_digest(tool: str, arguments: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a tool name and its exact arguments; an approval is bound to it."""
    return digest_of("tool_call", tool, canonical_json(dict(arguments)))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, (int, float)):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, (list, tuple)):
        return "a JSON array"
    return f"a {type(value).__name__}"


def _truncated(text: str) -> bool:
    # Unterminated string/object/array: the parser ran out of input rather than meeting a wrong character.
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
    except RecursionError:
        return False
    return False


def _value_problem(value: Any) -> str | None:
    """Why one value of parsed arguments is not one raw JSON text could give (``None`` when it is): a type JSON has
    no value of, a number that is not finite, or an integer a checkpoint cannot store."""
    if value is None or isinstance(value, (str, bool, dict, list, tuple)):
        return None
    if isinstance(value, int):
        if INTEGER_RANGE[0] <= value <= INTEGER_RANGE[1]:
            return None
        return "arguments hold an integer outside the 64-bit range a checkpoint can store"
    if isinstance(value, float):
        return None if math.isfinite(value) else "arguments hold a number that is not finite (NaN or Infinity)"
    return f"arguments hold a {type(value).__name__} value, which JSON cannot carry"


def shape_problem(arguments: dict[str, Any]) -> str | None:
    """Why parsed arguments are too deep, too large, or hold what raw JSON arguments could not (a key that is not a
    string, a key holding a UTF-16 surrogate, a value of a type JSON has no value of, ``NaN`` or an infinity, an
    integer too large to checkpoint):
    ``None`` when they are none of these, so arguments that arrived parsed meet the rules raw text meets. Iterative,
    and it stops at the first level or value past a limit, so it is safe on values nested past the interpreter's
    recursion limit (or holding themselves)."""
    count = len(arguments)
    stack: list[tuple[Any, int]] = [(arguments, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict) and not all(isinstance(key, str) for key in node):
            return "arguments hold a mapping key that is not a string"
        if isinstance(node, dict) and any(_SURROGATE.search(key) for key in node):
            return SURROGATE_KEY
        for child in node.values() if isinstance(node, dict) else node:
            if (problem := _value_problem(child)) is not None:
                return problem
            if isinstance(child, (dict, list, tuple)):
                if level >= MAX_ARGUMENT_DEPTH:
                    return f"arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels"
                count += len(child)
                if count > MAX_ARGUMENT_VALUES:
                    return f"arguments hold more than {MAX_ARGUMENT_VALUES} values"
                stack.append((child, level + 1))
    return None if count <= MAX_ARGUMENT_VALUES else f"arguments hold more than {MAX_ARGUMENT_VALUES} values"


def classify_arguments(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Check one tool call's arguments, given as parsed JSON or as raw text.

    The empty string (or only whitespace) reads as "no arguments", ``{}``, as LangChain's own parser reads it:
    providers send empty argument text for a tool that takes no parameters (OpenAI-compatible servers, Anthropic's
    stream when a tool has no input), and refusing it would make such tools unusable. That reading is safe only
    where nothing is missing, so two checks around this function refuse it: :func:`parse_calls` treats empty text as
    truncated on a cut-off turn, and :func:`empty_arguments_problem` refuses empty arguments for a tool with
    required parameters (which would otherwise run with defaults, or with nothing, when its schema is not enforced).

    Args:
        value: a ``dict`` (arguments that arrived parsed: malformed when nested deeper than
            :data:`MAX_ARGUMENT_DEPTH` or holding more than :data:`MAX_ARGUMENT_VALUES` values), raw argument text
            (``str``: parsed strictly by ``guard._json.loads``, so duplicate keys, ``NaN`` and excessive nesting are
            malformed too), or any other parsed value.

    Returns:
        ``(arguments, None)`` when the value is a JSON object, else ``(None, problem)`` with a phrase such as
        ``"arguments are not valid JSON"``, ``"arguments are truncated"``, ``"arguments are null"``,
        ``"arguments nest deeper than 64 levels"`` or ``"arguments are a JSON array, not an object"``.
    """
    if isinstance(value, dict):
        problem = shape_problem(value)
        return (value, None) if problem is None else (None, problem)
    if isinstance(value, str):
        if value.strip() == "":
            return {}, None
        try:
            parsed = strict_loads(value)
        except InvalidJson as exc:
            if exc.reason != "syntax":
                return None, f"arguments are not acceptable JSON: {exc.detail}"
            return None, "arguments are truncated" if _truncated(value) else "arguments are not valid JSON"
        if isinstance(parsed, dict):
            return parsed, None
        value = parsed
    if value is None:
        return None, "arguments are null"
    return None, f"arguments are {_kind(value)}, not an object"


def _raw_arguments(message: AIMessage) -> dict[str, str]:
    """``{tool_call_id: raw argument text}`` from wherever the message kept it."""
    raw: dict[str, str] = {}
    for entry in message.additional_kwargs.get("tool_calls") or ():
        if not isinstance(entry, Mapping):
            continue
        function = entry.get("function")
        call_id = entry.get("id")
        if isinstance(function, Mapping) and isinstance(call_id, str) and isinstance(function.get("arguments"), str):
            raw[call_id] = function["arguments"]
    if isinstance(message, AIMessageChunk):
        for chunk in message.tool_call_chunks:
            chunk_id, chunk_args = chunk.get("id"), chunk.get("args")
            if isinstance(chunk_id, str) and isinstance(chunk_args, str):
                raw[chunk_id] = chunk_args
    return raw


def _reason_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value.lower()
    name = getattr(value, "name", None)  # an enum member (some SDKs keep the finish reason as one)
    return name.lower() if isinstance(name, str) else None


def cut_off(message: AIMessage) -> str | None:
    """What in ``message``'s ``response_metadata`` says the output was cut off (e.g. ``"finish_reason=length"``:
    one of :data:`CUT_OFF_REASONS`, or an OpenAI Responses ``status=incomplete``), ``None`` when nothing does."""
    meta = message.response_metadata or {}
    found = [(key, meta.get(key)) for key in _REASON_KEYS]
    details = meta.get("incomplete_details")
    if isinstance(details, Mapping):
        found.append(("incomplete_details.reason", details.get("reason")))
    for key, value in found:
        reason = _reason_name(value)
        if reason in CUT_OFF_REASONS:
            return f"{key}={reason}"
    return "status=incomplete" if meta.get("status") == "incomplete" else None


def required_parameters(tool: BaseTool) -> frozenset[str]:
    """The parameters the model must give ``tool`` (its ``tool_call_schema``'s ``required``; injected arguments
    such as ``InjectedState`` are not in that schema). Empty when the schema cannot be read."""
    try:
        schema = tool.tool_call_schema
        if isinstance(schema, dict):
            required = schema.get("required")
        elif issubclass(schema, BaseModel):
            required = schema.model_json_schema().get("required")
        else:  # a pydantic.v1 model
            required = schema.schema().get("required")
    except Exception:  # noqa: BLE001 - an unreadable schema leaves the check to the tool's own validation
        return frozenset()
    return frozenset(r for r in required or () if isinstance(r, str))


def empty_arguments_problem(tool: Any, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` cannot run ``tool``: they are empty and the tool has required parameters. ``None`` when
    the arguments are not empty, ``tool`` is not a ``BaseTool`` (unknown tools are answered by the tool node), or it
    requires nothing."""
    if arguments or not isinstance(tool, BaseTool):
        return None
    required = required_parameters(tool)
    if not required:
        return None
    return f"arguments are empty, but tool `{tool.name}` requires {', '.join(sorted(required))}"


def _check_raw(arguments: dict[str, Any], raw: str) -> str | None:
    strict, problem = classify_arguments(raw)
    if problem is not None:
        return problem
    if strict != arguments:
        return "arguments differ from the text the model produced"
    return None


def parse_calls(message: AIMessage, tools: Sequence[Any] = ()) -> list[ParsedCall]:
    """Every tool call of a model turn, well-formed or not, in the order the model gave them.

    A call is malformed when LangChain already put it in ``invalid_tool_calls``; when its ``args`` are not an object;
    when the raw argument text the message kept does not strictly parse to the same object; when it is the last call
    of a cut-off turn (:func:`cut_off`) and no raw text proves it complete (no raw text, or empty text: the output
    ended before any argument was written); when its arguments are empty and its tool (in ``tools``) has required
    parameters; when it has no id; or when another call of the same turn has the same id (answers could not be
    routed to the right call).

    Args:
        message: the model's turn.
        tools: the agent's tools (``BaseTool``; other entries are ignored), for the required-parameters check.

    Returns:
        One :class:`ParsedCall` per call: ``tool_calls`` first, then ``invalid_tool_calls``.
    """
    raw = _raw_arguments(message)
    by_name = {tool.name: tool for tool in tools if isinstance(tool, BaseTool)}
    calls: list[ParsedCall] = []
    for call in message.tool_calls:
        call_id = call.get("id")
        name = call.get("name") or ""
        args, problem = classify_arguments(call.get("args"))
        text = raw.get(call_id) if call_id else None
        if problem is None and args is not None and text is not None:
            problem = _check_raw(args, text)
        if problem is None and args is not None:
            problem = empty_arguments_problem(by_name.get(name), args)
        calls.append(ParsedCall(call_id, name, args if problem is None else None, problem, text))
    reason = cut_off(message)
    last = calls[-1] if calls else None
    if last is not None and last.problem is None and not (last.raw or "").strip() and reason is not None:
        problem = f"arguments may be truncated: the output was cut off ({reason})"
        calls[-1] = ParsedCall(last.id, last.name, None, problem, last.raw)
    for invalid in message.invalid_tool_calls:
        args_text = invalid.get("args")
        _, problem = classify_arguments(args_text)
        if problem is None:
            problem = "the model's tool call could not be parsed"
        calls.append(
            ParsedCall(invalid.get("id"), invalid.get("name") or "", None, problem, args_text if args_text else None)
        )
    return _mark_id_problems(calls)


def _mark_id_problems(calls: Sequence[ParsedCall]) -> list[ParsedCall]:
    counts: dict[str | None, int] = {}
    for call in calls:
        counts[call.id] = counts.get(call.id, 0) + 1
    out: list[ParsedCall] = []
    for call in calls:
        if not call.id:
            out.append(ParsedCall(call.id, call.name, None, call.problem or "the tool call has no id", call.raw))
        elif counts[call.id] > 1:
            problem = call.problem or f"another tool call in the same turn has the id {call.id!r}"
            out.append(ParsedCall(call.id, call.name, None, problem, call.raw))
        else:
            out.append(call)
    return out


#: ``BaseTool.metadata`` key a tool author sets to declare the tool's effect for guard.
EFFECT_METADATA_KEY = "guard_effect"


def guard_effect(tool: BaseTool | None) -> Literal["read_only", "side_effecting", "unknown"]:
    """What the application declared ``tool`` does: ``metadata["guard_effect"]`` when it is ``"read_only"`` or
    ``"side_effecting"``, else ``"unknown"`` (MCP annotations are not read: a server sets them, and the MCP spec
    calls those of an untrusted server untrusted)."""
    metadata = getattr(tool, "metadata", None)
    declared = metadata.get(EFFECT_METADATA_KEY) if isinstance(metadata, Mapping) else None
    return declared if declared in ("read_only", "side_effecting") else "unknown"  # type: ignore[return-value]


def tool_effect(tool: BaseTool | None) -> Literal["read_only", "side_effecting", "unknown"]:
    """What ``tool``'s metadata says it does: :func:`guard_effect` when it says, else the MCP tool annotations that
    ``langchain-mcp-adapters`` copies into the metadata (``readOnlyHint: true`` -> read-only; ``destructiveHint:
    true`` or ``readOnlyHint: false`` -> side-effecting); ``"unknown"`` when it says nothing (no tool, no metadata,
    or other values)."""
    declared = guard_effect(tool)
    if declared != "unknown":
        return declared
    metadata = getattr(tool, "metadata", None)
    if not isinstance(metadata, Mapping):
        return "unknown"
    if metadata.get("destructiveHint") is True or metadata.get("readOnlyHint") is False:
        return "side_effecting"
    if metadata.get("readOnlyHint") is True:
        return "read_only"
    return "unknown"



def withhold_oversized(message: AIMessage) -> AIMessage:
    """``message`` with every call whose parsed arguments break :func:`shape_problem` moved to
    ``invalid_tool_calls``, its arguments replaced by a short note (a checkpointer could not store them, and they
    never run). The same message when there is none."""
    problems = [
        shape_problem(call["args"]) if isinstance(call.get("args"), dict) else None for call in message.tool_calls
    ]
    if not any(problems):
        return message
    kept = [call for call, problem in zip(message.tool_calls, problems, strict=True) if problem is None]
    withheld = [
        invalid_tool_call(name=call.get("name"), args=f"<withheld by guard: {problem}>", id=call.get("id"), error=problem)
        for call, problem in zip(message.tool_calls, problems, strict=True)
        if problem is not None
    ]
    return message.model_copy(update={"tool_calls": kept, "invalid_tool_calls": [*message.invalid_tool_calls, *withheld]})
