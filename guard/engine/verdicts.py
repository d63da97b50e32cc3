"""Where every verdict is made and recorded.

:func:`make` is the one place a :class:`~guard.verdict.Verdict` is constructed. The functions below it make the
verdicts that have no model answer (no policy matched, a fail mode decided, a state too long to judge, a body or a
tool call refused before a decision, a guard that raised) and the one that has (:func:`answered`). :func:`record` is
the one recording path: the ``guard.decisions`` counters, the decision span's attributes and the decision log.

A shadow policy's verdict allows and keeps the computed action in ``shadow_action``; :func:`make` applies that rule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from guard._markup import is_markup
from guard.engine.telemetry import credential_header
from guard.errors import BackendError, GuardError, Overloaded, StateAmbiguous, StateTooLong, UnsupportedQuestion
from guard.policy import Policy
from guard.policy.provenance import resolved_effect
from guard.policy.redact import UNMASKABLE_FLAG, Redactor, apply_redactions, masked_texts, merge_redactions
from guard.policy.rules import RuleError
from guard.subject import AgentSubject, HttpSubject, Subject
from guard.systemone import AnswerV1
from guard.verdict import ACTION_RANK, Action, FailMode, Redaction, Verdict

__all__ = [
    "FAIL_ACTIONS",
    "FAIL_CLOSED_MESSAGE",
    "GUARD_ERROR_RULE",
    "MASKED_ACTIONS",
    "STATE_ALIASED_MESSAGE",
    "STATE_AMBIGUOUS_MESSAGE",
    "STATE_AMBIGUOUS_RULE",
    "STATE_AMBIGUOUS_STATUS",
    "STATE_TOO_LONG_MESSAGE",
    "STATE_TOO_LONG_RULE",
    "STATE_TOO_LONG_STATUS",
    "accountable",
    "answered",
    "combined",
    "copy_from_json",
    "fail_mode",
    "guard_failed",
    "make",
    "no_match",
    "phase_of",
    "record",
    "redacting",
    "refused",
    "state_refused",
    "unsettled_handoff",
]

logger = logging.getLogger("guard.engine")

Phase = Literal["request", "response"]

#: Message of a fail-closed block when the policy gives none.
FAIL_CLOSED_MESSAGE = "The decision service is unavailable; try again later."
#: Rule, HTTP status and message of the block for a state field over its ``max_chars`` with ``truncate: error``.
STATE_TOO_LONG_RULE = "state_too_long"
STATE_TOO_LONG_STATUS = 413
STATE_TOO_LONG_MESSAGE = "Too long to check: {field} has {length} characters; this policy judges at most {max_chars}."
#: Rule and HTTP status of the block for a value the policy reads as one that the request sent more than once.
STATE_AMBIGUOUS_RULE = "state_ambiguous"
STATE_AMBIGUOUS_STATUS = 400
STATE_AMBIGUOUS_MESSAGE = "Sent more than once: the {what}; this check reads it as one value, send it once."
#: The message of that block for a query parameter or form field sent under another spelling (``q[]`` for ``q``).
STATE_ALIASED_MESSAGE = "Sent under another name: the {what}; this check reads it by its name, send it so."
#: The message of that block for a query parameter Rails on Rack 2 reads otherwise, as it splits a query at ``;``.
STATE_SEMICOLON_MESSAGE = ("Read otherwise at ';': the {what}; Rails on Rack 2 splits a query at ';' too, send a ';' "
                           "in a value as %3B.")
#: Rule of a verdict a fail mode made (the backend failed, or the guard itself raised).
GUARD_ERROR_RULE = "on_error"

#: The action each fail mode takes (what a verdict a fail mode made, or a handoff it settled, does).
FAIL_ACTIONS: dict[FailMode, Action] = {"closed": "block", "open": "allow", "escalate": "escalate"}

#: The actions that pass the subject on, so that every enforced ``redact`` beside the one that decides masks what
#: goes: ``redact`` (to the application), ``escalate`` (held, shown to reviewers and released masked) and ``handoff``
#: (to the handoff target). A ``block`` passes nothing on; an ``allow`` never decides beside an enforced ``redact``.
MASKED_ACTIONS: tuple[Action, ...] = ("escalate", "handoff", "redact")


def make(
    action: Action,
    decision_id: str,
    *,
    policy_id: str | None = None,
    policy_version: str | None = None,
    rule: str | None = None,
    answers: Mapping[str, AnswerV1] | None = None,
    status: int | None = None,
    message: str | None = None,
    message_from_input: bool = False,
    handoff: str | None = None,
    cache_hit: bool = False,
    backend: str | None = None,
    model: str | None = None,
    model_revision: str | None = None,
    latency_ms: float = 0.0,
    fail_mode: FailMode | None = None,
    error: str | None = None,
    retry_after: float | None = None,
    shadow: bool = False,
    state: Any = None,
    flags: dict[str, Any] | None = None,
    contributions: tuple[Verdict, ...] = (),
    redactions: tuple[Redaction, ...] = (),
    phase: Phase = "request",
    policy_digest: str | None = None,
    policy_file: str | None = None,
) -> Verdict:
    """The one constructor call of :class:`~guard.verdict.Verdict`.

    Args:
        action: what the policy decided; with ``shadow`` the verdict allows and this becomes ``shadow_action``.
        shadow: the policy runs in shadow mode.
        The others are the verdict's fields of the same name (``latency_ms`` in milliseconds).
    """
    return Verdict(
        action="allow" if shadow else action,
        decision_id=decision_id,
        policy_id=policy_id,
        policy_version=policy_version,
        rule=rule,
        answers=answers if answers is not None else {},  # type: ignore[arg-type]
        status=status,
        message=message,
        message_from_input=message_from_input,
        handoff=handoff,
        cache_hit=cache_hit,
        backend=backend,
        model=model,
        model_revision=model_revision,
        latency_ms=latency_ms,
        fail_mode=fail_mode,
        error=error,
        retry_after=retry_after,
        shadow_action=action if shadow else None,
        state=state,
        flags=flags if flags is not None else {},
        contributions=contributions,
        redactions=redactions,
        phase=phase,
        policy_digest=policy_digest,
        policy_file=policy_file,
    )


def phase_of(subject: Subject | None) -> Phase:
    """``response`` for an HTTP response subject, else ``request``."""
    return "response" if isinstance(subject, HttpSubject) and subject.phase == "response" else "request"


# Verdicts from the model's answers ---------------------------------------------------------------------------------


#: The message of a ``redact`` verdict turned into a block: what the rule masks is also where it cannot be masked.
UNMASKABLE = (
    "What the rule masks is also in an object key, the query string, the path, a header, an escaped text body (JSON "
    "escapes, HTML or XML character references or CDATA) or across a stream's events, where it cannot be masked; "
    "refused."
)


def _unmasked_texts(policy: Policy, subject: HttpSubject, redactions: tuple[Redaction, ...]) -> list[str]:
    """What of ``subject`` besides its body and query that ``policy``'s state and rules read goes on as it is, where
    a ``redact`` rule masks nothing (:attr:`Policy.http_reads`): a request's path (as matched and as sent), and the
    values of the headers read (a response's headers for a response), but the credential headers
    (:func:`~guard.engine.telemetry.credential_header`: the caller's own key, which the application is sent anyway).
    Where a rule may read any header (most read their names: ``subject.headers.exists(h, ...)``) and ``redactions``
    mask something in the body, only the headers that hold what they mask count; with nothing masked, every one."""
    reads = policy.http_reads
    headers = [value for name, value in subject.headers.items()
               if (reads.headers is None or name in reads.headers) and not credential_header(name)]
    if reads.headers is None and redactions:
        masked = masked_texts(subject.body, redactions)
        headers = [value for value in headers if any(text in value for text in masked)]
    paths = [subject.path, subject.sent_path] if subject.phase == "request" and reads.path else []
    return [*paths, *headers]


def answered(
    policy: Policy,
    outcome: Mapping[str, Any],
    *,
    decision_id: str,
    cache_hit: bool,
    latency_ms: float,
    state: Any,
    flags: dict[str, Any],
    subject: Subject,
) -> Verdict:
    """The verdict the rules reached on the model's (or the cache's) answers.

    A ``redact`` outcome finds its spans in ``subject``'s body here (:meth:`~guard.policy.redact.Redactor.find`);
    the verdict then keeps where they are, and no ``state`` (it would hold the text being masked).

    Args:
        outcome: the rules' result and the plan's constants, as :meth:`guard.engine.plan.Plan.outcome` returns them.
    """
    redactor = outcome["redact"]
    redactions: tuple[Redaction, ...] = ()
    action, status, message = outcome["action"], outcome["status"], outcome["message"]
    if redactor is not None and isinstance(subject, HttpSubject):
        redactions = redactor.find(subject.body, policy.detector)
        state = None
        query = subject.query if subject.phase == "request" else {}
        if action == "redact" and redactor.leaves(subject.body, query, redactions, policy.detector, subject.deltas,
                                                  markup=is_markup(subject.content_type),
                                                  clear=_unmasked_texts(policy, subject, redactions)):
            action, redactions, message = "block", (), UNMASKABLE
            status = 422 if subject.phase == "request" else None  # a response: the response block's own status
            flags = {**flags, UNMASKABLE_FLAG: 1}  # the decision log leaves the body and query out
    return make(
        action,
        decision_id,
        policy_id=outcome["policy_id"],
        policy_version=outcome["policy_version"],
        rule=outcome["rule"],
        answers=outcome["answers"],
        status=status,
        message=message,
        handoff=outcome["handoff"],
        cache_hit=cache_hit,
        backend=outcome["backend"],
        model=outcome["model"],
        model_revision=outcome["model_revision"],
        latency_ms=latency_ms,
        retry_after=outcome["retry_after"],
        shadow=policy.mode == "shadow",
        state=state,
        flags=flags,
        redactions=redactions,
        phase=phase_of(subject),
        policy_digest=policy.digest,
        policy_file=policy.file,
    )


def combined(
    policies: Sequence[Policy], contributions: Sequence[Verdict], *, decision_id: str, latency_ms: float
) -> Verdict:
    """The verdict of several matching policies from each one's own verdict (``contributions[i]`` is
    ``policies[i]``'s): the one that decides is the first by

    1. its action's place in :data:`~guard.verdict.ACTIONS` (block > escalate > handoff > redact > allow; a shadow
       policy's verdict allows);
    2. then, among equal actions, an enforced policy's verdict before a shadow one's (a shadow policy never decides
       what the client or the metrics see; it decides only when every matching policy is shadow), then the shadow
       action's place (among shadow verdicts, one that would block shows over one that would allow), then a fail
       mode that decided before one that did not (degraded decisions show);
    3. then the higher ``priority`` (default 0), then the policy id in string order, never the file order: the
       verdict does not depend on the order files are given in.

    Its fields are the verdict's; ``latency_ms`` is the whole evaluation, ``cache_hit`` holds when every policy's
    answers came from the cache (or it asked none), ``flags`` are every enforced contribution's (of a count, the
    largest any of them has, whatever the match order: each policy counts in its own state, and its own counts stay
    in its contribution; of any other value, the decisive one's where it has one; a shadow policy's stay in its own
    verdict unless it decides), with an enforced policy's ``fail_open`` left out when the verdict blocks or
    escalates (the subject did not pass), ``redactions`` are those
    of every enforced policy that redacts when the verdict passes the subject on (:data:`MASKED_ACTIONS`: ``redact``
    to the application now, ``escalate`` after a review, ``handoff`` to the handoff target), and ``contributions``
    keeps all of them in match order. A verdict with ``redactions`` keeps no ``state``: the deciding policy's state
    would hold the text being masked (an escalation's reviewers see the state rendered from the masked request,
    ``guard.asgi``).
    """
    priority = {policy.id: policy.priority for policy in policies}

    def rank(verdict: Verdict) -> tuple[int, bool, int, bool, int, str]:
        return (
            ACTION_RANK[verdict.action],
            verdict.shadow_action is not None,
            ACTION_RANK[verdict.shadow_action or "allow"],
            verdict.fail_mode is None,
            -priority[verdict.policy_id or ""],
            verdict.policy_id or "",
        )

    decisive = min(contributions, key=rank)
    asked = [c for c in contributions if c.backend is not None]  # rules-only verdicts name no backend
    flags: dict[str, Any] = {}
    for contribution in (*(c for c in contributions if c is not decisive and c.shadow_action is None), decisive):
        for name, value in contribution.flags.items():
            known = flags.get(name)
            flags[name] = max(known, value) if _is_count(known) and _is_count(value) else value
    if decisive.action in ("block", "escalate"):
        flags.pop("fail_open", None)  # an enforced fail-open beside a block let nothing through
    redactions: tuple[Redaction, ...] = ()
    if decisive.action in MASKED_ACTIONS and decisive.shadow_action is None:
        redactions = merge_redactions(r for c in contributions if c.action == "redact" and c.shadow_action is None
                                      for r in c.redactions)  # fmt: skip
    return make(
        decisive.shadow_action or decisive.action,
        decision_id,
        policy_id=decisive.policy_id,
        policy_version=decisive.policy_version,
        rule=decisive.rule,
        answers=decisive.answers,
        status=decisive.status,
        message=decisive.message,
        message_from_input=decisive.message_from_input,
        handoff=decisive.handoff,
        cache_hit=bool(asked) and all(c.cache_hit for c in asked),
        backend=decisive.backend,
        model=decisive.model,
        model_revision=decisive.model_revision,
        latency_ms=latency_ms,
        fail_mode=decisive.fail_mode,
        error=decisive.error,
        retry_after=decisive.retry_after,
        shadow=decisive.shadow_action is not None,
        state=None if redactions else decisive.state,
        flags=flags,
        contributions=tuple(contributions),
        redactions=redactions,
        phase=decisive.phase,
        policy_digest=decisive.policy_digest,
        policy_file=decisive.policy_file,
    )


def _is_count(value: Any) -> bool:
    """Whether a flag value is a count (an int or float, not a bool), which :func:`combined` keeps the largest of."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Verdicts without a model answer -----------------------------------------------------------------------------------


