"""The admin listener's app: liveness, readiness, Prometheus metrics and the reviewers' API, apart from the traffic.

``guard proxy`` serves this app on its own address (``--admin-listen``, default ``127.0.0.1:9901``, as Envoy's admin
listener), never on the proxied one, so a client of the protected service cannot reach the review API, the
console, the health text (error messages, policy snippets) or the metrics. With the middleware, serve it the same
way, on a second uvicorn server bound to loopback or an internal interface::

    guarded = GuardMiddleware(app, guard=guard, review_store=store)
    admin = admin_app(guard, review_store=store, reviewers=reviewers, metrics=guarded.metrics)
    # uvicorn.Server(uvicorn.Config(admin, host="127.0.0.1", port=9901, lifespan="off", **server_options())).serve()

(``guard.asgi.server.server_options``: without it uvicorn trusts ``X-Forwarded-For`` from a loopback peer, so a
local process could name a new client address on every wrong token and never be rate limited.)

=======  ===========================  ========================================================================
GET      ``/_guard/live``             liveness: 200 ``{"status": "alive"}`` while the process serves
GET      ``/_guard/health``           readiness (:class:`guard.asgi.health.HealthEndpoint`)
GET      ``/_guard/metrics``          Prometheus text: the process registry plus the ``guard_http_*`` counters
any      ``/_guard/admin/reviews/``   the reviewers' API and console (:mod:`guard.asgi.review_api`), when built
                                      with ``reviewers`` or ``insecure_loopback``
=======  ===========================  ========================================================================

Any other path is a 404 ``{code: not_found}``. Paths are read below any root path (uvicorn or hypercorn
``--root-path``, a ``Mount``), as routing reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard._rootpath import route_path
from guard.asgi._metrics import HttpMetrics
from guard.asgi._responses import refuse_target, send_json
from guard.asgi._target import canonical_scope
from guard.asgi.health import HealthEndpoint
from guard.asgi.review_api import Reviewer, json_errors, review_app
from guard.asgi.review_store import ReviewStore
from guard.engine import Guard
from guard.errors import BodyError

__all__ = [
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_ADMIN_PATH",
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_LIVE_PATH",
    "DEFAULT_METRICS_PATH",
    "AdminApp",
    "admin_app",
    "reviewer_tokens",
]

DEFAULT_ADMIN_LISTEN = "127.0.0.1:9901"
DEFAULT_LIVE_PATH = "/_guard/live"
DEFAULT_HEALTH_PATH = "/_guard/health"
DEFAULT_METRICS_PATH = "/_guard/metrics"
DEFAULT_ADMIN_PATH = "/_guard/admin/reviews"


class AdminApp:
    """The admin ASGI app (see the module docstring); built by :func:`admin_app`.

    Attributes:
        health: answers readiness (codes only; details for an admin token).
        metrics: the middleware's counters, reported with the process registry.
        reviews: the mounted reviewers' API, or ``None``.
    """

    def __init__(self, health: HealthEndpoint, metrics: HttpMetrics, reviews: ASGIApp | None,
                 paths: tuple[str, str, str, str]) -> None:
        self.health, self.metrics, self.reviews = health, metrics, reviews
        self.live_path, self.health_path, self.metrics_path, self.admin_path = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            scope = canonical_scope(scope)
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        path = route_path(scope)  # below any root path, as routing reads it
        if path == self.live_path:
            await send_json(send, 200, {"status": "alive"})
        elif path == self.health_path:
            await self.health(scope, send)
        elif path == self.metrics_path:
            body = generate_latest(REGISTRY) + self.metrics.render()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": body})
        elif self.reviews is not None and (path == self.admin_path or path.startswith(self.admin_path + "/")):
            if path == self.admin_path:  # the list lives at "<admin>/"; answer it here rather than with a 307
                full = scope["path"]
                scope = {**scope, "path": full + "/", "raw_path": (scope.get("raw_path") or full.encode()) + b"/"}
            await self.reviews(scope, receive, send)
        else:
            await send_json(send, 404, {"code": "not_found", "message": "not an admin endpoint", "field": "path"})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def admin_app(
    guard: Guard,
    *,
    review_store: ReviewStore | None = None,
    reviewers: Mapping[str, str | Reviewer] | None = None,
    insecure_loopback: bool = False,
    metrics: HttpMetrics | None = None,
    health: HealthEndpoint | None = None,
    live_path: str = DEFAULT_LIVE_PATH,
    health_path: str = DEFAULT_HEALTH_PATH,
    metrics_path: str = DEFAULT_METRICS_PATH,
    admin_path: str = DEFAULT_ADMIN_PATH,
    **review_options: Any,
) -> AdminApp:
    """The admin app for one guard: health, liveness, metrics and (with ``reviewers`` or ``insecure_loopback``)
    the reviewers' API over ``review_store``.

    Args:
        guard: the engine whose health is reported.
        review_store: the store the middleware holds items in (required with ``reviewers``).
        reviewers, insecure_loopback, **review_options: passed to :func:`guard.asgi.review_api.review_app`, with
            ``decision_log`` the guard's own unless given, so approvals and rejections are recorded with its decisions.
        metrics: the middleware's counters (``GuardMiddleware.metrics``); default a new, empty set.
        health: the readiness endpoint (``guard proxy`` passes one reporting its upstream and policy watcher);
            default one for ``guard`` alone, whose details the tokens of reviewers not scoped to tenants may read.
        live_path, health_path, metrics_path, admin_path: where each endpoint lives.

    Raises:
        ValueError: ``reviewers`` or ``insecure_loopback`` without a ``review_store``; see ``review_app``.
    """
    reviews: ASGIApp | None = None
    if reviewers is not None or insecure_loopback:
        if review_store is None:
            raise ValueError("the reviewers' API needs the review_store the middleware writes to")
        review_options.setdefault("decision_log", guard.decision_log)
        api = review_app(review_store, reviewers=reviewers, insecure_loopback=insecure_loopback, **review_options)
        reviews = json_errors(Starlette(routes=[Mount(admin_path, app=api)]))
    if health is None:
        health = HealthEndpoint(guard, review_store=review_store, admin_tokens=reviewer_tokens(reviewers))
    return AdminApp(health, metrics if metrics is not None else HttpMetrics(), reviews,
                    (live_path, health_path, metrics_path, admin_path))


def reviewer_tokens(reviewers: Mapping[str, str | Reviewer] | None) -> list[str]:
    """The bearer tokens of the ``reviewers`` not scoped to tenants (the credentials that may read health details):
    the details are the whole gateway's (cache counts, reload errors, backend errors), not one tenant's."""
    tokens = [r if isinstance(r, Reviewer) else Reviewer(r) for r in (reviewers or {}).values()]
    return [r.token for r in tokens if r.tenants is None]
