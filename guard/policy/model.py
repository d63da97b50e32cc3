"""The policy file format, as pydantic models. The JSON Schema in ``policies/guard-policy.schema.json`` is generated
from :class:`PolicyFileSpec` (``guard policy schema``), so editors validate what the loader accepts.

These models check shapes and types only (unknown keys and wrong types are errors, nothing is coerced from a
string). Meaning is checked when a policy is compiled (``guard/policy/loader.py``): CEL syntax and the names a rule
uses, System One limits, handoff targets, state sources that fit the matched subjects.

A file::

    handoff_targets: {<name>: HandoffTargetSpec}
    data: {<name>: any JSON value}          # OPA's "data": lists and thresholds rules read as data.<name>
    policies: [PolicySpec, ...]
"""

from __future__ import annotations

import re
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import unquote, urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from guard._urls import REFUSED_PATH_ESCAPES, is_path_control, split_url
from guard.policy._state import Repeats
from guard.policy.rules import MAX_WHEN_CHARS, MAX_WHEN_DEPTH
from guard.systemone import ID_PATTERN
from guard.verdict import Action, MaskStyle

__all__ = [
    "AgentMatchSpec",
    "CacheSpec",
    "HandoffTargetSpec",
    "HttpMatchSpec",
    "MatchSpec",
    "OnErrorSpec",
    "OutcomeSpec",
    "PolicyFileSpec",
    "PolicySpec",
    "QuestionSpec",
    "RedactSpec",
    "ResponseMatchSpec",
    "RuleSpec",
    "SourceSpec",
    "ToolArgumentSpec",
    "ToolSpec",
    "host_glob",
    "keys_at",
]

Truncate = Literal["head_tail", "head", "error"]
FailModeName = Literal["closed", "open", "escalate"]
SourceName = Literal[
    # HTTP subjects
    "method",
    "path",
    "host",
    "client",
    "content_type",
    "query",
    "header",
    "body",
    "form",
    "body_text",
    "request_text",
    "status",
    # agent subjects
    "event",
    "tool_name",
    "arguments",
    "tool_result",
    "user_message",
    "text",
]

DEFAULT_TIMEOUT_MS = 2000
MAX_TIMEOUT_MS = 60_000
DEFAULT_CACHE_TTL_S = 300.0
#: The longest ``cache.ttl`` a policy may ask for (30 days): answers older than that are better asked again, and a
#: finite bound keeps every store's expiry in range (Redis takes it in milliseconds).
MAX_CACHE_TTL_S = 30 * 24 * 3600
DEFAULT_HANDOFF_TIMEOUT_S = 30.0
DEFAULT_HANDOFF_STREAM_TIMEOUT_S = 600.0
#: The longest ``retry_after`` a policy may send (one day): a finite bound keeps ``Retry-After`` a number a client can
#: act on (``.inf`` would be no header value at all).
MAX_RETRY_AFTER_S = 24 * 3600
#: The most characters a question's ``instructions``, and its ``criteria``, may hold as the model reads them (a
#: string as it is, anything else as compact JSON): about the whole default 16,384-token prompt of English text, so a
#: longer one can leave no room for the state (the backend's own check at load, where it has one, is exact).
MAX_QUESTION_TEXT_CHARS = 65_536