def redacting(verdict: Verdict) -> str | None:
    """The id of the policy that asked for ``verdict``'s redactions: the deciding policy when it redacts, else (an
    escalation or handoff passing the masked subject on, :func:`combined`) the first enforced contribution that
    redacts; ``None`` when the verdict masks nothing."""
    if not verdict.redactions:
        return None
    if verdict.action == "redact":
        return verdict.policy_id
    enforced = (c.policy_id for c in verdict.contributions if c.action == "redact" and c.shadow_action is None)
    return next(enforced, verdict.policy_id)


def no_match(decision_id: str, latency_ms: float) -> Verdict:
    """No policy matched: allow, without a model call."""
    return make("allow", decision_id, latency_ms=latency_ms)


def state_refused(
    policy: Policy,
    exc: StateTooLong | StateAmbiguous,
    *,
    decision_id: str,
    backend: str,
    model_revision: str | None,
    latency_ms: float,
    flags: dict[str, Any],
) -> Verdict:
    """The block for a state ``policy`` will not judge, whatever its ``on_error`` says; no model was asked: a field
    over its ``max_chars`` with ``truncate: error`` (413, :data:`STATE_TOO_LONG_RULE`), or a value it reads as one
    sent more than once, under another name, or that Rails on Rack 2 reads otherwise at ``;`` (400,
    :data:`STATE_AMBIGUOUS_RULE`). Its message names what the request sent (a parameter's spelling, a JSON pointer):
    ``message_from_input``."""
    if isinstance(exc, StateTooLong):
        rule, status = STATE_TOO_LONG_RULE, STATE_TOO_LONG_STATUS
        message = STATE_TOO_LONG_MESSAGE.format(field=exc.field, length=exc.length, max_chars=exc.max_chars)
    else:
        rule, status = STATE_AMBIGUOUS_RULE, STATE_AMBIGUOUS_STATUS
        template = (STATE_SEMICOLON_MESSAGE if exc.at_semicolon else STATE_AMBIGUOUS_MESSAGE if exc.alias is None
                    else STATE_ALIASED_MESSAGE)
        message = template.format(what=exc.what)
    return make(
        "block",
        decision_id,
        policy_id=policy.id,
        policy_version=policy.version,
        rule=rule,
        status=status,
        message=message,
        message_from_input=True,
        backend=backend,
        model_revision=model_revision,
        latency_ms=latency_ms,
        shadow=policy.mode == "shadow",
        flags=flags,
        policy_digest=policy.digest,
        policy_file=policy.file,
    )


