"""A reverse proxy with the guard in front: ``guard proxy --policy FILE --upstream URL``.

Requests stream to the upstream with httpx and responses stream back, both without buffering (a guarded request's
body is read once by :class:`~guard.asgi.GuardMiddleware` and then streamed on). The status and headers are kept,
minus hop-by-hop headers (RFC 9110 7.6.1: ``Connection`` and the headers it names, ``Keep-Alive``,
``Transfer-Encoding``, ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``); ``X-Forwarded-For/-Proto/-Host`` are added.
Bodies pass as raw bytes, so ``Content-Encoding`` and ``Content-Length`` stay valid. HTTP/1.1 trailers cannot be
relayed (httpx does not expose them and uvicorn does not send them); they are dropped.

The upstream URL is built from parts: the configured scheme, host and port (nothing the client sends can change
them), the configured path prefix, then the request's canonical path (:mod:`guard.asgi._target`: the path the guard
matched) and its query string. A target that is not an origin-form path, or that servers could read differently
(``%2F``, backslash, ``;``), is a 400 ``invalid_target`` and is never forwarded.

Upstream trouble becomes ``{code, message}``: 502 ``upstream_unavailable`` (refused, reset, protocol error) or 504
``upstream_timeout`` (no connection or no response in time). If the upstream breaks after the response started, the
client connection is aborted (never a truncated body that looks complete).

Built-in endpoints, outside the guard: ``GET /_guard/live`` (liveness: 200 while the process serves), ``GET
/_guard/health`` (readiness, :mod:`guard.asgi.health`: 200 ``ok`` or ``degraded``, 503 ``failing`` when every request
would fail: no policy, a backend failing or failing its canary, the upstream unreachable; codes only, details for a
reviewer token) and ``GET /_guard/metrics`` (Prometheus text). With ``reviewers`` the reviewers' API is served at
``/_guard/admin/reviews``, each reviewer with their own bearer token.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard.asgi._metrics import HttpMetrics
from guard.asgi._responses import refuse_target, send_json
from guard.asgi._target import canonical_scope, request_target
from guard.asgi.health import HealthEndpoint
from guard.asgi.middleware import GuardMiddleware
from guard.asgi.review_api import review_app
from guard.engine import Guard
from guard.engine.health import FailureTracker
from guard.errors import BodyError
from guard.policy.watch import PolicyWatcher

__all__ = [
    "DEFAULT_ADMIN_PATH",
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_LIVE_PATH",
    "DEFAULT_METRICS_PATH",
    "HOP_BY_HOP",
    "ProxyConfig",
    "ReverseProxy",
    "proxy_app",
]

logger = logging.getLogger("guard.proxy")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
DEFAULT_LIVE_PATH = "/_guard/live"
DEFAULT_HEALTH_PATH = "/_guard/health"
DEFAULT_METRICS_PATH = "/_guard/metrics"
DEFAULT_ADMIN_PATH = "/_guard/admin/reviews"
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 200


@dataclass(frozen=True)
class ProxyConfig:
    """Where and how to forward.

    Attributes:
        upstream: base URL of the protected service (``http://127.0.0.1:9000`` or with a path prefix).
        connect_timeout: seconds to connect to the upstream (then 504).
        read_timeout: seconds of upstream silence allowed, before the response starts or between chunks.
        max_connections: size of the upstream connection pool.
        preserve_host: forward the client's ``Host`` (default: the upstream's host).
    """

    upstream: str
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    preserve_host: bool = False

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"upstream {self.upstream!r} must be an http(s) URL without query or fragment")
        try:
            httpx.URL(self.upstream)
        except httpx.InvalidURL as exc:
            raise ValueError(f"upstream {self.upstream!r} is not a valid URL: {exc}") from exc
        if not (self.connect_timeout > 0 and self.read_timeout > 0):
            raise ValueError("connect_timeout and read_timeout must be positive seconds")
        if self.max_connections < 1:
            raise ValueError(f"max_connections is {self.max_connections}; it must be at least 1")


class _ClientGone(Exception):
    """The client disconnected while its body was being forwarded."""


def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")}


def _forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    drop = HOP_BY_HOP | _connection_tokens(headers)
    return [(k, v) for k, v in headers if k.lower() not in drop]


class ReverseProxy:
    """The forwarding ASGI app (put :class:`GuardMiddleware` in front of it; :func:`proxy_app` does).

    Args:
        config: the upstream and timeouts.
        client: an ``httpx.AsyncClient`` to use (not closed here); default one built from ``config``.
        metrics: counters shared with the middleware (upstream errors are counted there).

    ``health`` tracks the upstream's recent outcomes (a refused or timed-out connection makes it ``failing``).
    """

    def __init__(
        self, config: ProxyConfig, *, client: httpx.AsyncClient | None = None, metrics: HttpMetrics | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else HttpMetrics()
        self.health = FailureTracker()
        self._base = httpx.URL(config.upstream)
        self._base_path = self._base.path.rstrip("/")
        self._host = self._base.netloc  # host[:port], never userinfo
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
            limits=httpx.Limits(
                max_connections=config.max_connections, max_keepalive_connections=config.max_connections
            ),
            follow_redirects=False,
            trust_env=False,
        )

    async def aclose(self) -> None:
        """Close the upstream connection pool this proxy created. Idempotent."""
        if self._owns_client:
            self._owns_client = False
            await self._client.aclose()

    def _url(self, scope: Scope) -> httpx.URL:
        """The upstream URL: the configured scheme, host and port, never anything from the client; the canonical
        path (already matched by the guard in front) under the upstream's path prefix; the query as received.

        Raises:
            BodyError: 400 ``invalid_target`` (see :mod:`guard.asgi._target`).
        """
        target = request_target(scope)
        query: bytes = scope.get("query_string", b"")
        return self._base.copy_with(path=self._base_path + target.raw_path.decode("ascii"), query=query or None)

    def _request(self, scope: Scope, receive: Receive) -> httpx.Request:
        url = self._url(scope)
        headers = [(k, v) for k, v in _forward_headers(scope["headers"]) if k.lower() not in (b"host", b"expect")]
        headers.append(
            (b"host", self._host if not self.config.preserve_host else dict(scope["headers"]).get(b"host", self._host))
        )
        client = scope.get("client")
        if client:
            prior = [v for k, v in scope["headers"] if k.lower() == b"x-forwarded-for"]
            chain = b", ".join([*prior, str(client[0]).encode()])
            headers = [(k, v) for k, v in headers if k.lower() != b"x-forwarded-for"]
            headers.append((b"x-forwarded-for", chain))
        headers.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
        original_host = dict(scope["headers"]).get(b"host")
        if original_host:
            headers.append((b"x-forwarded-host", original_host))
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        content = self._body(receive) if has_body else None
        return self._client.build_request(scope["method"], url, headers=headers, content=content)

    @staticmethod
    async def _body(receive: Receive) -> AsyncIterator[bytes]:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # pragma: no cover - proxy_app routes lifespan itself; websockets unsupported
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        try:
            request = self._request(scope, receive)
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        try:
            response = await self._client.send(request, stream=True)
        except _ClientGone:
            return
        except httpx.TimeoutException as exc:
            self.metrics.upstream_errors.labels("timeout").inc()
            self.health.failure("upstream_timeout", f"{type(exc).__name__}: {exc}")
            await send_json(
                send,
                504,
                {
                    "code": "upstream_timeout",
                    "message": f"the upstream did not answer in time ({type(exc).__name__})",
                    "field": None,
                },
            )
            return
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels("unavailable").inc()
            self.health.failure("upstream_unavailable", f"{type(exc).__name__}: {exc}")
            await send_json(
                send,
                502,
                {
                    "code": "upstream_unavailable",
                    "message": f"the upstream could not be reached ({type(exc).__name__})",
                    "field": None,
                },
            )
            return
        self.health.success()
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": _forward_headers(response.headers.raw),
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels("broken_stream").inc()
            logger.warning("upstream broke mid-response (%s); aborting the client connection", type(exc).__name__)
            raise
        except OSError:  # the client went away mid-response
            return
        finally:
            await response.aclose()


class _ProxyApp:
    """Top-level dispatcher: lifespan, health, metrics and the admin API outside the guard; the rest guarded.

    Every ``http`` request's target is made canonical first (:mod:`guard.asgi._target`), so the built-in endpoints,
    the guard and the upstream all see the same path.
    """

    def __init__(
        self,
        guarded: ASGIApp,
        proxy: ReverseProxy,
        health: HealthEndpoint,
        metrics: HttpMetrics,
        admin: ASGIApp | None,
        paths: tuple[str, str, str, str],
        on_startup: Callable[[], Awaitable[None]] | None,
        on_shutdown: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.guarded, self.proxy, self.health, self.metrics, self.admin = guarded, proxy, health, metrics, admin
        self.guard = health.guard
        self.live_path, self.health_path, self.metrics_path, self.admin_path = paths
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http":
            try:
                scope = canonical_scope(scope)
            except BodyError as exc:
                await refuse_target(send, exc, self.metrics)
                return
            path = scope["path"]
            if path == self.live_path:
                await send_json(send, 200, {"status": "alive"})
                return
            if path == self.health_path:
                await self.health(scope, send)
                return
            if path == self.metrics_path:
                body = generate_latest(REGISTRY) + self.metrics.render()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            if self.admin is not None and (path == self.admin_path or path.startswith(self.admin_path + "/")):
                if path == self.admin_path:  # the list lives at "<admin>/"; answer it here rather than with a 307
                    scope = {**scope, "path": path + "/", "raw_path": scope["raw_path"] + b"/"}
                await self.admin(scope, receive, send)
                return
        await self.guarded(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "lifespan.startup":
                if self.on_startup is not None:
                    await self.on_startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.proxy.aclose()
                if self.on_shutdown is not None:
                    await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def proxy_app(
    guard: Guard,
    config: ProxyConfig,
    *,
    reviewers: Mapping[str, str] | None = None,
    review_insecure_loopback: bool = False,
    watcher: PolicyWatcher | None = None,
    client: httpx.AsyncClient | None = None,
    live_path: str = DEFAULT_LIVE_PATH,
    health_path: str = DEFAULT_HEALTH_PATH,
    metrics_path: str = DEFAULT_METRICS_PATH,
    admin_path: str = DEFAULT_ADMIN_PATH,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    **middleware_options: Any,
) -> ASGIApp:
    """The whole proxy: :class:`ReverseProxy` behind :class:`GuardMiddleware`, plus health, metrics and (with
    ``reviewers``, or ``review_insecure_loopback``) the reviewers' API.

    Args:
        guard: the engine (the caller closes it).
        config: upstream and timeouts.
        reviewers: serve the reviewers' API at ``admin_path``; reviewer name -> bearer token
            (:func:`guard.asgi.review_api.review_routes`).
        review_insecure_loopback: serve it without tokens to loopback clients only (403 for any other).
        watcher: the policy watcher, reported by health (``watcher_dead`` when its task ended).
        client: an ``httpx.AsyncClient`` for the upstream (tests); default one from ``config``.
        live_path, health_path, metrics_path, admin_path: where the built-in endpoints live (liveness, readiness,
            Prometheus text, reviewers' API).
        on_startup: awaited at lifespan startup (e.g. start a policy watcher).
        on_shutdown: awaited at lifespan shutdown, after the upstream pool is closed (e.g. close the Guard).
        **middleware_options: passed to :class:`GuardMiddleware` (``limits``, ``review_store``, ``handoff``, ...).
    """
    metrics: HttpMetrics = middleware_options.pop("metrics", None) or HttpMetrics()
    proxy = ReverseProxy(config, client=client, metrics=metrics)
    guarded = GuardMiddleware(proxy, guard=guard, metrics=metrics, **middleware_options)
    admin: ASGIApp | None = None
    if reviewers is not None or review_insecure_loopback:
        reviews = review_app(guarded.review_store, reviewers=reviewers, insecure_loopback=review_insecure_loopback)
        admin = Starlette(routes=[Mount(admin_path, app=reviews)])
    health = HealthEndpoint(guard, upstream=proxy.health, admin_tokens=(reviewers or {}).values(),
                            watcher=watcher)
    return _ProxyApp(
        guarded,
        proxy,
        health,
        metrics,
        admin,
        (live_path, health_path, metrics_path, admin_path),
        on_startup,
        on_shutdown,
    )
