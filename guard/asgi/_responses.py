"""Answers the middleware gives itself: JSON error bodies with stable codes, and decision headers on ``send``.

Bodies are ``{code, message, field}`` for requests the guard could not inspect and ``{code, message, policy, rule,
decision_id}`` for decisions (OPA's ``ErrorV1`` shape; snake_case codes are the constants below).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Awaitable, Sequence
from typing import Any, Literal

from starlette.types import Message, Send

from guard.asgi._metrics import HttpMetrics
from guard.errors import BodyError
from guard.verdict import Verdict, outcome_headers

__all__ = [
    "BLOCKED",
    "DECISION_HEADERS",
    "DECISION_UNAVAILABLE",
    "HANDOFF_FAILED",
    "PENDING_REVIEW",
    "RATE_LIMITED",
    "REVIEW_CONFLICT",
    "REVIEW_NOT_FOUND",
    "REVIEW_UNAVAILABLE",
    "DecisionHeaders",
    "HeaderList",
    "block_code",
    "encode_headers",
    "failed_open",
    "refuse_target",
    "refuse_unmatched_body",
    "retry_after_value",
    "send_json",
    "send_with_headers",
    "verdict_headers",
]

DecisionHeaders = Literal["brief", "full"]
#: How much the response to an allowed HTTP request says of the decision (``GuardMiddleware(decision_headers=...)``,
#: ``guard proxy --decision-headers``): ``brief``, the decision id and a fail-open flag; ``full``, every decision header.
DECISION_HEADERS: tuple[DecisionHeaders, ...] = ("brief", "full")

BLOCKED = "blocked"
RATE_LIMITED = "rate_limited"
DECISION_UNAVAILABLE = "decision_unavailable"
PENDING_REVIEW = "pending_review"
REVIEW_NOT_FOUND = "review_not_found"
REVIEW_CONFLICT = "review_conflict"
REVIEW_UNAVAILABLE = "review_unavailable"
REVIEW_OUTCOME_UNKNOWN = "review_outcome_unknown"
HANDOFF_FAILED = "handoff_failed"

HeaderList = list[tuple[bytes, bytes]]
_JSON = (b"content-type", b"application/json")
logger = logging.getLogger("guard.asgi")


def encode_headers(pairs: Sequence[tuple[str, str]]) -> HeaderList:
    """``[(name, value)]`` as ASGI header bytes (latin-1; unencodable characters become ``?``)."""
    return [(k.encode("latin-1", "replace"), v.encode("latin-1", "replace")) for k, v in pairs]


def retry_after_value(seconds: float) -> bytes:
    """A ``Retry-After`` value: whole seconds, rounded up (RFC 9110 10.2.3)."""
    return str(max(0, math.ceil(seconds))).encode()


@functools.lru_cache(maxsize=1024)
def _encoded_outcome(
    action: str, policy_id: str | None, version: str | None, rule: str | None, fail_mode: str | None, shadow: bool
) -> tuple[tuple[bytes, bytes], ...]:
    """:func:`~guard.verdict.outcome_headers` encoded, remembered: they repeat for every request with the same
    outcome."""
    return tuple(encode_headers(outcome_headers(action, policy_id, version, rule, fail_mode, shadow=shadow)))


def failed_open(verdict: Verdict) -> tuple[str, ...]:
    """The ids of the enforced policies whose fail mode let the request through undecided: what a client is told
    (``x-guard-fail-mode: open``) and ``guard_http_fail_open_total`` counts, each under its own id. The policy that
    decided (fail mode ``open``), or one beside another enforced policy's allow, redact or handoff (the combined
    verdict's ``flags.fail_open``); none when the verdict blocks or escalates. A shadow policy's fail-open decides
    only its own verdict (its decision log record and span say so), never what happens to the request."""
    if verdict.shadow_action is not None:
        return ()
    if verdict.contributions:
        if not verdict.flags.get("fail_open"):
            return ()
        return tuple(c.policy_id or "" for c in verdict.contributions
                     if c.shadow_action is None and c.flags.get("fail_open"))  # fmt: skip
    return (verdict.policy_id or "",) if verdict.fail_mode == "open" else ()


def verdict_headers(verdict: Verdict, *, full: bool = True) -> HeaderList:
    """The verdict's decision headers (``x-guard-*``, as :meth:`Verdict.headers` names them), plus ``Retry-After``
    when it carries one. A new list.

    Args:
        full: every header also when the verdict allows; ``False``: an allowing verdict's headers are the decision
            id and, when an enforced policy failed open (:func:`failed_open`), ``x-guard-fail-mode: open``. A
            verdict guard answers itself (block, escalate, handoff) always gets every header.
    """
    out = [(b"x-guard-decision-id", verdict.decision_id.encode("latin-1", "replace"))]
    shadow, opened = verdict.shadow_action, failed_open(verdict)
    # ``open`` also when another enforced policy decided (a redact, a handoff) and one beside it failed open
    fail_mode = verdict.fail_mode or ("open" if opened else None)
    if full or verdict.action != "allow":
        out += _encoded_outcome(
            shadow or verdict.action,
            verdict.policy_id,
            verdict.policy_version,
            verdict.rule,
            fail_mode,
            shadow is not None,
        )
    elif opened:  # a shadow policy's fail mode, whichever, allows too: not the client's to know
        out.append((b"x-guard-fail-mode", b"open"))
    if verdict.retry_after is not None and verdict.action != "allow":
        out.append((b"retry-after", retry_after_value(verdict.retry_after)))
    return out


def block_code(verdict: Verdict) -> str:
    """``decision_unavailable`` (fail closed), ``rate_limited`` (429) or ``blocked``."""
    if verdict.fail_mode == "closed":
        return DECISION_UNAVAILABLE
    if verdict.status == 429:
        return RATE_LIMITED
    return BLOCKED


async def send_json(
    send: Send, status: int, payload: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Send a whole JSON response."""
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def send_with_headers(send: Send, extra: HeaderList, message: Message) -> Awaitable[None]:
    """``send`` for the application: adds ``extra`` to ``http.response.start``, passes everything else untouched.

    Bind with ``functools.partial(send_with_headers, send, extra)``. Not a coroutine function: it returns what
    ``send`` returns for the caller to await, so each message costs no extra coroutine.
    """
    if message["type"] == "http.response.start":
        message = {**message, "headers": [*message.get("headers", ()), *extra]}
    return send(message)