def fail_mode(
    policy: Policy,
    subject: Subject,
    exc: Exception,
    *,
    decision_id: str,
    backend: str,
    model: str | None,
    model_revision: str | None,
    latency_ms: float,
    state: Any,
    flags: dict[str, Any],
) -> Verdict:
    """The verdict of the policy's fail mode (``closed``: block, ``open``: allow, flagged ``fail_open``;
    ``escalate``) when deciding failed: a backend error, a timeout, a malformed answer or a rule that failed."""
    reason = _reason(exc)
    if not isinstance(exc, (GuardError, TimeoutError)):
        logger.error("policy %s: unexpected %s while deciding; fail mode applies", policy.id, reason, exc_info=exc)
    fail = policy.fail_policy(subject)
    status = retry_after = None
    message = fail.message
    if fail.mode == "closed":
        status = fail.status
        message = fail.message or FAIL_CLOSED_MESSAGE
        retry_after = _retry_after(fail.retry_after, getattr(exc, "retry_after", None))
    elif fail.mode == "open":
        flags = {**flags, "fail_open": True}
        logger.warning("policy %s@%s FAILED OPEN (%s): subject allowed without a decision", policy.id,
                       policy.version, reason)  # fmt: skip
    return make(
        FAIL_ACTIONS[fail.mode],
        decision_id,
        policy_id=policy.id,
        policy_version=policy.version,
        rule=GUARD_ERROR_RULE,
        status=status,
        message=message,
        backend=backend,
        model=model,
        model_revision=model_revision,
        latency_ms=latency_ms,
        fail_mode=fail.mode,
        error=_error_text(reason, exc, policy),
        retry_after=retry_after,
        shadow=policy.mode == "shadow",
        state=state,
        flags=flags,
        phase=phase_of(subject),
        policy_digest=policy.digest,
        policy_file=policy.file,
    )


