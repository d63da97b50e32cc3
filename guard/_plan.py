"""Per-policy plans for the decision hot path: what one policy needs per request, worked out once.

A :class:`Plan` belongs to one policy object answered by one backend revision. It holds the cache key's constant
part (:class:`~guard._answers.KeyTemplate`), the wire id -> question key map, whether the rule result may be kept
with cached answers (:meth:`Plan.rules`), and a bounded memo from a rendered state to its normalised form, flags and
cache key (:meth:`Plan.prepare`).

Why the state memo is exact: normalisation (``guard/normalize.py``) and the key are pure functions of the rendered
state, and a memo entry is only made when the normalised state survives a JSON round trip unchanged, type for type
(so a memo hit rebuilds the very same value, as a fresh object each time: callers may keep or change it freely).
States that are not plain JSON (a YAML date, NaN, a tuple) or longer than :data:`STATE_MEMO_MAX_CHARS` are
normalised every time, as before.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from guard._answers import KeyTemplate
from guard.backends.base import DecisionBackend
from guard.cache import CachedAnswers
from guard.normalize import normalize_value
from guard.policy import Policy, apply_rules
from guard.policy.rules import RuleResult, rule_inputs
from guard.subject import Subject
from guard.systemone import AnswerV1

__all__ = ["STATE_MEMO_ENTRIES", "STATE_MEMO_MAX_CHARS", "Plan"]

#: Rendered states remembered per plan (least recently used first out). With :data:`STATE_MEMO_MAX_CHARS` this
#: bounds a plan's memo to about 2 MiB of ASCII text (raw and normalised JSON), 8 MiB at worst.
STATE_MEMO_ENTRIES = 128
#: Longest rendered state (JSON characters) that is remembered.
STATE_MEMO_MAX_CHARS = 8192
#: Names a rule may read whose values do not come from the subject: rules reading only these (and question keys)
#: give the same result for the same cached answers.
ANSWER_INPUTS = frozenset({"answers", "data", "flags"})

_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class Plan:
    """What one policy answered by one backend revision needs per request.

    Attributes:
        policy: the policy (identity matters: a reloaded policy gets a new plan).
        backend: the backend that answers it; revision: its ``model_revision`` when the plan was made.
        key: the cache key template (constant part rendered once).
        names: wire question id -> question key.
        memo_flags: ``None`` when the rules read the subject or the state (they run on every request); else whether
            the rule result also depends on the normalisation flags (the memo key then includes them).
    """

    __slots__ = ("__weakref__", "_states", "backend", "key", "memo_flags", "names", "policy", "revision")

    def __init__(self, policy: Policy, backend: DecisionBackend, revision: str) -> None:
        self.policy = policy
        self.backend = backend
        self.revision = revision
        self.key = KeyTemplate(
            backend=backend.name, revision=revision, model=policy.model, questions=[q.wire for q in policy.questions]
        )
        self.names = policy.question_keys()
        reads = rule_inputs(policy.rules)
        pure = reads <= ANSWER_INPUTS | frozenset(self.names.values())
        self.memo_flags: bool | None = ("flags" in reads) if pure else None
        self._states: OrderedDict[str, tuple[str, tuple[tuple[str, Any], ...], str]] = OrderedDict()

    def prepare(self, subject: Subject) -> tuple[Any, dict[str, Any], str]:
        """Render ``subject``'s state, normalise it and hash its cache key.

        Returns:
            ``(state, flags, key)``: the normalised state (a new object), the normalisation flags (a new dict) and the
            cache key (64 hex characters).
        """
        raw = self.policy.render_state(subject)
        try:
            text: str | None = _JSON.encode(raw)
        except (TypeError, ValueError):  # not plain JSON: normalise every time
            text = None
        if text is not None and len(text) > STATE_MEMO_MAX_CHARS:
            text = None
        if text is not None:
            known = self._states.get(text)
            if known is not None:
                normalized_json, known_flags, known_key = known
                return json.loads(normalized_json), dict(known_flags), known_key
        normalized = normalize_value(raw)
        state, flags = normalized.value, dict(normalized.flags)
        key = self.key.key(state)
        if text is not None:
            self._remember(text, state, flags, key)
        return state, flags, key

    def rules(
        self, cached: CachedAnswers, answers: Mapping[str, AnswerV1], *, subject: Subject, state: Any,
        flags: dict[str, Any],
    ) -> RuleResult:
        """Apply the policy's rules to ``answers`` (question key -> answer, from ``cached``).

        When the rules read only the answers, ``data`` and ``flags``, the result is a pure function of those (CEL
        has no clock or randomness here), so it is kept in ``cached.memo`` and reused by later hits on the same cache
        entry; another plan (a reloaded policy, a new threshold) keeps its own. Converting answers into CEL values is
        most of a rule's cost, so this takes the rules off the hit path. A rule that fails is not kept.

        Raises:
            RuleError: when a ``when`` fails or does not return a boolean.
        """
        policy = self.policy
        if self.memo_flags is None:
            return apply_rules(
                policy.id, policy.rules, policy.default, answers,
                subject=subject, state=state, flags=flags, data=policy.data,
            )  # fmt: skip
        memo_key = (id(self), tuple(sorted(flags.items())) if self.memo_flags else None)
        kept = cached.memo.get(memo_key)
        if kept is not None and kept[0]() is self:  # a weak reference: cache entries do not keep old plans alive
            result: RuleResult = kept[1]
            return result
        result = apply_rules(policy.id, policy.rules, policy.default, answers, flags=flags, data=policy.data)
        cached.remember(memo_key, (weakref.ref(self), result))
        return result

    def _remember(self, text: str, state: Any, flags: dict[str, Any], key: str) -> None:
        try:
            normalized_json = _JSON.encode(state)
        except (TypeError, ValueError):
            return
        if not _same_json(json.loads(normalized_json), state):
            return
        states = self._states
        states[text] = (normalized_json, tuple(flags.items()), key)
        states.move_to_end(text)
        while len(states) > STATE_MEMO_ENTRIES:
            try:
                states.popitem(last=False)
            except KeyError:  # emptied by another thread (the sync facade's portal) meanwhile
                break


def _same_json(a: Any, b: Any) -> bool:
    """``a == b`` with the same type at every level (``1`` vs ``1.0`` vs ``True``, ``int`` vs an ``int`` subclass)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is str and _same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