#: What a path glob must look like (a request's path always starts with ``/``), and the error's hint.
PATH_GLOB_PATTERN = r"^/"
#: A policy version: printable ASCII without spaces, as it is sent in the ``x-guard-policy`` header (``id@version``).
VERSION_PATTERN = r"^[!-~]{1,64}$"
#: A policy id, rule id or handoff target name: each is sent in a response header (``x-guard-policy``,
#: ``x-guard-rule``, ``x-guard-handoff``).
NAME_PATTERN = f"^{ID_PATTERN.pattern}$"  # the question id's pattern (System One's)
#: A media type without parameters, ``type/subtype`` (RFC 9110 8.3.1 tokens, without ``*``), or a range: ``type/*``
#: or ``*/*`` (guard/policy/_match.py ``media_matches``).
MEDIA_TYPE_PATTERN = r"^(?:\*/\*|[A-Za-z0-9!#$%&'+.^_`|~-]+/(?:\*|[A-Za-z0-9!#$%&'+.^_`|~-]+))$"
#: An HTTP method: an RFC 9110 token (9.1), no spaces or commas.
METHOD_PATTERN = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"
PATTERN_HINTS = {
    PATH_GLOB_PATTERN: "a path glob starts with '/' (e.g. /v1/**); a path without one matches no request",
    MEDIA_TYPE_PATTERN: "a media type is type/subtype without parameters (e.g. application/json), or a range: "
    "type/* (e.g. text/*) or */*",
    METHOD_PATTERN: "a method is one token per list item (e.g. [POST, PUT]); this one would match no request",
    NAME_PATTERN: "an id or name is 1 to 100 characters from A-Z, a-z, 0-9, '_', '.' and '-'; it is sent in a "
    "response header",
    VERSION_PATTERN: "a version is 1 to 64 printable ASCII characters without spaces (e.g. '1.2.0'); it is sent in "
    "the x-guard-policy response header",
}
MediaType = Annotated[str, Field(pattern=MEDIA_TYPE_PATTERN)]
HttpMethod = Annotated[str, Field(pattern=METHOD_PATTERN)]
#: The methods of the IANA HTTP Method Registry, and the cache purges of Varnish and nginx (PURGE, BAN): a method
#: outside these is probably misspelt (``guard policy check`` warns).
KNOWN_METHODS = frozenset({
    "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "CONNECT", "COPY", "DELETE", "GET", "HEAD", "LABEL",
    "LINK", "LOCK", "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE", "MOVE", "OPTIONS",
    "ORDERPATCH", "PATCH", "POST", "PRI", "PROPFIND", "PROPPATCH", "PUT", "QUERY", "REBIND", "REPORT", "SEARCH",
    "TRACE", "UNBIND", "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE", "UPDATEREDIRECTREF", "VERSION-CONTROL",
    "PURGE", "BAN",
})  # fmt: skip


#: What a host glob may hold: what a ``Host`` header's name does (letters, digits, ``-._~``; ``:`` in a bare IPv6
#: address, as a server address without ``Host`` is matched), or an ``[IPv6]`` literal with an optional zone, and
#: the glob's ``*`` and ``?``.
_HOST_GLOB = re.compile(r"[A-Za-z0-9\-._~*?:]+|\[[A-Za-z0-9\-._~*?:%]+\]")
_NOT_HOST = re.compile(r"[^A-Za-z0-9\-._~*?:%\[\]]")
_PORT_HINT = " (to tell ports apart, match the Host header: headers: {host: '*:8443'})"


def host_glob(glob: str, *, port_hint: str = "") -> str:
    """``glob`` when it is a host glob some ``Host`` can match: hosts are matched lower-case, without port and
    trailing dot (``guard/asgi/_subject.py``), so a glob holding either, a URL (``https://api.example.com``), or a
    character no ``Host`` holds (a space, ``/``, ``@``, a letter outside ASCII) would never match.

    Args:
        port_hint: added to the message for a glob with a port.

    Raises:
        ValueError: naming the glob and what is wrong with it.
    """
    if "://" in glob:
        raise ValueError(f"host glob {glob!r} is a URL; write its host alone: {urlsplit(glob).hostname or ''!r}")
    if glob.count(":") == 1 or "]:" in glob:
        raise ValueError(f"host glob {glob!r} holds a port; hosts are matched without the port, so it would never "
                         f"match: drop the port{port_hint}")
    if glob.endswith("."):
        raise ValueError(f"host glob {glob!r} ends in a dot; hosts are matched without the trailing dot of a fully "
                         f"qualified name, so it would never match: write {glob.rstrip('.')!r}")
    if not glob:
        raise ValueError("host glob '' is empty; write a host name (api.example.com) or a glob (*.example.com)")
    if not _HOST_GLOB.fullmatch(glob):
        bad = _NOT_HOST.search(glob)
        what = f"holds {bad.group()!r}, which no Host header holds" if bad else "is no host name or [IPv6] literal"
        raise ValueError(f"host glob {glob!r} {what}, so it would never match: a host is letters, digits, '-', '.' "
                         "and '_' (an international name in its xn-- form), an IPv4 address or an [IPv6] literal; "
                         "'*' and '?' match within a label")
    return glob


