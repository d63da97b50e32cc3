"""Render the decision state from a subject, following a policy's declarative ``state`` mapping, and prepare it for
the model.

No code runs from YAML: each state field names a source (a subject field), optionally a JSON pointer into it, a
header/query/form name, a default and a character cap. The judged content only ever becomes *data* in the state.

Two steps: :func:`render_state` reads the subject (the raw state, nothing cut), and :func:`prepare_state` makes
what the model sees: every string normalised (``guard/policy/normalize.py``), then each field's ``max_chars`` applied to
the normalised text, so the cap counts characters the model reads (invisible padding does not use it up); of a value
far over its cap (:data:`NORMALIZE_WINDOW`) only the ends that can be kept are normalised. A cut is never silent: it keeps what the field's ``truncate`` says, puts :data:`CUT_MARKER` where text was left out, and
counts the field in the flag ``truncated``; with ``truncate: error`` the state is refused (:class:`StateTooLong`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from guard._json import Repeated as RepeatedKey
from guard._params import QS, KeyPath, fills, is_plain, labels, pairs, qs_names, readings, shown
from guard.errors import StateAmbiguous, StateTooLong
from guard.policy.normalize import Normalized, normalize_value
from guard.subject import AgentSubject, HttpSubject, Subject

__all__ = [
    "AGENT_SOURCES",
    "CUT_MARKER",
    "DEFAULT_TRUNCATE",
    "HTTP_SOURCES",
    "NAMED_SOURCES",
    "NORMALIZE_WINDOW",
    "REQUEST_SOURCES",
    "RESPONSE_SOURCES",
    "Repeats",
    "StateField",
    "Truncate",
    "default_fields",
    "default_state",
    "prepare_state",
    "render_state",
    "resolve_pointer",
    "split_pointer",
]

#: What a field over its ``max_chars`` keeps: ``head_tail`` the first and last halves of the cap, ``head`` the first
#: ``max_chars`` characters; ``error`` refuses the state (the verdict is a block, HTTP 413).
Truncate = Literal["head_tail", "head", "error"]
#: The default: an instruction placed after filler (the usual way to push it past a cap) is still read.
DEFAULT_TRUNCATE: Truncate = "head_tail"
#: How a named query parameter, form field or header sent more than once is read (:class:`StateField`).
Repeats = Literal["refuse", "list", "join"]
#: Put where text was left out (``{cut}``: characters not shown), so the model and a reviewer see the state is partial.
CUT_MARKER = "[... {cut} characters cut ...]"
#: A value longer than this many times its cap (a string's characters; a list's or object's compact JSON text) is
#: normalised only at the ends that can be kept (this many times the cap at each end), so a huge body costs a bounded
#: amount of work; shorter values are normalised whole, then cut.
NORMALIZE_WINDOW = 2

_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)

HTTP_SOURCES = frozenset(
    {
        "method", "path", "host", "client", "content_type", "query", "header", "body", "form", "body_text",
        "request_text", "status",
    }
)
#: Sources only a response policy (``match.http.response``) can read.
RESPONSE_SOURCES = frozenset({"status"})
#: Sources only a request policy can read (a response policy's ``body_text`` is the response's text).
REQUEST_SOURCES = frozenset({"request_text"})
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
        max_chars: cap on the value's length in characters, after normalisation (a string's length; an object's,
            list's or number's compact JSON text); ``None`` = no cap.
        truncate: what a value over ``max_chars`` keeps (:data:`Truncate`).
        children: the fields of a nested object (then ``source`` is ``None``).
        repeated: a named query parameter, form field or header sent more than once: ``refuse``
            (:class:`~guard.errors.StateAmbiguous`), ``list`` (query, form: every value, always a list) or ``join``
            (header: the copies joined with ``", "``).
    """

    name: str
    source: str | None
    pointer: tuple[str, ...] = ()
    key: str | None = None
    const: Any = None
    default: Any = None
    max_chars: int | None = None
    truncate: Truncate = DEFAULT_TRUNCATE
    children: tuple[StateField, ...] | None = None
    repeated: Repeats = "refuse"


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
    """Follow pointer tokens into a JSON value; returns ``_MISSING`` when any step is absent.

    Raises:
        StateAmbiguous: a step is a key the object repeats (its values collected, ``duplicate_keys="collect"``):
            parsers differ on which value counts.
    """
    for depth, token in enumerate(tokens):
        if isinstance(value, Mapping):
            if token not in value:
                return _MISSING
            value = value[token]
            if isinstance(value, RepeatedKey):
                raise StateAmbiguous("body", "/" + "/".join(tokens[: depth + 1]))
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


