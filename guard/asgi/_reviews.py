"""Escalation over HTTP: hold the request as a review item, answer 202, and release it once when approved.

* ``escalate`` verdict -> :func:`hold`: a review item with the request (minus credentials) and its content digest;
  202 ``{code: pending_review, review_id, status_url, release_url, ...}`` with ``Location: status_url``.
* The client polls ``GET <review_path>/<id>`` (:class:`ClientReviewEndpoints`) and, once approved, either calls
  ``POST <review_path>/<id>/release`` (the held request is replayed to the application, with the releasing
  request's credentials) or resends the same request with ``x-guard-review-id: <id>`` (:func:`release_on_resend`).
  Either way the release is single-use (a second one is a 409) and bound to the original client: it must carry the
  ``release_token`` from the 202 in ``x-guard-release-token`` and the same credentials (``Authorization``,
  ``Cookie``, ``X-Api-Key``, ``Proxy-Authorization``) as the held request; the digest covers both, so a review id
  alone releases nothing.
* The digest also covers everything the matching policy read besides method, path, query and body
  (:attr:`guard.policy.Policy.http_reads`): the values of the headers its state and rules read (every header but
  :data:`~guard.asgi._subject.UNBOUND_HEADERS` when a rule reads ``subject.headers`` other than by a literal name),
  the client address when it is read, and the tenant; ``Content-Type`` and ``Content-Encoding`` always (:data:`BODY_HEADERS`: they
  say how the body is read). A request approved with ``x-customer-tier: premium`` and resent with ``free``
  is a 409, never released.
* An escalation beside another enforced policy's ``redact`` carries that policy's spans (``verdict.redactions``):
  the request is masked before it is held, so the item's state (rendered from the masked request), the held body,
  the stored item and the body a release replays are all masked, and the digest binds the masked body; a resent
  request is masked by the same spans before its digest is compared.
* One client may hold at most ``max_pending_per_client`` pending items and ``max_bytes_per_client`` bytes of items
  (the store's caps): past them, 429 ``review_quota_exceeded`` for that client only, with ``Retry-After``. Past the
  store's own caps (``max_bytes``; in memory ``max_items`` too), 503 ``review_unavailable``: fail closed.
* A release is logged at INFO (logger ``guard.review``) and written to the guard's decision log as a ``review``
  record (event ``released``, the reviewer who approved it), before the request is replayed. A release whose reply
  from Redis was lost is replayed and recorded when the store reads it back as made; when it cannot tell, the answer
  is 503 ``review_outcome_unknown`` and nothing is replayed (at most once).

Reviewers approve and reject through :mod:`guard.asgi.review_api`, which is mounted separately (and protected).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from guard._body import ReplayReceive, read_body
from guard._rootpath import route_path
from guard.asgi._metrics import HttpMetrics
from guard.asgi._parse import redacted_request
from guard.asgi._ratelimit import client_key
from guard.asgi._responses import (
    PENDING_REVIEW,
    REVIEW_CONFLICT,
    REVIEW_NOT_FOUND,
    REVIEW_OUTCOME_UNKNOWN,
    REVIEW_UNAVAILABLE,
    HeaderList,
    retry_after_value,
    send_json,
    verdict_headers,
)
from guard.asgi._subject import (
    METHOD_OVERRIDE_HEADERS,
    UNBOUND_HEADERS,
    ClientHeader,
    client_address,
    header_map,
    held_request,
    is_credential,
    subject_summary,
)
from guard.asgi.review_store import NEW_ITEM, ReviewItem, ReviewStore
from guard.engine import Guard
from guard.engine.telemetry import ReviewEvent, record_review, redact_secrets
from guard.errors import (
    BodyError,
    ReviewConflict,
    ReviewError,
    ReviewNotFound,
    ReviewOutcomeUnknown,
    ReviewQuotaExceeded,
    ReviewStoreUnavailable,
)
from guard.policy import HttpReads
from guard.subject import HttpSubject, digest_of
from guard.verdict import Redaction, Verdict

logger = logging.getLogger("guard.asgi")

__all__ = ["RELEASE_TOKEN_HEADER", "REVIEW_HEADER", "ClientReviewEndpoints", "content_digest",
           "hold", "release_on_resend"]

REVIEW_HEADER = "x-guard-review-id"
RELEASE_TOKEN_HEADER = "x-guard-release-token"
DEFAULT_REVIEW_MESSAGE = "The request is held for review."
STORE_RETRY_AFTER_S = 5
_RELEASE_BODY_LIMIT = 64 * 1024
BODY_HEADERS = ("content-type", "content-encoding")
"""Headers every release digest binds, whatever the policy names: they say how the body's bytes are read (JSON,
a form, multipart; compressed or not), so the same bytes resent as another type would reach the application as
fields nobody reviewed."""


class ReviewHost(Protocol):
    """What the review steps read from the middleware that holds them (``GuardMiddleware``)."""

    app: ASGIApp
    guard: Guard
    review_store: ReviewStore
    review_path: str
    metrics: HttpMetrics
    client_header: ClientHeader | None

    def tenant_of(self, scope: Scope, headers: dict[str, str]) -> str | None:
        """The request's tenant (``None`` without one). Raises BodyError for an ambiguous tenant header."""
        ...

    async def respond(self, scope: Scope, receive: Receive, send: Send, headers: HeaderList = ()) -> None:
        """Run the app for ``scope`` (``headers`` added to its response start), its response judged by the response
        policies that watch the request."""
        ...


