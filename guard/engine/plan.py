"""Per-policy plans for the decision hot path: what one policy needs per request, worked out once.

A :class:`Plan` belongs to one policy object answered by one backend revision. It holds the cache key's constant
part (:class:`~guard.engine.keys.KeyTemplate`), the wire id -> question key map, whether the rule result may be kept
with cached answers (:meth:`Plan.outcome`), and a bounded memo from a rendered state to its normalised form, flags and
cache key, for each cache scope apart (:meth:`Plan.prepare`).

Why the state memo is exact: preparing the state (normalisation and the fields' caps, ``Policy.prepare_state``) and
the key are pure functions of the rendered state. The usual state, an object whose values are all strings, is
remembered by its items and rebuilt as a new dict of the same strings. Any other state is remembered by its JSON text, and only when its normalised form survives
a JSON round trip unchanged, type for type, so a memo hit rebuilds the very same value as a fresh object (callers may
keep or change it freely). States that are not plain JSON (a YAML date, NaN) or longer than
:data:`STATE_MEMO_MAX_CHARS` characters are normalised every time, as before.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from guard.backends.base import DecisionBackend
from guard.engine.cache import CachedAnswers
from guard.engine.keys import KeyTemplate
from guard.policy import Policy, apply_rules
from guard.policy.provenance import rule_features
from guard.policy.rules import FEATURE_NAMES, rule_inputs
from guard.subject import Subject
from guard.systemone import MAX_QUESTIONS, QuestionV1, ReadOnlyDict, SystemOneRequestV1, SystemOneResponseV1, UsageV1

__all__ = [
    "STATE_MEMO_ENTRIES",
    "STATE_MEMO_MAX_CHARS",
    "STATE_RESERVE",
    "Group",
    "Plan",
    "group_plans",
    "keyed_revision",
]

#: Rendered states remembered per plan (least recently used first out). With :data:`STATE_MEMO_MAX_CHARS` this
#: bounds a plan's memo to about 2 MiB of ASCII text (raw and normalised JSON), 8 MiB at worst.
STATE_MEMO_ENTRIES = 128
#: Longest rendered state that is remembered (characters of its JSON, or of an object of strings' names and values).
STATE_MEMO_MAX_CHARS = 8192
#: Names a rule may read whose values do not come from the subject: rules reading only these (and question keys)
#: give the same result for the same cached answers.
ANSWER_INPUTS = frozenset({"answers", "data", "flags"})

#: The share of a local model's prompt (``max_length``) a request shared by several policies leaves their state at
#: least: a policy whose questions would leave it less is asked apart (the state's tail past the room is not read,
#: so a policy asked with others' long schemas read less of it than alone).
STATE_RESERVE = 0.5

_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


MemoKey = tuple[tuple[str, str], ...] | str


def _memo_key(raw: Any) -> MemoKey | None:
    """What identifies a rendered state in the memo: its items when it is an object of strings (the usual state:
    text, a header, a path), else its JSON text; ``None`` when it is not plain JSON or too long to keep."""
    if type(raw) is dict:
        items = tuple(raw.items())
        size = 0
        for name, value in items:
            if type(name) is not str or type(value) is not str:
                break
            size += len(name) + len(value)
        else:
            return items if size <= STATE_MEMO_MAX_CHARS else None
    try:
        text = _JSON.encode(raw)
    except (TypeError, ValueError):  # not plain JSON (NaN, a date, ...): normalised every time
        return None
    return text if len(text) <= STATE_MEMO_MAX_CHARS else None


class Plan:
    """What one policy answered by one backend revision needs per request.

    Attributes:
        policy: the policy (identity matters: a reloaded policy gets a new plan).
        backend: the backend that answers it; revision: its ``model_revision`` when the plan was made (empty for a
            rules-only policy, which no model answers).
        epoch: that backend's canary epoch (0, or the one its replicas share: a start time in milliseconds plus
            one per canary failed after passing it, and one per canary passed again after failing it); in the cache
            key, so answers stored before a failure or a recovery, perhaps by the broken model, are not read after
            it.
        key: the cache key template (constant part rendered once).
        names: wire question id -> question key.
        orders: wire id -> option ids in the policy's order, for each choice question (a cached answer may come
            from a policy that lists the same options in another order: the key does not depend on it).
        memo_flags: ``None`` when the rules read the subject or the state (they run on every request); else whether
            the rule result also depends on the normalisation flags (the memo key then includes them).
        no_answers: for a policy without questions (rules only), the empty answers its rules run on (no model call
            and no cache; the rule result is kept here when it reads no per-subject name); else ``None``.

    Threading: a plan serves every event loop of its Guard; its state memo is read and written only under
    ``_lock``.
    """

    __slots__ = (
        "__weakref__",
        "_lock",
        "_states",
        "backend",
        "epoch",
        "features",
        "key",
        "memo_flags",
        "names",
        "no_answers",
        "orders",
        "policy",
        "revision",
    )

    def __init__(self, policy: Policy, backend: DecisionBackend, revision: str, epoch: int = 0) -> None:
        self.policy = policy
        self.backend = backend
        self.revision = revision
        self.epoch = epoch
        self.key = KeyTemplate(
            backend=backend.name, revision=keyed_revision(revision, epoch), model=policy.model,
            questions=[q.wire for q in policy.questions],
        )
        self.names = policy.question_keys()
        self.orders = {q.wire.id: q.wire.option_ids() for q in policy.questions if q.wire.type == "choice"}
        reads = rule_inputs(policy.rules)
        self.features = reads & FEATURE_NAMES  # call / result: computed from the subject for every decision
        pure = reads <= ANSWER_INPUTS | frozenset(self.names.values())
        self.memo_flags: bool | None = ("flags" in reads) if pure else None
        # (cache scope, memo key) -> (flat, normalised items or JSON, flags, cache key)
        self._states: OrderedDict[tuple[str | None, MemoKey], tuple[bool, Any, tuple[tuple[str, Any], ...], str]] = (
            OrderedDict())
        self.no_answers = None if policy.questions else CachedAnswers(SystemOneResponseV1("", {}, UsageV1(0)))
        self._lock = threading.Lock()

    def prepare(self, subject: Subject, scope: str | None = None) -> tuple[dict[str, Any], Any, dict[str, Any], str]:
        """Render ``subject``'s state, normalise it and hash its cache key. The last :data:`STATE_MEMO_ENTRIES` states
        normalised are remembered for each ``scope`` apart (the decision's cache scope, a tenant: one scope cannot time
        whether another rendered the same state; ``None``: every unscoped decision's).

        Returns:
            ``(raw, state, flags, key)``: the rendered state as received (what the rules read), the normalised (and
            capped) state the model reads (a new object), its flags (a new dict) and the cache key (64 hex
            characters).

        Raises:
            StateTooLong: a field with ``truncate: error`` is over its ``max_chars``.
        """
        raw = self.policy.render_state(subject)
        memo_key = _memo_key(raw)
        if memo_key is not None:
            with self._lock:
                known = self._states.get((scope, memo_key))
            if known is not None:
                flat, normalized, known_flags, known_key = known
                state = dict(normalized) if flat else json.loads(normalized)
                return raw, state, dict(known_flags), known_key
        prepared = self.policy.prepare_state(raw, subject)
        state, flags = prepared.value, dict(prepared.flags)
        key = self.key.key(state)
        if memo_key is not None:
            self._remember(scope, memo_key, state, flags, key)
        return raw, state, flags, key

    def outcome(
        self, cached: CachedAnswers, *, subject: Subject, state: Any, flags: dict[str, Any]
    ) -> dict[str, Any]:
        """What the rules decided on the answers in ``cached`` (``state``: the rendered state as received, not the
        model's normalised copy), for :func:`guard.engine.verdicts.answered`:
        ``action`` (before shadow mode applies), ``policy_id``, ``policy_version``, ``rule``, ``answers``, ``status``,
        ``message``, ``handoff``, ``backend``, ``model``, ``model_revision``, ``retry_after`` and ``redact`` (the rule's
        :class:`~guard.policy.redact.Redactor`, for ``redact``). ``answers`` maps question keys to the cached answers,
        read-only (:class:`~guard.systemone.ReadOnlyDict`; a choice answer's probabilities in this policy's option
        order, :attr:`orders`): answers and map are shared by the decisions this plan serves from one entry.

        Sets ``flags["state_tokens_dropped"]`` first when the backend read only part of the state (the rules may act
        on a partial read), and ``flags["out_of_competence"]`` when it reports it could not read the state.

        When the rules read only the answers, ``data`` and ``flags``, the result is a pure function of those (CEL
        has no clock or randomness here), so it is kept in ``cached.memo`` and reused by later hits on the same cache
        entry; another plan (a reloaded policy, a new threshold) keeps its own. Converting answers into CEL values is
        most of a rule's cost, so this takes the rules off the hit path. A rule that fails is not kept.

        Returns:
            A new dict (the kept one stays as it was whatever the caller does with it).

        Raises:
            RuleError: when a ``when`` fails or does not return a boolean.
        """
        response = cached.response
        dropped = getattr(response.usage, "state_tokens_dropped", 0)
        if isinstance(dropped, int) and dropped > 0:
            flags["state_tokens_dropped"] = dropped
        if getattr(response.usage, "out_of_competence", 0):
            flags["out_of_competence"] = 1
        if self.memo_flags is None:
            return self._outcome(response, subject=subject, state=state, flags=flags)
        memo_key = (id(self), tuple(sorted(flags.items())) if self.memo_flags else None)
        kept = cached.memo.get(memo_key)
        if kept is not None and kept[0]() is self:  # a weak reference: cache entries do not keep old plans alive
            return dict(kept[1])
        fields = self._outcome(response, flags=flags)
        cached.remember(memo_key, (weakref.ref(self), fields))
        return dict(fields)

    def _outcome(
        self, response: SystemOneResponseV1, *, subject: Subject | None = None, state: Any = None,
        flags: dict[str, Any],
    ) -> dict[str, Any]:
        """:meth:`outcome` computed: the rules applied to ``response``'s answers (``subject`` and ``state``, the
        rendered state as received, only for rules that read them)."""
        policy, names, orders = self.policy, self.names, self.orders
        answers = ReadOnlyDict({
            key: response.answers[qid].in_order(orders[qid]) if qid in orders else response.answers[qid]
            for qid, key in names.items()
        })  # fmt: skip; a group's response has more answers than this policy's
        features = rule_features(
            subject, self.features, tools=policy.tools, trusted=policy.trusted, detector=policy.detector
        ) if self.features else None
        result = apply_rules(
            policy.id, policy.rules, policy.default, answers,
            subject=subject, state=state, flags=flags, data=policy.data, features=features,
        )  # fmt: skip
        outcome = result.outcome
        asked = bool(names)  # rules only: no backend, model or revision took part
        return {
            "action": outcome.action,
            "policy_id": policy.id,
            "policy_version": policy.version,
            "rule": result.rule,
            "answers": answers,
            "status": outcome.status,
            "message": outcome.message,
            "handoff": outcome.handoff,
            "backend": self.backend.name if asked else None,
            "model": response.model if asked else None,
            "model_revision": self.revision if asked else None,
            "retry_after": outcome.retry_after,
            "redact": outcome.redact,
        }

    def _remember(self, scope: str | None, memo_key: MemoKey, state: Any, flags: dict[str, Any], key: str) -> None:
        entry: tuple[bool, Any, tuple[tuple[str, Any], ...], str]
        if isinstance(memo_key, tuple):  # a flat object of strings normalises to one
            entry = (True, tuple(state.items()), tuple(flags.items()), key)
        else:
            try:
                normalized_json = _JSON.encode(state)
            except (TypeError, ValueError):
                return
            if not _same_json(json.loads(normalized_json), state):
                return
            entry = (False, normalized_json, tuple(flags.items()), key)
        with self._lock:
            states = self._states
            states[scope, memo_key] = entry
            states.move_to_end((scope, memo_key))
            while len(states) > STATE_MEMO_ENTRIES:
                states.popitem(last=False)


def _same_json(a: Any, b: Any) -> bool:
    """``a == b`` with the same type at every level (``1`` vs ``1.0`` vs ``True``, ``int`` vs an ``int`` subclass)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is str and _same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def keyed_revision(revision: str, epoch: int) -> str:
    """The revision a cache key names: the backend's, and its canary epoch once it has one (a shared store's, or
    after a canary failure)."""
    return revision if epoch == 0 else f"{revision}#epoch-{epoch}"


class Group:
    """Plans of policies that one model call answers: the same backend (revision), model, state declaration and mode
    (enforced or shadow), so the same state; their questions go out in one request, each distinct question once
    (:func:`group_plans`).

    Attributes:
        plans: the policies' plans, in match order.
        questions: the request's questions: the first plan's, then each later plan's that are not already there.
        key: the cache key template of that request (answers for a group are cached apart from one policy's).
        timeout: seconds the call may take: the longest of the policies' timeouts (each policy still waits only its
            own ``timeout``, then its fail mode decides).
        ttl: seconds the answers are cached: the shortest of the policies' ``cache.ttl`` (0 when one says 0).
    """

    __slots__ = ("_keys", "key", "plans", "questions", "timeout", "ttl")

    def __init__(self, plans: tuple[Plan, ...], questions: tuple[QuestionV1, ...]) -> None:
        first = plans[0]
        self.plans = plans
        self.questions = questions
        self.key = KeyTemplate(
            backend=first.backend.name, revision=keyed_revision(first.revision, first.epoch), model=first.policy.model,
            questions=questions,
        )
        self.timeout = max(plan.policy.timeout for plan in plans)
        self.ttl = min(plan.policy.cache_ttl for plan in plans)
        # (cache scope, first plan's key: it names the state exactly) -> this group's key
        self._keys: dict[tuple[str | None, str], str] = {}

    def prepare(self, subject: Subject, scope: str | None = None) -> tuple[dict[str, Any], Any, dict[str, Any], str]:
        """``(raw, state, flags, key)`` as :meth:`Plan.prepare`, with this group's cache key (remembered for the last
        :data:`STATE_MEMO_ENTRIES` states, for each ``scope`` apart: each dict operation is atomic, so no lock)."""
        raw, state, flags, own_key = self.plans[0].prepare(subject, scope)
        if len(self.plans) == 1:
            return raw, state, flags, own_key
        key = self._keys.get((scope, own_key))
        if key is None:
            key = self.key.key(state)
            if len(self._keys) >= STATE_MEMO_ENTRIES:
                self._keys.clear()
            self._keys[scope, own_key] = key
        return raw, state, flags, key

    def request(self, state: Any) -> SystemOneRequestV1:
        """The one System One request for every plan's questions."""
        return SystemOneRequestV1(model=self.plans[0].policy.model, state=state, questions=self.questions)


def group_plans(plans: tuple[Plan, ...]) -> tuple[Group, ...]:
    """Split the plans of the policies matching one subject into :class:`Group` s, in match order.

    A plan joins the first group with the same backend object and revision, the same model, an equal ``state``
    declaration (so the same state for every subject) and the same mode (a shadow policy's questions go in a request
    of their own, so a backend that refuses, omits or is slow on them never decides an enforced verdict), unless one
    of its questions has the wire id of a different question there (a request holds each id once), or the request
    would then ask more than :data:`~guard.systemone.MAX_QUESTIONS` questions or, with a backend that can tell
    (``state_room``, a local Clef model's), leave the state less than :data:`STATE_RESERVE` of its prompt; otherwise it
    starts a group. Identical questions are asked once.
    A plan without questions (rules only) is a group of its own with no questions: nothing is asked for it.
    """
    groups: list[tuple[list[Plan], list[QuestionV1]]] = []
    for plan in plans:
        policy = plan.policy
        if not policy.questions:  # rules only: a group of its own that asks nothing
            groups.append(([plan], []))
            continue
        for members, questions in groups:
            head = members[0]
            if (
                not questions
                or head.backend is not plan.backend
                or head.revision != plan.revision
                or head.epoch != plan.epoch
                or head.policy.model != policy.model
                or head.policy.state_fields != policy.state_fields
                or (head.policy.mode == "shadow") != (policy.mode == "shadow")
            ):
                continue
            by_id = {q.id: q for q in questions}
            if any(q.wire.id in by_id and by_id[q.wire.id] != q.wire for q in policy.questions):
                continue
            added = [q.wire for q in policy.questions if q.wire.id not in by_id]
            if added and not _fits(plan.backend, [*questions, *added]):
                continue
            members.append(plan)
            questions.extend(added)
            break
        else:
            groups.append(([plan], [q.wire for q in policy.questions]))
    return tuple(Group(tuple(members), tuple(questions)) for members, questions in groups)


def _fits(backend: DecisionBackend, questions: list[QuestionV1]) -> bool:
    """Whether one request shared by several policies may ask ``questions``: at most
    :data:`~guard.systemone.MAX_QUESTIONS` (the Workers AI limit, which a decision worker's default profile enforces
    too), and, when the backend can tell (``state_room`` and ``max_length``, a local Clef model's), a schema that
    leaves the state :data:`STATE_RESERVE` of the prompt."""
    if len(questions) > MAX_QUESTIONS:
        return False
    room = getattr(backend, "state_room", None)
    return not callable(room) or room(questions) >= STATE_RESERVE * backend.max_length  # type: ignore[attr-defined]
