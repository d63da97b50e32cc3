"""The reviewers' API: list, read, approve and reject review items (JSON over HTTP, mountable Starlette routes).

Authentication is on by default: every call sends ``Authorization: Bearer <token>`` with one reviewer's own token,
once (a call sending ``Authorization`` more than once is a 400 ``repeated_header``, whichever copy is valid), and the
reviewer recorded on a decision is the token's name (a request body cannot choose it)::

    reviewers = parse_reviewer_tokens(os.environ["GUARD_REVIEW_TOKENS"])   # "alice:<token>,bob:<token>"
    app = Starlette(routes=[Mount("/admin/reviews", app=review_app(store, reviewers=reviewers))])

Without tokens the API refuses to be built, unless ``insecure_loopback=True``: then it answers only clients
connecting from a loopback address (127.0.0.0/8, ``::1``) and records them as ``loopback``; any other client gets 403,
and so does a call a browser made for a page of another origin (an ``Origin`` other than the scheme://host:port the
call was sent to, another local port included; ``Sec-Fetch-Site``) or under a ``Host`` that is not this machine's
(DNS rebinding). In every mode an approve or reject body must be ``Content-Type: application/json`` (or an empty body
without a ``Content-Type``), else 415, so an HTML form cannot decide.
Tokens are compared in constant time (SHA-256 of the presented token against each reviewer's, every one compared).

**Tenants.** A reviewer may be scoped to tenants (``Reviewer(token, tenants={"acme"})``, or ``name:token:acme|globex``
in :func:`parse_reviewer_tokens`): it lists, reads, approves and rejects only items whose ``tenant`` is one of them;
any other item is a 404 ``review_not_found``, as if it did not exist (so ids of other tenants cannot be probed). An
unscoped reviewer sees every item, those without a tenant included.

**Rate limit.** Each reviewer's token gets a token bucket (``rate_limit=(per second, burst)``, default
:data:`DEFAULT_RATE_LIMIT`), kept apart from the buckets of calls without a valid token, which share one per client
address, so guessing tokens is as slow as the limit and a flood of such calls from many addresses (which may fill
their table: :mod:`guard.asgi._ratelimit`) never slows a reviewer. Past it: 429 ``rate_limited`` with
``Retry-After``.

=======  ===========================  =============================================================================
GET      ``/``                        items with ``?status=pending`` (default; ``approved``, ``rejected``,
                                      ``released``, ``all``) and ``?limit=`` (1-1000, default 100), oldest first
GET      ``/{id}``                    one item with its state, answers and held body (``subject.body``, below)
POST     ``/{id}/approve``            pending -> approved; JSON body ``{"note": ..., "accept_unseen_body": true}``
                                      (both optional)
POST     ``/{id}/reject``             pending -> rejected; JSON body ``{"note": ...}`` (optional)
GET      ``/console``                 the review console page (``guard.asgi.console``)
=======  ===========================  =============================================================================

**What an approval releases.** An HTTP item's ``subject.body`` shows the held body as the application will receive
it (:mod:`guard.asgi._body_view`): ``text``, the body as sent, and ``decoded``, what a JSON body's ``\\u`` escapes or
a form's percent-encoding decode to (``None`` without any), each masked only where a secret is (a secret-named
field's value) and at most :data:`~guard.asgi._body_view.MAX_SHOWN_BODY_BYTES` UTF-8 bytes, invisible characters
shown as ``\\u202e`` escapes; ``complete``; and ``not_shown``, what is left out (``"3412 more bytes not shown"``, masks
where a secret is repeated, invisible characters, or the size and media type of a body that cannot be shown as text:
binary, a multipart body with a binary file, one sent with ``Content-Encoding``). Listings carry the views cut to
:data:`~guard.asgi._body_view.MAX_PREVIEW_BYTES` bytes each, with ``preview: true`` where they are cut; ``GET /{id}``
carries them whole. Approving a pending item whose body is not ``complete`` (or that shows no body: held before
this view existed) needs ``"accept_unseen_body": true`` in the approve body: without it the answer is 409
``body_not_shown`` (``field``: ``accept_unseen_body``) and the item stays pending.

**Audit.** Each approval and rejection is logged at INFO (logger ``guard.review``: the item, what happened, the
reviewer, the decision id and the policy) and written to ``decision_log`` (:func:`guard.asgi.admin.admin_app` passes
the guard's) as a record of kind ``review`` (:meth:`guard.engine.telemetry.DecisionLog.review`): the decision and
item ids, the reviewer, the tenant, the time, ``accept_unseen_body`` and the SHA-256 of the note, never its text. The
middleware records a release the same way.

Errors are ``{code, message, field}``: 404 ``review_not_found``, 409 ``review_conflict`` (with the item's
``status``), 409 ``body_not_shown``, 503 ``review_unavailable``, 503 ``review_outcome_unknown`` (the store did not
answer an approval or rejection sent to it and could not tell after whether it was made: read the item's status; a
change whose answer was lost but which a read shows made is answered and recorded as made), 400
``invalid_parameter``, 400 ``repeated_header``, 401 ``unauthorized``, 403 ``loopback_only``, 413 ``body_too_large``,
415 ``unsupported_media_type``, 429 ``rate_limited``. Every answer carries ``Cache-Control: no-store`` and
``X-Content-Type-Options: nosniff``. Releasing an approved item is the client's step
(``guard/asgi/_reviews.py``) or the agent's (``guard.asgi.review_store.ReviewStore.release``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard._body import declared_length, read_body
from guard._headers import sole_header
from guard._json import loads
from guard.asgi._body_view import body_preview
from guard.asgi._ratelimit import TokenBuckets, client_key
from guard.asgi._responses import REVIEW_OUTCOME_UNKNOWN
from guard.asgi.console import console_route
from guard.asgi.review_store import STATUSES, ReviewItem, ReviewStore
from guard.engine.telemetry import DecisionLog, ReviewEvent, record_review
from guard.errors import BodyError, InvalidJson, ReviewConflict, ReviewError, ReviewNotFound, ReviewOutcomeUnknown

__all__ = ["ACCEPT_UNSEEN_BODY", "DEFAULT_RATE_LIMIT", "MAX_LIST_LIMIT", "MIN_TOKEN_CHARS", "Reviewer", "is_loopback",
           "parse_reviewer_tokens", "review_app", "review_routes"]

MAX_LIST_LIMIT = 1000
MIN_TOKEN_CHARS = 16
LOOPBACK_REVIEWER = "loopback"
ACCEPT_UNSEEN_BODY = "accept_unseen_body"
"""The approve body's field that says the reviewer approves a held body not shown in full (cut, or not text)."""
DEFAULT_RATE_LIMIT = (5.0, 30)
"""Review API calls per second per token (and per client address without one), and the burst allowed."""