HostGlob = Annotated[str, AfterValidator(lambda glob: host_glob(glob, port_hint=_PORT_HINT))]


_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
#: A query written into a path glob: '?' then a parameter name, then '=', '&' or the glob's end (?op=delete, ?all).
#: '?' followed by anything else ('/a/?=1', '/files/?.txt', '/v?/chat') is the one-character wildcard.
_QUERY_LIKE = re.compile(r"\?[A-Za-z_][A-Za-z0-9_.-]*(?:[=&]|$)")


def _path_glob(glob: str) -> str:
    """``glob`` itself when the canonical path every request is reduced to (guard/asgi/_target.py: percent-decoded,
    empty segments merged, dot segments removed; a backslash, an encoded slash or backslash and a control character
    refused) could match it. ';' and '#' stay allowed: %3B and %23 decode to them.

    Raises:
        ValueError: naming what the glob holds that no such path holds, and what to write instead.
    """
    if "//" in glob:
        merged = re.sub("/{2,}", "/", glob)
        raise ValueError(f"path glob {glob!r} holds '//'; requests are matched with empty segments merged "
                         f"(/api//admin is judged as /api/admin), so it would never match: write {merged!r}")
    dots = [segment for segment in glob.split("/") if segment in (".", "..")]
    if dots:
        raise ValueError(f"path glob {glob!r} holds the dot segment {dots[0]!r}; requests are matched with dot "
                         "segments removed (/a/./b is judged as /a/b, /a/../b as /b), so it would never match: write "
                         "the path it stands for")
    escapes = [match.group() for match in _ESCAPE.finditer(glob)]
    for escape in escapes:
        byte = int(escape[1:], 16)
        if byte in REFUSED_PATH_ESCAPES or is_path_control(byte):
            what = REFUSED_PATH_ESCAPES.get(byte, "an encoded control character")
            raise ValueError(f"path glob {glob!r} holds {escape!r}, {what}; a request whose path holds it is refused "
                             "(400 invalid_target), so it would never match")
    if escapes:  # a percent-escape matches only its own text (a request sending %25), never the decoded character
        decoded = unquote(glob, errors="replace")
        wildcard = " ('?' and '*' stay wildcards: a glob has no literal form of them)" if any(
            escape.upper() in ("%3F", "%2A") for escape in escapes) else ""
        raise ValueError(f"path glob {glob!r} holds the percent-escape {escapes[0]!r}; requests are matched on "
                         "their decoded path (/caf%C3%A9 is judged as /caf\u00e9), so it matches only the text "
                         f"{escapes[0]!r} (sent as %25{escapes[0][1:]}), never the character it encodes: write "
                         f"the character itself: {decoded!r}{wildcard}")
    query = _QUERY_LIKE.search(glob)
    if query:
        raise ValueError(f"path glob {glob!r} holds a query string ({query.group().rstrip('=&')!r}); a path glob "
                         "matches the path only ('?' is any one character of it), so it would never match a query: "
                         "match the path, and the query in a rule (state: {op: 'query:op'}, when: state.op == "
                         "'delete')")
    for char in glob:
        if char == "\\" or is_path_control(ord(char)):
            raise ValueError(f"path glob {glob!r} holds {char!r}; a request whose path holds it is refused (400 "
                             "invalid_target), so it would never match")
    return glob


