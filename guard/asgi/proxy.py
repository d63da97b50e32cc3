"""A reverse proxy with the guard in front: ``guard proxy --policy FILE --upstream URL``.

Requests stream to the upstream over a pool of keep-alive connections (:mod:`guard.asgi._upstream`) and responses
stream back, both without buffering (a guarded request's
body is read once by :class:`~guard.asgi.GuardMiddleware` and then streamed on). The status and headers are kept,
minus hop-by-hop headers (RFC 9110 7.6.1: ``Connection`` and the headers it names, ``Keep-Alive``,
``Transfer-Encoding``, ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``); ``X-Forwarded-For/-Proto/-Host`` are added.
Bodies pass as raw bytes, so ``Content-Encoding`` and ``Content-Length`` stay valid. HTTP/1.1 trailers cannot be
relayed (uvicorn does not send them); they are dropped.

The upstream URL is built from parts: the configured scheme, host and port (nothing the client sends can change
them), the configured path prefix, then the request's canonical path (:mod:`guard.asgi._target`: the path the guard
matched) and its query string. A target that is not an origin-form path, or that servers could read differently
(``%2F``, backslash, ``;``), is a 400 ``invalid_target`` and is never forwarded.

Upstream trouble becomes ``{code, message}``: 502 ``upstream_unavailable`` (refused, reset, protocol error) or 504
``upstream_timeout`` (no connection or no response in time). If the upstream breaks after the response started, the
client connection is aborted (never a truncated body that looks complete).

Built-in endpoints, outside the guard: ``GET /_guard/live`` (liveness: 200 while the process serves), ``GET
/_guard/health`` (readiness: 200 with the engine's health, ``ok`` or ``degraded``, while a policy set is loaded) and
``GET /_guard/metrics`` (Prometheus text). WebSocket upgrades on paths no policy matches are relayed to the
upstream; on a path a policy matches they are refused with a reason (:mod:`guard.asgi._websocket`). With ``reviewers`` the reviewers' API is served at
``/_guard/admin/reviews``, each reviewer with their own bearer token.
"""

from __future__ import annotations

import logging
import ssl
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
from guard.asgi._upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from guard.asgi._websocket import WebSocketRelay
from guard.asgi.middleware import GuardMiddleware
from guard.asgi.review_api import review_app
from guard.engine import Guard
from guard.errors import BodyError

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
        max_connections: most upstream connections open at once (and kept alive when idle).
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
    drop = HOP_BY_HOP | _connection_tokens(headers) if any(k.lower() == b"connection" for k, _ in headers) else \
        HOP_BY_HOP
    return [(k, v) for k, v in headers if k.lower() not in drop]


#: Request headers the proxy sets itself (besides the hop-by-hop ones).
_REPLACED = frozenset({b"host", b"expect", b"x-forwarded-for"})