#: The media types of a form body (and none: a body built in code, or one Rack reads as a form); ``multipart/*`` too.
_FORM_MEDIA = frozenset({"", "application/x-www-form-urlencoded"})
#: HTTP sources that are the subject's attribute of that name.
_HTTP_ATTRIBUTES = HTTP_SOURCES - NAMED_SOURCES


def _read(field: StateField, subject: Subject, spellings: dict[str, _Spellings]) -> Any:
    """The value of a source that is not an attribute of an HTTP subject (:func:`_render_field` reads those).

    Raises:
        StateAmbiguous: a named query parameter or form field the request sends more than once, read with
            ``repeated: refuse``, or sends under another spelling (:func:`_refuse_aliases`).
    """
    source = field.source
    if isinstance(subject, HttpSubject):
        if source == "header":  # a repeated header is refused before the state is read (Policy.render_state)
            return subject.headers.get((field.key or "").lower(), _MISSING)
        if source == "query":
            if field.key is None:
                return subject.query
            if "query" not in spellings:
                spellings["query"] = _Spellings.of(subject.query, rack2=_rack2_query(subject),
                                                   qs=_qs_names(subject.query_string))
            sent = spellings["query"]
            _refuse_aliases(field, sent)
            values = subject.query.get(field.key)
            if sent.rack2 is not None and _filled(sent.rack2.get(field.key)) != _filled(values):
                raise StateAmbiguous("query", field.key, at_semicolon=True)
            return _named(field, values)
        if source == "form":
            form = subject.body if isinstance(subject.body, Mapping) else {}
            if field.key is None:
                return form
            if "form" not in spellings:
                spellings["form"] = _Spellings.of(form, qs=_qs_names(subject.form_string),
                                                  json=subject.content_type not in _FORM_MEDIA
                                                  and not subject.content_type.startswith("multipart/"))
            _refuse_aliases(field, spellings["form"])
            values = form.get(field.key, _MISSING)
            return _named(field, values) if isinstance(values, list) else values
        return _MISSING
    if source in AGENT_SOURCES:
        return getattr(subject, source)
    return _MISSING


@dataclass(frozen=True)
class _Spellings:
    """The query parameter or form field names of one request, as :func:`_refuse_aliases` checks them against each
    field read by name (found once per request, whatever the number of fields).

    Attributes:
        names: every name as guard split them (at ``&``), each once.
        odd: those of ``names`` that are not plain (:func:`guard._params.is_plain`): the only ones that can fill
            the place of a plain field under another spelling.
        rack2: a query holding ``;``: each name Rack 2 reads to its values (it splits at ``;`` too), only from pairs
            that carry ``=`` (a bare name is ``nil`` there); ``None`` otherwise (Rack 2 reads it as guard does).
        rack2_only: names Rack 2 reads more often than ``names`` holds them (``x=1;q=2`` holds a ``q``), each as
            often as it has it more.
        qs_only: names qs (Express) reads more often than ``names`` holds them: it ends a name at ``]=`` before
            its first ``=`` (``q[=]=x`` names ``q[=]``, which qs reads as ``q``).
        json: the names are a JSON object's keys, which no framework's form parser splits: only a spelling every
            framework reads into the field's place is refused (``comment[]``, as before such spellings were told
            apart by framework), not one some read so (``[comment]``, ``comment[x``).
    """

    names: tuple[str, ...]
    odd: tuple[str, ...]
    rack2: Mapping[str, list[str]] | None = None
    rack2_only: tuple[str, ...] = ()
    qs_only: tuple[str, ...] = ()
    json: bool = False

    @classmethod
    def of(cls, params: Mapping[str, Any], *, rack2: Mapping[str, list[str]] | None = None,
           qs: Iterable[str] | None = None, json: bool = False) -> _Spellings:
        """The spellings of ``params`` (a query's or form's ``{name: [values]}``, or a JSON object), with Rack 2's
        reading of the query (``rack2``) and the names qs reads from the query or urlencoded form (``qs``) where
        they may differ."""
        only = [name for name, values in (rack2 or {}).items() for _ in range(len(values) - len(params.get(name, ())))]
        qs_extra = Counter(qs or ())
        qs_extra.subtract({name: len(params[name]) for name in qs_extra if name in params})
        return cls(tuple(params), tuple(name for name in params if not is_plain(name)), rack2, tuple(only),
                   tuple(qs_extra.elements()), json)