#: A path glob: starts with ``/`` (the pattern, also in the JSON Schema) and holds nothing a request's canonical path
#: never holds (:func:`_path_glob`).
PathGlob = Annotated[str, Field(pattern=PATH_GLOB_PATTERN), AfterValidator(_path_glob)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
VersionText = Annotated[str, Field(pattern=VERSION_PATTERN)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _version_string(value: Any) -> Any:
    # ``version: 3`` is common; keep it as text. ``version: 1.10`` would silently become 1.1, so it must be quoted.
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # pydantic turns ValueError (not TypeError) into a validation error with the field's path
        raise ValueError(f"YAML reads this as the number {value!r}; quote the version, e.g. version: '1.10'")  # noqa: TRY004
    return value


def _source_shorthand(value: Any) -> Any:
    # "body:/messages/-1/content" -> {from: body, pointer: ...}; "header:user-agent" -> {from: header, name: ...}
    if isinstance(value, str):
        source, sep, arg = value.partition(":")
        if not sep:
            return {"from": source}
        if arg.startswith("/") or arg == "":
            return {"from": source, "pointer": arg}
        return {"from": source, "name": arg}
    return value


def _outcome_shorthand(value: Any) -> Any:
    return {"action": value} if isinstance(value, str) else value


class ResponseMatchSpec(_Strict):
    """Which upstream responses a response policy judges (of the requests its other ``http`` conditions match).
    Every listed condition must hold; an empty list means "any"."""

    status: list[Annotated[int, Field(ge=100, le=599)]] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Response status codes (100 to 599), e.g. [200, 201]; [] = any.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Response header name (case-insensitive) -> value glob; every one must be present and match.",
    )
    content_types: list[MediaType] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Response media types without parameters, e.g. [application/json, text/event-stream], or "
        "ranges: text/* (every text type), */* (any media type, or none: the same as []); [] = any, a response "
        "without a Content-Type too.",
    )


class HttpMatchSpec(_Strict):
    """Which HTTP requests a policy applies to. Every listed condition must hold; an empty list means "any".

    Globs: in ``paths`` ``*`` matches within one ``/`` segment and ``**`` across segments; in ``hosts`` ``*``
    matches within one ``.`` label; in ``headers`` values ``*`` matches anything (the header must be present).
    """

    methods: list[HttpMethod] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="HTTP methods, e.g. [POST, PUT] (compared case-insensitively); GET also matches HEAD, which "
        "servers answer with the GET handler; [] = any.",
    )
    paths: list[PathGlob] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Path globs, e.g. /v1/chat/** or /api/*/items (* within a segment, ** across, ? one character); "
        "[] = any.",
    )
    hosts: list[HostGlob] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Host globs without port or trailing dot, e.g. *.example.com (* within a label); [] = any.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Header name (case-insensitive) -> value glob; every one must be present and match; '*' = present.",
    )
    content_types: list[MediaType] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Media types without parameters, e.g. application/json, or ranges: application/* (every "
        "application type), */* (any media type, or none: the same as []); [] = any, a request without a "
        "Content-Type too.",
    )
    response: ResponseMatchSpec | None = Field(
        default=None,
        description="Judge the upstream's response instead of the request: the conditions above select the "
        "requests, these the responses (status, headers, media type); omitted: the policy judges requests.",
    )


class AgentMatchSpec(_Strict):
    """Which agent events a policy applies to. An empty list means "any"."""

    events: list[Literal["tool_call", "tool_result", "model_input", "model_output"]] = Field(
        default_factory=list, json_schema_extra={"default": []}, description="Agent events to judge; [] = all four."
    )
    tools: list[str] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Tool-name globs, e.g. [shell, 'fs_*']; [] = any. A non-empty list never matches events without a "
        "tool (model input/output): with only those in events it is a load error.",
    )


class MatchSpec(_Strict):
    """A policy matches HTTP subjects when ``http`` is given, agent subjects when ``agent`` is given (or both)."""

    http: HttpMatchSpec | None = Field(default=None, description="Match HTTP requests; omitted: none.")
    agent: AgentMatchSpec | None = Field(default=None, description="Match agent events; omitted: none.")


