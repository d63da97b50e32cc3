"""The outcome of one evaluation: a **verdict** (OPA's *decision*) and the record of how it was reached."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from guard.normalize import FLAG_NAMES as NORMALIZE_FLAG_NAMES
from guard.systemone import AnswerV1

__all__ = [
    "DECISION_HEADERS",
    "FLAG_NAMES",
    "Action",
    "DecisionHeaders",
    "FailMode",
    "Verdict",
    "new_decision_id",
    "outcome_headers",
]

Action = Literal["allow", "block", "escalate", "handoff"]
FailMode = Literal["closed", "open", "escalate"]
DecisionHeaders = Literal["brief", "full"]
#: How much the response to an allowed HTTP request says of the decision (``GuardMiddleware(decision_headers=...)``,
#: ``guard proxy --decision-headers``): ``brief``, the decision id and a fail-open flag; ``full``, every decision header.
DECISION_HEADERS: tuple[DecisionHeaders, ...] = ("brief", "full")

#: Flags rules read as ``flags.<name>`` (``0`` when absent): the normalisation findings (``guard/normalize.py``),
#: ``truncated`` (state fields cut to their ``max_chars``) and ``state_tokens_dropped`` (state tokens the backend
#: reported it did not read, ``usage.state_tokens_dropped``) and ``out_of_competence`` (the backend could not read the
#: state: an unsupported language or non-text, ``usage.out_of_competence``). A verdict also carries ``fail_open``
#: (rules never see it: they did not run).
FLAG_NAMES = (*NORMALIZE_FLAG_NAMES, "truncated", "state_tokens_dropped", "out_of_competence")


@dataclass(frozen=True)
class Verdict:
    """What to do with a subject, and why.

    Attributes:
        action: ``allow``, ``block``, ``escalate`` or ``handoff``. In shadow mode this is always ``allow`` and
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
        handoff: the handoff target named by the rule.
        cache_hit: the answers came from the probability cache.
        backend: the backend's name.
        model: the model id that answered.
        model_revision: the weights' revision.
        latency_ms: wall time of the evaluation, milliseconds.
        fail_mode: the fail mode that decided (``closed``/``open``/``escalate``), ``None`` when the model decided.
        error: the backend error that triggered the fail mode.
        retry_after: seconds, for fail-closed and rate-like blocks.
        shadow_action: in shadow mode, the action the policy computed.
        state: the rendered decision state the model saw (for reviewers; already normalised and redacted).
        flags: findings about the state, by name in :data:`FLAG_NAMES` (only non-zero ones, e.g. ``{"unicode_tags":
            18, "truncated": 1}``), and ``fail_open`` when a fail-open policy allowed without a decision.
    """

    action: Action
    decision_id: str
    policy_id: str | None = None
    policy_version: str | None = None
    rule: str | None = None
    answers: dict[str, AnswerV1] = field(default_factory=dict)
    status: int | None = None
    message: str | None = None
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

    @property
    def allowed(self) -> bool:
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
        """A JSON-safe summary for response bodies and logs (probabilities rounded to 4 decimals)."""
        return {
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
        }


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


class _IdsAhead:
    """Decision ids made :data:`BATCH` at a time from one ``os.urandom`` call, handed out one per decision.

    One ``getrandom`` system call and one batch of C-level formatting per 256 ids instead of both per id: on a virtual
    machine with kernel page-table isolation a system call also slows the code after it (flushed translation buffers),
    and the two together were a few microseconds of every cached decision. The bits are the kernel's CSPRNG output all
    the same and each id is handed out once: ``list.pop`` is atomic, two threads that find the list empty at once each
    make their own, and a forked child drops what it inherited (it would repeat its parent's ids).
    """

    BATCH = 256

    def __init__(self) -> None:
        self.ready: list[str] = []
        os.register_at_fork(after_in_child=self._drop)

    def _drop(self) -> None:
        self.ready = []

    def refill(self) -> str:
        """A new batch in :attr:`ready`, less the id returned."""
        ready = self.ready = _uuid4_texts(os.urandom(16 * self.BATCH))
        return ready.pop()


# RFC 9562 section 5.4: the version nibble (octet 6, high half) is 0100 and the variant's top bits (octet 8) are 10.
_KEEP = bytes.fromhex("ffffffffffff0fff3fffffffffffffff")
_SET = bytes.fromhex("00000000000040008000000000000000")
_DASHES = (8, 13, 18, 23)  # where the canonical text form puts "-" (8-4-4-4-12 hex digits)
_DIGIT_AT = tuple(i for i in range(36) if i not in _DASHES)  # text position of each of the 32 hex digits


@functools.lru_cache(maxsize=4)
def _uuid_masks(count: int) -> tuple[int, int, bytes]:
    keep = int.from_bytes(_KEEP * count, "big")
    set_bits = int.from_bytes(_SET * count, "big")
    template = b"00000000-0000-0000-0000-000000000000\n" * count
    return keep, set_bits, template


def _uuid4_texts(random_bytes: bytes) -> list[str]:
    """Version-4 UUID texts, one per 16 of ``random_bytes``, as ``str(uuid.uuid4())`` writes them: the version and
    variant bits set (RFC 9562 section 5.4) on all of them at once with two big-integer operations, and the hex digits
    placed into their text positions with one strided copy per digit position (32 in all, whatever the count)."""
    count = len(random_bytes) // 16
    keep, set_bits, template = _uuid_masks(count)
    digits = ((int.from_bytes(random_bytes, "big") & keep) | set_bits).to_bytes(16 * count, "big").hex().encode()
    text = bytearray(template)
    for digit, position in enumerate(_DIGIT_AT):
        text[position::37] = digits[digit::32]
    return text.decode("ascii").split()


_IDS = _IdsAhead()


def new_decision_id() -> str:
    """A random UUID (version 4, RFC 9562 section 5.4) in its canonical text form, like ``str(uuid.uuid4())``: 122
    random bits from ``os.urandom``, without building a ``UUID`` object or making a system call per id."""
    try:
        return _IDS.ready.pop()
    except IndexError:
        return _IDS.refill()
