"""The gateway's readiness endpoint (``GET /_guard/health`` of ``guard proxy``): what the report says, and to whom.

Anyone gets the status, ``ready`` and one code per check (:func:`guard.engine.health.public_health`): no error text
and nothing of the policies. A caller with an admin bearer token (``Authorization: Bearer <token>``; ``guard proxy``
takes the tokens of its reviewers not scoped to tenants) gets the full report with ``details``; one sending
``Authorization`` more than once gets 400 ``repeated_header`` and no report. The HTTP status is 200 while ``ready``
(``ok`` or ``degraded``) and 503 when ``failing``: no policy loaded, a backend that fails every call or its canary,
or an upstream that cannot be reached (see :mod:`guard.engine.health`).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from guard._headers import sole_header
from guard.asgi._ratelimit import TokenBuckets, client_key
from guard.asgi._responses import send_json
from guard.asgi.review_api import DEFAULT_RATE_LIMIT
from guard.engine.health import FailureTracker, health_report, public_health
from guard.errors import BodyError
from guard.policy.watch import PolicyWatcher

if TYPE_CHECKING:
    from starlette.types import Scope, Send

    from guard.asgi.review_store import ReviewStore
    from guard.engine import Guard

__all__ = ["HealthEndpoint"]


class HealthEndpoint:
    """Answers health requests for one gateway.

    Args:
        guard: the engine.
        upstream: the proxy's upstream tracker (``ReverseProxy.health``), reported as check ``upstream``.
        review_store: the store escalated requests are held in, reported as check ``review_store``.
        admin_tokens: bearer tokens that see the details (none: nobody does).
        watcher: the policy watcher, when one runs (set later with :attr:`watcher` when it is made after the app).
    """

    def __init__(
        self,
        guard: Guard,
        *,
        upstream: FailureTracker | None = None,
        review_store: ReviewStore | None = None,
        admin_tokens: Iterable[str] = (),
        watcher: PolicyWatcher | None = None,
    ) -> None:
        self.guard = guard
        self.upstream = upstream
        self.review_store = review_store
        self.watcher = watcher
        self._digests = [hashlib.sha256(t.encode()).digest() for t in admin_tokens]
        self._guesses = TokenBuckets(*DEFAULT_RATE_LIMIT)  # wrong tokens per client address, as the review API's

    def _admin(self, given: bytes) -> bool:
        """Whether ``given`` (the ``Authorization`` value) is ``Bearer`` and one of the admin tokens."""
        bearer = given.startswith(b"Bearer ")
        presented = hashlib.sha256(given[7:] if bearer else b"").digest()
        matched = [secrets.compare_digest(presented, d) for d in self._digests]  # all compared: timing tells nothing
        return bearer and any(matched)

    def _guessing(self, scope: Scope, given: bytes | None) -> float:
        """Seconds a client that sent a wrong token must wait (0 when it may try): the details answer tells whether
        a token is right, so wrong ones are limited per address as the review API limits them."""
        if given is None:
            return 0.0  # a probe: codes only, never limited
        client = scope.get("client")
        return self._guesses.take("client:" + client_key(client[0] if client else None))

    def report(self) -> dict[str, Any]:
        """The full report (:func:`guard.engine.health.health_report`) with the upstream and review store checks."""
        parts = {}
        if self.upstream is not None:
            parts["upstream"] = self.upstream.check()
        store_health = getattr(self.review_store, "health", None)
        if isinstance(store_health, FailureTracker):
            parts["review_store"] = store_health.check()
        return health_report(self.guard, watcher=self.watcher, parts=parts)

    async def __call__(self, scope: Scope, send: Send) -> None:
        """Send the report: codes only, or everything for an admin; 503 while failing. A request sending
        ``Authorization`` more than once gets 400 ``repeated_header`` (field ``authorization``) and no report, before
        any token is compared (:func:`~guard._headers.sole_header` says why not 401)."""
        try:
            given = sole_header(scope["headers"], "authorization")
        except BodyError as exc:  # two credentials: which one a front proxy checked is unknown
            await send_json(send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field},
                            [(b"cache-control", b"no-store")])
            return
        admin = self._admin(given or b"")
        wait = 0.0 if admin else self._guessing(scope, given)
        if wait:
            await send_json(send, 429, {"code": "rate_limited", "message": "too many wrong tokens; slow down",
                                        "field": "authorization"},
                            [(b"retry-after", str(math.ceil(wait)).encode()), (b"cache-control", b"no-store")])
            return
        report = self.report()
        body = report if admin else public_health(report)
        await send_json(send, 200 if report["ready"] else 503, body, [(b"cache-control", b"no-store")])