class SourceSpec(_Strict):
    """Where one state field comes from: exactly one of ``from`` (a subject field), ``const`` (a fixed value) or
    ``fields`` (a nested object of further sources).

    Shorthand strings: ``body``, ``body:/a/0/b`` (JSON pointer), ``header:user-agent``, ``query:q``, ``form:prompt``,
    ``arguments:/command``, ``tool_result``. Negative array indices in pointers count from the end
    (``/messages/-1/content`` = the last message).
    """

    from_: SourceName | None = Field(
        default=None,
        alias="from",
        description="The subject field to read: HTTP method, path, host, client, content_type, query, header, body, "
        "form, body_text (the body's text), request_text (the query's, the path's words and the body's text; requests only), status "
        "(responses only); agent event, tool_name, arguments, tool_result, user_message, text.",
    )
    const: Any = Field(default=None, description="A fixed JSON value for this field (instead of 'from').")
    fields: dict[str, SourceField] | None = Field(
        default=None,
        description="A nested object: field name -> source or shorthand string, rendered in this order.",
    )
    pointer: str | None = Field(
        default=None,
        description="RFC 6901 JSON pointer into body, form, arguments or tool_result, e.g. /messages/-1/content "
        "(negative index = from the end).",
    )
    name: str | None = Field(
        default=None, description="Header, query parameter or form field name (required for header)."
    )
    default: Any = Field(default=None, description="Value when the source or pointer target is absent or null.")
    max_chars: int | None = Field(
        default=None,
        gt=0,
        description="Cap on the value's length in characters, counted after normalisation (a string's length; an "
        "object's, list's or number's compact JSON text); a longer value is cut as 'truncate' says and counted in "
        "flags.truncated; omitted: no cap.",
    )
    truncate: Truncate = Field(
        default="head_tail",
        description="What a value over max_chars keeps: head_tail = its first and last max_chars/2 characters with a "
        "cut marker between (an instruction placed after filler is still read); head = its first max_chars and the "
        "marker; error = judge nothing and block (HTTP 413). Only with max_chars.",
    )
    repeated: Repeats = Field(
        default="refuse",
        description="A query parameter, form field or header (with 'name') the request sends more than once: refuse = "
        "judge nothing and block (HTTP 400, rule state_ambiguous: parsers differ on which copy counts); list = read "
        "every value, always as a list (query and form); join = read the copies joined with ', ' as RFC 9110 combines "
        "them (header).",
    )


SourceField = Annotated[SourceSpec, BeforeValidator(_source_shorthand, json_schema_input_type=str | SourceSpec)]
SourceSpec.model_rebuild()


class QuestionSpec(_Strict):
    """One System One question, either written out (``type``, ``instructions``, ``criteria``) or taken from the
    built-in catalog (``catalog: guard.prompt_injection``): then the canonical id, type, wording and options are used,
    which both the compact CPU model and Clef answer.

    ``id`` is the wire id sent to the model (default: the key in ``questions``; for a catalog question, the catalog
    id). ``criteria``: noul ``{"true": ..., "false": ...}`` (quoted: a plain ``true`` is YAML's boolean, not text);
    choice ``{option_id: description}`` (2-255 options, sent sorted by id: their order does not matter); score
    ``[lowest level, ..., highest]`` (2-10 levels). Limits are the Workers AI limits, checked at load.
    """

    id: str | None = Field(
        default=None,
        description=f"Wire id sent to the model, {ID_PATTERN.pattern}; default: the key (catalog: the catalog id).",
    )
    catalog: str | None = Field(
        default=None,
        description="A built-in catalog question id (guard.prompt_injection, guard.harmful_request, "
        "guard.harm_severity, guard.tool_call_serves_task, guard.refusal); then omit type, instructions, criteria.",
    )
    type: Literal["noul", "choice", "score"] | None = Field(
        default=None,
        description="noul = yes/no (answer: P(true)); choice = one of 2-255 options; score = one of 2-10 ordered "
        "levels (answer: expected level). Required unless catalog is given.",
    )
    instructions: Any = Field(
        default=None,
        description="What to decide: a string, or an object/array of strings. Required unless catalog. At most "
        f"{MAX_QUESTION_TEXT_CHARS} characters (anything but a string counted as compact JSON).",
    )
    criteria: Any = Field(
        default=None,
        description='Options: noul {"true": ..., "false": ...} (optional; quoted: a plain true is not text); choice '
        "{option_id: description} (2-255, sent sorted by id: their order does not matter); score [lowest level, ..., "
        f"highest] (2-10). At most {MAX_QUESTION_TEXT_CHARS} characters as compact JSON.",
    )