def _refuse_aliases(field: StateField, sent: _Spellings) -> None:
    """Refuse a request that sends, under another spelling, the query parameter or form field ``field`` reads by
    name: one a framework stores where it stores ``field.key`` or below it (:func:`guard._params.fills`):
    ``q[]=attack`` beside or instead of ``q``, ``filter[search][]`` for ``filter[search]`` (a sibling such as
    ``filter[status]`` fills another place). Such an application would read that value as the field while the
    policy read the field absent or another copy. ``field.key`` itself among ``sent.names`` is skipped, among
    ``sent.rack2_only`` refused; of a plain ``field.key``, only names that are not plain are compared; of a JSON
    object's keys (``sent.json``), only one every framework reads so is refused.

    Raises:
        StateAmbiguous: naming the field, the first such spelling (one Rack 2 alone reads after a ``;``)
            and the frameworks that read it so.
    """
    key = field.key or ""
    plain = is_plain(key)
    names = [name for name in (sent.odd if plain else sent.names) if name != key]
    rack2_only = [name for name in sent.rack2_only if not (plain and name != key and is_plain(name))]
    qs_only = [name for name in sent.qs_only if not (plain and is_plain(name))]
    if not names and not rack2_only and not qs_only:
        return
    wanted = readings(key)
    rack2 = {"Rack 2": wanted["Rack 2"]} if "Rack 2" in wanted else {}
    qs = {framework: wanted[framework] for framework in QS if framework in wanted}
    spellings = [*((name, name, wanted) for name in names), *((name, ";" + name, rack2) for name in rack2_only),
                 *((name, name, qs) for name in qs_only)]
    for name, alias, frameworks in spellings:
        found = [framework for framework, path in readings(name).items()
                 if framework in frameworks and fills(path, frameworks[framework])]
        if found and (not sent.json or len(found) == len(frameworks)):
            raise StateAmbiguous(field.source or "", key, alias=alias, readers=_readers(found, wanted))


def _readers(frameworks: list[str], wanted: Mapping[str, KeyPath]) -> tuple[tuple[tuple[str, ...], str], ...]:
    """``frameworks`` grouped by the parameter each reads the field as (its ``wanted`` key path, spelt as PHP spells
    it), named as users know them: ``((("PHP",), "a_b"), (("Rails", "Express"), "a.b"))``."""
    by_reading: dict[str, list[str]] = {}
    for framework in frameworks:
        by_reading.setdefault(shown(wanted[framework]), []).append(framework)
    return tuple((labels(group), reading) for reading, group in by_reading.items())


def _rack2_query(subject: HttpSubject) -> dict[str, list[str]] | None:
    """Rack 2's reading of a query holding ``;`` (:func:`guard._params.pairs`: split at ``;`` as well as ``&``):
    each name to its values, from the pairs that carry ``=`` only (Rack 2 reads a bare name as ``nil``: no value
    it could be judged on); ``None`` for a query without ``;``, which Rack 2 splits as guard does."""
    if ";" not in subject.query_string:
        return None
    out: dict[str, list[str]] = {}
    for name, value in pairs(subject.query_string):
        if value is not None:
            out.setdefault(name, []).append(value)
    return out