def accountable(policies: Sequence[Policy]) -> Policy | None:
    """The policy a decision made without the model names, of every policy matching the subject (a refused body, a
    malformed tool call, a guard that raised): an enforced one before a shadow one, then the higher ``priority``, then
    the policy id in string order (never the file order, as :func:`combined`); ``None`` when none matches. Its mode
    says whether such a refusal is enforced: a shadow policy is named only when every matching policy is shadow."""
    return min(policies, key=lambda p: (p.mode == "shadow", -p.priority, p.id), default=None)


def refused(
    policy: Policy | None,
    *,
    decision_id: str,
    rule: str,
    status: int,
    message: str,
    error: str | None = None,
    flags: dict[str, Any] | None = None,
    phase: Phase = "request",
    shadow: bool = False,
) -> Verdict:
    """A block made before any decision because the input cannot be judged: an HTTP body that cannot be inspected
    (``rule`` = the body error's code; ``phase`` ``response`` for an upstream response), a malformed tool call
    (``malformed_arguments``). With ``shadow`` (every matching policy is in shadow mode, where the enforcement point
    allows it) the verdict allows and records the refusal as ``shadow_action`` ``block``. ``message`` may quote the
    input (a JSON key, a charset): ``message_from_input``."""
    return make(
        "block",
        decision_id,
        policy_id=policy.id if policy else None,
        policy_version=policy.version if policy else None,
        rule=rule,
        status=status,
        message=message,
        message_from_input=True,
        error=error,
        flags=flags,
        phase=phase,
        shadow=shadow,
        policy_digest=policy.digest if policy else None,
        policy_file=policy.file if policy else None,
    )