class RedactSpec(_Strict):
    """What a ``redact`` outcome masks in an HTTP body (request or response) before it goes on."""

    patterns: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Label -> regular expression (RE2 syntax: no look-around or backreferences) searched in every string of the body, e.g. "
        "card: '\\b(?:\\d[ -]?){13,16}\\b'; the label is recorded, never the text.",
    )
    detector: bool = Field(
        default=False, description="Also mask the spans the policy's instruction detector finds (label instructions)."
    )
    style: MaskStyle = Field(
        default="redact",
        description="redact = [REDACTED:<label>]; mask = one * per character, the last 4 kept for spans of 8 or more.",
    )


class OutcomeSpec(_Strict):
    """What to do: ``allow``, ``block`` (with ``status`` 4xx, default 403; 429 for rate-like rules), ``escalate``
    (human review), ``handoff`` (to the LLM target named in ``handoff``) or ``redact`` (mask spans named in
    ``redact``, then allow; HTTP only)."""

    action: Action = Field(
        description="allow; block (refuse); escalate (hold for human review); handoff (send to an LLM target); "
        "redact (mask the spans 'redact' names in the body, then allow; HTTP only)."
    )
    status: int | None = Field(
        default=None, ge=400, le=499, description="HTTP status of a block (block only); default 403."
    )
    message: str | None = Field(default=None, description="Text for the caller, the reviewer or the agent's model.")
    retry_after: float | None = Field(
        default=None,
        ge=0,
        le=MAX_RETRY_AFTER_S,
        allow_inf_nan=False,
        description=f"Seconds, sent as Retry-After (e.g. with status 429; not with allow), at most {MAX_RETRY_AFTER_S} "
        "(a day); omitted: none.",
    )
    handoff: str | None = Field(
        default=None, description="A key of the file's handoff_targets (handoff only, and required there)."
    )
    redact: RedactSpec | None = Field(
        default=None, description="What to mask (redact only, and required there): patterns and/or the detector."
    )


class RuleSpec(OutcomeSpec):
    """One rule: ``when`` is a CEL expression over the answers (by question key), ``subject``, ``state``, ``flags``
    and ``data``; rules are tried in order and the first whose ``when`` is true decides."""

    id: str = Field(pattern=NAME_PATTERN,
                    description="Rule id, unique in the policy; reported as the verdict's rule. 'default' and "
                    "'on_error' are the verdict's rule when no rule fired or a fail mode decided.")
    when: str = Field(
        description="CEL expression that must yield a bool, e.g. injection.noul >= 0.85; names: question keys, "
        "answers, subject, state, flags, data, call, result. x.matches(p) searches x for the RE2 pattern p (Unicode "
        "\\d \\s \\w, ASCII \\b; no backreferences or lookaround). Functions besides CEL's: skeleton(x), "
        "confusable(x, y), sqli(x), xss(x), code_exec(x) and path_traversal(x) (docs/policies.md). At most "
        f"{MAX_WHEN_CHARS} characters, nested at most {MAX_WHEN_DEPTH} deep (operators in a row, plus one per bracket). "
        "Inside the body of a macro over request data (state, subject, call, result) the request is read only "
        "through the macro's variable, and map() and filter() do not run over it: else the cost grows with the "
        "square of the request."
    )


class OnErrorSpec(_Strict):
    """The fail mode: what happens when the backend errors, times out or returns a malformed answer.

    ``closed`` blocks (HTTP 503 with ``Retry-After``), ``escalate`` sends to review, ``open`` allows, loudly: flagged on
    the verdict, counted and logged as a warning. Default: closed for HTTP, escalate for agent tool calls, closed for
    other agent events.
    """

    mode: FailModeName = Field(
        description="closed (block with status), open (allow, flagged and logged) or escalate (human review)."
    )
    status: int = Field(default=503, ge=400, le=599, description="HTTP status of a fail-closed block (closed only).")
    retry_after: float = Field(
        default=5.0,
        ge=0,
        le=MAX_RETRY_AFTER_S,
        allow_inf_nan=False,
        description=f"Seconds for Retry-After on a fail-closed block (closed only), at most {MAX_RETRY_AFTER_S} "
        "(a day); a shorter hint from the backend is passed on, a longer one is capped at this value.",
    )
    message: str | None = Field(
        default=None, description="Text for the caller; default for closed: the decision service is unavailable."
    )