def _client_binding(headers: Sequence[tuple[bytes, bytes]], release_token: bytes) -> list[bytes]:
    """The release token and the credential headers (name and value, sorted): who may release."""
    credentials = sorted(b"%s:%s" % (k.lower(), v) for k, v in headers if is_credential(k))
    return [release_token, *credentials]


def binding(reads: HttpReads) -> dict[str, Any]:
    """What a held item records of ``reads`` (JSON-safe), so its release is checked against the same fields."""
    return {"headers": sorted(reads.headers) if reads.headers is not None else None, "client": reads.client}


def _read_values(headers: Sequence[tuple[bytes, bytes]], bound: dict[str, Any], client: str | None,
                 tenant: str | None) -> list[bytes]:
    """The values the policy read: each bound header and :data:`BODY_HEADERS` (all its values, in order; absent is
    not empty), or every header but :data:`~guard.asgi._subject.UNBOUND_HEADERS`; the client when bound; the tenant."""
    names: list[str] | None = bound.get("headers")
    if names is None:
        values = sorted(b"%s:%s" % (k.lower(), v) for k, v in headers if k.lower() not in UNBOUND_HEADERS)
    else:
        values = []
        for name in [*names, *(body for body in BODY_HEADERS if body not in names)]:
            raw = name.encode("latin-1")
            found = [v for k, v in headers if k.lower() == raw]
            values.append(raw + (b"=" + b"\x00".join(found) if found else b" absent"))
    if bound.get("client"):
        values.append(b"client=" + (client or "").encode("utf-8", "replace"))
    values.append(b"tenant=" + (tenant.encode("utf-8", "replace") if tenant is not None else b"\x00none"))
    return values


def content_digest(method: str, path: str, query: bytes, body: bytes, headers: Sequence[tuple[bytes, bytes]],
                   bound: dict[str, Any], client: str | None, tenant: str | None, release_token: bytes,
                   credentials: Sequence[tuple[bytes, bytes]]) -> str:
    """What a release is bound to: method, path, query string, the body bytes as received, the values the policy
    read (:func:`_read_values` over ``headers``), the release token and the credential headers of ``credentials``
    (SHA-256 hex, :func:`guard.subject.digest_of`)."""
    return digest_of(method, path, query, body, *_read_values(headers, bound, client, tenant),
                     *_client_binding(credentials, release_token))