@dataclass(frozen=True)
class Reviewer:
    """One reviewer's credential and scope.

    Attributes:
        token: the bearer token (at least :data:`MIN_TOKEN_CHARS` characters).
        tenants: the tenants whose items it may see and decide; ``None`` = every item.
    """

    token: str = field(repr=False)
    tenants: frozenset[str] | None = None


def _as_reviewer(value: str | Reviewer) -> Reviewer:
    return value if isinstance(value, Reviewer) else Reviewer(value)
logger = logging.getLogger("guard.asgi")

_MAX_DECISION_BODY = 16 * 1024
_BODY_TIMEOUT_S = 10.0  # for a decision body of at most 16 KiB
_MAX_TEXT = 1000


def _unseen_body(item: ReviewItem) -> str | None:
    """What of a pending item's held body its reviewer cannot see (its ``subject.body.not_shown``, made by
    :func:`guard.asgi._subject.shown_body`); ``None`` when it is shown whole, or the item is not pending or holds no
    request (an agent's, a decided one)."""
    if item.status != "pending" or item.request is None:
        return None
    shown = item.subject.get("body")
    if not isinstance(shown, dict):
        return "the item does not show its held body"
    return None if shown.get("complete") is True else str(shown.get("not_shown"))


def _listed(item: ReviewItem) -> dict[str, Any]:
    """An item as a listing carries it: a held body's views as a preview (:func:`guard.asgi._body_view.body_preview`);
    ``GET /{id}`` gives them whole."""
    out = item.to_json()
    shown = out["subject"].get("body") if isinstance(out.get("subject"), dict) else None
    if isinstance(shown, dict):
        out["subject"] = {**out["subject"], "body": body_preview(shown)}
    return out


#: Sent with every answer: items carry held requests (bodies, queries, headers), so no browser or proxy cache keeps
#: them, and no browser reads one as anything but JSON.
_NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def _json(content: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status_code, headers=_NO_STORE)