def _qs_names(text: str) -> list[str] | None:
    """The names qs (Express) reads from a query or urlencoded form ``text`` (:func:`guard._params.qs_names`) when it
    holds ``]=`` or a percent-escaped bracket (qs reads ``%5D=`` as ``]=``), where they can differ from guard's
    split; ``None`` otherwise (qs names the pieces as guard does)."""
    return list(qs_names(text)) if "]=" in text or "%5" in text else None


def _filled(values: list[str] | None) -> list[str]:
    """The values that are not empty, in order: what :func:`_read` compares of guard's and Rack 2's readings of a
    query parameter (an empty value, or a bare name, gives an application nothing to judge)."""
    return [value for value in values or () if value]


def _named(field: StateField, values: list[Any] | None) -> Any:
    """One query parameter's or form field's ``values`` as ``field.repeated`` reads them."""
    if not values:
        return _MISSING
    if field.repeated == "list":
        return list(values)
    if len(values) > 1:
        raise StateAmbiguous(field.source or "", field.key or "")
    return values[0]


def _render_field(field: StateField, subject: Subject, spellings: dict[str, _Spellings]) -> Any:
    source = field.source
    if source in _HTTP_ATTRIBUTES and isinstance(subject, HttpSubject):  # the usual case: body_text, body, path, ...
        value = getattr(subject, source)
    elif field.children is not None:
        return _render(field.children, subject, spellings)
    elif source is None:
        return field.const
    else:
        value = _read(field, subject, spellings)
    if field.pointer and value is not _MISSING:
        value = resolve_pointer(value, field.pointer)
    if value is _MISSING or value is None:
        value = field.default
    return value


def render_state(fields: tuple[StateField, ...], subject: Subject) -> dict[str, Any]:
    """Build the raw state object ``{field.name: value}`` in declaration order (key order is model input): the
    subject's values as they are, not yet normalised or cut (see :func:`prepare_state`)."""
    return _render(fields, subject, {})


def _render(fields: tuple[StateField, ...], subject: Subject, spellings: dict[str, _Spellings]) -> dict[str, Any]:
    """:func:`render_state`, with ``spellings``: the request's query and form names by source, found at the first
    field that reads one by name."""
    state: dict[str, Any] = {}
    for field in fields:  # a loop, not a comprehension: no function object made per call
        state[field.name] = _render_field(field, subject, spellings)
    return state


def prepare_state(fields: tuple[StateField, ...], raw: Mapping[str, Any]) -> Normalized:
    """The state the model sees, from the raw state :func:`render_state` built with the same ``fields``.

    Every string is normalised (object keys inside values too; the field names come from the policy and stay), then
    each field with ``max_chars`` is cut as its ``truncate`` says, innermost fields first.

    Returns:
        :class:`~guard.policy.normalize.Normalized`: the new state (``raw`` is not changed) and the flags: the
        normalisation findings plus ``truncated``, the number of fields cut.

    Raises:
        StateTooLong: a field with ``truncate: error`` is over its ``max_chars``.
    """
    flags: dict[str, int] = {}
    state = {field.name: _prepare(field, raw.get(field.name), field.name, flags) for field in fields}
    return Normalized(state, flags)


def _prepare(field: StateField, value: Any, path: str, flags: dict[str, int]) -> Any:
    if field.children is not None and isinstance(value, Mapping):
        value = {c.name: _prepare(c, value.get(c.name), f"{path}.{c.name}", flags) for c in field.children}
        return value if field.max_chars is None else _cap(field, value, path, flags)
    limit = field.max_chars
    if limit is not None and isinstance(value, (str, Mapping, list, tuple)):
        length = len(value) if isinstance(value, str) else len(_JSON.encode(value))
        if length > 2 * NORMALIZE_WINDOW * limit:
            return _cut_long(field, value, length, limit, path, flags)
    normalized = normalize_value(value)
    _merge(flags, normalized.flags)
    return normalized.value if limit is None else _cap(field, normalized.value, path, flags)


def _merge(flags: dict[str, int], found: Mapping[str, int]) -> None:
    for name, n in found.items():
        flags[name] = flags.get(name, 0) + n


