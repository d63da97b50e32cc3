"""``GuardMiddleware``: a pure ASGI middleware that judges requests before the application sees them.

Every ``http`` request's target is first made canonical (:mod:`guard.asgi._target`: origin-form only, dot segments
removed, slashes merged; ``%2F``, backslash and ``;`` refused with 400 ``invalid_target``), and the application gets
that path, so what policies match is what the application routes on. Paths are matched case-sensitively and a
trailing slash is kept (``/V1/x`` and ``/v1/x/`` are other paths than ``/v1/x``): in front of a router that folds
case or slashes, list every form in the policy's ``paths`` or use a glob. Headers the policy reads have one
canonical view: a repeated single-value header (``Content-Type``, ``Content-Length``, ``Host``, ...,
:data:`~guard.asgi._subject.SINGLE_VALUE_HEADERS`) is refused with 400 ``repeated_header`` naming it, and a
``+json`` media type matches a policy's ``application/json``. A method override (``X-HTTP-Method-Override``,
``X-HTTP-Method``, ``X-Method-Override``, ``?_method=`` or a POST body's ``_method`` field, wherever frameworks read
them: :mod:`guard.asgi._override`) is refused with 400 ``method_override`` by default; ``method_override="judge"``
matches and judges a POST as the method it asks for where every modelled framework honours it (one of
:data:`~guard.asgi._override.HONOURED_METHODS`; any other override, and a ``_method`` frameworks read as different
methods, is refused), ``"ignore"`` as sent.

For a request that a policy matches, it reads
the body up to a cap on received bytes, undoes ``Content-Encoding``, parses JSON, forms or text strictly, builds the
:class:`~guard.subject.HttpSubject`, awaits the verdict and then:

=========  ==========================================================================================================
allow      replays the body byte for byte to the application and streams its response untouched (decision headers
           added to ``http.response.start``; later ``receive()`` calls pass through); the verdict is in
           ``scope["state"]["guard"]`` (Starlette's ``request.state.guard``)
redact     the same with the rule's spans masked in the body (re-encoded: new ``Content-Length``, no
           ``Content-Encoding``; 422 ``redact_unsupported`` for multipart); ``verdict.redactions`` says where
block      answers itself: JSON ``{code, message, policy, rule, decision_id}`` with the rule's status (403 default,
           429 for rate-like rules, 503 + ``Retry-After`` when a fail-closed policy could not decide); never a 500
escalate   stores a review item and answers 202 with its id and status URL (see ``guard/asgi/_reviews.py``)
handoff    answers with the LLM target's reply, streamed when the client asked for a stream
=========  ==========================================================================================================

An ``escalate`` or ``handoff`` verdict that won over another enforced policy's ``redact`` carries its spans
(``verdict.redactions``): the request is masked as for ``redact`` before it is held or handed off.

A body that cannot be inspected, or that the application could read differently, is refused before any decision
and recorded as one: 413 too large (received or decoded), 415 unknown encoding, a charset other than UTF-8 or
US-ASCII, or a binary media type, 400 malformed (``Content-Type`` parameters, JSON not UTF-8, duplicate keys, too
deep; bad forms; ambiguous multipart). Scopes other than ``http``, and requests no policy matches, pass straight
through without their body being read.

A response policy (``match.http.response``) that watches the request judges the application's response before the
client gets it (:mod:`guard.asgi._respond`), whether or not a request policy matched; such a request reaches the
application without ``Range`` and ``If-Range``, so the response is judged whole
(:func:`~guard.asgi._respond.watched_scope`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import operator
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard._body import BODY_TIMEOUT, ReplayReceive, declared_length, read_body
from guard._headers import sole_header
from guard._rootpath import route_path
from guard.asgi._decode import REQUEST_ENCODINGS, check_unread_as_sent, decode_content, parse_encodings
from guard.asgi._handoff import respond_with_handoff
from guard.asgi._media import media_type
from guard.asgi._metrics import HttpMetrics
from guard.asgi._override import (
    HONOURED_METHODS,
    body_method,
    check_judged,
    judged_scope,
    may_carry_method,
    may_name_method,
)
from guard.asgi._parse import parse_body, redacted_request
from guard.asgi._respond import ResponseJudge, watched_scope
from guard.asgi._responses import (
    DECISION_HEADERS,
    DecisionHeaders,
    HeaderList,
    block_code,
    failed_open,
    refuse_target,
    refuse_unmatched_body,
    send_json,
    send_with_headers,
    verdict_headers,
)
from guard.asgi._reviews import REVIEW_HEADER, ClientReviewEndpoints, hold, release_on_resend
from guard.asgi._subject import ClientHeader, head_subject, header_map, query_map, with_body
from guard.asgi._target import canonical_scope, path_views
from guard.asgi._upgrade import judged_by, refuse_invalid_upgrade, refuse_judged_upgrade
from guard.asgi.handoff import HandoffClient
from guard.asgi.limits import BodyLimits
from guard.asgi.review_store import MemoryReviewStore, ReviewStore
from guard.backends import start_backend
from guard.engine import Guard, verdicts
from guard.engine.ids import new_decision_id
from guard.errors import BodyError, StateTooLong
from guard.policy import Policy, PolicyView
from guard.policy.loader import ViewMatch, policy_subjects
from guard.subject import HttpSubject
from guard.verdict import Verdict

__all__ = ["BODYLESS_METHODS", "DEFAULT_REVIEW_PATH", "INLINE_PARSE_BYTES", "METHOD_OVERRIDES",
           "READ_HEADERS_EXTENSION", "STATE_KEY", "GuardMiddleware", "MethodOverride", "PathCase", "TrailingSlash",
           "UnexpectedBody"]

#: Media types an application parses as received, whatever ``Content-Encoding`` says (refused encoded).
_FORMS = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})

logger = logging.getLogger("guard.asgi")

DEFAULT_REVIEW_PATH = "/_guard/reviews"
"""Where clients poll and release their held requests (``GET <path>/<id>``, ``POST <path>/<id>/release``)."""

#: Where the application finds the request's verdict: ``scope["state"]["guard"]`` (Starlette:
#: ``request.state.guard``), set for allowed and redacted requests; absent when no policy matched.
STATE_KEY = "guard"
#: The ASGI scope extension (``scope["extensions"]``) that tells the application, a proxy behind the guard, which
#: request headers the policies read: lower-case names as bytes, as an ASGI scope names headers, or ``None`` when a
#: rule may read any header (:attr:`~guard.policy.PolicyView.read_header_names`). :class:`~guard.asgi.proxy.ReverseProxy` lets no ``Connection``
#: header remove them.
READ_HEADERS_EXTENSION = "guard.read_headers"
#: The request header that tells the application which decision let the request through (the response's own).
DECISION_ID_HEADER = b"x-guard-decision-id"
#: The review headers a release is asked with: dropped from a request this middleware judged or released (they were
#: for it), kept on one it passes on unjudged (they may be for a GuardMiddleware or guard proxy behind it).
_REVIEW_REQUEST_HEADERS = frozenset({b"x-guard-release-token", b"x-guard-review-id"})
MethodOverride = Literal["refuse", "judge", "ignore"]
"""What a method override header, ``?_method=`` or a POST body's ``_method`` field does: 400 (``refuse``), the
judged method (``judge``: on a POST asking for one of :data:`~guard.asgi._override.HONOURED_METHODS`; any other
override, and a ``_method`` frameworks read as different methods, is a 400), nothing (``ignore``: for applications that never honour one)."""
METHOD_OVERRIDES: tuple[str, ...] = ("refuse", "judge", "ignore")
PathCase = Literal["fold", "exact"]
"""How paths are matched: ``fold`` (default) also as lower-cased, ``exact`` only as sent."""
TrailingSlash = Literal["strip", "keep"]
"""``strip`` (default): a path ending in ``/`` is also matched without it; ``keep``: only as sent."""
UnexpectedBody = Literal["refuse", "judge", "pass"]
"""A body on a method without body semantics (:data:`BODYLESS_METHODS`) that no policy matches as sent (one that
lists the method judges it as usual), or on any other method but POST, PUT and PATCH (``QUERY``, a WebDAV or custom
method) that no policy matches as sent but one would as a POST: 400 ``unexpected_body`` (``refuse``, default), judged
by the policy that would judge it as a POST (``judge``), or passed unjudged (``pass``)."""
BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
"""Methods whose request content has no defined meaning (RFC 9110 9.3); many routers still read one."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: The methods a POST body's ``_method`` field may ask for: where a policy judges the path under one of them, the body
#: is read for the field.
_OVERRIDDEN = tuple(sorted(HONOURED_METHODS - {"POST"}))