def _error(http_status: int, code: str, message: str, field: str | None = None, **extra: Any) -> JSONResponse:
    return _json({"code": code, "message": message, "field": field, **extra}, http_status)


def _review_error(exc: ReviewError) -> JSONResponse:
    if isinstance(exc, ReviewNotFound):
        return _error(404, "review_not_found", str(exc), "id")
    if isinstance(exc, ReviewConflict):
        return _error(409, "review_conflict", str(exc), "status", status=exc.status)
    logger.warning("review store unavailable: %s", exc)  # the driver's words name hosts and ports: the log only
    if isinstance(exc, ReviewOutcomeUnknown):
        return _error(503, REVIEW_OUTCOME_UNKNOWN, "the review store did not answer the change, and whether it was "
                      "made is unknown: read the item's status before deciding again")
    return _error(503, "review_unavailable", "the review store could not be reached; try again")


def parse_reviewer_tokens(text: str) -> dict[str, Reviewer]:
    """Reviewers from ``"name:token,name:token:tenant|tenant"`` (whitespace around entries ignored; a token holds
    no ``:`` or ``,``; the optional third part scopes the reviewer to those tenants).

    Returns:
        reviewer name -> :class:`Reviewer`.

    Raises:
        ValueError: an empty list, an entry without ``name:``, an empty tenant list, a repeated name or token, or a
            token shorter than :data:`MIN_TOKEN_CHARS`.
    """
    out: dict[str, Reviewer] = {}
    for number, entry in enumerate((e.strip() for e in text.split(",")), 1):
        name, sep, rest = entry.partition(":")
        if not entry:
            continue
        # entries are named by position: one may be a bare token, or written token:name
        if not sep or not name.strip():
            raise ValueError(f"reviewer token entry {number}: expected name:token")
        if name.strip() in out:
            raise ValueError(f"reviewer token entry {number}: its name is listed before")
        token, scoped, tenants = rest.partition(":")
        names = frozenset(t.strip() for t in tenants.split("|") if t.strip())
        if scoped and not names:
            raise ValueError(f"reviewer token entry {number}: an empty tenant list after the token")
        if len(token.strip()) < MIN_TOKEN_CHARS:
            raise ValueError(f"reviewer token entry {number}: the token has {len(token.strip())} characters; at least "
                             f"{MIN_TOKEN_CHARS} (name:token)")
        out[name.strip()] = Reviewer(token.strip(), names if scoped else None)
    _check_reviewers(out)
    return out


def _check_reviewers(reviewers: Mapping[str, str | Reviewer]) -> None:
    if not reviewers:
        raise ValueError("no reviewer tokens given")
    tokens = [_as_reviewer(r).token for r in reviewers.values()]
    for name, token in zip(reviewers, tokens):
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"reviewer {name!r}: the token has {len(token)} characters; at least {MIN_TOKEN_CHARS}")
    if len(set(tokens)) != len(tokens):
        raise ValueError("two reviewers share a token; each reviewer needs their own")


#: A ``Host`` authority as RFC 9110 writes it: a bracketed IPv6 address or a name without ``:``, ``@``, ``/``, ``[``,
#: ``]`` or blank space, then at most a port of digits.
_AUTHORITY = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:@/\[\]\s]+))(?::[0-9]{1,5})?")


def _loopback_name(authority: str) -> bool:
    """Whether a ``Host`` authority (``host[:port]``) names this machine: ``localhost`` or a loopback address. An
    authority that is not one host and an optional port of digits (``127.0.0.1:8000@evil.example``, ``[::1]x``) names
    none."""
    parsed = _AUTHORITY.fullmatch(authority)
    if parsed is None:
        return False
    host = parsed["ipv6"] or parsed["name"]
    return host.lower() == "localhost" or is_loopback(host)


def _from_elsewhere(request: Request) -> str | None:
    """Why a tokenless (loopback) call is refused although it comes from this machine: a browser sent it for a page
    of another origin (``Origin`` other than this API's own scheme://host:port, ``Sec-Fetch-Site``: cross-site
    request forgery, from other sites and from other local ports alike), or under a name that is not this machine's
    (``Host``: DNS rebinding). ``None`` for a call from a local tool (no ``Origin``) or from a page of this API's
    own origin (the console)."""
    host = request.headers.get("host", "")
    if not _loopback_name(host):
        return "this review API has no tokens and answers requests to localhost only (Host)"
    origin = request.headers.get("origin")
    if origin is not None and _origin(origin) != _origin(f"{request.url.scheme}://{host}"):
        return "this review API has no tokens and refuses calls from pages of other origins (Origin)"
    if request.headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return "this review API has no tokens and refuses calls from pages of other sites (Sec-Fetch-Site)"
    return None