def _cap(field: StateField, value: Any, path: str, flags: dict[str, int]) -> Any:
    """``value`` (already normalised) within ``field.max_chars``: itself, or its text cut with the marker."""
    limit = field.max_chars
    if limit is None or value is None:
        return value
    text = value if isinstance(value, str) else _JSON.encode(value)
    if len(text) <= limit:
        return value
    if field.truncate == "error":
        raise StateTooLong(path, len(text), limit)
    flags["truncated"] = flags.get("truncated", 0) + 1
    marker = CUT_MARKER.format(cut=len(text) - limit)
    if field.truncate == "head":
        return f"{text[:limit]}\n{marker}"
    head = limit - limit // 2
    return f"{text[:head]}\n{marker}\n{text[len(text) - (limit - head) :]}"


def _cut_long(field: StateField, raw: Any, length: int, limit: int, path: str, flags: dict[str, int]) -> Any:
    """A value far over its cap (``length``: a string's characters, a list's or object's compact JSON text): only
    its ends are normalised (:func:`_end`: :data:`NORMALIZE_WINDOW` times the cap, widened while invisible padding
    leaves them shorter than the cap, so the cap counts what the model reads), then cut to the cap; the marker counts
    the characters of the original text left out. A value whose ends never fill the cap is normalised whole and
    capped as a short one is."""
    window = NORMALIZE_WINDOW * limit
    while 2 * window < length:
        head_raw = _end(raw, window, last=False)
        tail_raw = _end(raw, window, last=True) if field.truncate != "head" else head_raw
        head_text: str = head_raw.value
        tail_text: str = tail_raw.value
        if len(head_text) >= limit and len(tail_text) >= limit:
            if field.truncate == "error":
                raise StateTooLong(path, length, limit)
            _merge(flags, head_raw.flags)
            flags["truncated"] = flags.get("truncated", 0) + 1
            marker = CUT_MARKER.format(cut=length - limit)
            if field.truncate == "head":
                return f"{head_text[:limit]}\n{marker}"
            _merge(flags, tail_raw.flags)
            head = limit - limit // 2
            return f"{head_text[:head]}\n{marker}\n{tail_text[len(tail_text) - (limit - head) :]}"
        window *= 4
    normalized = normalize_value(raw)
    _merge(flags, normalized.flags)
    return _cap(field, normalized.value, path, flags)


def _end(value: Any, window: int, *, last: bool) -> Normalized:
    """The first (``last``: the last) ``window`` characters of ``value``, normalised: a string's, or a list's or
    object's compact JSON text as :func:`_cap` writes it, normalised as the whole value is (each string and key on
    its own, object keys that normalise alike kept apart) but only the items inside the window (:func:`_edge`); a
    string cut at the window's edge is read as that part of it, as a long string's end is."""
    if isinstance(value, str):
        return normalize_value(value[-window:] if last else value[:window])
    flags: dict[str, int] = {}
    _, text = _edge(value, window, flags, last=last)
    return Normalized(text if text is not None else _normalized_json(value, flags), flags)