def _body_may_ask(judged: str) -> tuple[str, ...]:
    """The methods a POST judged as ``judged`` (an override in its head may have asked for it) may run once its body's
    ``_method`` field is read: :data:`_OVERRIDDEN`, and the POST too where the head asked for another method (a
    blank field makes Rails run the POST)."""
    return _OVERRIDDEN if judged.upper() == "POST" else (*_OVERRIDDEN, "POST")


#: Request bodies larger than this (bytes as received), and every encoded one, are decoded and parsed on a thread:
#: reading a megabyte of JSON Lines takes a few hundred milliseconds, which on the event loop every other request
#: would wait for. Smaller ones are parsed in place (a thread hop costs more than their parse).
INLINE_PARSE_BYTES = 64 * 1024


def _off_loop(body: bytes, *, encoded: bool) -> bool:
    """Whether ``body`` is decoded and read on a thread: encoded (megabytes once decoded) or over
    :data:`INLINE_PARSE_BYTES`."""
    return encoded or len(body) > INLINE_PARSE_BYTES


def _decoded_and_parsed(body: bytes, codings: list[str] | None, content_type: str,
                        limits: BodyLimits) -> tuple[bytes, Any, str]:
    """``body`` once its ``codings`` are undone and its :func:`parse_body` (run on a thread for large bodies); an
    encoded ``body`` that reads as text as sent is refused first (:func:`check_unread_as_sent`)."""
    if codings:
        check_unread_as_sent(body, codings)
        body = decode_content(body, codings, limits.max_decoded_bytes)
    return body, *parse_body(body, content_type, limits)



def _app_scope(scope: Scope, headers: HeaderList, *, judged: bool, view: PolicyView | None = None) -> Scope:
    """``scope`` as the application gets it: a client's ``x-guard-decision-id`` removed (and, on a ``judged``
    request, one this middleware judged or released, its ``x-guard-release-token`` and ``x-guard-review-id``), and
    the decision's id the response carries (``x-guard-decision-id`` in ``headers``: an allowed, redacted or released
    request's) set as ``x-guard-decision-id``. A name spelled with ``_`` (``x_guard_decision_id``) is removed as well:
    a WSGI server reads ``_`` and ``-`` alike (``HTTP_X_GUARD_DECISION_ID``). With ``view``, the headers its
    policies read are added to the :data:`READ_HEADERS_EXTENSION` extension: a guard in front of this one (two
    stacked middlewares) named those its own policies read, which stay named (``None``, any header, if either is)."""
    dropped = {DECISION_ID_HEADER, *_REVIEW_REQUEST_HEADERS} if judged else {DECISION_ID_HEADER}
    kept = [(k, v) for k, v in scope["headers"] if k.lower().replace(b"_", b"-") not in dropped]
    kept += [(k, v) for k, v in headers if k == DECISION_ID_HEADER][:1]
    if view is None:
        return {**scope, "headers": kept}
    extensions = dict(scope.get("extensions") or {})
    read = view.read_header_names
    if READ_HEADERS_EXTENSION in extensions:
        earlier = extensions[READ_HEADERS_EXTENSION]
        read = None if earlier is None or read is None else read | earlier
    extensions[READ_HEADERS_EXTENSION] = read
    return {**scope, "headers": kept, "extensions": extensions}