def _bound_method(method: str, headers: dict[str, str]) -> str:
    """The method a release digest binds: the request's, with every method override header (also spelt with
    underscores, which WSGI servers read as the same header; the ``_method`` query parameter is in the query, a
    body's field in the body), so an approved POST cannot be resent as the PUT an application that honours the header
    would run."""
    overrides = [f"{name}={value}" for name, value in sorted(headers.items())
                 if name.replace("_", "-") in METHOD_OVERRIDE_HEADERS]
    return "\n".join([method, *overrides])


def _scope_digest(mw: ReviewHost, scope: Scope, body: bytes, bound: dict[str, Any], release_token: bytes) -> str:
    """:func:`content_digest` of a request as it arrived (held, or resent), its method bound by
    :func:`_bound_method`."""
    headers = header_map(scope)
    return content_digest(_bound_method(scope["method"], headers), scope["path"], scope.get("query_string", b""), body,
                          scope["headers"],
                          bound, client_address(scope, headers, mw.client_header), mw.tenant_of(scope, headers),
                          release_token, scope["headers"])


def _presented_token(scope: Scope) -> bytes:
    return next((v for k, v in scope["headers"] if k.lower() == RELEASE_TOKEN_HEADER.encode()), b"")


async def _no_token(send: Send) -> None:
    """A release of a held request without ``x-guard-release-token``: 400 naming the header, where the digest check
    would call it a mismatch, as if the content differed."""
    await send_json(send, 400, {"code": "release_token_missing", "message": f"send the release_token of the 202 in "
                                f"the {RELEASE_TOKEN_HEADER} header", "field": f"headers.{RELEASE_TOKEN_HEADER}"})


#: What a client is told when the review store cannot answer.
STORE_DOWN_MESSAGE = "The review store is unavailable; try again later."
#: What a client is told when the store did not answer a release sent to it and could not tell after whether it was
#: made (a release made so is not replayed: at most once).
OUTCOME_UNKNOWN_MESSAGE = ("The review store did not answer the release, and whether it was made is unknown: read "
                           "the item's status; if it is released, the request was not sent on and cannot be released "
                           "again.")