def _origin(url: str) -> str:
    """``scheme://host[:port]`` lower-cased, without a default port (``:80`` for http, ``:443`` for https), as a
    browser writes ``Origin``."""
    url = url.lower()
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if url.startswith(scheme) and url.endswith(port):
            return url[: -len(port)]
    return url


def _not_json(request: Request, body: bytes) -> JSONResponse | None:
    """The 415 answer for a decision body that is not ``application/json`` (an empty body may come without a
    ``Content-Type``), so an HTML form or a "simple" cross-site ``fetch`` cannot decide; ``None`` when it is JSON."""
    content_type = request.headers.get("content-type")
    if content_type is None and not body:
        return None
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json":
        return None
    return _error(415, "unsupported_media_type", "send the decision as 'Content-Type: application/json' (or no body "
                  "and no Content-Type)", "content-type")


def _list_limit(raw: str) -> int | None:
    """``?limit=`` as an int from 1 to :data:`MAX_LIST_LIMIT`: plain ASCII digits, no leading zero, at most four
    digits (so ``int()`` never sees a long string). ``None`` for anything else."""
    if not (raw.isascii() and raw.isdigit()) or raw.startswith("0") or len(raw) > len(str(MAX_LIST_LIMIT)):
        return None
    limit = int(raw)
    return limit if 1 <= limit <= MAX_LIST_LIMIT else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (127.0.0.0/8, ``::1``); names are not resolved."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Api:
    def __init__(self, store: ReviewStore, reviewers: Mapping[str, str | Reviewer] | None, insecure_loopback: bool,
                 rate_limit: tuple[float, int], decision_log: DecisionLog | None) -> None:
        self.store = store
        self.decision_log = decision_log
        if reviewers is None and not insecure_loopback:
            raise ValueError("the review API needs reviewer tokens (reviewers={name: token}); without them it runs "
                             "only with insecure_loopback=True, for clients on this machine")
        if reviewers is not None:
            _check_reviewers(reviewers)
        scoped = {n: _as_reviewer(r) for n, r in (reviewers or {}).items()}
        self._digests = [(hashlib.sha256(r.token.encode()).digest(), n) for n, r in scoped.items()]
        self._tenants = {n: r.tenants for n, r in scoped.items()}
        self._reviewer_buckets = TokenBuckets(*rate_limit, max_keys=max(len(scoped), 1))  # one per reviewer
        self._client_buckets = TokenBuckets(*rate_limit)  # calls without a valid token, per client address

    def _reviewer(self, request: Request) -> str | JSONResponse:
        """The caller's reviewer name, or the 400/401/403/429 answer (400 ``repeated_header`` for ``Authorization``
        sent more than once, before any token is compared: :func:`~guard._headers.sole_header` says why not 401)."""
        client = request.client.host if request.client else ""
        if not self._digests:
            if not is_loopback(client):
                return _error(403, "loopback_only", "this review API has no tokens and answers loopback clients "
                              "only", "client")
            refused = _from_elsewhere(request)
            if refused is not None:
                return _error(403, "loopback_only", refused, "origin")
            return self._limited(self._reviewer_buckets, LOOPBACK_REVIEWER) or LOOPBACK_REVIEWER
        try:
            given = (sole_header(request.scope["headers"], "authorization") or b"").decode("latin-1")
        except BodyError as exc:  # two credentials: which one a front proxy checked is unknown
            return _error(exc.status, exc.code, exc.reason, exc.field)
        presented = hashlib.sha256(given[7:].encode() if given.startswith("Bearer ") else b"").digest()
        found: str | None = None
        for digest, name in self._digests:  # every digest is compared, so the time does not tell which matched
            if secrets.compare_digest(presented, digest) and given.startswith("Bearer "):
                found = name
        if found is None:
            return self._limited(self._client_buckets, client_key(client)) or _error(
                401, "unauthorized", "send 'Authorization: Bearer <your review token>'", "authorization")
        return self._limited(self._reviewer_buckets, found) or found

    @staticmethod
    def _limited(buckets: TokenBuckets, key: str) -> JSONResponse | None:
        wait = buckets.take(key)
        if not wait:
            return None
        response = _error(429, "rate_limited", "too many review API calls; slow down", "authorization")
        response.headers["retry-after"] = str(math.ceil(wait))
        return response

    def _visible(self, who: str, item: ReviewItem) -> bool:
        tenants = self._tenants.get(who)
        return tenants is None or (item.tenant is not None and item.tenant in tenants)

    async def _item(self, who: str, review_id: str) -> ReviewItem:
        """The item, if ``who`` may see it. Raises ReviewNotFound (also for another tenant's item)."""
        item = await self.store.get(review_id)
        if not self._visible(who, item):
            raise ReviewNotFound(review_id)
        return item

    async def list(self, request: Request) -> JSONResponse:
        if isinstance(who := self._reviewer(request), JSONResponse):
            return who
        status = request.query_params.get("status", "pending")
        if status not in (*STATUSES, "all"):
            return _error(400, "invalid_parameter", f"status {status[:40]!r} is not one of {[*STATUSES, 'all']}",
                          "status")
        raw_limit = request.query_params.get("limit", "100")
        limit = _list_limit(raw_limit)
        if limit is None:
            return _error(400, "invalid_parameter", f"limit {raw_limit[:40]!r} must be an integer from 1 to "
                          f"{MAX_LIST_LIMIT}", "limit")
        try:
            items = await self.store.list_items(None if status == "all" else status,  # type: ignore[arg-type]
                                                limit=limit, tenants=self._tenants.get(who))
        except ReviewError as exc:
            return _review_error(exc)
        return _json({"items": [_listed(item) for item in items], "count": len(items)})

    async def get(self, request: Request) -> JSONResponse:
        if isinstance(who := self._reviewer(request), JSONResponse):
            return who
        try:
            item = await self._item(who, request.path_params["review_id"])
        except ReviewError as exc:
            return _review_error(exc)
        return _json(item.to_json())

    async def _decision(self, request: Request, *, approve: bool) -> tuple[str | None, bool] | JSONResponse:
        """The decision body's ``note`` and, for an approval, ``accept_unseen_body`` (default ``False``); or the
        4xx answer naming the field."""
        try:  # read no more than the cap: a large declared length is refused unread, a stream stops past the cap
            body = await read_body(request.receive, _MAX_DECISION_BODY,
                                   declared_length(request.headers.get("content-length")), _BODY_TIMEOUT_S)
        except BodyError as exc:
            return _error(exc.status, exc.code, exc.reason, exc.field)
        if body is None:
            return _error(400, "body_incomplete", "the client disconnected before the decision body ended", "body")
        if (refused := _not_json(request, body)) is not None:
            return refused
        if not body.strip():
            return None, False
        try:
            data = loads(body)
        except InvalidJson as exc:
            return _error(400, "invalid_json", str(exc), "body")
        if isinstance(data, dict) and "by" in data:
            return _error(400, "invalid_parameter", "the reviewer comes from the token; do not send 'by'", "by")
        if isinstance(data, dict) and not approve and ACCEPT_UNSEEN_BODY in data:
            return _error(400, "invalid_parameter", f"only an approval takes '{ACCEPT_UNSEEN_BODY}'",
                          ACCEPT_UNSEEN_BODY)
        if not isinstance(data, dict) or set(data) - {"note", ACCEPT_UNSEEN_BODY}:
            fields = "an optional 'note'" + (f" and '{ACCEPT_UNSEEN_BODY}'" if approve else "")
            return _error(400, "invalid_parameter", f"the body must be an object with {fields}", "body")
        note = data.get("note")
        if note is not None and (not isinstance(note, str) or len(note) > _MAX_TEXT):
            return _error(400, "invalid_parameter", f"note must be a string of at most {_MAX_TEXT} characters",
                          "note")
        accept = data.get(ACCEPT_UNSEEN_BODY, False)
        if not isinstance(accept, bool):
            return _error(400, "invalid_parameter", f"{ACCEPT_UNSEEN_BODY} must be true or false", ACCEPT_UNSEEN_BODY)
        return note, accept

    async def approve(self, request: Request) -> JSONResponse:
        return await self._decide(request, approve=True)

    async def reject(self, request: Request) -> JSONResponse:
        return await self._decide(request, approve=False)

    async def _decide(self, request: Request, *, approve: bool) -> JSONResponse:
        if isinstance(who := self._reviewer(request), JSONResponse):
            return who
        decision = await self._decision(request, approve=approve)
        if isinstance(decision, JSONResponse):
            return decision
        note, accept_unseen_body = decision
        review_id = request.path_params["review_id"]
        change = self.store.approve if approve else self.store.reject
        try:
            item = await self._item(who, review_id)
            unseen = _unseen_body(item)
            if approve and unseen is not None and not accept_unseen_body:
                return _error(409, "body_not_shown", f"the held body is not shown in full ({unseen}) and an "
                              f"approval releases all of it: read the item, then approve with "
                              f"\"{ACCEPT_UNSEEN_BODY}\": true, or reject it", ACCEPT_UNSEEN_BODY)
            item = await change(review_id, by=who, note=note)
        except ReviewError as exc:
            return _review_error(exc)
        if approve and unseen is not None:
            logger.info("review item %s approved by %s with its body not shown in full (%s)", review_id, who, unseen)
        record_review(self.decision_log, ReviewEvent(
            "approved" if approve else "rejected", item.decision_id, item.id, who, tenant=item.tenant,
            policy_id=item.policy_id, policy_version=item.policy_version, note=note,
            accept_unseen_body=accept_unseen_body if approve else None))
        return _json(item.to_json())