def guard_failed(
    policy: Policy | None, mode: FailMode, exc: BaseException, *, decision_id: str, latency_ms: float
) -> Verdict:
    """The verdict of an enforcement point's fail mode when the guard itself raised; its ``error`` names the
    exception's type only (``guard_error: KeyError``), as :func:`fail_mode`'s does an unexpected one."""
    return make(
        FAIL_ACTIONS[mode],
        decision_id,
        policy_id=policy.id if policy else None,
        policy_version=policy.version if policy else None,
        rule=GUARD_ERROR_RULE,
        latency_ms=latency_ms,
        fail_mode=mode,
        error=f"guard_error: {type(exc).__name__}",  # its text may quote the input; the caller logs the traceback
        policy_digest=policy.digest if policy else None,
        policy_file=policy.file if policy else None,
    )


def unsettled_handoff(verdict: Verdict, mode: FailMode, reason: str) -> Verdict:
    """``verdict`` (a ``handoff``) with the fail mode that decided because the handoff could not be settled."""
    return make(
        verdict.action,
        verdict.decision_id,
        policy_id=verdict.policy_id,
        policy_version=verdict.policy_version,
        rule=verdict.rule,
        answers=verdict.answers,
        status=verdict.status,
        message=verdict.message,
        message_from_input=verdict.message_from_input,
        handoff=verdict.handoff,
        cache_hit=verdict.cache_hit,
        backend=verdict.backend,
        model=verdict.model,
        model_revision=verdict.model_revision,
        latency_ms=verdict.latency_ms,
        fail_mode=mode,
        error=reason[:500],
        retry_after=verdict.retry_after,
        state=verdict.state,
        flags=verdict.flags,
        policy_digest=verdict.policy_digest,
        policy_file=verdict.policy_file,
    )