class ReverseProxy:
    """The forwarding ASGI app (put :class:`GuardMiddleware` in front of it; :func:`proxy_app` does).

    Args:
        config: the upstream and timeouts.
        metrics: counters shared with the middleware (upstream errors are counted there).
    """

    def __init__(self, config: ProxyConfig, *, metrics: HttpMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else HttpMetrics()
        self.base = httpx.URL(config.upstream)
        self._base_path = self.base.path.rstrip("/").encode("ascii")
        self._host = self.base.netloc  # host[:port], never userinfo
        tls = ssl.create_default_context() if self.base.scheme == "https" else None
        port = self.base.port or (443 if tls else 80)
        self._pool = UpstreamPool(self.base.host, port, tls=tls, max_connections=config.max_connections,
                                  connect_timeout=config.connect_timeout, read_timeout=config.read_timeout)

    async def aclose(self) -> None:
        """Close the idle upstream connections. Idempotent."""
        await self._pool.aclose()

    def _target(self, scope: Scope) -> bytes:
        """The upstream target: the configured path prefix, then the canonical path (already matched by the guard in
        front), then the query as received. Scheme, host and port are the configured ones, never the client's.

        Raises:
            BodyError: 400 ``invalid_target`` (see :mod:`guard.asgi._target`).
        """
        target = request_target(scope)
        query: bytes = scope.get("query_string", b"")
        return self._base_path + target.raw_path + (b"?" + query if query else b"")

    def _headers(self, scope: Scope) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The headers sent upstream (hop-by-hop ones dropped; ``Host`` and ``X-Forwarded-*`` set) and whether the
        request has a body."""
        raw: list[tuple[bytes, bytes]] = scope["headers"]
        headers = _forward_headers(raw)
        host = forwarded_for = None
        has_body = False
        for k, v in raw:
            name = k.lower()
            if name == b"host":
                host = v
            elif name == b"x-forwarded-for":
                forwarded_for = v if forwarded_for is None else forwarded_for + b", " + v
            elif name in (b"content-length", b"transfer-encoding"):
                has_body = True
        out = [(k.lower(), v) for k, v in headers if k.lower() not in _REPLACED]
        out.append((b"host", host if self.config.preserve_host and host else self._host))
        client = scope.get("client")
        if client:
            peer = str(client[0]).encode()
            out.append((b"x-forwarded-for", forwarded_for + b", " + peer if forwarded_for else peer))
        out.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
        if host:
            out.append((b"x-forwarded-host", host))
        return out, has_body

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
        if scope["type"] != "http":  # pragma: no cover - proxy_app routes lifespan and websockets itself
            return
        try:
            target = self._target(scope)
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        headers, has_body = self._headers(scope)
        try:
            response = await self._pool.request(scope["method"], target, headers,
                                                self._body(receive) if has_body else None)
        except _ClientGone:
            return
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(exc.kind).inc()
            timeout = isinstance(exc, UpstreamTimeout)
            await send_json(send, 504 if timeout else 502, {
                "code": "upstream_timeout" if timeout else "upstream_unavailable",
                "message": f"the upstream {'did not answer in time' if timeout else 'could not be reached'} ({exc})",
                "field": None,
            })  # fmt: skip
            return
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": _forward_headers(response.headers)})
            ended = False
            async for chunk in response.body():
                ended = response.complete  # a known length's last piece ends the response itself
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels("broken_stream").inc()
            logger.warning("upstream broke mid-response (%s); aborting the client connection", exc)
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
        websockets: WebSocketRelay,
        guard: Guard,
        metrics: HttpMetrics,
        admin: ASGIApp | None,
        paths: tuple[str, str, str, str],
        on_startup: Callable[[], Awaitable[None]] | None,
        on_shutdown: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.guarded, self.proxy, self.guard, self.metrics, self.admin = guarded, proxy, guard, metrics, admin
        self.websockets = websockets
        self.live_path, self.health_path, self.metrics_path, self.admin_path = paths
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            try:
                scope = canonical_scope(scope)
            except BodyError as exc:
                await send({"type": "websocket.close", "code": 1008, "reason": exc.reason[:120]})
                return
            await self.websockets(scope, receive, send)
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
                await self._readiness(send)
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

    async def _readiness(self, send: Send) -> None:
        """200 while a policy set is loaded and requests are judged, ``status`` ``ok`` or ``degraded`` (a Redis
        error in the last 30 s, or a failed reload with the last good policies still active); 503 only when no policy
        is loaded."""
        health = self.guard.health()
        ready = health["policies"] > 0
        await send_json(send, 200 if ready else 503, {**health, "ready": ready})

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
        live_path, health_path, metrics_path, admin_path: where the built-in endpoints live (liveness, readiness,
            Prometheus text, reviewers' API).
        on_startup: awaited at lifespan startup (e.g. start a policy watcher).
        on_shutdown: awaited at lifespan shutdown, after the upstream pool is closed (e.g. close the Guard).
        **middleware_options: passed to :class:`GuardMiddleware` (``limits``, ``review_store``, ``handoff``, ...).
    """
    metrics: HttpMetrics = middleware_options.pop("metrics", None) or HttpMetrics()
    proxy = ReverseProxy(config, metrics=metrics)
    guarded = GuardMiddleware(proxy, guard=guard, metrics=metrics, **middleware_options)
    admin: ASGIApp | None = None
    if reviewers is not None or review_insecure_loopback:
        reviews = review_app(guarded.review_store, reviewers=reviewers, insecure_loopback=review_insecure_loopback)
        admin = Starlette(routes=[Mount(admin_path, app=reviews)])
    relay = WebSocketRelay(guard, proxy.base, open_timeout=config.connect_timeout,
                           client_header=middleware_options.get("client_header"))
    return _ProxyApp(
        guarded,
        proxy,
        relay,
        guard,
        metrics,
        admin,
        (live_path, health_path, metrics_path, admin_path),
        on_startup,
        on_shutdown,
    )