async def _review_error(send: Send, exc: ReviewError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    if isinstance(exc, ReviewNotFound):
        await send_json(send, 404, {"code": REVIEW_NOT_FOUND, "message": str(exc), "review_id": exc.review_id},
                        headers)
    elif isinstance(exc, ReviewConflict):
        await send_json(send, 409, {"code": REVIEW_CONFLICT, "message": str(exc), "review_id": exc.review_id,
                                    "status": exc.status}, headers)
    elif isinstance(exc, ReviewOutcomeUnknown):
        logger.error("review store did not answer a release (item %s): %s", exc.review_id, exc)
        await send_json(send, 503, {"code": REVIEW_OUTCOME_UNKNOWN, "message": OUTCOME_UNKNOWN_MESSAGE,
                                    "review_id": exc.review_id}, headers)
    else:  # the store's own error (an address, a driver message) goes to the log, not to the client
        logger.error("review store unavailable (item %s): %s", exc.review_id, exc)
        review_id = None if exc.review_id == NEW_ITEM else exc.review_id
        await send_json(send, 503, {"code": REVIEW_UNAVAILABLE, "message": STORE_DOWN_MESSAGE, "review_id": review_id},
                        [*headers, (b"retry-after", str(STORE_RETRY_AFTER_S).encode())])


def _urls(mw: ReviewHost, scope: Scope, review_id: str) -> tuple[str, str]:
    status_url = f"{scope.get('root_path', '')}{mw.review_path}/{review_id}"
    return status_url, f"{status_url}/release"


async def hold(
    mw: ReviewHost, scope: Scope, send: Send, subject: HttpSubject, body: bytes, verdict: Verdict, reads: HttpReads
) -> None:
    """Store a review item for an ``escalate`` verdict and answer 202 (503 when the store is down or full: fail
    closed; 429 when this client has too many pending items or bytes held). ``reads``: what the policy read (bound
    by the digest)."""
    headers = verdict_headers(verdict)
    release_token = secrets.token_urlsafe(24)
    bound = binding(reads)
    # the item shows reviewers the state without the secrets the request names (a query's api_key, a password);
    # that walks every key and string of the body (seconds for a large one): done on a thread, off the event loop
    verdict = dataclasses.replace(verdict, state=await asyncio.to_thread(redact_secrets, verdict.state, subject))
    request = held_request(scope, body, bound)
    if verdict.redactions:  # a resent request is masked so before its digest is compared
        request["redactions"] = [r.to_json() for r in verdict.redactions]
    try:
        digest = _scope_digest(mw, scope, body, bound, release_token.encode())
        tenant = mw.tenant_of(scope, subject.headers)
        # the body's view reads each credential-shaped value (milliseconds apiece): built on a thread
        summary = await asyncio.to_thread(subject_summary, subject, body, tenant)
        item = await mw.review_store.create(verdict, subject=summary, digest=digest,
                                            request=request, tenant=tenant,
                                            client=client_key(subject.client) if subject.client else None)
    except ReviewQuotaExceeded as exc:
        mw.metrics.count_review("client_quota")
        await send_json(send, 429, {"code": "review_quota_exceeded", "message": str(exc), "review_id": None},
                        [*headers, (b"retry-after", retry_after_value(exc.retry_after))])
        return
    except ReviewStoreUnavailable as exc:
        mw.metrics.count_review("store_unavailable")
        await _review_error(send, exc, headers)
        return
    mw.metrics.count_review("created")
    status_url, release_url = _urls(mw, scope, item.id)
    await send_json(send, 202, {
        "code": PENDING_REVIEW, "message": verdict.message or DEFAULT_REVIEW_MESSAGE, "review_id": item.id,
        "status_url": status_url, "release_url": release_url, "release_token": release_token,
        "expires_at": item.expires_at,
        "policy": verdict.policy_id, "rule": verdict.rule, "decision_id": verdict.decision_id,
    }, [*headers, (b"location", status_url.encode("latin-1", "replace")), (REVIEW_HEADER.encode(), item.id.encode())])


def _released(mw: ReviewHost, item: ReviewItem) -> None:
    """Count and record the release of ``item`` (logged at INFO, and written to the guard's decision log as a
    ``review`` record naming the reviewer who approved it), before the held request is replayed."""
    mw.metrics.count_review("released")
    record_review(mw.guard.decision_log, ReviewEvent(
        "released", item.decision_id, item.id, item.decided_by, tenant=item.tenant, policy_id=item.policy_id,
        policy_version=item.policy_version))


def _released_headers(item: ReviewItem) -> HeaderList:
    return [(b"x-guard-decision-id", item.decision_id.encode("latin-1", "replace")), (b"x-guard-action", b"allow"),
            (REVIEW_HEADER.encode(), item.id.encode()), (b"x-guard-review", b"released")]


async def release_on_resend(
    mw: ReviewHost, scope: Scope, receive: Receive, send: Send, review_id: str, body: bytes, decoded: bytes,
    value: Any,
) -> None:
    """The client resent an approved request with ``x-guard-review-id`` (``body`` as received, ``decoded`` with its
    ``Content-Encoding`` undone, ``value`` as parsed):
    release it once if the content, what the policy read, the release token and the credentials match. An item held
    masked (another policy's ``redact`` beside the escalation) is compared, and released, masked the same way."""
    try:
        held = (await mw.review_store.get(review_id)).request or {}
        if held and not _presented_token(scope):
            await _no_token(send)
            return
        if held.get("redactions"):
            try:
                body, scope = redacted_request(scope, value, [Redaction(**r) for r in held["redactions"]],
                                               decoded)
            except (BodyError, ValueError):  # the spans do not fit this body: not the content reviewed
                held = {}
        digest = _scope_digest(mw, scope, body, held.get("bound", {}), _presented_token(scope)) if held else ""
        item = await mw.review_store.release(review_id, digest)
    except ReviewError as exc:
        mw.metrics.count_review("refused")
        await _review_error(send, exc)
        return
    _released(mw, item)
    await mw.respond(scope, ReplayReceive(body, receive), send, _released_headers(item))


class ClientReviewEndpoints:
    """``GET <review_path>/<id>`` (status, no state or answers) and ``POST <review_path>/<id>/release``."""

    def __init__(self, mw: ReviewHost) -> None:
        self.mw = mw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rest = route_path(scope)[len(self.mw.review_path):].strip("/")
        review_id, _, action = rest.partition("/")
        method = scope["method"].upper()
        if review_id and not action and method in ("GET", "HEAD"):
            await self._status(scope, send, review_id)
        elif review_id and action == "release" and method == "POST":
            await self._release(scope, receive, send, review_id)
        elif review_id and action in ("", "release"):
            await send_json(send, 405, {"code": "method_not_allowed", "message": f"{method} is not allowed here",
                                        "field": "method"}, [(b"allow", b"POST" if action else b"GET, HEAD")])
        else:
            await send_json(send, 404, {"code": "not_found", "message": f"use GET {self.mw.review_path}/<id> or POST "
                                        f"{self.mw.review_path}/<id>/release", "field": "path"})

    async def _status(self, scope: Scope, send: Send, review_id: str) -> None:
        try:
            item = await self.mw.review_store.get(review_id)
        except ReviewError as exc:
            await _review_error(send, exc)
            return
        payload: dict[str, Any] = item.public_json()
        if item.status == "approved":
            payload["release_url"] = _urls(self.mw, scope, item.id)[1]
        await send_json(send, 200, payload)

    async def _release(self, scope: Scope, receive: Receive, send: Send, review_id: str) -> None:
        try:
            if await read_body(receive, _RELEASE_BODY_LIMIT) is None:  # the release call's own body is not used
                return
        except BodyError as exc:
            await send_json(send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field})
            return
        try:
            item = await self.mw.review_store.get(review_id)
            if item.request is None:  # released or rejected (the request is deleted then), or not an HTTP item
                await self.mw.review_store.release(review_id, "")  # raises the conflict that names the status
                raise ReviewConflict(review_id, item.status, "the item holds no HTTP request to release")
            held = item.request
            if not _presented_token(scope):
                await _no_token(send)
                return
            body = base64.b64decode(held["body_b64"])
            headers = [*((k.encode("latin-1"), v.encode("latin-1")) for k, v in held["headers"]),
                       *((k, v) for k, v in scope["headers"] if is_credential(k))]  # what is replayed
            mine = header_map(scope)
            digest = content_digest(_bound_method(held["method"], header_map({"headers": headers})), held["path"],
                                    held["query_string"].encode("latin-1"), body,
                                    headers, held.get("bound", {}), client_address(scope, mine, self.mw.client_header),
                                    self.mw.tenant_of(scope, mine), _presented_token(scope), scope["headers"])
            item = await self.mw.review_store.release(review_id, digest)
        except BodyError as exc:
            await send_json(send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field})
            return
        except ReviewError as exc:
            self.mw.metrics.count_review("refused")
            await _review_error(send, exc)
            return
        _released(self.mw, item)
        headers.append((b"content-length", str(len(body)).encode()))
        replay = {**scope, "method": held["method"], "path": held["path"], "raw_path": held["raw_path"].encode(
            "latin-1"), "query_string": held["query_string"].encode("latin-1"), "headers": headers}
        await self.mw.respond(replay, ReplayReceive(body, receive), send, _released_headers(item))