class GuardMiddleware:
    """Judge matched requests with a :class:`~guard.engine.Guard` before the application sees them.

    Example:
        >>> app = Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=guard)])  # doctest: +SKIP

    Args:
        app: the ASGI application to protect.
        guard: the engine; its policies decide which requests are judged.
        max_body_bytes: most received body bytes inspected (default 1 MiB); overrides ``limits``.
        max_decoded_bytes: most bytes after ``Content-Encoding`` decoding (default 4 MiB); overrides ``limits``.
        max_json_depth: deepest JSON nesting (default 64); overrides ``limits``.
        limits: every body limit at once (:class:`~guard.asgi.limits.BodyLimits`).
        review_store: where escalated requests wait; default an in-process :class:`~guard.asgi.review_store.MemoryReviewStore`.
        handoff: the client for ``handoff`` verdicts; default a :class:`~guard.asgi.handoff.HandoffClient` using the
            policy file's targets.
        review_path: path prefix of the client-facing review endpoints.
        client_header: a header to which each trusted proxy in front appends the address it got the request from
            (``x-forwarded-for``); default the peer address. The address used is the ``client_hops``-th from the
            right (the left-most entries are the client's own text); the peer address when the header is absent,
            has fewer entries or that entry is not an IP address. Addresses are compared in one spelling
            (``0::1`` is ``::1``).
        client_hops: how many trusted proxies append to ``client_header`` (1, the default: the right-most entry).
        metrics: counters to use (a proxy shares them with its ``/metrics``); default a new :class:`HttpMetrics`.
        decision_headers: what the application's response to an allowed request says of the decision.
            ``"brief"`` (default): ``x-guard-decision-id``, and ``x-guard-fail-mode: open`` when an enforced policy
            failed open (a shadow policy's fail mode is never the client's to know); ``"full"``: every decision
            header (``x-guard-action``, ``x-guard-policy``, ``x-guard-rule``, ``x-guard-shadow``). Responses guard
            gives itself (block, review, handoff) always carry every one.
        method_override: ``"refuse"`` (default), ``"judge"`` or ``"ignore"`` (:data:`MethodOverride`).
        path_case: ``"fold"`` (default) or ``"exact"`` (:data:`PathCase`).
        trailing_slash: ``"strip"`` (default) or ``"keep"`` (:data:`TrailingSlash`).
        unexpected_body: ``"refuse"`` (default), ``"judge"`` or ``"pass"`` (:data:`UnexpectedBody`).
        tenant_header: a header set by a trusted layer in front (an authenticating gateway) naming the request's
            tenant; review items carry it, and reviewers scoped to tenants see only theirs. Sent twice: 400.
        tenant: instead of ``tenant_header``, a function from the request's subject (its credentials in
            ``subject.headers``) to the tenant, or ``None``.
        cache_per_tenant: with ``tenant_header`` or ``tenant``, each tenant's decisions are cached apart (the
            default): the probability cache shares an entry only between requests of one tenant, so that a tenant
            cannot time whether another sent the same text within the policy's cache ``ttl``. ``False`` shares
            entries across tenants (more hits, where tenants trust each other).

    Raises:
        ValueError: for an invalid limit, a ``review_path`` that does not start with ``/``, an unknown
            ``decision_headers`` or ``method_override``, a ``client_hops`` below 1.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        guard: Guard,
        max_body_bytes: int | None = None,
        max_decoded_bytes: int | None = None,
        max_json_depth: int | None = None,
        limits: BodyLimits | None = None,
        review_store: ReviewStore | None = None,
        handoff: HandoffClient | None = None,
        review_path: str = DEFAULT_REVIEW_PATH,
        client_header: str | None = None,
        client_hops: int = 1,
        metrics: HttpMetrics | None = None,
        decision_headers: DecisionHeaders = "brief",
        method_override: MethodOverride = "refuse",
        path_case: PathCase = "fold",
        trailing_slash: TrailingSlash = "strip",
        unexpected_body: UnexpectedBody = "refuse",
        tenant_header: str | None = None,
        tenant: Callable[[HttpSubject], str | None] | None = None,
        cache_per_tenant: bool = True,
    ) -> None:
        base = limits or BodyLimits()
        overrides: dict[str, Any] = {}
        if max_body_bytes is not None:
            overrides["max_body_bytes"] = max_body_bytes
            if max_decoded_bytes is None:
                overrides["max_decoded_bytes"] = max(base.max_decoded_bytes, max_body_bytes)
        if max_decoded_bytes is not None:
            overrides["max_decoded_bytes"] = max_decoded_bytes
        if max_json_depth is not None:
            overrides["max_json_depth"] = max_json_depth
        self.limits = dataclasses.replace(base, **overrides) if overrides else base
        if not review_path.startswith("/") or review_path.rstrip("/") == "":
            raise ValueError(f"review_path is {review_path!r}; it must be a path like '/_guard/reviews'")
        if decision_headers not in DECISION_HEADERS:
            raise ValueError(f"decision_headers is {decision_headers!r}; it must be one of {DECISION_HEADERS}")
        if method_override not in METHOD_OVERRIDES:
            raise ValueError(f"method_override is {method_override!r}; it must be one of {METHOD_OVERRIDES}")
        self.method_override = method_override
        for name, value, allowed in (("path_case", path_case, ("fold", "exact")),
                                     ("trailing_slash", trailing_slash, ("strip", "keep")),
                                     ("unexpected_body", unexpected_body, ("refuse", "judge", "pass"))):
            if value not in allowed:
                raise ValueError(f"{name} is {value!r}; it must be one of {allowed}")
        self._fold = path_case == "fold"
        self._strip = trailing_slash == "strip"
        self.unexpected_body = unexpected_body
        if client_hops < 1:
            raise ValueError(f"client_hops is {client_hops!r}; it must be 1 or more")
        if tenant_header is not None and tenant is not None:
            raise ValueError("give tenant_header or tenant, not both")
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self._tenant = tenant
        self.cache_per_tenant = cache_per_tenant
        self.app = app
        self.guard = guard
        self.decision_headers = decision_headers
        self._full_headers = decision_headers == "full"
        self.review_store: ReviewStore = review_store if review_store is not None else MemoryReviewStore()
        self.handoff = handoff if handoff is not None else HandoffClient()
        self.review_path = review_path.rstrip("/")
        self.client_header = ClientHeader(client_header.lower(), client_hops) if client_header else None
        self.metrics = metrics if metrics is not None else HttpMetrics()
        self._review_prefix = self.review_path + "/"
        self._reviews = ClientReviewEndpoints(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            scope = canonical_scope(scope)  # what is matched below is what the application routes on
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        path = route_path(scope)  # the review path lies below the root path, as the application's routes do
        if path.startswith(self._review_prefix) or path == self.review_path:
            await self._reviews(scope, receive, send)
            return
        view = self.guard.policies.view()  # one version of the policies judges this request and its response
        try:
            headers = header_map(scope)
            judged = judged_scope(scope, headers, self.method_override)
            head, matched, views = self._match(judged, headers, view)
            body_override = (self.method_override != "ignore" and scope["method"] == "POST"
                             and may_carry_method(headers.get("content-type", "")))
            if body_override and not matched:  # a matched request's body is read, and its field checked, in _guard
                found = await self._unmatched_body_method(scope, judged, receive, send, headers, view)
                if found is None:
                    return
                if found[0] is not judged:
                    head, matched, views = self._match(found[0], headers, view)
                judged, receive = found
            method = judged["method"].upper()
            body_since = None  # when guard began reading the body, if it did (the body's deadline counts from then)
            if (not matched and self.unexpected_body != "pass" and method not in _BODY_METHODS
                    and (has_body := _declares_body(scope, headers)) is not False):  # a body no policy would judge
                posted = {**judged, "method": "POST"}
                # on a method without body semantics any body counts (matched as a POST once one is found); on
                # another method, only where a POST would be judged
                as_post = None if method in BODYLESS_METHODS else self._match(posted, headers, view)
                if as_post is None or as_post.policies:
                    if has_body is None:  # HTTP/2 or 3 without Content-Length: the body itself says
                        body_since = time.monotonic()
                        peeked = await self._peek_body(receive, send, body_since)
                        if peeked is None:
                            return
                        has_body, receive = peeked
                    if has_body:
                        if self.unexpected_body == "refuse":
                            raise BodyError(400, "unexpected_body", f"a {method} request carries a body; send it "
                                            "with POST, PUT or PATCH", field="body")
                        head, matched, views = as_post or self._match(posted, headers, view)
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        if not matched:
            await self.respond(scope, receive, send, method=head.method, policies=view, judged=False)
            return
        await self._guard(scope, receive, send, head, matched, views, view, body_override=body_override,
                          body_since=body_since)

    async def _peek_body(self, receive: Receive, send: Send, since: float) -> tuple[bool, Receive] | None:
        """Whether a request whose headers cannot say (:func:`_declares_body`) carries content: its body is read, as
        :func:`read_body` reads one, up to its first part with bytes or its end (an empty body is none), within
        ``body_timeout_s`` of ``since`` (a ``time.monotonic()``; reading the rest of a judged body counts from it
        too). Returns the answer and the ``receive`` to use from here on, which gives the part read again first;
        ``None`` when the request is answered: the client left (counted), or nothing arrived in time (408
        ``body_timeout``, counted as a body rejection, connection closed)."""
        recorded = _Recorded(receive)

        async def to_first_part() -> Message:
            message = await recorded()
            if message["type"] == "http.request" and message.get("body"):
                return {**message, "more_body": False}  # the body's first bytes end the read, as its last part would
            return message

        try:
            # no size limit: one part is read, and it is in memory already
            part = await read_body(to_first_part, sys.maxsize, None, self.limits.body_timeout_s, started=since)
        except BodyError as exc:
            await refuse_unmatched_body(send, exc, self.metrics)
            return None
        if part is None:
            self.metrics.count_disconnect()
            return None
        return bool(part), recorded.replay()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket upgrade: refused on a path a policy matches (guard does not judge its messages; see
        :mod:`guard.asgi._upgrade`) or with a method override (400 ``method_override`` unless ``ignore``, as a GET
        with one is: an application that honours it on any method runs the method it asks for), else passed to the
        application with its target made canonical."""
        try:
            scope = canonical_scope(scope)
            judged_scope(scope, header_map(scope), self.method_override)
        except BodyError as exc:
            await refuse_invalid_upgrade(scope, send, exc)
            return
        policy = judged_by(self.guard, scope, self.client_header)
        if policy is not None:
            await refuse_judged_upgrade(scope, send, policy)
            return
        await self.app(_app_scope(scope, (), judged=False), receive, send)

    def _watching(self, scope: Scope, headers: dict[str, str], view: PolicyView) -> ViewMatch:
        """The request and the response policies of ``view`` that judge its response, matched as :meth:`_match`
        matches request policies."""
        return self._on_path_views(scope, headers, view, watching=True)

    async def respond(
        self, scope: Scope, receive: Receive, send: Send, headers: HeaderList = (), *, method: str | None = None,
        app: ASGIApp | None = None, policies: PolicyView | None = None, judged: bool = True,
    ) -> None:
        """Run ``app`` (the application by default; a handoff target's reply) for ``scope``, ``headers`` added to its
        response start; the response judged by every response policy that watches the request (matched with
        ``method``, the judged method, when a method override gave one). Every path that lets the app answer goes
        through here: a request no policy judges, an allowed one, one a review released, and a handoff. ``policies``:
        the version of the policies the request was matched on (:meth:`~guard.policy.PolicySet.view` at its head);
        ``None``: the active one (a release is a request of its own). ``judged``: a request policy judged it or a
        review released it (the default); ``False``: it is passed on unjudged, its review headers kept for a guard
        behind this one."""
        as_judged = {**scope, "method": method} if method is not None else scope
        view = policies if policies is not None else self.guard.policies.view()
        request_headers = header_map(scope)
        head, watching, views = self._watching(as_judged, request_headers, view)
        cache_scope = None
        if watching:
            try:
                tenant = self.tenant_of(scope, request_headers)  # refused when ambiguous, as on the request path
                cache_scope = tenant if self.cache_per_tenant else None
                if scope.get("query_string"):  # a response policy reads the request's query too
                    head = dataclasses.replace(head, query=query_map(scope, self.limits.max_form_fields))
            except BodyError as exc:
                await self._refuse(send, head, watching[0], exc)
                return
        judge = ResponseJudge(self.guard, head, watching, send, self.limits, self.metrics, headers,
                              cache_scope=cache_scope, views=views) if watching else None
        app_send = judge or (functools.partial(send_with_headers, send, headers) if headers else send)
        scope = _app_scope(scope, headers, judged=judged, view=view)
        response = (app or self.app)(watched_scope(scope) if judge else scope, receive, app_send)
        await (judge.run(response) if judge else response)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The lifespan scope: at ``lifespan.startup`` the guard's backends start first (the compact model warms up, a
        local Clef backend runs its self-test), so the first request does not pay for it inside its deadline; one
        that fails answers ``lifespan.startup.failed`` (the server exits) instead of serving decisions it cannot make.
        Then the application's lifespan runs as usual; at ``lifespan.shutdown`` the shadow decisions still running in
        the background are recorded first (:meth:`~guard.engine.Guard.drain`, each bounded by its policy's timeout),
        so stopping the server loses none of them."""
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                for backend in {id(b): b for b in self.guard.backends.values()}.values():
                    await start_backend(backend)
            except Exception as exc:  # noqa: BLE001 - whatever stops a backend starting stops the app starting
                logger.error("guard: a decision backend failed to start: %s", exc)
                await send({"type": "lifespan.startup.failed", "message": f"guard: a decision backend failed to "
                            f"start: {exc}"})
                return
        first = [message]

        async def replay() -> Message:
            if first:
                return first.pop()
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.guard.drain()
            return message

        await self.app(scope, replay, send)

    def _match(self, scope: Scope, headers: dict[str, str], view: PolicyView) -> ViewMatch:
        """The subject, every policy of ``view`` that judges it (empty when none does) and the views some of them
        judge instead."""
        return self._on_path_views(scope, headers, view)

    def _on_path_views(
        self, scope: Scope, headers: dict[str, str], view: PolicyView, *, watching: bool = False
    ) -> ViewMatch:
        """The subject and the policies of ``view`` that match it (``watching``: watch it) on any of its path's
        views (lower-cased, trailing slash removed, as configured; and as sent), each judged on the first it matches:
        :meth:`~guard.policy.PolicyView.matching_views`."""
        heads = [head_subject(scope, headers, self.client_header, path)
                 for path in path_views(scope["path"], fold=self._fold, strip=self._strip)]
        return view.matching_views(heads, watching=watching)

    def tenant_of(self, scope: Scope, headers: dict[str, str]) -> str | None:
        """The request's tenant: the ``tenant_header`` value, or what ``tenant`` says of the request's subject;
        ``None`` without either.

        Raises:
            BodyError: 400 ``repeated_header`` when the tenant header is sent more than once (a copy spelled with
                ``_`` counted: an application behind a WSGI server reads it as the same header).
        """
        if self.tenant_header is not None:
            raw = sole_header(scope["headers"], self.tenant_header, wsgi_alike=True) or b""
            value = raw.decode("latin-1").strip(" \t")  # as HTTP trims a field (RFC 9110 5.5): not
            return value or None  # str.strip's NBSP or NEL, which would file "acme\xa0" under acme, sent on as sent
        if self._tenant is not None:
            return self._tenant(head_subject(scope, headers, self.client_header))
        return None

    async def _guard(
        self, scope: Scope, receive: Receive, send: Send, head: HttpSubject, matched: tuple[Policy, ...],
        views: Mapping[str, HttpSubject], view: PolicyView, *, body_override: bool = False,
        body_since: float | None = None,
    ) -> None:
        """One matched request (``matched``: every policy of ``view`` that matches it, in match order, each judged on
        ``head`` or, where it matched only another view of the path, on its view in ``views``), from body read to
        response; with ``body_override``, a POST whose body's ``_method`` field is checked first (under ``judge``
        the request is matched and judged again as the method it asks for). ``body_since``: the ``time.monotonic()``
        at which guard began reading the body (:meth:`_peek_body`), from which ``body_timeout_s`` counts; default
        now."""
        limits, headers = self.limits, head.headers
        try:
            tenant = self.tenant_of(scope, headers)  # an ambiguous tenant is refused before anything is held
        except BodyError as exc:
            await self._refuse(send, head, verdicts.accountable(matched) or matched[0], exc)
            return
        # Only shadow policies match: a body guard cannot inspect is recorded as a shadow refusal and passed on, so
        # what was read is kept to replay (at most max_body_bytes and one chunk: reading stops there).
        recorded = _Recorded(receive) if all(p.mode == "shadow" for p in matched) else None
        try:
            read = await self._read_body(recorded or receive, headers, body_since)
            if read is None:
                return
            body, decoded, value, text = read
            method = (await self._read_body_method(body, headers, head.method)
                      if body_override and ("content-encoding" in headers or may_name_method(body)) else None)
            query = query_map(scope, limits.max_form_fields) if scope.get("query_string") else {}
        except BodyError as exc:
            if recorded is not None and self._may_pass_on(scope, head, exc, body_override, view):
                await self._pass_shadow(scope, send, head, matched, exc, recorded.replay(), view)
                return
            await self._refuse(send, head, verdicts.accountable(matched) or matched[0], exc)
            return
        if method is not None:
            asked, asked_matched, asked_views = self._match({**scope, "method": method}, headers, view)
            if asked_matched:
                await self._guard(scope, ReplayReceive(body, receive), send, asked, asked_matched, asked_views, view)
                return
            if method not in _BODY_METHODS and self.unexpected_body != "pass":  # as __call__ treats such a body
                if self.unexpected_body == "refuse":
                    await self._refuse(send, head, verdicts.accountable(matched) or matched[0], BodyError(
                        400, "unexpected_body", f"a {method} request carries a body; send it with POST, PUT or PATCH",
                        field="body"))
                    return  # under "judge": judged below as the POST it was matched as
            else:
                await self.respond(scope, ReplayReceive(body, receive), send, method=method, policies=view,
                                   judged=False)
                return
        subject = with_body(head, query, value, text, body)
        review_id = headers.get(REVIEW_HEADER)
        if review_id:
            await release_on_resend(self, scope, receive, send, review_id.strip(), body, decoded, value)
            return
        # matched on the head already; with cache_per_tenant, each tenant's decisions are cached apart
        verdict = await self.guard.aevaluate(subject, policies=matched, views=policy_subjects(subject, views),
                                             cache_scope=tenant if self.cache_per_tenant else None)
        self.metrics.count_request(verdict.policy_id or "", verdict.action)
        for policy_id in failed_open(verdict):
            self.metrics.count_fail_open(policy_id)
        # masking the body and rendering the state it shows reviewers walk every key and string of the body: on a
        # thread for a large or encoded one
        large = _off_loop(body, encoded="content-encoding" in headers)
        if verdict.action in verdicts.MASKED_ACTIONS and verdict.redactions:
            # what goes on (to the app, to reviewers and on release, to a handoff target) is the masked request
            try:
                if large:
                    body, scope = await asyncio.to_thread(redacted_request, scope, value, verdict.redactions, decoded)
                else:
                    body, scope = redacted_request(scope, value, verdict.redactions, decoded)
                if verdict.action != "redact":
                    subject = with_body(head, query, *await self._parsed(body, headers), body)
            except BodyError as exc:  # named for the policy whose redaction cannot be applied
                await self._refuse(send, head, next(p for p in matched if p.id == verdicts.redacting(verdict)), exc)
                return
        if verdict.action in ("allow", "redact"):
            scope.setdefault("state", {})[STATE_KEY] = verdict  # as Starlette's Request.state does; servers copy it
            decision = verdict_headers(verdict, full=self._full_headers)
            await self.respond(scope, ReplayReceive(body, receive), send, decision, method=head.method, policies=view)
        elif verdict.action == "block":
            await _block(send, verdict)
        elif verdict.action == "escalate":
            reads = functools.reduce(operator.or_, (p.http_reads for p in matched))  # bound to what any policy read
            if verdict.redactions:  # reviewers see the state the escalating policy renders from the masked request
                policy = next(p for p in matched if p.id == verdict.policy_id)
                judged = policy_subjects(subject, views).get(policy.id, subject)
                if large:
                    state = await asyncio.to_thread(_state_of, policy, judged)
                else:
                    state = _state_of(policy, judged)
                verdict = dataclasses.replace(verdict, state=state)
            await hold(self, scope, send, subject, body, verdict, reads)
        else:
            policy = next(p for p in matched if p.id == verdict.policy_id)  # the policy whose rule handed off
            outcomes: list[str] = []

            async def handoff_app(scope: Scope, receive: Receive, reply: Send) -> None:  # the LLM answers, not the app
                outcomes.append(await respond_with_handoff(self.handoff, policy, verdict, subject, reply,
                                                           verdict_headers(verdict), receive))  # fmt: skip

            await self.respond(scope, receive, send, method=head.method, app=handoff_app, policies=view)
            self.metrics.count_handoff(outcomes[0] if outcomes else "blocked")  # none: a response policy cut it

    async def _read_body(self, receive: Receive, headers: dict[str, str],
                         since: float | None = None) -> tuple[bytes, bytes, Any, str] | None:
        """The request body as received, decoded (its ``Content-Encoding`` undone), its parsed value and its judged
        text (:func:`parse_body`); ``None`` when the client left first (counted). ``since``: the
        ``time.monotonic()`` from which ``body_timeout_s`` counts, when reading began earlier; default now.

        Raises:
            BodyError: the body is too large, too slow, badly encoded or cannot be parsed.
        """
        limits = self.limits
        encoding = headers.get("content-encoding")
        codings = parse_encodings(encoding, limits.max_encodings, REQUEST_ENCODINGS) if encoding else None
        declared = declared_length(headers.get("content-length"))
        body = await read_body(receive, limits.max_body_bytes, declared, limits.body_timeout_s, started=since)
        if body is None:
            self.metrics.count_disconnect()
            return None
        media = media_type(headers.get("content-type", ""))
        if codings and media in _FORMS:
            # an application parses a form as received (Starlette does not undo Content-Encoding): the bytes guard
            # would judge, decoded, are not the fields the application reads
            raise BodyError(415, "encoded_form", f"a {media} body is sent with Content-Encoding; send the form "
                            "uncompressed", field="content-encoding")
        content_type = headers.get("content-type", "")
        if _off_loop(body, encoded=bool(codings)):
            return body, *await asyncio.to_thread(_decoded_and_parsed, body, codings, content_type, limits)
        return body, body, *parse_body(body, content_type, limits)

    async def _parsed(self, body: bytes, headers: dict[str, str]) -> tuple[Any, str]:
        """:func:`parse_body` of ``body`` (not encoded) by ``headers``' ``Content-Type``, on a thread past
        :data:`INLINE_PARSE_BYTES`: the value and text the application reads of a masked body."""
        content_type = headers.get("content-type", "")
        if _off_loop(body, encoded=False):
            return await asyncio.to_thread(parse_body, body, content_type, self.limits)
        return parse_body(body, content_type, self.limits)

    async def _read_body_method(self, body: bytes, headers: dict[str, str], asked: str) -> str | None:
        """:meth:`_body_method`, on a thread for an encoded body or one over :data:`INLINE_PARSE_BYTES` (it decodes
        and parses as :meth:`_read_body` does)."""
        if _off_loop(body, encoded="content-encoding" in headers):
            return await asyncio.to_thread(self._body_method, body, headers, asked)
        return self._body_method(body, headers, asked)

    def _body_method(self, body: bytes, headers: dict[str, str], asked: str) -> str | None:
        """The method a POST body's ``_method`` field (:func:`~guard.asgi._override.body_method`: Rails'
        ``Rack::MethodOverride``, Laravel and Symfony read it) makes the request judged as under ``judge``; ``None``
        when it asks for nothing or for ``asked`` (the judged method: POST, or what an override header or
        ``?_method=`` asks for). The body is read as received and, when its ``Content-Encoding`` decodes, decoded.

        Raises:
            BodyError: 400 ``method_override`` (``field``: ``_method``): the field asks for another method under
                ``refuse``, or one some frameworks ignore or read differently under ``judge``
                (:func:`~guard.asgi._override.check_judged`, :func:`~guard.asgi._override.body_method`), or is
                blank there beside an override header or query parameter, or names another method than they do, or
                the received and decoded bodies name different methods.
        """
        content_type, judge = headers.get("content-type", ""), self.method_override == "judge"
        decoded = None
        if encoding := headers.get("content-encoding"):
            # every coding guard decodes, br too: an application that inflates a body itself reads its _method
            # decoded (where a policy judges the POST itself, a br body was refused before this)
            with contextlib.suppress(BodyError):  # not really encoded: the application reads the bytes as they are
                decoded = decode_content(body, parse_encodings(encoding, self.limits.max_encodings),
                                         self.limits.max_decoded_bytes)
        if decoded is None:
            found = [body_method(body, content_type, self.limits, judge=judge)]
        else:
            found = [body_method(decoded, content_type, self.limits, judge=judge)]
            try:
                found.append(body_method(body, content_type, self.limits, judge=judge))
            except BodyError as exc:  # compressed bytes guard's parser cannot split: nor can an application's
                if exc.code == "method_override":
                    raise
        methods = {method for method in found if method}
        asked = asked.upper()
        if "" in found and asked != "POST":  # Rails reads the blank field and runs the POST, others what was asked
            raise BodyError(400, "method_override", f"the body's _method field is blank beside an override asking "
                            f"for {asked[:20]!r}; Rails would run the POST: send one override", field="_method")
        if not methods or methods == {asked}:
            return None
        if len(methods) > 1 or asked != "POST":
            raise BodyError(400, "method_override", "the body's _method field and the request's other method "
                            f"overrides name different methods ({', '.join(sorted(methods | {asked}))}); send one",
                            field="_method")
        (method,) = methods
        if self.method_override == "refuse":
            raise BodyError(400, "method_override", f"the body's _method field asks for another method "
                            f"({method[:20]!r}); send the request with that method instead", field="_method")
        check_judged("_method", method, "POST")
        return method

    async def _unmatched_body_method(
        self, scope: Scope, judged: Scope, receive: Receive, send: Send, headers: dict[str, str], view: PolicyView
    ) -> tuple[Scope, Receive] | None:
        """:meth:`_body_method` for a POST no policy judges: its body is read (under the body limits) only where a
        policy judges the path under a method the field may ask for (:func:`_body_may_ask`). Returns the scope to match (``judged``, or with
        the method asked for) and the ``receive`` that replays the body; ``None`` when the answer was sent (a body
        over the limits) or the client left.

        Raises:
            BodyError: as :meth:`_body_method`.
        """
        asked = _body_may_ask(judged["method"])
        policies = [p for m in asked for p in self._match({**scope, "method": m}, headers, view)[1]]
        if not policies:
            return judged, receive
        limits = self.limits
        try:
            body = await read_body(receive, limits.max_body_bytes, declared_length(headers.get("content-length")),
                                   limits.body_timeout_s)
        except BodyError as exc:
            await self._refuse(send, self._match(judged, headers, view)[0], policies[0], exc)
            return None
        if body is None:
            self.metrics.count_disconnect()
            return None
        method = await self._read_body_method(body, headers, judged["method"])
        return ({**judged, "method": method} if method else judged), ReplayReceive(body, receive)

    def _may_pass_on(self, scope: Scope, head: HttpSubject, exc: BodyError, body_override: bool,
                     view: PolicyView) -> bool:
        """Whether a body that cannot be inspected, where only shadow policies match ``head`` (the request as judged),
        may go on: not a body that never came (not waited for), not one whose ``_method`` field asks for another
        method, and, where a body's ``_method`` is read, not one unread (too large, malformed) while an enforced
        policy judges the path under a method it could ask for (:func:`_body_may_ask`: a POST of ``_method=DELETE``
        under a shadow POST policy ran the DELETE an enforced policy blocks)."""
        if exc.code in (BODY_TIMEOUT, "method_override"):
            return False
        if not body_override:
            return True
        asked = (p for m in _body_may_ask(head.method)
                 for p in self._match({**scope, "method": m}, head.headers, view)[1])
        return all(policy.mode == "shadow" for policy in asked)

    async def _pass_shadow(
        self, scope: Scope, send: Send, head: HttpSubject, matched: tuple[Policy, ...], exc: BodyError,
        receive: Receive, view: PolicyView,
    ) -> None:
        """A body guard cannot inspect where every matching policy is in shadow mode: the refusal it would have sent
        is recorded as a shadow verdict (``allow``, ``shadow_action`` ``block``, rule = the body error's code) and the
        request goes on, its body replayed from ``receive``."""
        policy = verdicts.accountable(matched) or matched[0]
        verdict = verdicts.refused(
            policy, decision_id=new_decision_id(), rule=exc.code, status=exc.status, message=exc.reason,
            error=exc.code, shadow=True,
        )  # fmt: skip
        self.guard.record(verdict, head, policy=policy)
        self.metrics.count_request(policy.id, verdict.action)
        logger.info("shadow policy %s: would refuse %s %r (%s); passed on", policy.id, head.method, head.path, exc.code)
        scope.setdefault("state", {})[STATE_KEY] = verdict
        await self.respond(scope, receive, send, verdict_headers(verdict, full=self._full_headers), method=head.method,
                           policies=view)

    async def _refuse(self, send: Send, head: HttpSubject, policy: Policy, exc: BodyError) -> None:
        """Answer a request whose body cannot be inspected; it is recorded as a decision of its own."""
        self.metrics.count_body_rejection(exc.code)
        verdict = verdicts.refused(
            policy, decision_id=new_decision_id(), rule=exc.code, status=exc.status, message=exc.reason, error=exc.code
        )
        self.guard.record(verdict, head, policy=policy)
        logger.info("refused %s %r before a decision: %s (policy %s)", head.method, head.path, exc.code, policy.id)
        await send_json(
            send,
            exc.status,
            {
                "code": exc.code,
                "message": exc.reason,
                "field": exc.field,
                "policy": policy.id,
                "rule": exc.code,
                "decision_id": verdict.decision_id,
            },
            # a stalled body is not waited for: close. (After a 413 the server reads and drops the rest, so the
            # client, still sending, gets the answer rather than a reset; the head timer bounds that drain.)
            [*verdict_headers(verdict), (b"connection", b"close")] if exc.status == 408 else verdict_headers(verdict),
        )


class _Recorded:
    """A ``receive`` that keeps the messages it hands out, so they can be replayed (:meth:`replay`) to the
    application when a request goes on after guard stopped reading its body part way. An empty ``http.request`` that
    is not the last (``more_body`` true) is not kept: it adds no byte, and a client sending nothing but empty parts
    (empty HTTP/2 DATA frames) would grow the list until the body deadline."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._messages: list[Message] = []

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request" or message.get("body") or not message.get("more_body", False):
            self._messages.append(message)
        return message

    def replay(self) -> Receive:
        """A ``receive`` that gives the kept messages again, in order, then the real ``receive``'s."""
        pending = list(self._messages)
        receive = self._receive

        async def replayed() -> Message:
            return pending.pop(0) if pending else await receive()

        return replayed


def _declares_body(scope: Scope, headers: dict[str, str]) -> bool | None:
    """Whether the request's headers say it carries content: a ``Transfer-Encoding``, or a ``Content-Length`` other
    than 0. ``None`` when they cannot say: HTTP/2 and HTTP/3 have no ``Transfer-Encoding`` and make ``Content-Length``
    optional, so without one a body may follow (:meth:`GuardMiddleware._peek_body` finds out); an HTTP/1.x request without either
    has none (RFC 9112 6.3)."""
    length = headers.get("content-length")
    if length is None and "transfer-encoding" not in headers and scope.get("http_version", "1.1") not in ("1.0", "1.1"):
        return None
    return "transfer-encoding" in headers or (length is not None and length.strip() not in ("", "0"))


def _state_of(policy: Policy, subject: HttpSubject) -> Any:
    """The state ``policy`` renders for ``subject`` as the model would read it (normalised, each field cut to its
    ``max_chars``); ``None`` when a field with ``truncate: error`` is over its ``max_chars`` (masks can be longer
    than the text they replace)."""
    try:
        return policy.prepare_state(policy.render_state(subject), subject).value
    except StateTooLong:
        return None


async def _block(send: Send, verdict: Verdict) -> None:
    """Answer a block verdict: its status (403 by default, 503 when a fail-closed policy could not decide) and
    ``{code, message, policy, rule, decision_id}``."""
    status = verdict.status or (503 if verdict.fail_mode == "closed" else 403)
    await send_json(
        send,
        status,
        {
            "code": block_code(verdict),
            "message": verdict.message or "The request was blocked by policy.",
            "policy": verdict.policy_id,
            "rule": verdict.rule,
            "decision_id": verdict.decision_id,
        },
        verdict_headers(verdict),
    )
