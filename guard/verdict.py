"""The outcome of one evaluation: a **verdict** (OPA's *decision*) and the record of how it was reached."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from guard.systemone import AnswerV1

__all__ = [
    "ACTIONS",
    "ACTION_RANK",
    "Action",
    "FailMode",
    "MaskStyle",
    "Redaction",
    "Verdict",
    "outcome_headers",
    "strongest",
]

Action = Literal["allow", "block", "escalate", "handoff", "redact"]
#: Every action, strongest first: when verdicts combine, the earlier action wins (block > escalate > handoff > redact
#: > allow). The one list the policy schema, the rules and verdict combination read.
ACTIONS: tuple[Action, ...] = ("block", "escalate", "handoff", "redact", "allow")
FailMode = Literal["closed", "open", "escalate"]
MaskStyle = Literal["redact", "mask"]
"""How a redacted span is replaced: ``redact`` by ``[REDACTED:<label>]``; ``mask`` by one ``*`` per character,
keeping the last 4 characters of a span of 8 or more (``************1111``)."""

#: Each action's place in :data:`ACTIONS` (0: the strongest), what verdicts are ordered by when they combine.
ACTION_RANK: dict[Action, int] = {action: rank for rank, action in enumerate(ACTIONS)}


def strongest(actions: Iterable[Action]) -> Action:
    """The action that wins among ``actions`` by :data:`ACTIONS` order (``allow`` for none)."""
    return min(actions, key=ACTION_RANK.__getitem__, default="allow")


@dataclass(frozen=True)
class Redaction:
    """One span a ``redact`` verdict replaces; it locates the span, it never holds the text.

    Attributes:
        pointer: RFC 6901 JSON pointer to the string in the body (``""``: the body is that string; forms:
            ``/<field>/<index>``).
        start, end: character offsets into that string (``text[start:end]``).
        label: the rule's pattern name, or ``instructions`` for a span the policy's detector found.
        style: how it is replaced (:data:`MaskStyle`).
    """

    pointer: str
    start: int
    end: int
    label: str
    style: MaskStyle = "redact"

    def to_json(self) -> dict[str, Any]:
        """The redaction as the decision log and the review API write it."""
        return {"pointer": self.pointer, "start": self.start, "end": self.end, "label": self.label,
                "style": self.style}



@dataclass(frozen=True)
class Verdict:
    """What to do with a subject, and why.

    Attributes:
        action: ``allow``, ``block``, ``escalate``, ``handoff`` or ``redact`` (allow with :attr:`redactions`
            replaced first). In shadow mode this is always ``allow`` and
            ``shadow_action`` holds what the policy would have done.
        decision_id: unique id of this decision; goes back to the caller (body or ``x-guard-decision-id`` header).
        policy_id: the policy that matched (``None`` when none matched: allow without a model call).
        policy_version: that policy's version.
        rule: the id of the rule that fired, ``"default"`` when none did, or ``"on_error"`` when a fail mode decided.
        answers: each question's answer (probabilities unrounded), empty when the backend failed; on a decision
            from the model or the cache a read-only :class:`~guard.systemone.ReadOnlyDict` shared with the cache entry
            (copy it with ``dict(...)`` to change it).
        status: HTTP status for ``block`` (403 default, 429 for rate-like rules, 503 for fail-closed).
        message: the rule's message for the caller or the model.
        message_from_input: the message may repeat text the subject sent (a refusal's reason naming a JSON key or
            path, a charset, a parameter's spelling): the decision log leaves it out under ``log_input="none"``.
        handoff: the handoff target named by the rule.
        cache_hit: the answers came from the probability cache.
        backend: the backend's name.
        model: the model id that answered.
        model_revision: the answering backend's ``model_revision``: the weights' revision and what else the answers
            depend on (``+guard=<code digest>`` for a model in this process, ``+confidence=<profile>``, a System One
            server's reported checkpoint after ``#``); part of the cache key.
        latency_ms: wall time of the evaluation, milliseconds.
        fail_mode: the fail mode that decided (``closed``/``open``/``escalate``), ``None`` when the model decided.
        error: the backend error that triggered the fail mode.
        retry_after: seconds, for fail-closed and rate-like blocks.
        shadow_action: in shadow mode, the action the policy computed.
        state: the rendered decision state the model saw (for reviewers; already normalised and redacted);
            ``None`` on a verdict with :attr:`redactions` (it would hold the text being masked).
        flags: findings about the state, by name in :data:`guard.policy.rules.FLAG_NAMES` (only non-zero ones, e.g. ``{"unicode_tags":
            18, "truncated": 1}``), and ``fail_open`` when a fail-open policy allowed without a decision.
        contributions: when several policies matched, each one's own verdict, in match order (the fields above are
            those of the one that decided, ``docs/policies.md`` "Several matching policies"); empty otherwise.
        redactions: what a ``redact`` verdict replaces (where, not what); in shadow mode what it would have. An
            ``escalate`` or ``handoff`` verdict that won over enforced ``redact`` ones carries theirs: what it holds
            or hands off is masked so (``guard.engine.verdicts.MASKED_ACTIONS``).
        phase: ``request``, or ``response`` for a verdict on an upstream's response (``match.http.response``).
        policy_digest: which text of the policy decided (:attr:`guard.policy.Policy.digest`); ``None`` without a
            policy.
        policy_file: the file that policy was loaded from.
    """

    action: Action
    decision_id: str
    policy_id: str | None = None
    policy_version: str | None = None
    rule: str | None = None
    answers: dict[str, AnswerV1] = field(default_factory=dict)
    status: int | None = None
    message: str | None = None
    message_from_input: bool = False
    handoff: str | None = None
    cache_hit: bool = False
    backend: str | None = None
    model: str | None = None
    model_revision: str | None = None
    latency_ms: float = 0.0
    fail_mode: FailMode | None = None
    error: str | None = None
    retry_after: float | None = None
    shadow_action: Action | None = None
    state: Any = None
    flags: dict[str, Any] = field(default_factory=dict)
    contributions: tuple[Verdict, ...] = ()
    redactions: tuple[Redaction, ...] = ()
    phase: Literal["request", "response"] = "request"
    policy_digest: str | None = None
    policy_file: str | None = None

    @property
    def allowed(self) -> bool:
        """``True`` when the action is ``allow`` (a ``redact`` verdict lets the request on, masked, but is not this)."""
        return self.action == "allow"

    def probabilities(self) -> dict[str, dict[str, float]]:
        """``{question_id: {option_id: probability}}`` for every answer."""
        return {qid: dict(answer.probabilities) for qid, answer in self.answers.items()}

    def headers(self) -> list[tuple[str, str]]:
        """Decision headers for HTTP responses (lower-case names): the decision id, then
        :func:`outcome_headers`."""
        return [
            ("x-guard-decision-id", self.decision_id),
            *outcome_headers(
                self.shadow_action or self.action,
                self.policy_id,
                self.policy_version,
                self.rule,
                self.fail_mode,
                shadow=self.shadow_action is not None,
            ),
        ]

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe summary for response bodies and logs (probabilities rounded to 4 decimals); with
        ``contributions``, ``policies`` lists each matching policy's own summary (without ``policies``)."""
        out = {
            "decision_id": self.decision_id,
            "action": self.action,
            "policy": self.policy_id,
            "policy_version": self.policy_version,
            "rule": self.rule,
            "message": self.message,
            "answers": {qid: answer.to_json() for qid, answer in self.answers.items()},
            "cache_hit": self.cache_hit,
            "backend": self.backend,
            "model": self.model,
            "model_revision": self.model_revision,
            "latency_ms": round(self.latency_ms, 3),
            "fail_mode": self.fail_mode,
            "error": self.error,
            "shadow_action": self.shadow_action,
            "flags": self.flags,
            "redactions": [r.to_json() for r in self.redactions],
            "phase": self.phase,
        }
        if self.contributions:
            out["policies"] = [contribution.to_json() for contribution in self.contributions]
        return out


def outcome_headers(
    action: str,
    policy_id: str | None,
    policy_version: str | None,
    rule: str | None,
    fail_mode: str | None,
    *,
    shadow: bool = False,
) -> tuple[tuple[str, str], ...]:
    """The decision headers other than the id, the same for every verdict with the same outcome: ``x-guard-action``
    (the shadow action in shadow mode, which then adds ``x-guard-shadow: true``), ``x-guard-policy`` (``id@version``),
    ``x-guard-rule`` and ``x-guard-fail-mode``, each only when set.

    Args:
        action: the action taken, or in shadow mode the action the policy computed (``Verdict.shadow_action``).
        shadow: the policy is in shadow mode.
    """
    out = [("x-guard-action", action)]
    if policy_id:
        out.append(("x-guard-policy", f"{policy_id}@{policy_version}"))
    if rule:
        out.append(("x-guard-rule", rule))
    if fail_mode:
        out.append(("x-guard-fail-mode", fail_mode))
    if shadow:
        out.append(("x-guard-shadow", "true"))
    return tuple(out)
