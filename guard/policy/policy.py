"""Compiled policies (:class:`Policy`) and the live, reloadable set of them (:class:`PolicySet`).

A :class:`Policy` is immutable and built only by the loader (``guard/policy/loader.py``), so everything in it has
been validated: matchers compiled, CEL compiled and name-checked, questions within the System One limits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from guard.errors import PolicyError
from guard.normalize import Normalized
from guard.policy._match import AgentMatcher, HttpMatcher
from guard.policy._state import StateField, default_state, prepare_state, render_state
from guard.policy.instructions import Detector, find_instructions
from guard.policy.provenance import ToolSpec
from guard.policy.rules import CompiledRule, Outcome
from guard.subject import AgentSubject, HttpSubject, Subject
from guard.systemone import QuestionV1, SystemOneRequestV1
from guard.verdict import FailMode

__all__ = ["DEFAULT_MODEL", "FailPolicy", "HandoffTarget", "Policy", "PolicyQuestion", "PolicySet"]

logger = logging.getLogger("guard.policy")

#: Model name sent in the System One request when a policy names none.
DEFAULT_MODEL = "clef-flash"
#: Fail-mode defaults (ARCHITECTURE.md "Failure modes are policy"): closed for HTTP, escalate for agent tool calls.
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
        timeout: seconds.
        system_prompt: optional system prompt for the target.
    """

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    timeout: float = 30.0
    system_prompt: str | None = None


@dataclass(frozen=True)
class FailPolicy:
    """What a fail mode does: ``closed`` blocks with ``status``, ``open`` allows (loudly), ``escalate`` reviews."""

    mode: FailMode
    status: int = DEFAULT_FAIL_STATUS
    retry_after: float = DEFAULT_RETRY_AFTER_S
    message: str | None = None
    explicit: bool = False


@dataclass(frozen=True)
class PolicyQuestion:
    """One question of a policy: ``key`` is the name rules use; ``wire`` is what the model is asked; ``path`` and
    ``line`` locate it in the file (for errors found after loading, e.g. a backend that cannot answer it)."""

    key: str
    wire: QuestionV1
    path: str = ""
    line: int | None = None


@dataclass(frozen=True)
class Policy:
    """One compiled policy. Built by the loader; see ``docs/policies.md`` for the YAML it comes from.

    Attributes:
        id, version, description: from the file.
        mode: ``enforce`` or ``shadow`` (compute and record, but allow).
        file, line: where it was defined.
        questions: in file order (the order is model input).
        rules: in evaluation order.
        default: the outcome when no rule fires.
        on_error: the explicit fail policy, or ``None`` for the per-subject default.
        timeout: seconds for the whole decision (cache wait + model call).
        cache_ttl: seconds; 0 = never cached.
        backend: name in the backends mapping given to ``Guard`` (``None`` = the default backend).
        model: model name sent in the request.
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
    handoff_targets: Mapping[str, HandoffTarget] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    trusted: tuple[str, ...] = ()
    detector: Detector = find_instructions

    def matches(self, subject: Subject) -> bool:
        """Cheap check on method/path/host/headers or event/tool name; never reads the body."""
        if isinstance(subject, HttpSubject):
            return self.http is not None and self.http.matches(subject)
        return self.agent is not None and self.agent.matches(subject)

    def render_state(self, subject: Subject) -> dict[str, Any]:
        """The raw decision state for ``subject``, in declaration order (not yet normalised or cut)."""
        return render_state(self._fields(subject), subject)

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
        """One System One request with all of this policy's questions (one subject per request, case C25)."""
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

    def question_keys(self) -> dict[str, str]:
        """Wire question id -> the key rules use."""
        return {q.wire.id: q.key for q in self.questions}


class PolicySet:
    """The live set of policies, in match order (files in the order given, policies in file order).

    The first policy whose ``match`` accepts a subject decides it. :meth:`reload` re-reads the source files; if any
    fails, the last good set stays active and the error is logged and raised.

    Attributes:
        sources: the files this set was loaded from (empty for sets built from text).
        reload_failures: how many reloads failed.
    """

    def __init__(
        self,
        policies: Sequence[Policy],
        *,
        sources: Sequence[str | Path] = (),
        validator: Callable[[Sequence[Policy]], None] | None = None,
    ) -> None:
        self._policies: tuple[Policy, ...] = tuple(policies)
        self.sources: tuple[Path, ...] = tuple(Path(s) for s in sources)
        self.validator = validator
        self.reload_failures = 0
        self.last_error: PolicyError | None = None
        self._lock = threading.Lock()
        _check_unique(self._policies)

    @property
    def policies(self) -> tuple[Policy, ...]:
        return self._policies

    def __iter__(self) -> Iterator[Policy]:
        return iter(self._policies)

    def __len__(self) -> int:
        return len(self._policies)

    def __getitem__(self, policy_id: str) -> Policy:
        for policy in self._policies:
            if policy.id == policy_id:
                return policy
        raise KeyError(policy_id)

    def match(self, subject: Subject) -> Policy | None:
        """The first policy that matches ``subject``, or ``None``."""
        for policy in self._policies:
            if policy.matches(subject):
                return policy
        return None

    def replace(self, policies: Sequence[Policy]) -> None:
        """Swap in a new set after validating it; on error the current set stays.

        Raises:
            PolicyError: when two policies share an id or the validator (e.g. ``Guard``'s backend check) rejects one.
        """
        new = tuple(policies)
        _check_unique(new)
        if self.validator is not None:
            self.validator(new)
        with self._lock:
            self._policies = new

    def reload(self) -> None:
        """Re-read :attr:`sources`. On any error the last good policies stay active.

        Raises:
            PolicyError: naming the file, line and key of the first problem (also logged, and counted in
                :attr:`reload_failures`).
        """
        from guard.policy.loader import load_files

        try:
            fresh = load_files(*self.sources)
            self.replace(fresh.policies)
        except PolicyError as exc:
            self.reload_failures += 1
            self.last_error = exc
            logger.error("policy reload failed; keeping the last good policies (%d active): %s", len(self), exc)
            raise
        self.last_error = None
        logger.info("policies reloaded: %s", ", ".join(f"{p.id}@{p.version}" for p in self._policies))


def _check_unique(policies: Sequence[Policy]) -> None:
    seen: dict[str, Policy] = {}
    for policy in policies:
        if policy.id in seen:
            first = seen[policy.id]
            raise PolicyError(
                policy.file,
                policy.line,
                "id",
                f"policy id {policy.id!r} is already defined in {first.file}:{first.line}; ids must be unique",
            )
        seen[policy.id] = policy