async def refuse_target(send: Send, exc: BodyError, metrics: HttpMetrics, *, close: bool = False) -> None:
    """Answer a request whose target, headers or method were refused before any policy was matched (400
    ``invalid_target``, ``repeated_header``, ``method_override``, ``unexpected_body``; ``{code, message, field}``;
    counted in ``guard_http_target_rejections_total``), with ``Connection: close`` when ``close`` (what follows the
    request on its connection cannot be trusted to start a request). The target itself is not logged."""
    metrics.count_target_rejection(exc.code)
    logger.info("refused a request target before matching: %s (%s)", exc.code, exc.field)
    await _send_unmatched(send, exc, close=close)


async def refuse_unmatched_body(send: Send, exc: BodyError, metrics: HttpMetrics) -> None:
    """Answer a request whose body could not be read before any policy was matched (408 ``body_timeout`` while the
    middleware looks for a body on an HTTP/2 or 3 request without ``Content-Length``; ``{code, message, field}``;
    counted in ``guard_http_body_rejections_total``), with ``Connection: close`` after a 408 (a stalled body is not
    waited for)."""
    metrics.count_body_rejection(exc.code)
    logger.info("refused a request body before matching: %s (%s)", exc.code, exc.field)
    await _send_unmatched(send, exc, close=exc.status == 408)


async def _send_unmatched(send: Send, exc: BodyError, *, close: bool) -> None:
    """``{code, message, field}`` with ``exc``'s status, and ``Connection: close`` when ``close``."""
    await send_json(send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field},
                    [(b"connection", b"close")] if close else ())