class CacheSpec(_Strict):
    """Probability cache settings; ``ttl`` in seconds, 0 turns the cache off for this policy."""

    ttl: float = Field(
        default=DEFAULT_CACHE_TTL_S,
        ge=0,
        le=MAX_CACHE_TTL_S,
        allow_inf_nan=False,
        description=f"Seconds to keep a subject's answers (at most {MAX_CACHE_TTL_S}, 30 days); 0 = do not cache.",
    )


ProvenanceSource = Literal["user", "trusted", "tool_result", "agent", "flagged_tool_result", "none"]


class ToolArgumentSpec(_Strict):
    """The sources a sensitive argument may have (``guard/policy/provenance.py``)."""

    from_: list[ProvenanceSource] = Field(
        alias="from",
        min_length=1,
        description="Allowed sources: user (the user's messages), trusted (system messages, the policy's trusted "
        "values), tool_result (a tool result outside spans flagged as instructions), agent (a message in the user's "
        "role the user did not write: a conversation summary, a parent agent's task), flagged_tool_result, none.",
    )


class ToolSpec(_Strict):
    """What a tool does, for tool-call rules (``call.effect``, ``call.disallowed``)."""

    effect: Literal["read_only", "side_effecting"] = Field(
        description="read_only (reads, changes nothing) or side_effecting (sends, pays, writes, deletes)."
    )
    arguments: dict[str, ToolArgumentSpec] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Sensitive argument name -> the sources it may have, e.g. recipient: {from: [user, trusted]}.",
    )
    evidence: bool | None = Field(
        default=None,
        description="Whether a value in the tool's results counts as tool_result (false for a tool that computes its "
        "output from the model's input, such as a shell: its values keep the source they have elsewhere, else none); "
        "omitted: true, but false for provider code execution and well-known code, shell and calculator tools "
        "(code_execution, code_interpreter, local_shell, shell, bash, terminal, python, python_repl, calculator, "
        "python_interpreter, execute_command, run_code ...: guard.policy.provenance.CODE_TOOLS), names compared in "
        "letters and digits only, case ignored, a namespaced one also by its last part (functions.python, "
        "mcp__shell__bash; not mcp__python__search_pypi). No list names every such tool: declare the others false.",
    )


class PolicySpec(_Strict):
    """One policy: match -> state -> questions -> ordered rules -> default."""

    id: str = Field(pattern=NAME_PATTERN, description="Policy id, unique across all loaded files.")
    version: Annotated[str, BeforeValidator(_version_string, json_schema_input_type=VersionText | int)] = Field(
        pattern=VERSION_PATTERN,
        description="Policy version, a string of 1-64 printable ASCII characters without spaces (an integer is "
        "accepted; quote anything with dots, e.g. '1.10'); sent in the x-guard-policy header as id@version.",
    )
    description: str = Field(default="", description="What the policy is for (free text).")
    mode: Literal["enforce", "shadow"] = Field(
        default="enforce", description="enforce = act on the verdict; shadow = compute and record it, but allow."
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="When several policies match and their verdicts have the same action, the higher priority's "
        "verdict is the one reported (its rule, message, status); it never outranks a more severe action. Ties: the "
        "policy id in string order.",
    )
    match: MatchSpec = Field(description="Which subjects the policy decides; needs http, agent or both.")
    state: dict[str, SourceField] | None = Field(
        default=None,
        description="State field name -> source, or a shorthand string (path, body:/prompt, header:user-agent), in "
        "model-input order; omitted: a default state for the subject kind.",
    )
    questions: dict[str, QuestionSpec] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Question key (the name rules use, [A-Za-z_][A-Za-z0-9_]*) -> question; 0-64, asked in one "
        "request. None (rules only): the rules decide without a model call.",
    )
    rules: list[RuleSpec] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Tried top to bottom; the first whose when is true decides.",
    )
    default: Annotated[
        OutcomeSpec, BeforeValidator(_outcome_shorthand, json_schema_input_type=Action | OutcomeSpec)
    ] = Field(
        default=OutcomeSpec(action="allow"),
        description="Outcome when no rule fires: an action name, or an outcome object.",
        json_schema_extra={"default": "allow"},
    )
    on_error: OnErrorSpec | None = Field(
        default=None,
        description="Fail mode for backend errors, timeouts, malformed answers and failing rules; omitted: escalate "
        "for agent tool calls, closed for everything else.",
    )
    timeout_ms: int = Field(
        default=DEFAULT_TIMEOUT_MS,
        ge=1,
        le=MAX_TIMEOUT_MS,
        description="Milliseconds for the whole decision (cache wait + model call); then the fail mode decides.",
    )
    cache: CacheSpec = Field(default=CacheSpec(), description="Probability cache settings.")
    backend: str | None = Field(
        default=None, description="A name in the backends given to Guard; omitted: 'default' (or the only one)."
    )
    model: str | None = Field(
        default=None, description="Model name sent in the System One request; omitted: clef-flash."
    )
    tools: dict[str, ToolSpec] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Tool name -> its effect and sensitive arguments, read by tool-call rules through call.*; a tool "
        "not listed has effect unknown. Needs match.agent.",
    )
    trusted: list[str] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        description="Values from trusted configuration (own accounts, company domains): an argument found here has "
        "the source trusted. Needs match.agent.",
    )


