"""A reverse proxy with the guard in front: ``guard proxy --policy FILE --upstream URL``.

Requests stream to the upstream with httpx and responses stream back, both without buffering (a guarded request's
body is read once by :class:`~guard.asgi.GuardMiddleware` and then streamed on). The status and headers are kept,
minus hop-by-hop headers (RFC 9110 7.6.1: ``Connection`` and the headers it names, ``Keep-Alive``,
``Transfer-Encoding``, ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``); ``X-Forwarded-For/-Proto/-Host`` are added.
Bodies pass as raw bytes, so ``Content-Encoding`` and ``Content-Length`` stay valid. HTTP/1.1 trailers cannot be
relayed (httpx does not expose them and uvicorn does not send them); they are dropped.

Upstream trouble becomes ``{code, message}``: 502 ``upstream_unavailable`` (refused, reset, protocol error) or 504
``upstream_timeout`` (no connection or no response in time). If the upstream breaks after the response started, the
client connection is aborted (never a truncated body that looks complete).

Built-in endpoints, outside the guard: ``GET /_guard/health`` (the engine's health; 503 when degraded) and ``GET
/_guard/metrics`` (Prometheus text). With ``review_token`` the reviewers' API is served at
``/_guard/admin/reviews`` behind that bearer token.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard.asgi._metrics import HttpMetrics
from guard.asgi._responses import send_json
from guard.asgi.middleware import GuardMiddleware
from guard.asgi.review_api import review_app
from guard.engine import Guard

__all__ = [
    "DEFAULT_ADMIN_PATH",
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_METRICS_PATH",
    "HOP_BY_HOP",
    "ProxyConfig",
    "ReverseProxy",
    "proxy_app",
]

logger = logging.getLogger("guard.proxy")

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
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
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"upstream {self.upstream!r} must be an http(s) URL without query or fragment")
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
    """

    def __init__(
        self, config: ProxyConfig, *, client: httpx.AsyncClient | None = None, metrics: HttpMetrics | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else HttpMetrics()
        base = urlsplit(config.upstream)
        self._base_path = base.path.rstrip("/").encode()
        self._origin = f"{base.scheme}://{base.netloc}"
        self._host = base.netloc.encode()
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=config.max_connections,
                                max_keepalive_connections=config.max_connections),
            follow_redirects=False, trust_env=False,
        )

    async def aclose(self) -> None:
        """Close the upstream connection pool this proxy created. Idempotent."""
        if self._owns_client:
            self._owns_client = False
            await self._client.aclose()

    def _request(self, scope: Scope, receive: Receive) -> httpx.Request:
        raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
        query = scope.get("query_string", b"")
        url = self._origin.encode() + self._base_path + raw_path + (b"?" + query if query else b"")
        headers = [(k, v) for k, v in _forward_headers(scope["headers"]) if k.lower() not in (b"host", b"expect")]
        headers.append((b"host", self._host if not self.config.preserve_host else
                        dict(scope["headers"]).get(b"host", self._host)))
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
        return self._client.build_request(scope["method"], url.decode("latin-1"), headers=headers, content=content)

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
            response = await self._client.send(self._request(scope, receive), stream=True)
        except _ClientGone:
            return
        except httpx.TimeoutException as exc:
            self.metrics.upstream_errors.labels("timeout").inc()
            await send_json(send, 504, {"code": "upstream_timeout", "message": f"the upstream did not answer in "
                                        f"time ({type(exc).__name__})", "field": None})
            return
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels("unavailable").inc()
            await send_json(send, 502, {"code": "upstream_unavailable", "message": f"the upstream could not be "
                                        f"reached ({type(exc).__name__})", "field": None})
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": _forward_headers(response.headers.raw)})
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
    """Top-level dispatcher: lifespan, health, metrics and the admin API outside the guard; the rest guarded."""

    def __init__(self, guarded: ASGIApp, proxy: ReverseProxy, guard: Guard, metrics: HttpMetrics,
                 admin: ASGIApp | None, paths: tuple[str, str, str],
                 on_startup: Callable[[], Awaitable[None]] | None,
                 on_shutdown: Callable[[], Awaitable[None]] | None) -> None:
        self.guarded, self.proxy, self.guard, self.metrics, self.admin = guarded, proxy, guard, metrics, admin
        self.health_path, self.metrics_path, self.admin_path = paths
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http":
            path = scope["path"]
            if path == self.health_path:
                health = self.guard.health()
                await send_json(send, 200 if health["status"] == "ok" else 503, health)
                return
            if path == self.metrics_path:
                body = generate_latest(REGISTRY) + self.metrics.render()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
                await send({"type": "http.response.body", "body": body})
                return
            if self.admin is not None and (path == self.admin_path or path.startswith(self.admin_path + "/")):
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
    review_token: str | None = None,
    client: httpx.AsyncClient | None = None,
    health_path: str = DEFAULT_HEALTH_PATH,
    metrics_path: str = DEFAULT_METRICS_PATH,
    admin_path: str = DEFAULT_ADMIN_PATH,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    **middleware_options: Any,
) -> ASGIApp:
    """The whole proxy: :class:`ReverseProxy` behind :class:`GuardMiddleware`, plus health, metrics and (with
    ``review_token``) the reviewers' API.

    Args:
        guard: the engine (the caller closes it).
        config: upstream and timeouts.
        review_token: serve the reviewers' API at ``admin_path``, requiring ``Authorization: Bearer <token>``.
        client: an ``httpx.AsyncClient`` for the upstream (tests); default one from ``config``.
        health_path, metrics_path, admin_path: where the built-in endpoints live.
        on_startup: awaited at lifespan startup (e.g. start a policy watcher).
        on_shutdown: awaited at lifespan shutdown, after the upstream pool is closed (e.g. close the Guard).
        **middleware_options: passed to :class:`GuardMiddleware` (``limits``, ``review_store``, ``handoff``, ...).
    """
    metrics: HttpMetrics = middleware_options.pop("metrics", None) or HttpMetrics()
    proxy = ReverseProxy(config, client=client, metrics=metrics)
    guarded = GuardMiddleware(proxy, guard=guard, metrics=metrics, **middleware_options)
    admin: ASGIApp | None = None
    if review_token is not None:
        admin = Starlette(routes=[Mount(admin_path, app=review_app(guarded.review_store, token=review_token))])
    return _ProxyApp(guarded, proxy, guard, metrics, admin, (health_path, metrics_path, admin_path), on_startup,
                     on_shutdown)

