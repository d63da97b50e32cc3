"""Compiled policies (:class:`Policy`); the live, reloadable set of them is :class:`~guard.policy.loader.PolicySet`.

A :class:`Policy` is immutable and built only by the loader (``guard/policy/loader.py``), so everything in it has
been validated: matchers compiled, CEL compiled and name-checked, questions within the System One limits.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from guard.errors import StateAmbiguous
from guard.policy._match import AgentMatcher, HttpMatcher
from guard.policy._state import StateField, default_state, prepare_state, render_state
from guard.policy.instructions import Detector, find_instructions
from guard.policy.normalize import Normalized
from guard.policy.provenance import ToolSpec
from guard.policy.rules import CompiledRule, Outcome
from guard.subject import AgentSubject, HttpSubject, Subject
from guard.systemone import ID_PATTERN, QuestionV1, SystemOneRequestV1
from guard.verdict import FailMode

__all__ = ["DEFAULT_MODEL", "FailPolicy", "HandoffTarget", "HttpReads", "Policy", "PolicyQuestion", "policy_label",
           "rule_header_reads"]

logger = logging.getLogger("guard.policy")

#: Model name sent in the System One request when a policy names none.
DEFAULT_MODEL = "clef-flash"
#: Fail-mode defaults: closed for HTTP, escalate for agent tool calls.
DEFAULT_HTTP_FAIL_MODE: FailMode = "closed"
DEFAULT_TOOL_CALL_FAIL_MODE: FailMode = "escalate"
DEFAULT_AGENT_FAIL_MODE: FailMode = "closed"
DEFAULT_FAIL_STATUS = 503
DEFAULT_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class HandoffTarget:
    """An OpenAI-compatible chat endpoint named in a policy file's ``handoff_targets``.

    Attributes:
        name: the key rules use in ``handoff:``.
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the chat model name.
        api_key_env: environment variable holding the API key (read by the CLI/handoff client, never here).
        timeout: seconds for a whole answer, and for a stream's head and each content chunk.
        system_prompt: optional system prompt for the target.
        stream_timeout: seconds a streamed answer may last in all, head to end.

    Raises:
        ValueError: ``name`` does not match :data:`~guard.systemone.ID_PATTERN` (it is sent in the
            ``x-guard-handoff`` response header), or a timeout is not a finite number above 0. The loader checks a
            policy file's targets the same way; this catches the ones built in code (``HandoffClient(targets=...)``).
    """

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    timeout: float = 30.0
    system_prompt: str | None = None
    stream_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and ID_PATTERN.fullmatch(self.name)):
            raise ValueError(f"handoff target name {self.name!r} must match {ID_PATTERN.pattern}: it is sent in the "
                             "x-guard-handoff response header")
        for field_name in ("timeout", "stream_timeout"):
            seconds = getattr(self, field_name)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                    math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"handoff target {self.name!r}: {field_name} is {seconds!r}; it must be a finite "
                                 "number of seconds above 0")


@dataclass(frozen=True)
class FailPolicy:
    """What a fail mode does: ``closed`` blocks with ``status``, ``open`` allows (loudly), ``escalate`` reviews."""

    mode: FailMode
    status: int = DEFAULT_FAIL_STATUS
    retry_after: float = DEFAULT_RETRY_AFTER_S
    message: str | None = None


@dataclass(frozen=True)
class PolicyQuestion:
    """One question of a policy: ``key`` is the name rules use; ``wire`` is what the model is asked; ``path`` and
    ``line`` locate it in the file (for errors found after loading, e.g. a backend that cannot answer it)."""

    key: str
    wire: QuestionV1
    path: str = ""
    line: int | None = None


@dataclass(frozen=True)
class HttpReads:
    """What of an HTTP request a policy's state and rules read, besides method, query and body.

    Attributes:
        headers: lower-case header names read (``host`` for ``host``, ``content-type`` for ``content_type``);
            ``None`` = possibly any header (a rule reads ``subject.headers`` other than by a literal name, or reads
            ``subject`` whole).
        client: whether the client address is read.
        path: whether the path is read (a ``path`` or ``request_text`` state field, the default state of a request,
            ``subject.path`` or ``subject`` whole in a rule).
    """

    headers: frozenset[str] | None
    client: bool
    path: bool

    def __or__(self, other: HttpReads) -> HttpReads:
        """What either reads: the union of header names (``None`` if either may read any header)."""
        headers = None if self.headers is None or other.headers is None else self.headers | other.headers
        return HttpReads(headers, self.client or other.client, self.path or other.path)


_SUBJECT_HEADER_FIELDS = {"host": "host", "content_type": "content-type"}
_LITERAL_HEADER = re.compile(r"""subject\s*\.\s*headers\s*\[\s*(["'])([^"'\\]+)\1\s*\]""")
_LITERAL_IN = re.compile(r"""(["'])([^"'\\]+)\1\s+in\s+subject\s*\.\s*headers\b""")
_SUBJECT_FIELD = re.compile(r"subject\s*\.\s*([A-Za-z_]\w*)")
_PLAIN_FIELDS = frozenset({"method", "path", "query", "query_string", "body", "body_text", "repeated_headers"})


def _state_leaves(fields: tuple[StateField, ...]) -> Iterator[StateField]:
    for f in fields:
        if f.children is not None:
            yield from _state_leaves(f.children)
        else:
            yield f


def _rule_reads(source: str) -> tuple[set[str] | None, bool, bool]:
    """Header names, whether the client is read and whether the path is read by one ``when``; ``None`` names = any
    header."""
    names: set[str] = set()
    for pattern in (_LITERAL_HEADER, _LITERAL_IN):
        names |= {m.group(2).lower() for m in pattern.finditer(source)}
        source = pattern.sub("", source)
    client = path = any_header = False
    for match in _SUBJECT_FIELD.finditer(source):
        name = match.group(1)
        if name == "client":
            client = True
        elif name == "path":
            path = True
        elif name in _SUBJECT_HEADER_FIELDS:
            names.add(_SUBJECT_HEADER_FIELDS[name])
        elif name == "headers":
            any_header = True  # subject.headers used some other way
        elif name not in _PLAIN_FIELDS:
            return None, True, True  # an unknown field
    if len(_SUBJECT_FIELD.findall(source)) != len(re.findall(r"\bsubject\b", source)):
        return None, True, True  # subject read whole (passed to a function, indexed)
    return (None, True, path) if any_header else (names, client, path)


def rule_header_reads(source: str) -> set[str] | None:
    """The lower-case header names one ``when`` reads (what :attr:`Policy.http_reads` takes from it); ``None`` when
    it may read any header."""
    return _rule_reads(source)[0]


def policy_label(policy_id: str, version: str, digest: str) -> str:
    """``id@version digest <digest>``: a policy and its text (:attr:`Policy.digest`) as logs and ``guard policy``
    name them."""
    return f"{policy_id}@{version} digest {digest}"


@dataclass(frozen=True)
class Policy:
    """One compiled policy. Built by the loader; see ``docs/policies.md`` for the YAML it comes from.

    Attributes:
        id, version, description: from the file.
        mode: ``enforce`` or ``shadow`` (compute and record, but allow).
        priority: among several matching policies' verdicts with the same action, the higher one is reported.
        file, line: where it was defined.
        index: its place in the file's ``policies`` list (errors name it ``policies[index]``); ``None`` when not
            known.
        questions: in file order (the order is model input).
        rules: in evaluation order.
        default: the outcome when no rule fires.
        on_error: the explicit fail policy, or ``None`` for the per-subject default.
        timeout: seconds for the whole decision (cache wait + model call).
        cache_ttl: seconds; 0 = never cached.
        backend: name in the backends mapping given to ``Guard`` (``None`` = the default backend).
        model: model name sent in the request.
        digest: which policy text this is: 16 hex digits of the SHA-256 of its canonical form (the loader's
            ``policy_digest``); in the decision log, on the span and wherever a policy is named with it
            (:attr:`label`).
        handoff_targets: the file's targets.
        data: the file's ``data`` block.
        tools: tool name -> :class:`~guard.policy.provenance.ToolSpec` (effect, sensitive arguments).
        trusted: values from trusted configuration (argument provenance ``trusted``).
        detector: finds instructions to the agent in tool results (``call.*`` and ``result.*`` in rules); replace
            it with ``dataclasses.replace(policy, detector=...)`` to plug in another.
    """

    id: str
    version: str
    description: str
    mode: Literal["enforce", "shadow"]
    file: str
    line: int | None
    http: HttpMatcher | None
    agent: AgentMatcher | None
    state_fields: tuple[StateField, ...] | None
    questions: tuple[PolicyQuestion, ...]
    rules: tuple[CompiledRule, ...]
    default: Outcome
    on_error: FailPolicy | None
    timeout: float
    cache_ttl: float
    backend: str | None
    model: str
    digest: str
    handoff_targets: Mapping[str, HandoffTarget] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    trusted: tuple[str, ...] = ()
    detector: Detector = find_instructions
    priority: int = 0
    index: int | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """How logs and ``guard policy`` name this policy and its text (:func:`policy_label`)."""
        return policy_label(self.id, self.version, self.digest)

    def matches(self, subject: Subject) -> bool:
        """Cheap check on method/path/host/headers or event/tool name; never reads the body."""
        if isinstance(subject, HttpSubject):
            return self.http is not None and self.http.matches(subject)
        return self.agent is not None and self.agent.matches(subject)

    def watches(self, request: HttpSubject) -> bool:
        """A response policy whose request conditions accept ``request``: it judges that request's response."""
        return self.http is not None and self.http.watches(request)

    def render_state(self, subject: Subject) -> dict[str, Any]:
        """The raw decision state for ``subject``, in declaration order (not yet normalised or cut).

        Raises:
            StateAmbiguous: the request sends a query parameter or form field the state reads as one value more than
                once.
        """
        return render_state(self._fields(subject), subject)

    def check_repeated(self, subject: Subject) -> None:
        """Refuse a request that sends more than once a header this policy reads as one value: a header its
        ``match`` names, or one its state or rules read by name (:attr:`http_reads`) but those a state field reads
        with ``repeated: join`` (:attr:`joined_headers`). Parsers differ on which copy counts, so the guard could
        judge one copy while the application reads another. A rule that reads ``subject.headers`` other than by a
        literal name (``exists``, a computed key) sees the copies joined.

        Raises:
            StateAmbiguous: naming the first such header.
        """
        if isinstance(subject, HttpSubject) and subject.repeated_headers:
            read, joined = self.http_reads.headers, self.joined_headers
            matched = {name for name, _ in self.http.headers} if self.http is not None else set()
            for name in subject.repeated_headers:
                if name in matched or (name not in joined and read is not None and name in read):
                    raise StateAmbiguous("header", name)

    @functools.cached_property
    def joined_headers(self) -> frozenset[str]:
        """The headers a state field reads with ``repeated: join``: their copies joined with ``", "`` are read as
        one value. Every other header the state or rules read (:attr:`http_reads`) is refused when repeated."""
        return frozenset(leaf.key.lower() for leaf in _state_leaves(self.state_fields or ())
                         if leaf.source == "header" and leaf.key and leaf.repeated == "join")

    def prepare_state(self, raw: Mapping[str, Any], subject: Subject) -> Normalized:
        """What the model sees, from :meth:`render_state`'s ``raw`` state for the same ``subject``: every string
        normalised, then each field's ``max_chars`` applied (``guard/policy/_state.py``).

        Returns:
            The state and its flags (normalisation findings, ``truncated``: fields cut).

        Raises:
            StateTooLong: a field with ``truncate: error`` is over its ``max_chars``.
        """
        return prepare_state(self._fields(subject), raw)

    def _fields(self, subject: Subject) -> tuple[StateField, ...]:
        return self.state_fields if self.state_fields is not None else default_state(subject)

    def build_request(self, state: Any) -> SystemOneRequestV1:
        """One System One request with all of this policy's questions (one subject per request; a policy without
        questions asks nothing and is never sent)."""
        return SystemOneRequestV1(model=self.model, state=state, questions=tuple(q.wire for q in self.questions))

    def fail_policy(self, subject: Subject) -> FailPolicy:
        """The explicit ``on_error``, else the default for the subject's kind (closed for HTTP, escalate for tool
        calls, closed for other agent events)."""
        if self.on_error is not None:
            return self.on_error
        if isinstance(subject, AgentSubject):
            mode = DEFAULT_TOOL_CALL_FAIL_MODE if subject.event == "tool_call" else DEFAULT_AGENT_FAIL_MODE
            return FailPolicy(mode)
        assert isinstance(subject, HttpSubject)
        return FailPolicy(DEFAULT_HTTP_FAIL_MODE)

    @functools.cached_property
    def http_reads(self) -> HttpReads:
        """The headers, client and path fields this policy's state and rules read (:class:`HttpReads`): the headers
        and client are what an HTTP approval must stay bound to besides method, path, query and body."""
        headers: set[str] | None = set()
        client = False
        path = self.state_fields is None  # a request's default state holds the path
        for leaf in _state_leaves(self.state_fields or ()):
            if leaf.source in ("path", "request_text"):
                path = True
            elif leaf.source == "header" and leaf.key:
                headers.add(leaf.key.lower())
            elif leaf.source in _SUBJECT_HEADER_FIELDS:
                headers.add(_SUBJECT_HEADER_FIELDS[leaf.source])
            elif leaf.source == "client":
                client = True
        for rule in self.rules:
            if "subject" not in rule.names:
                continue
            names, reads_client, reads_path = _rule_reads(rule.source)
            client, path = client or reads_client, path or reads_path
            headers = None if names is None or headers is None else headers | names
        return HttpReads(frozenset(headers) if headers is not None else None, client, path)

    def question_keys(self) -> dict[str, str]:
        """Wire question id -> the key rules use."""
        return {q.wire.id: q.key for q in self.questions}