def _edge(value: Any, budget: int, flags: dict[str, int], *, last: bool) -> tuple[int, str | None]:
    """How much of JSON value ``value`` the first (``last``: the last) ``budget`` characters of its compact JSON
    text hold: ``(length, None)`` when all of it (its text has ``length`` characters), else ``(budget, text)``, that
    part of its text normalised (the flags added to ``flags``).

    Items are taken in order (from the end, ``last``) while the budget lasts and normalised together (an object's
    keys that normalise alike are numbered among those inside: ``"text (2)"`` of the whole value can be ``"text"`` in
    its last window); the item across the edge is cut the same way, a string (value or key) to its characters
    inside. Numbers, booleans and ``null`` stay whole. Visits only the items inside: work bounded by ``budget``,
    not by the value."""
    if isinstance(value, str):
        if len(value) + 2 <= budget and len(encoded := _JSON.encode(value)) <= budget:
            return len(encoded), None
        keep = max(budget - 1, 0)  # the text's own quote at the far end
        text = _normalized_json(value[len(value) - keep :] if last else value[:keep], flags)
        return budget, text[1:] if last else text[:-1]
    if isinstance(value, Mapping):
        kept: dict[Any, Any] = {}
        used = 1  # the brace at this end
        for key, child in reversed(list(value.items())) if last else value.items():
            room = budget - used - (1 if kept else 0)  # a comma between members
            if room <= 0:
                return budget, _joined(kept, None, flags, last=last)
            if last:  # the value stands nearer the end than its key
                child_used, cut = _edge(child, room, flags, last=True)
                if cut is None:
                    key_used, key_cut = _edge(key, room - child_used - 1, flags, last=True)
                    if key_cut is not None:
                        cut = f"{key_cut}:{_normalized_json(child, flags)}"
            else:
                key_used, cut = _edge(key, room, flags, last=False)
                if cut is None:
                    child_used, child_cut = _edge(child, room - key_used - 1, flags, last=False)
                    if child_cut is not None:  # the key normalised among those before it, as in the whole value
                        keyed = _normalized_json({**kept, key: None}, flags)
                        return budget, keyed[: -len("null}")] + child_cut
            if cut is not None:
                return budget, _joined(kept, cut, flags, last=last)
            kept[key] = child
            used += key_used + 1 + child_used + (1 if len(kept) > 1 else 0)
        return used + 1, None
    if isinstance(value, (list, tuple)):
        items: list[Any] = []
        used = 1  # the bracket at this end
        for child in reversed(value) if last else value:
            room = budget - used - (1 if items else 0)
            if room <= 0:
                return budget, _joined(items, None, flags, last=last)
            child_used, cut = _edge(child, room, flags, last=last)
            if cut is not None:
                return budget, _joined(items, cut, flags, last=last)
            items.append(child)
            used += child_used + (1 if len(items) > 1 else 0)
        return used + 1, None
    return len(_JSON.encode(value)), None


def _joined(kept: dict[Any, Any] | list[Any], cut: str | None, flags: dict[str, int], *, last: bool) -> str:
    """The text of a list's or object's items inside a window: ``kept``, the whole ones (from the end when
    ``last``), normalised together, and ``cut``, the text of the one across the edge (``None``: the edge fell
    between items), without the bracket on the edge's side."""
    if last:
        whole = _normalized_json(dict(reversed(kept.items())) if isinstance(kept, dict) else kept[::-1], flags)
        return whole[1:] if cut is None else cut + ("," + whole[1:] if kept else whole[-1])
    whole = _normalized_json(kept, flags)
    return whole[:-1] if cut is None else whole[:-1] + ("," if kept else "") + cut


def _normalized_json(value: Any, flags: dict[str, int]) -> str:
    """``value`` normalised (the flags added to ``flags``) as compact JSON text."""
    normalized = normalize_value(value)
    _merge(flags, normalized.flags)
    return _JSON.encode(normalized.value)


_HTTP_DEFAULT = (StateField("method", "method"), StateField("path", "path"), StateField("body", "body"))
_HTTP_RESPONSE_DEFAULT = (StateField("status", "status"), StateField("body", "body"))
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
    """The state used when a policy has no ``state`` block: method/path/body for an HTTP request, status/body for a response; ``{task, tool_call: {name,
    arguments}}`` for a tool call; task/tool/result for a tool result; the text for model input and output."""
    if isinstance(subject, AgentSubject):
        return _AGENT_DEFAULTS[subject.event]
    return _HTTP_RESPONSE_DEFAULT if subject.phase == "response" else _HTTP_DEFAULT


def default_fields(http: Literal["request", "response"] | None, events: Collection[str]) -> list[tuple[StateField, ...]]:
    """Every default state a policy without a ``state`` block may render: an HTTP request's or response's (``http``:
    which one the policy judges, ``None`` when it matches no HTTP), and each of ``events``' (the agent events it
    matches; all four when it matches agent events of any kind)."""
    out = [{"request": _HTTP_DEFAULT, "response": _HTTP_RESPONSE_DEFAULT}[http]] if http else []
    return out + [_AGENT_DEFAULTS[event] for event in _AGENT_DEFAULTS if event in events]