class HandoffTargetSpec(_Strict):
    """An OpenAI-compatible chat endpoint a ``handoff`` sends the subject to. The key is read from ``api_key_env``."""

    base_url: str = Field(description="Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="Chat model name sent to the target.")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key; omitted: no key is sent."
    )
    timeout: float = Field(
        default=DEFAULT_HANDOFF_TIMEOUT_S, gt=0, allow_inf_nan=False, description="Seconds to wait for the target."
    )
    system_prompt: str | None = Field(default=None, description="System prompt placed before the decision summary.")
    stream_timeout: float = Field(
        default=DEFAULT_HANDOFF_STREAM_TIMEOUT_S,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a streamed answer may last in all, head to end; past it the stream ends with an error.",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        # the URL is not quoted back: one that does not parse as intended may hold a key where a host would be
        try:
            parts = split_url(url)
        except ValueError as exc:
            raise ValueError(f"base_url is not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000/v1)")
        return url


class PolicyFileSpec(_Strict):
    """A policy file: one or more policies, the handoff targets they name, and data their rules read."""

    policies: list[PolicySpec] = Field(
        min_length=1,
        description="One or more policies; every policy whose match accepts a subject decides it, and the most "
        "severe verdict wins (block > escalate > handoff > redact > allow).",
    )
    handoff_targets: dict[Name, HandoffTargetSpec] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}, "additionalProperties": False},  # a name the pattern refuses is an error
        description="Target name (sent in the x-guard-handoff header) -> OpenAI-compatible endpoint that "
        "handoff rules name.",
    )
    data: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra={"default": {}},
        description="Values rules read as data.<name> (thresholds, lists), like OPA's data.",
    )


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation admits: ``Annotated`` and ``X | None`` taken apart."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [t for arg in get_args(annotation) for t in _unwrap(arg) if t is not type(None)]
    return [annotation]


def keys_at(model: type[BaseModel], path: Sequence[str | int]) -> tuple[str, ...]:
    """The keys a file validated by ``model`` accepts in the mapping at ``path`` (a key path as errors name it, e.g.
    ``("policies", 0, "rules", 2)``), sorted; empty where that is not a mapping with fixed keys."""
    candidates: list[Any] = [model]
    for part in path:
        following: list[Any] = []
        for candidate in candidates:
            for tp in _unwrap(candidate):
                origin, args = get_origin(tp), get_args(tp)
                if isinstance(part, int) and origin is list:
                    following.append(args[0])
                elif isinstance(part, str) and origin is dict:
                    following.append(args[1])
                elif isinstance(part, str) and isinstance(tp, type) and issubclass(tp, BaseModel):
                    following += [f.annotation for name, f in tp.model_fields.items() if (f.alias or name) == part]
        candidates = following
    return tuple(sorted({f.alias or name for candidate in candidates for tp in _unwrap(candidate)
                         if isinstance(tp, type) and issubclass(tp, BaseModel)
                         for name, f in tp.model_fields.items()}))  # fmt: skip