def review_routes(
    store: ReviewStore, *, reviewers: Mapping[str, str | Reviewer] | None = None, insecure_loopback: bool = False,
    rate_limit: tuple[float, int] = DEFAULT_RATE_LIMIT, decision_log: DecisionLog | None = None,
) -> list[Route]:
    """The reviewers' routes (see the module docstring), to include in your own app or ``Mount``.

    Args:
        store: the review store the middleware writes to.
        reviewers: reviewer name -> bearer token or :class:`Reviewer` (each token at least :data:`MIN_TOKEN_CHARS`
            characters, all distinct); every call must send one (401 otherwise).
        insecure_loopback: with no ``reviewers``, answer loopback clients without a token (403 for others).
        rate_limit: ``(calls per second, burst)`` per token (and per client address without a valid one).
        decision_log: where each approval and rejection is recorded (a ``review`` record,
            :meth:`~guard.engine.telemetry.DecisionLog.review`): the guard's own log (``guard.decision_log``;
            :func:`guard.asgi.admin.admin_app` passes it). Every decision is also logged at INFO (``guard.review``).

    Raises:
        ValueError: no ``reviewers`` and not ``insecure_loopback``; a short or shared token; a bad rate limit.
    """
    api = _Api(store, reviewers, insecure_loopback, rate_limit, decision_log)
    return [
        console_route(),  # GET /console: the page; before /{review_id}
        Route("/", api.list, methods=["GET"]),
        Route("/{review_id}", api.get, methods=["GET"]),
        Route("/{review_id}/approve", api.approve, methods=["POST"]),
        Route("/{review_id}/reject", api.reject, methods=["POST"]),
    ]


