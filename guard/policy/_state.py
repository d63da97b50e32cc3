"""Render the decision state from a subject, following a policy's declarative ``state`` mapping.

No code runs from YAML: each state field names a source (a subject field), optionally a JSON pointer into it, a
header/query/form name, a default and a character cap. The judged content only ever becomes *data* in the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from guard.subject import AgentSubject, HttpSubject, Subject

__all__ = [
    "AGENT_SOURCES",
    "HTTP_SOURCES",
    "StateField",
    "default_state",
    "render_state",
    "resolve_pointer",
    "split_pointer",
]

HTTP_SOURCES = frozenset(
    {"method", "path", "host", "client", "content_type", "query", "header", "body", "form", "body_text"}
)
AGENT_SOURCES = frozenset({"event", "tool_name", "arguments", "tool_result", "user_message", "text"})
POINTER_SOURCES = frozenset({"body", "form", "arguments", "tool_result"})
NAMED_SOURCES = frozenset({"header", "query", "form"})

_MISSING = object()


@dataclass(frozen=True)
class StateField:
    """One compiled state field.

    Attributes:
        name: key in the rendered state object.
        source: subject field it reads (``None`` for a constant).
        pointer: RFC 6901 JSON pointer split into tokens (negative array indices count from the end).
        key: header, query parameter or form field name.
        const: the constant value when ``source`` is ``None``.
        default: value when the source is absent.
        max_chars: cap on a string value's length.
        children: the fields of a nested object (then ``source`` is ``None``).
    """

    name: str
    source: str | None
    pointer: tuple[str, ...] = ()
    key: str | None = None
    const: Any = None
    default: Any = None
    max_chars: int | None = None
    children: tuple[StateField, ...] | None = None


def split_pointer(pointer: str) -> tuple[str, ...]:
    """``"/a/b~1c/0"`` -> ``("a", "b/c", "0")`` (RFC 6901 escapes ``~1`` and ``~0``).

    Raises:
        ValueError: when a non-empty pointer does not start with ``/``.
    """
    if pointer == "":
        return ()
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer {pointer!r} must start with '/'")
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


def resolve_pointer(value: Any, tokens: tuple[str, ...]) -> Any:
    """Follow pointer tokens into a JSON value; returns ``_MISSING`` when any step is absent."""
    for token in tokens:
        if isinstance(value, Mapping):
            if token not in value:
                return _MISSING
            value = value[token]
        elif isinstance(value, (list, tuple)):
            try:
                index = int(token)
            except ValueError:
                return _MISSING
            if not -len(value) <= index < len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def _read(field: StateField, subject: Subject) -> Any:
    source = field.source
    if isinstance(subject, HttpSubject):
        if source == "header":
            return subject.headers.get((field.key or "").lower(), _MISSING)
        if source == "query":
            if field.key is None:
                return subject.query
            values = subject.query.get(field.key)
            if not values:
                return _MISSING
            return values[0] if len(values) == 1 else list(values)
        if source == "form":
            form = subject.body if isinstance(subject.body, Mapping) else {}
            if field.key is not None:
                values = form.get(field.key, _MISSING)
                if isinstance(values, list) and len(values) == 1:
                    return values[0]
                return values
            return form
        if source in HTTP_SOURCES:
            return getattr(subject, source)
        return _MISSING
    if source in AGENT_SOURCES:
        return getattr(subject, source)
    return _MISSING


def _render_field(field: StateField, subject: Subject) -> Any:
    if field.children is not None:
        return render_state(field.children, subject)
    if field.source is None:
        return field.const
    value = _read(field, subject)
    if field.pointer and value is not _MISSING:
        value = resolve_pointer(value, field.pointer)
    if value is _MISSING or value is None:
        value = field.default
    if field.max_chars is not None and isinstance(value, str) and len(value) > field.max_chars:
        value = value[: field.max_chars]
    return value


def render_state(fields: tuple[StateField, ...], subject: Subject) -> dict[str, Any]:
    """Build the state object ``{field.name: value}`` in declaration order (key order is model input)."""
    return {field.name: _render_field(field, subject) for field in fields}


_HTTP_DEFAULT = (StateField("method", "method"), StateField("path", "path"), StateField("body", "body"))
_AGENT_DEFAULTS: dict[str, tuple[StateField, ...]] = {
    "tool_call": (
        StateField("task", "user_message"),
        StateField(
            "tool_call", None, children=(StateField("name", "tool_name"), StateField("arguments", "arguments"))
        ),
    ),
    "tool_result": (
        StateField("task", "user_message"),
        StateField("tool", "tool_name"),
        StateField("result", "tool_result"),
    ),
    "model_input": (StateField("text", "text"),),
    "model_output": (StateField("task", "user_message"), StateField("text", "text")),
}


def default_state(subject: Subject) -> tuple[StateField, ...]:
    """The state used when a policy has no ``state`` block: method/path/body for HTTP; ``{task, tool_call: {name,
    arguments}}`` for a tool call; task/tool/result for a tool result; the text for model input and output."""
    if isinstance(subject, AgentSubject):
        return _AGENT_DEFAULTS[subject.event]
    return _HTTP_DEFAULT
