"""The policy file format, as pydantic models. The JSON Schema in ``policies/guard-policy.schema.json`` is generated
from :class:`PolicyFileSpec` (``guard policy schema``), so editors validate what the loader accepts.

These models check shapes and types only (unknown keys and wrong types are errors, nothing is coerced from a
string). Meaning is checked when a policy is compiled (``guard/policy/_compile.py``): CEL syntax and the names a rule
uses, System One limits, handoff targets, state sources that fit the matched subjects.

A file::

    handoff_targets: {<name>: HandoffTargetSpec}
    data: {<name>: any JSON value}          # OPA's "data": lists and thresholds rules read as data.<name>
    policies: [PolicySpec, ...]
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

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
    "RuleSpec",
    "SourceSpec",
]

Action = Literal["allow", "block", "escalate", "handoff"]
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
DEFAULT_HANDOFF_TIMEOUT_S = 30.0


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


class HttpMatchSpec(_Strict):
    """Which HTTP requests a policy applies to. Every listed condition must hold; an empty list means "any".

    Globs: in ``paths`` ``*`` matches within one ``/`` segment and ``**`` across segments; in ``hosts`` ``*``
    matches within one ``.`` label; in ``headers`` values ``*`` matches anything (the header must be present).
    """

    methods: list[str] = Field(default_factory=list, description="Upper-case methods, e.g. [POST, PUT].")
    paths: list[str] = Field(default_factory=list, description="Path globs, e.g. /v1/chat/** or /api/*/items.")
    hosts: list[str] = Field(default_factory=list, description="Host globs without port, e.g. *.example.com.")
    headers: dict[str, str] = Field(default_factory=dict, description="Header name -> value glob (all must match).")
    content_types: list[str] = Field(default_factory=list, description="Media types, e.g. application/json.")


class AgentMatchSpec(_Strict):
    """Which agent events a policy applies to. An empty list means "any"."""

    events: list[Literal["tool_call", "tool_result", "model_input", "model_output"]] = Field(default_factory=list)
    tools: list[str] = Field(default_factory=list, description="Tool-name globs, e.g. [shell, 'fs_*'].")


class MatchSpec(_Strict):
    """A policy matches HTTP subjects when ``http`` is given, agent subjects when ``agent`` is given (or both)."""

    http: HttpMatchSpec | None = None
    agent: AgentMatchSpec | None = None


class SourceSpec(_Strict):
    """Where one state field comes from: exactly one of ``from`` (a subject field), ``const`` (a fixed value) or
    ``fields`` (a nested object of further sources).

    Shorthand strings: ``body``, ``body:/a/0/b`` (JSON pointer), ``header:user-agent``, ``query:q``, ``form:prompt``,
    ``arguments:/command``, ``tool_result``. Negative array indices in pointers count from the end
    (``/messages/-1/content`` = the last message).
    """

    from_: SourceName | None = Field(default=None, alias="from")
    const: Any = None
    fields: dict[str, SourceField] | None = Field(default=None, description="A nested object: name -> source.")
    pointer: str | None = Field(default=None, description="JSON pointer into body, form, arguments or tool_result.")
    name: str | None = Field(default=None, description="Header, query parameter or form field name.")
    default: Any = Field(default=None, description="Value when the source is absent.")
    max_chars: int | None = Field(default=None, gt=0, description="Truncate a string value to this many characters.")


SourceField = Annotated[SourceSpec, BeforeValidator(_source_shorthand, json_schema_input_type=str | SourceSpec)]
SourceSpec.model_rebuild()


class QuestionSpec(_Strict):
    """One System One question, either written out (``type``, ``instructions``, ``criteria``) or taken from the
    built-in catalog (``catalog: guard.prompt_injection``): then the canonical id, type, wording and options are used,
    which both the compact CPU model and Clef answer.

    ``id`` is the wire id sent to the model (default: the key in ``questions``; for a catalog question, the catalog
    id). ``criteria``: noul ``{true: ..., false: ...}``; choice ``{option_id: description}`` (2-255 options, order
    kept); score ``[lowest level, ..., highest]`` (2-10 levels). Limits are the Workers AI limits, checked at load.
    """

    id: str | None = None
    catalog: str | None = Field(default=None, description="A built-in catalog question id, e.g. guard.harm_severity.")
    type: Literal["noul", "choice", "score"] | None = None
    instructions: Any = Field(default=None, description="What to decide: a string, or an object/array of strings.")
    criteria: Any = None


class OutcomeSpec(_Strict):
    """What to do: ``allow``, ``block`` (with ``status`` 4xx, default 403; 429 for rate-like rules), ``escalate``
    (human review) or ``handoff`` (to the LLM target named in ``handoff``)."""

    action: Action
    status: int | None = Field(default=None, ge=400, le=499)
    message: str | None = None
    retry_after: float | None = Field(default=None, ge=0)
    handoff: str | None = None


class RuleSpec(OutcomeSpec):
    """One rule: ``when`` is a CEL expression over the answers (by question key), ``subject``, ``state``, ``flags``
    and ``data``; rules are tried in order and the first whose ``when`` is true decides."""

    id: str
    when: str


class OnErrorSpec(_Strict):
    """The fail mode: what happens when the backend errors, times out or returns a malformed answer.

    ``closed`` blocks (HTTP 503 with ``Retry-After``), ``escalate`` sends to review, ``open`` allows, loudly: flagged on
    the verdict, counted and logged as a warning. Default: closed for HTTP, escalate for agent tool calls, closed for
    other agent events.
    """

    mode: FailModeName
    status: int = Field(default=503, ge=400, le=599)
    retry_after: float = Field(default=5.0, ge=0)
    message: str | None = None


class CacheSpec(_Strict):
    """Probability cache settings; ``ttl`` in seconds, 0 turns the cache off for this policy."""

    ttl: float = Field(default=DEFAULT_CACHE_TTL_S, ge=0)


class PolicySpec(_Strict):
    """One policy: match -> state -> questions -> ordered rules -> default."""

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    version: Annotated[str, BeforeValidator(_version_string, json_schema_input_type=str | int)]
    description: str = ""
    mode: Literal["enforce", "shadow"] = "enforce"
    match: MatchSpec
    state: dict[str, SourceField] | None = Field(
        default=None, description="State field name -> source; omitted: a default state for the subject kind."
    )
    questions: dict[str, QuestionSpec]
    rules: list[RuleSpec] = Field(default_factory=list)
    default: Annotated[
        OutcomeSpec, BeforeValidator(_outcome_shorthand, json_schema_input_type=Action | OutcomeSpec)
    ] = OutcomeSpec(action="allow")
    on_error: OnErrorSpec | None = None
    timeout_ms: int = Field(default=DEFAULT_TIMEOUT_MS, ge=1, le=MAX_TIMEOUT_MS)
    cache: CacheSpec = CacheSpec()
    backend: str | None = Field(default=None, description="A name in the backends given to Guard.")
    model: str | None = Field(default=None, description="Model name sent in the System One request.")


class HandoffTargetSpec(_Strict):
    """An OpenAI-compatible chat endpoint a ``handoff`` sends the subject to. The key is read from ``api_key_env``."""

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout: float = Field(default=DEFAULT_HANDOFF_TIMEOUT_S, gt=0)
    system_prompt: str | None = None


class PolicyFileSpec(_Strict):
    """A policy file: one or more policies, the handoff targets they name, and data their rules read."""

    policies: list[PolicySpec] = Field(min_length=1)
    handoff_targets: dict[str, HandoffTargetSpec] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)