def review_app(
    store: ReviewStore, *, reviewers: Mapping[str, str | Reviewer] | None = None, insecure_loopback: bool = False,
    rate_limit: tuple[float, int] = DEFAULT_RATE_LIMIT, decision_log: DecisionLog | None = None,
) -> Starlette:
    """A small Starlette app serving :func:`review_routes` (same arguments and errors), ready to ``Mount``."""
    return json_errors(Starlette(routes=review_routes(store, reviewers=reviewers, insecure_loopback=insecure_loopback,
                                                     rate_limit=rate_limit, decision_log=decision_log)))


def json_errors(app: Starlette) -> Starlette:
    """``app`` answering its router's own refusals (no route: 404, a route without the method: 405) with the
    reviewers' JSON error body, and a path with an extra trailing slash with a 404 rather than a redirect built from
    the client's ``Host``. Returns ``app``."""
    app.router.redirect_slashes = False
    app.add_exception_handler(HTTPException, _router_error)
    return app


async def _router_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        response = _error(405, "method_not_allowed", f"{request.method} is not allowed here", "method")
    elif exc.status_code == 404:
        response = _error(404, "not_found", "no reviewers' endpoint at this path", "path")
    else:
        response = _error(exc.status_code, "http_error", exc.detail)
    response.headers.update(exc.headers or {})
    return response
