"""What the guard judges: a **subject** is one HTTP request or one agent event (OPA's *input*).

Enforcement points build subjects; policies match them and render their decision state from them
(``guard/policy``). Subjects are frozen and hold decoded, bounded data only: the ASGI middleware has already applied
its body cap, decoding and duplicate-key checks before a subject exists.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from guard._json import JSON_LEVELS, json_unescaped

__all__ = [
    "JOINED_WORDS",
    "PLAIN_KEY_CHARS",
    "AgentEvent",
    "AgentSubject",
    "HttpSubject",
    "Subject",
    "ToolEffect",
    "TurnMessage",
    "body_strings",
    "body_text_of",
    "carries_over",
    "digest_of",
    "escape_readings",
    "is_plain_key",
    "joined_words",
    "judged_strings",
    "path_words",
]

AgentEvent = Literal["tool_call", "tool_result", "model_input", "model_output"]
ToolEffect = Literal["read_only", "side_effecting", "unknown"]

PLAIN_KEY_CHARS = 24
"""Longest object key or form field name left out of the judged text when it is a plain identifier."""
_PLAIN_KEY = re.compile(rf"[A-Za-z0-9_.:@$\-]{{1,{PLAIN_KEY_CHARS}}}")
JOINED_WORDS = 4
"""Fewest words a token joins (:func:`joined_words`) for a path segment, a key or a field name to be read as words."""
#: What joins words in a token: a run of ``- _ + . ~ , :`` (a path keeps ``+`` as it is, and an app or a model reads
#: ``Ignore+all+previous+instructions`` or ``ignore:all:previous:instructions`` as words).
_JOINS = re.compile(r"[-_+.~,:]+")
#: A camelCase run of words (``ignoreAll``, ``IgnoreAllPrevious``): each hump an upper-case letter and lower-case ones,
#: so base64 (``aGVsbG8``) and acronyms (``XMLHttp``) are not.
_CAMEL = re.compile(r"[A-Za-z][a-z]*(?:[A-Z][a-z]+)+")
_HUMP = re.compile(r"(?<=[a-z])(?=[A-Z])")
#: Three joins or humps, which four words need: most names have fewer, and are answered by this one match.
_THREE_BREAKS = re.compile(r"(?:[^-_+.~,:]*?(?:[-_+.~,:]|[a-z][A-Z])){3}")
_LETTERS = re.compile(r"[^\W\d_]+")
#: A percent-escape left in a decoded path: the path was encoded twice (``%2520`` arrives as ``%20``).
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def joined_words(token: str, *, names: bool = True) -> str | None:
    """The words of ``token`` joined by spaces when it joins :data:`JOINED_WORDS` or more words of letters (the first of
    two or more) by runs of ``- _ + . ~ , :`` or camelCase humps: ``ignore-all-previous-instructions``,
    ``EvilwordIgnoreAllPrevious``, ``ignore:all:previous:rules`` -> ``ignore all previous instructions``, ...;
    ``None`` for ids, dates, versions, anything with a digit, and shorter names (``user_id``, ``createdAt``,
    ``X-Request-Id``). ``names=False`` (a path segment) reads only ``- _ + . ~ ,``: RPC-style routes name their
    actions in camelCase or after ``:`` (``/api/markAllAsReadForCurrentUser``, ``/v1/data:batchGet``), and read as
    words they sent benign requests to review."""
    if not names and ":" in token:
        return None
    if not _THREE_BREAKS.match(token):
        return None
    words: list[str] = []
    for part in _JOINS.split(token):
        if names and _CAMEL.fullmatch(part):
            words += _HUMP.split(part)
        elif _LETTERS.fullmatch(part):
            words.append(part)
        elif part:  # a digit or other punctuation (leading and trailing joins leave empty parts)
            return None
    return " ".join(words) if len(words) >= JOINED_WORDS and len(words[0]) >= 2 else None


def _format_as_space(segment: str) -> str:
    """``segment`` with each Unicode format character (category Cf: zero-width space and joiners, bidi marks, soft
    hyphen) as a space: an app or a model reads ``ignore``, U+200B, ``all`` as two words."""
    if segment.isascii():
        return segment
    return "".join(" " if unicodedata.category(c) == "Cf" else c for c in segment)


def path_words(path: str) -> list[str]:
    """The segments of a (decoded) path that hold words: those with whitespace (a format character such as U+200B
    counts as a space), as they are, or once more percent-decoded when the path was encoded twice
    (``Ignore%20all%20previous``); and those that join four or more words (:func:`joined_words`: by ``- _ + . ~
    ,``; not camelCase or ``:``, a route's action names), joined by spaces instead: what a framework passes to the app as a path parameter and the app
    may store or hand to a model (a model reads ``%20`` as a space). Route words, ids, dates and short slugs are left
    out."""
    out = []
    for segment in path.split("/"):
        if _ESCAPE.search(segment):
            segment = urllib.parse.unquote(segment)
        segment = _format_as_space(segment)
        if any(c.isspace() for c in segment):
            out.append(segment)
        elif (words := joined_words(segment, names=False)) is not None:
            out.append(words)
    return out


@dataclass(frozen=True)
class HttpSubject:
    """One HTTP request, or the upstream's response to one (``phase="response"``).

    Attributes:
        method: upper-case method, e.g. ``"POST"``.
        path: the URL path, without the query string.
        query: query parameters, each name to its list of values, in arrival order (the query split at ``&``).
        query_string: the query as sent (percent-escapes kept; its bytes as latin-1 text), where ``query`` is read
            from; empty when the subject was built from ``query`` alone. Frameworks split and name its parameters
            in their own ways (Rack 2 splits at ``;`` too), and a state field that reads one by name checks them.
        headers: header name (lower-case) to value; repeated headers joined with ``", "``.
        repeated_headers: the names (lower-case, sorted) of the request headers sent more than once, or spelled with
            ``_`` (named with ``-``: a WSGI server reads ``x_user`` as ``x-user``); a policy that reads one of them as
            one value refuses the request (:class:`~guard.errors.StateAmbiguous`). Empty for a response: the
            upstream's repeated headers are read joined.
        host: the ``Host`` header (without port), lower-case.
        client: client identity: the peer address, or what a trusted header says.
        content_type: media type without parameters, lower-case (``"application/json"``).
        body: the decoded body: a JSON value, ``{field: [values]}`` for forms, a ``str`` for text, ``None`` if empty.
        body_text: the text fields of the body joined, for policies that judge "all user text" of the body at once;
            left out (``None``), it is made from ``body`` as the middleware makes it (:func:`body_text_of`), so a
            subject built in code with only a ``body`` has its text judged. A copy with another body is made with
            :meth:`with_body`, which makes its text too (``dataclasses.replace`` with only ``body`` would keep the
            old text).
        form_string: a urlencoded request body as sent (its bytes as latin-1 text) when it holds ``]=``, where qs
            (Express's ``urlencoded({extended: true})``) ends a field name otherwise than guard's split (``q[=]=x``
            names ``q[=]``, which it reads as ``q``); empty otherwise. A state field that reads a form field by name
            checks the names qs reads from it. Not logged, and not read by rules (they read ``body``).
        status: the response status (responses only).
        phase: ``request``, or ``response``: then ``headers``, ``content_type``, ``body`` and ``body_text`` are the
            response's (a streamed response's: the window being judged, as text), and method, path, host, client and
            query the request's.
        sent_path: the path as sent where ``path`` is the view policies matched, lower-cased or without its trailing
            slash (``GuardMiddleware(path_case=..., trailing_slash=...)``); empty when they are the same.
            :attr:`request_text` reads the path's words from it (a lower-cased view has lost the camelCase of
            ``/notes/IgnoreAllPreviousInstructions``). Not logged, and not read by rules.
        deltas: a streamed response's window only: the pieces its client joins into one text
            (:class:`guard.asgi._deltas.DeltaJoiner`: per place in the events' JSON whose string changes from
            event to event, the end of what earlier windows held there, then each new string); ``body_text`` holds
            each joined. A redact span that crosses two pieces cannot be masked, so the response is stopped.
        kind: always ``"http"``.
    """

    method: str
    path: str
    query: dict[str, list[str]] = field(default_factory=dict)
    query_string: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    host: str = ""
    client: str | None = None
    content_type: str = ""
    body: Any = None
    body_text: str = None  # type: ignore[assignment]  # None: made from body in __post_init__, always a str after
    form_string: str = ""
    status: int | None = None
    phase: Literal["request", "response"] = "request"
    repeated_headers: tuple[str, ...] = ()
    deltas: tuple[tuple[str, ...], ...] = ()
    sent_path: str = ""
    kind: Literal["http"] = "http"

    def __post_init__(self) -> None:
        if self.body_text is None:  # set once, while the frozen instance is being built
            object.__setattr__(self, "body_text", body_text_of(self.body))

    def with_body(self, body: Any, body_text: str | None = None, **changes: Any) -> HttpSubject:
        """A copy with ``body`` and its ``body_text`` (``None``: made from ``body``, :func:`body_text_of`), and the
        other fields ``changes`` names. What belongs to the old body alone, ``form_string`` and ``deltas``, is empty
        unless ``changes`` names it."""
        changes = {"form_string": "", "deltas": (), **changes}
        return replace(self, body=body, body_text=body_text_of(body) if body_text is None else body_text, **changes)

    @property
    def request_text(self) -> str:
        """All user text the request carries, joined with newlines: the query's judged strings (each value, and each
        parameter name that is not a plain identifier, as :func:`body_strings` reads a form), the path's segments
        that hold words, as sent (:func:`path_words`: ``/notes/Ignore all previous instructions``,
        ``/notes/ignore-all-previous-instructions``, ``/notes/IgnoreAllPreviousInstructions``; route words, ids and
        short slugs are left out), then ``body_text``.

        An app may read a parameter from the query or the path as readily as from the body, so a policy that judges
        "all user text" reads this, not ``body_text``. Empty strings are left out.
        """
        words = path_words(self.sent_path or self.path)
        return "\n".join(part for part in (*body_strings(self.query), *words, self.body_text) if part)


@dataclass(frozen=True)
class TurnMessage:
    """One message of the conversation before an agent event, as argument provenance reads it.

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``tool``, or ``agent``: a message in the user's role that the user
            did not write (a conversation summary, such as LangChain's ``SummarizationMiddleware`` writes, or the task
            a parent agent gave this agent as a sub-agent).
        text: all of the message's text.
        tool_name, tool_call_id: the tool and call a ``tool`` message answers (``tool_name`` ``None``: not known, and
            the result is no evidence for argument provenance).
        flagged: what guard did with a tool result it flagged: ``withheld`` or ``quoted`` (the text is guard's notice
            or quote), ``stripped`` (the text is what was left once the instructions were cut out); ``None`` for a
            result passed on as it was. Of an ``agent`` message, ``summarized``: it summarizes a conversation that
            held flagged tool results, so all of its text counts as flagged.
        cut: of a ``stripped`` result, the instructions cut out of it (kept where the model does not read them), so
            a value they named stays tainted though the rest of the result repeats it.
        arguments: of a ``tool`` message, the arguments of the call it answers (``None`` when not known): a value
            the result repeats from them (``sent 90 EUR to X``, ``X is valid``) is not one the tool gave.
        result_name: of a ``tool`` message, the name the result itself carries (``None``: none). A router's or MCP
            proxy's result is named after the inner tool (``sandbox`` for the call ``dispatch``): where this name
            differs from ``tool_name``, the result is evidence only where both names give it.
    """

    role: Literal["system", "user", "assistant", "tool", "agent"]
    text: str
    tool_name: str | None = None
    tool_call_id: str | None = None
    flagged: Literal["withheld", "quoted", "stripped", "summarized"] | None = None
    cut: str = ""
    arguments: Any = None
    result_name: str | None = None


@dataclass(frozen=True)
class AgentSubject:
    """One agent event: a tool call before it runs, a tool result before the model sees it, or model input/output.

    Attributes:
        event: ``"tool_call"``, ``"tool_result"``, ``"model_input"`` or ``"model_output"``.
        tool_name: the tool's name (tool events).
        tool_call_id: the call's id (tool events).
        arguments: the parsed tool arguments (an object); never coerced from malformed JSON.
        tool_result: the tool's output (``tool_result``).
        user_message: the user's last message, i.e. the task the agent is serving.
        text: the model input or output text (model events).
        thread_id: the LangGraph thread, when known.
        history: the conversation before the event, oldest first (tool calls: what argument provenance reads).
        tool_effect: what the tool's own metadata says it does (``read_only``, ``side_effecting``; ``unknown`` when
            it says nothing); a policy's ``tools:`` declaration takes precedence (in ``call.effect`` and in the
            decision log's ``input.tool_effect``).
        kind: always ``"agent"``.
    """

    event: AgentEvent
    tool_name: str | None = None
    tool_call_id: str | None = None
    arguments: Any = None
    tool_result: Any = None
    user_message: str | None = None
    text: str | None = None
    thread_id: str | None = None
    history: tuple[TurnMessage, ...] = ()
    tool_effect: ToolEffect = "unknown"
    kind: Literal["agent"] = "agent"


Subject = HttpSubject | AgentSubject


def is_plain_key(key: str) -> bool:
    """Whether an object key or form field name is a plain identifier (structure, left out of ``body_text``): at most
    :data:`PLAIN_KEY_CHARS` characters from ``A-Z a-z 0-9 _ - . : @ $`` that do not join four or more words
    (:func:`joined_words`: ``user_id`` and ``createdAt`` are plain, ``ignore_all_prior_rules`` and
    ``ignoreAllPriorRules`` are not)."""
    return _PLAIN_KEY.fullmatch(key) is not None and joined_words(key) is None


def body_text_of(body: Any) -> str:
    """The ``body_text`` of a ``body`` built in code: its judged strings (:func:`judged_strings`) joined with newlines,
    as the middleware joins a parsed JSON or form body's, read as JSON holds it (mapping keys as text, tuples and sets
    as lists, other values as ``str``); a ``bytes`` body decoded as UTF-8 (an undecodable byte read as U+FFFD);
    ``""`` for ``None`` and for values that hold no string.

    Raises:
        ValueError: a body that refers to itself or is nested past the interpreter's recursion limit.
    """
    if isinstance(body, bytes | bytearray):
        return bytes(body).decode("utf-8", "replace")
    if body is None or isinstance(body, str):
        return body or ""
    try:
        return "\n".join(judged_strings(json.loads(json.dumps(_text_keys(body), default=str))))
    except RecursionError:
        raise ValueError("the body refers to itself or is nested too deep to read its text; pass body_text=") from None


def _text_keys(value: Any) -> Any:
    """``value`` with every mapping key as text (``str(key)``) and tuples and sets as lists."""
    if isinstance(value, Mapping):
        return {key if isinstance(key, str) else str(key): _text_keys(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_text_keys(item) for item in value]
    return value


def body_strings(value: Any) -> list[str]:
    """The judged strings of a parsed JSON or urlencoded body, in document order: every string value, and every
    object key (form field name) that is not a plain identifier, just before its value.

    One pass with a stack of iterators (no recursion, so any depth is safe); a flat object is a single loop.
    """
    if isinstance(value, str):
        return [value]
    out: list[str] = []
    if not isinstance(value, dict | list):
        return out
    append = out.append
    plain = is_plain_key
    stack: list[Iterator[Any]] = [iter(value.items() if isinstance(value, dict) else value)]
    while stack:
        for node in stack[-1]:
            if isinstance(node, tuple):  # (key, value) of an object: parsed JSON holds no tuples otherwise
                key, node = node
                if not plain(key):
                    append(key)
            if isinstance(node, str):
                append(node)
            elif isinstance(node, dict):
                stack.append(iter(node.items()))
                break
            elif isinstance(node, list):
                stack.append(iter(node))
                break
        else:
            stack.pop()
    return out


def judged_strings(value: Any) -> list[str]:
    """The strings of a parsed body that ``body_text`` joins: :func:`body_strings`, then their
    :func:`escape_readings`."""
    strings = body_strings(value)
    return strings + escape_readings(strings)


def escape_readings(strings: list[str]) -> list[str]:
    """What an application that parses the JSON ``strings`` hold reads where that JSON is written with escapes (a
    field holding ``json.dumps`` of an object: ``{"q": "\\u0069gnore ..."}``), which a rule's pattern must see: the
    strings with a backslash and a ``{``, ``[`` or ``"`` (without a backslash, a document's strings are in it as
    written), joined by newlines, with their escapes decoded (:func:`guard._json.json_unescaped`: ``{"q": "ignore
    ..."}``), then that text decoded again while it changes, :data:`~guard._json.JSON_LEVELS` times in all
    (``json.dumps`` applied twice or more). Each decoding is one pass over a text no longer than the one before, so
    the readings add up to at most ``JSON_LEVELS`` times the strings' length, in time linear in it, however many
    strings there are (parsing each string as a document took seconds for a 1 MiB body of short strings)."""
    text = "\n".join(s for s in strings if "\\" in s and ("{" in s or "[" in s or '"' in s))
    out: list[str] = []
    for _ in range(JSON_LEVELS):
        decoded = json_unescaped(text)
        if decoded == text:
            break
        out.append(decoded)
        text = decoded
    return out


#: What :func:`carries_over` counts for each value inside a body, arguments or result, besides a string's length: a
#: JSON value's punctuation, and a bound on the values it walks (at most ``chars / 8``).
_VALUE_CHARS = 8


def carries_over(subject: HttpSubject | AgentSubject, chars: int) -> bool:
    """Whether ``subject`` carries more than ``chars`` characters of data a state or a rule may read: the lengths of
    its strings (path, query, headers, body text; an agent event's text, user message and history), and for each
    value inside its query, body, arguments or result :data:`_VALUE_CHARS` plus a string's length. Counting stops
    once over ``chars``, so a megabyte body is walked no further than a small one."""
    if isinstance(subject, HttpSubject):
        count = len(subject.path) + len(subject.query_string) + len(subject.body_text)
        count += sum(len(name) + len(value) for name, value in subject.headers.items())
        stack: list[Any] = [subject.query, subject.body]
    else:
        count = len(subject.text or "") + len(subject.user_message or "")
        count += sum(len(message.text) for message in subject.history)
        stack = [subject.arguments, subject.tool_result]
    while stack and count <= chars:
        value = stack.pop()
        count += _VALUE_CHARS
        if isinstance(value, str | bytes | bytearray):
            count += len(value)
        elif isinstance(value, Mapping):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            stack.extend(value)
    return count > chars


def digest_of(*parts: bytes | str) -> str:
    """What an approval is bound to: SHA-256 (hex) of the parts, each length-prefixed so ``("ab", "c")`` and ``("a", "bc")`` differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()