def copy_from_json(data: Mapping[str, Any]) -> Verdict:
    """A verdict rebuilt from the summary an agent's private state keeps (answers left out), for message
    templates."""
    return make(
        data["action"],
        data["decision_id"],
        policy_id=data.get("policy"),
        policy_version=data.get("policy_version"),
        rule=data.get("rule"),
        message=data.get("message"),
        handoff=data.get("handoff"),
        fail_mode=data.get("fail_mode"),
        error=data.get("error"),
    )


# Recording ---------------------------------------------------------------------------------------------------------


def _clear_masked(subject: HttpSubject, verdict: Verdict, policies: Sequence[Policy]) -> HttpSubject:
    """``subject`` with what the redact rule of each of ``verdict``'s refusals as unmaskable
    (:data:`~guard.policy.redact.UNMASKABLE_FLAG`) matches masked in its path (as matched and as sent) and header
    values; ``subject`` itself when there is none."""
    by_id = {policy.id: policy for policy in policies}
    masks: list[tuple[Redactor, Policy]] = []
    for own in (verdict, *verdict.contributions):
        policy = by_id.get(own.policy_id or "")
        if own.flags.get(UNMASKABLE_FLAG) and policy is not None:
            outcome = next((rule.outcome for rule in policy.rules if rule.id == own.rule), policy.default)
            if outcome.redact is not None:
                masks.append((outcome.redact, policy))
    if not masks:
        return subject

    def masked(text: str) -> str:
        for redactor, policy in masks:
            text = apply_redactions(text, redactor.find(text, policy.detector))
        return text

    headers = {name: masked(value) for name, value in subject.headers.items()}
    return dataclasses.replace(subject, path=masked(subject.path), sent_path=masked(subject.sent_path), headers=headers)


def record(
    telemetry: Any,
    decision_log: Any,
    verdict: Verdict,
    subject: Subject,
    *,
    policy: Policy | None,
    cache: str | None = None,
    span: Any = None,
    matched: Sequence[Policy] = (),
) -> Verdict:
    """Record one decision: count it and set its span's attributes (``telemetry.finish``; ``span`` ``None`` when
    none was started), and write its decision-log record when a policy matched and a log is configured. Where a
    ``redact`` rule was refused because what it masks is in the path or a header (:data:`UNMASKABLE`), the span's
    ``url.path`` and the log's path and headers have what the rule's patterns match there masked.

    Args:
        telemetry: a :class:`~guard.engine.telemetry.Telemetry`.
        decision_log: a :class:`~guard.engine.telemetry.DecisionLog`, or ``None``.
        policy: the policy that decided (an agent subject's ``tool_effect`` is logged as that policy's rules read
            it: :func:`~guard.policy.provenance.resolved_effect`), ``None`` when unknown.
        cache: how the answers were found (``hit``, ``miss``, ``shared``), ``None`` without a cache lookup.
        matched: the other policies that matched (a contribution's redact rule is looked up there).

    Returns:
        ``verdict``.
    """
    path = None
    if isinstance(subject, HttpSubject):
        masked = _clear_masked(subject, verdict, [*matched, policy] if policy is not None else matched)
        path = masked.path if masked.path != subject.path else None
        subject = masked
    telemetry.finish(span, verdict, cache=cache, path=path)
    if verdict.policy_id is not None and decision_log is not None:
        if isinstance(subject, AgentSubject) and policy is not None:
            effect = resolved_effect(policy.tools, subject.tool_name, subject.tool_effect)
            if effect != subject.tool_effect:
                subject = dataclasses.replace(subject, tool_effect=effect)
        decision_log.record(verdict, subject, cache=cache, span=span)
    return verdict


def _retry_after(policy_seconds: float, hint: Any) -> float:
    """Retry-After of a fail-closed block: the policy's ``retry_after``, or the backend's hint (a worker's queue
    estimate, a 429's header) when that is shorter. A longer hint is capped: a backend's own rate limit (an hour for
    a used-up quota) is the operator's problem, not a wait to hand to every client."""
    if isinstance(hint, (int, float)) and not isinstance(hint, bool) and math.isfinite(hint) and 0 <= hint:
        return min(float(hint), policy_seconds)
    return policy_seconds


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BackendError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, UnsupportedQuestion):
        return "unsupported_question"
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, RuleError):
        return "rule_error"
    return "internal_error"


def _error_text(reason: str, exc: BaseException, policy: Policy) -> str:
    """The verdict's ``error`` (also the span's ``guard.error`` and the decision log's ``error``): ``reason: detail``,
    at most 500 characters. A rule error's text names the rule, the policy and the kind of failure, never a request
    value (:class:`~guard.policy.rules.RuleError`); an unexpected exception gives only its type (its text is
    unchecked: a ``KeyError`` quotes its key; fail_mode logs it with its traceback)."""
    if reason == "internal_error":
        detail = type(exc).__name__
    else:
        detail = str(exc) or (f"no decision within {policy.timeout * 1000:.0f} ms" if reason == "timeout" else "")
    return f"{reason}: {detail}"[:500] if detail else reason
