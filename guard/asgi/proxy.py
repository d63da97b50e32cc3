"""A reverse proxy with the guard in front: ``guard proxy --policy FILE --upstream URL``.

Requests stream to the upstream over the proxy's own keep-alive pool (:mod:`guard.asgi._upstream`) and responses
stream back, both without buffering (a guarded request's body is read once by :class:`~guard.asgi.GuardMiddleware`
and then streamed on). The status and headers are kept, minus hop-by-hop headers (RFC 9110 7.6.1: ``Connection``
and the headers it names, ``Keep-Alive``, ``Transfer-Encoding``, ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``);
``X-Forwarded-For`` is appended to, ``X-Forwarded-Proto/-Host`` are set (the client's, its other ``X-Forwarded-*``
(``-Ssl``, ``-Scheme``, ``-Port``, ``-Prefix``, ...), ``Forwarded``, ``X-Real-IP``, ``Front-End-Https``,
``X-Url-Scheme``, ``X-Scheme``, ``CloudFront-Forwarded-Proto``, ``X-Arr-Ssl``, ``Forwarded-Proto``, ``X-Host`` and
``X-Original-Host``, dropped unless ``ProxyConfig.trust_forwarded``): ``X-Forwarded-Host`` is the request's ``Host`` as
sent. A ``Host`` that is not ``host[:port]`` is a 400 ``invalid_host``; so, with ``ProxyConfig.allowed_hosts``, is a
request whose ``Host`` names no host listed there or that has none (it would reach the upstream as
``X-Forwarded-Host``), and a trusted ``X-Forwarded-Host``, ``X-Host``, ``X-Original-Host`` or ``Forwarded``
``host=`` naming another host. ``Connection`` never removes ``Content-Type``,
``Content-Encoding``, a method override header, ``X-Guard-Decision-Id``, the guard's ``tenant_header`` and
``client_header`` or a header its
policies read (and no header at all where a rule may read any: :data:`~guard.asgi.middleware.READ_HEADERS_EXTENSION`);
under ``method_override="judge"`` an override header spelled with ``_`` (names the proxy drops) is a 400
``method_override``, so the upstream never runs a method guard did not judge.
A ``Location`` or ``Content-Location`` under the upstream URL is made a path on the proxy (nginx's default
``proxy_redirect``). Bodies pass as raw bytes, so ``Content-Encoding`` and ``Content-Length`` stay valid. HTTP/1.1
trailers cannot be relayed (uvicorn does not send them); they are dropped.

The upstream URL is built from parts: the configured scheme, host and port (nothing the client sends can change
them), the configured path prefix, then the request's canonical path (:mod:`guard.asgi._target`: the path the guard
matched) and its query string. A target that is not an origin-form path, or that servers could read differently
(``%2F``, backslash, ``;``), is a 400 ``invalid_target`` and is never forwarded; so is any ``CONNECT`` (its target is
``host:port``, RFC 9110 9.3.6: a tunnel this proxy does not open, and a server that reads an upstream's 2xx answer
to it as an open tunnel cannot send the answer's body).

Upstream trouble becomes ``{code, message}``: 502 ``upstream_unavailable`` (refused, reset, protocol error) or 504
``upstream_timeout`` (no connection or no response in time), and so is one that breaks or goes silent mid-body while
nothing has reached the client yet (a response policy holds the response until it is judged). If the upstream breaks
after the response started, the client connection is aborted (never a truncated body that looks complete). A client
that leaves while its response is relayed (``http.disconnect``) stops the relay: the upstream connection is closed and
what a response policy was judging is dropped (counted in ``guard_http_client_disconnects_total``).

The proxied listener serves nothing of its own besides the clients' review endpoints of the middleware
(``/_guard/reviews/<id>``): liveness, readiness, metrics and the reviewers' API are on the admin listener
(:mod:`guard.asgi.admin`, ``guard proxy --admin-listen``), and a request for ``/_guard/health`` here is forwarded
to the upstream like any other path (judged when a policy matches it).

WebSocket upgrades on paths no policy matches are relayed to the upstream; on a path a policy matches they
are refused with a reason (:mod:`guard.asgi._websocket`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message, Receive, Scope, Send

from guard._body import Deadline, check_framing
from guard._tracecontext import quietly
from guard._urls import named_url, password_unclear
from guard.asgi._metrics import HttpMetrics
from guard.asgi._respond import ResponseJudge
from guard.asgi._responses import refuse_target, send_json
from guard.asgi._subject import METHOD_OVERRIDE_HEADERS, forwarded_hosts, host_name
from guard.asgi._target import INVALID_TARGET, canonical_scope, request_target
from guard.asgi._upgrade import refuse_invalid_upgrade
from guard.asgi._upstream import UpstreamBusy, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout
from guard.asgi._websocket import WebSocketRelay
from guard.asgi.middleware import DECISION_ID_HEADER, READ_HEADERS_EXTENSION, GuardMiddleware
from guard.engine import Guard
from guard.engine.health import FailureTracker
from guard.errors import BodyError
from guard.policy._match import compile_glob
from guard.policy.model import host_glob

__all__ = [
    "DEFAULT_MAX_HEAD_BYTES",
    "HOP_BY_HOP",
    "ProxyApp",
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
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 200
#: Most WebSockets relayed at once (each holds an upstream connection of its own, outside ``max_connections``).
DEFAULT_MAX_WEBSOCKETS = 1000
DEFAULT_BODY_IDLE_TIMEOUT_S = 30.0
#: Most bytes of a request head the proxy takes by default (target, and each header as ``name: value`` with its line
#: end): uvicorn's h11 default for a head that arrives in several reads, which h11 does not apply to one read.
DEFAULT_MAX_HEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class ProxyConfig:
    """Where and how to forward.

    Attributes:
        upstream: base URL of the protected service (``http://127.0.0.1:9000`` or with a path prefix; no user name or
            password, which the proxy would not send).
        connect_timeout: seconds to connect to the upstream (then 504).
        read_timeout: seconds of upstream silence allowed, before the response starts or between chunks, and while
            the upstream reads none of a request body.
        max_connections: most upstream connections open at once (and kept alive when idle).
        queue_timeout: most seconds a request waits for a free upstream connection when all ``max_connections`` are
            in use (slow clients' bodies, a slow upstream); then 503 ``upstream_busy`` with ``Retry-After``.
        preserve_host: forward the client's ``Host`` (default: the upstream's host).
        body_idle_timeout: most seconds of client silence while a request body is forwarded (408 before the
            upstream answered; the upstream request is abandoned).
        trust_forwarded: keep the client's ``X-Forwarded-*`` (``-Proto``, ``-Host``, ``-Ssl``, ``-Port``, ...),
            ``Forwarded``, ``X-Real-IP``, ``Front-End-Https``, ``X-Url-Scheme``, ``X-Scheme``,
            ``CloudFront-Forwarded-Proto``, ``X-Arr-Ssl``, ``Forwarded-Proto``, ``X-Host`` and ``X-Original-Host``
            (guard behind a proxy of yours that sets them, e.g. one that terminates TLS). Default: they are dropped
            (``X-Forwarded-For`` is kept and appended to) and the proxy sets ``X-Forwarded-Proto`` (the scheme the
            client reached it by) and ``X-Forwarded-Host`` (the request's ``Host`` as sent, which the client chooses:
            see ``allowed_hosts``) itself.
        allowed_hosts: the hosts this proxy serves, as a policy's ``hosts:`` globs (``api.example.com``,
            ``*.example.com``: ``*`` within a label; no port, no trailing dot, any case): a request or WebSocket
            upgrade whose ``Host`` (without port and trailing dot) matches none is refused with 400 ``invalid_host``
            before any policy judges it, as nginx's ``server_name`` or Django's ``ALLOWED_HOSTS`` keep a forged
            ``Host`` from reaching the application (and its reset links through ``X-Forwarded-Host``); so is a
            request without ``Host`` (HTTP/1.0) or with an empty one, and, under ``trust_forwarded``, one whose
            ``X-Forwarded-Host`` entries or ``Forwarded`` ``host=`` values (kept for the upstream) name a host none
            matches. Each glob is checked as a policy's ``hosts:`` glob is (ValueError). Empty (the default): any
            well-formed ``Host``, and a request without one passes (none is sent on).
        max_websockets: most WebSockets relayed at once (each holds an upstream connection of its own); another
            upgrade is refused with 503 ``upstream_busy`` (or a close with 1013, "try again later").
        max_head_bytes: most bytes of a request head (target and headers; a WebSocket upgrade's too): 431
            ``head_too_large`` past it (raise it for large single-sign-on cookies; ``guard proxy`` raises uvicorn's
            own cap with it).
        trust_traceparent: the guard's decision span continues the client's W3C ``traceparent`` (and
            ``tracestate``), so it joins the caller's trace next to the upstream's own spans. Default: the decision
            span starts a trace of its own, since a client's header chooses the trace id and, under a parent-based
            sampler, whether the decision is recorded at all. The headers are forwarded to the upstream either way.

    Raises:
        ValueError: naming the field (``ProxyConfig.read_timeout``), its value and what is allowed.
    """

    upstream: str
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S
    preserve_host: bool = False
    body_idle_timeout: float = DEFAULT_BODY_IDLE_TIMEOUT_S
    trust_forwarded: bool = False
    trust_traceparent: bool = False
    max_websockets: int = DEFAULT_MAX_WEBSOCKETS
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        if "@" in parts.netloc or password_unclear(self.upstream):  # checked first: the errors below quote the URL
            raise ValueError("ProxyConfig.upstream holds a user name or password (user:...@), which the proxy does "
                             "not send to the upstream, or an '@' that may end one (write an '@' of the path as "
                             "%40); give the URL without them")
        shown = named_url(self.upstream)  # user:password@host, with no '//', is still hidden
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"ProxyConfig.upstream {shown!r} must be an http(s) URL without query or fragment")
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when it is read
        except ValueError as exc:
            raise ValueError(f"ProxyConfig.upstream {shown!r}: {exc}") from None
        try:
            httpx.URL(self.upstream)
        except httpx.InvalidURL as exc:
            raise ValueError(f"ProxyConfig.upstream {shown!r} is not a valid URL: {exc}") from exc
        for name in ("connect_timeout", "read_timeout", "queue_timeout", "body_idle_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ProxyConfig.{name} is {value!r}; it must be positive seconds")
        for name in ("max_connections", "max_websockets"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProxyConfig.{name} is {getattr(self, name)}; it must be at least 1")
        if self.max_head_bytes < 1024:
            raise ValueError(f"ProxyConfig.max_head_bytes is {self.max_head_bytes}; it must be at least 1024")
        for glob in self.allowed_hosts:
            try:
                host_glob(glob.strip())
            except ValueError as exc:
                raise ValueError(f"ProxyConfig.allowed_hosts: {exc}") from None


class _ClientGone(Exception):
    """The client disconnected while its body was being forwarded."""


class _ClientStalled(Exception):
    """The client sent nothing for ``body_idle_timeout`` seconds while its body was being forwarded."""


#: Method override headers as the proxy reads them (lower-case bytes).
_OVERRIDES = frozenset(name.encode() for name in METHOD_OVERRIDE_HEADERS)
#: Headers a request's ``Connection`` cannot name for removal: what the body is, as guard read it to judge it (the
#: upstream got it without a ``Content-Type`` and parsed it as whatever it defaults to), the method override
#: headers guard may have judged the request's method by (``method_override="judge"``), and the decision's id
#: ``GuardMiddleware`` set. :class:`ReverseProxy` adds the tenant header the guard in front reads.
_NOT_REMOVABLE = frozenset({b"content-type", b"content-encoding", *_OVERRIDES, b"x-guard-decision-id"})
#: A ``Host`` the proxy accepts: a name or IPv4 address (RFC 3986 reg-name, without the sub-delimiters such as ``,``
#: and the percent-escapes no DNS name holds) or an ``[IPv6]`` literal, then an optional port.
_HOST = re.compile(rb"(?:[A-Za-z0-9\-._~]+|\[[0-9A-Fa-f:.]+(?:%25[A-Za-z0-9\-._~]+)?\])(?::(?P<port>[0-9]{0,5}))?")
#: Response headers whose URL is made relative when it points into the upstream.
_LOCATIONS = frozenset({b"location", b"content-location"})


def _valid_host(host: bytes) -> bool:
    """Whether a ``Host`` value is a name, IPv4 address or ``[IPv6]`` literal (with a zone id, RFC 6874), then an
    optional port of at most 65535 (an empty one, ``a.example:``, is allowed by RFC 3986)."""
    match = _HOST.fullmatch(host)
    return match is not None and int(match.group("port") or 0) <= 65535


def _connection_tokens(value: bytes, kept: frozenset[bytes] = _NOT_REMOVABLE) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",")} - kept


def _forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop-by-hop ones (:data:`HOP_BY_HOP` and those ``Connection`` names), in one pass."""
    out: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()
    for k, v in headers:
        name = k.lower()
        if name in HOP_BY_HOP:
            if name == b"connection":
                named |= _connection_tokens(v)
        else:
            out.append((k, v))
    return [(k, v) for k, v in out if k.lower() not in named] if named else out


#: Request headers the proxy sets itself (besides the hop-by-hop ones). ``x-guard-decision-id`` comes as
#: ``GuardMiddleware`` sets it: the decision's id, a client's own dropped.
_REPLACED = frozenset({b"host", b"expect", b"x-forwarded-for"})
#: Headers that tell the upstream how the client reached it: set by the proxy, or by a trusted proxy in front of it.
#: Every other ``X-Forwarded-*`` but ``X-Forwarded-For`` (``-Ssl``, ``-Scheme``, ``-Port``, ``-Prefix``, ``-Server``,
#: which Rack, Werkzeug's ProxyFix and others read) is dropped with them (:data:`_FORWARDED_PREFIX`).
#: Also dropped, as they claim a scheme or a host: Tornado (``xheaders=True``) and Jupyter read ``X-Scheme``, CloudFront
#: sets ``CloudFront-Forwarded-Proto``, IIS ARR ``X-Arr-Ssl``; ``Forwarded-Proto``, ``X-Host`` and ``X-Original-Host``
#: are read by other frameworks' proxy settings.
_FORWARDED = frozenset({b"x-forwarded-proto", b"x-forwarded-host", b"forwarded", b"x-real-ip", b"front-end-https",
                        b"x-url-scheme", b"x-scheme", b"cloudfront-forwarded-proto", b"x-arr-ssl", b"forwarded-proto",
                        b"x-host", b"x-original-host"})
_FORWARDED_PREFIX = b"x-forwarded-"
#: The headers among them that name the host, a list of ``host[:port]`` (``allowed_hosts`` checks each entry).
_HOST_CLAIMS = frozenset({b"x-forwarded-host", b"x-host", b"x-original-host"})
#: Request headers that name another target than the request line's, which some upstreams route on (IIS URL Rewrite,
#: older Symfony and Zend): a request guard matched as ``/other`` would be served as the ``/v1/admin`` they name.
_REWRITES = frozenset({b"x-original-url", b"x-rewrite-url"})
#: Request headers not copied upstream as they are.
_NOT_COPIED = HOP_BY_HOP | _REPLACED | _REWRITES


class ReverseProxy:
    """The forwarding ASGI app (put :class:`GuardMiddleware` in front of it; :func:`proxy_app` does).

    Args:
        config: the upstream and timeouts.
        metrics: counters shared with the middleware (upstream errors are counted there).
        judged_overrides: the guard in front judges a method override header (``method_override="judge"``): one
            spelled with ``_``, which the proxy does not forward, is refused (400 ``method_override``).
        tenant_header: the guard in front's ``tenant_header``: a request's ``Connection`` cannot name it for
            removal, so the upstream gets the tenant the guard read.
        client_header: the guard in front's ``client_header``: likewise, so the upstream gets the client address
            the guard judged.

    ``health`` tracks the upstream's recent outcomes (a refused or timed-out connection makes it ``failing``).
    """

    def __init__(self, config: ProxyConfig, *, metrics: HttpMetrics | None = None,
                 judged_overrides: bool = False, tenant_header: str | None = None,
                 client_header: str | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else HttpMetrics()
        self.health = FailureTracker()
        self.base = httpx.URL(config.upstream)
        self._base_path = self.base.path.rstrip("/").encode("ascii")
        self._host = self.base.netloc  # host[:port], never userinfo
        tls = ssl.create_default_context() if self.base.scheme == "https" else None
        port = self.base.port or (443 if tls else 80)
        self._not_copied = _NOT_COPIED if config.trust_forwarded else _NOT_COPIED | _FORWARDED
        self._forwarded_prefix = None if config.trust_forwarded else _FORWARDED_PREFIX
        self._allowed_hosts = tuple(compile_glob(h.strip().lower(), ".") for h in config.allowed_hosts)
        self._judged_overrides = _OVERRIDES if judged_overrides else frozenset()
        named = {header.lower().encode("latin-1") for header in (tenant_header, client_header) if header}
        self._not_removable = _NOT_REMOVABLE | named
        origin = self.base.scheme.encode() + b"://" + self._host.lower()
        self._origins = (origin,) if self.base.port else (origin, origin + b":%d" % port)  # the port left out or not
        self._pool = UpstreamPool(self.base.host, port, tls=tls, max_connections=config.max_connections,
                                  connect_timeout=config.connect_timeout, read_timeout=config.read_timeout,
                                  queue_timeout=config.queue_timeout)

    def check(self, scope: Scope) -> None:
        """Refuse, before any policy judges it, a request this proxy could not send on as received: what
        :meth:`check_head` refuses, and what :meth:`_target` and :meth:`_headers` do. The connection is closed after
        the answer.

        Raises:
            BodyError: as :meth:`check_head`; 400 ``invalid_target``, ``invalid_host``, ``method_override``.
        """
        self.check_head(scope)
        self._target(scope)
        self._headers(scope)

    def check_head(self, scope: Scope) -> None:
        """Refuse a request head (an HTTP request's or a WebSocket upgrade's) over ``max_head_bytes`` (h11 caps only
        a head that arrives in several reads), or one framing a body both by ``Content-Length`` and
        ``Transfer-Encoding`` (:func:`~guard._body.check_framing`).

        Raises:
            BodyError: 431 ``head_too_large``; 400 ``ambiguous_length``.
        """
        headers = scope["headers"]
        limit = self.config.max_head_bytes
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b"")) + sum(
            len(k) + len(v) + 4 for k, v in headers
        )
        if size > limit:
            raise BodyError(431, "head_too_large", f"the request head is over {limit} bytes", field="headers")
        check_framing(headers)

    def upgrade_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The headers of a WebSocket upgrade sent on to the upstream: those of an HTTP request (:meth:`_headers`:
        the client's forwarding headers dropped unless trusted, ``X-Forwarded-*`` set), without ``Host``, which the
        relay's own handshake sets, without the method override headers, which no policy judged the upgrade by
        (an upstream that honours one on any method would run it), and without a client's ``X-Guard-Decision-Id``
        (no policy judged the upgrade; on an HTTP request ``GuardMiddleware`` drops it); ``X-Forwarded-Proto`` is
        ``http`` or ``https`` for ``ws`` or ``wss``."""
        scheme = {"ws": "http", "wss": "https"}.get(scope.get("scheme", "ws"), "http")
        return [(k, v) for k, v in self._headers({**scope, "scheme": scheme})[0]
                if k != b"host" and k != DECISION_ID_HEADER and k not in _OVERRIDES]

    async def aclose(self) -> None:
        """Close the idle upstream connections. Idempotent."""
        await self._pool.aclose()

    def _target(self, scope: Scope) -> bytes:
        """The upstream target: the configured path prefix, then the canonical path (already matched by the guard in
        front), then the query as received. Scheme, host and port are the configured ones, never the client's.

        Raises:
            BodyError: 400 ``invalid_target`` (see :mod:`guard.asgi._target`), or for a ``CONNECT``.
        """
        if scope["method"] == "CONNECT":
            raise BodyError(400, INVALID_TARGET, "CONNECT asks for a tunnel to host:port, which this proxy does not "
                                                 "open", field="method")
        target = request_target(scope)
        query: bytes = scope.get("query_string", b"")
        return self._base_path + target.raw_path + (b"?" + query if query else b"")

    def _headers(self, scope: Scope) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The headers sent upstream (hop-by-hop ones, names with an underscore and the target-rewriting
        ``X-Original-URL`` / ``X-Rewrite-URL`` dropped; ``Host`` and ``X-Forwarded-*`` set; ``x-guard-decision-id``
        as ``GuardMiddleware`` sets it for a judged or released request, a client's own never sent) and whether the
        request has a body; names lower-cased.

        With ``Transfer-Encoding`` the client's ``Content-Length`` is not sent either: the server read the body by
        its chunks (RFC 9112 section 6.3: the encoding overrides the length), so the upstream gets that body chunked.
        Sending the length with the de-chunked body would let the upstream read the rest of it as a second request,
        one guard never judged (request smuggling).

        Raises:
            BodyError: 400 ``invalid_host`` for a ``Host`` that is not ``host[:port]``, or a host outside
                ``allowed_hosts`` (:meth:`_check_allowed`); 400 ``method_override`` for an override header spelled
                with ``_`` that the guard judged (``judged_overrides``).
        """
        out: list[tuple[bytes, bytes]] = []
        named: set[bytes] = set()
        host = forwarded_for = None
        has_body = chunked = False
        for k, v in scope["headers"]:
            name = k.lower()
            if b"_" in name:
                if name.replace(b"_", b"-") in self._judged_overrides:
                    field = name.decode("latin-1")
                    raise BodyError(400, "method_override", f"the {field} header, which guard judged the method by, "
                                    "has '_' in its name, and this proxy does not forward such names; send it as "
                                    f"{field.replace('_', '-')}", field=field)
                continue  # WSGI, CGI and PHP read X_Real_IP as X-Real-IP, which guard judged absent (nginx drops them)
            if name in self._not_copied:
                if name == b"host":
                    host = v
                elif name == b"x-forwarded-for":
                    forwarded_for = v if forwarded_for is None else forwarded_for + b", " + v
                elif name == b"transfer-encoding":
                    has_body = chunked = True
                elif name == b"connection":
                    named |= _connection_tokens(v, self._not_removable)
                continue
            if self._forwarded_prefix and name.startswith(self._forwarded_prefix):
                continue  # the client's X-Forwarded-Ssl/-Scheme/-Port/...: untrusted (X-Forwarded-For was read above)
            if name == b"content-length":
                has_body = True
                if v.strip().isdigit():  # as the server read it (h11 took "010" as 10): no reader can read it otherwise
                    v = str(int(v)).encode()
            out.append((name, v))
        if host and not _valid_host(host):
            raise BodyError(400, "invalid_host", f"the Host header ({host[:60].decode('utf-8', 'replace')!r}) is not "
                            "a host name or address with an optional port (0-65535)", field="host")
        if self._allowed_hosts:
            self._check_allowed(host, out)
        if named:
            named = self._removable(scope, named)
        if chunked:
            named.add(b"content-length")
        if named:
            out = [(k, v) for k, v in out if k not in named]
        out.append((b"host", host if self.config.preserve_host and host else self._host))
        client = scope.get("client")
        if client:
            peer = str(client[0]).encode()
            out.append((b"x-forwarded-for", forwarded_for + b", " + peer if forwarded_for else peer))
        if not self.config.trust_forwarded:
            out.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
            if host:
                out.append((b"x-forwarded-host", host))
        return out, has_body

    @staticmethod
    def _removable(scope: Scope, named: set[bytes]) -> set[bytes]:
        """The headers ``Connection`` ``named`` that are removed: all of them but those the policies of the guard in
        front read (its :data:`~guard.asgi.middleware.READ_HEADERS_EXTENSION`), which the upstream must get as they
        were judged; none when a rule may read any header."""
        extensions = scope.get("extensions") or {}
        if READ_HEADERS_EXTENSION not in extensions:
            return named
        read = extensions[READ_HEADERS_EXTENSION]
        if read is None:
            return set()
        return named - read

    def _check_allowed(self, host: bytes | None, kept: list[tuple[bytes, bytes]]) -> None:
        """Refuse a request whose host is not one of ``allowed_hosts``: a ``Host`` (well-formed, see :meth:`_headers`)
        none of the globs matches, no ``Host`` (HTTP/1.0) or an empty one, and, under ``trust_forwarded``, an
        ``X-Forwarded-Host``, ``X-Host`` or ``X-Original-Host`` entry or ``Forwarded`` ``host=`` the headers ``kept``
        for the upstream hold that names another host: an application behind the proxy reads those as the host the
        client asked for.

        Raises:
            BodyError: 400 ``invalid_host``, ``field`` the header at fault.
        """
        if not host:
            raise BodyError(400, "invalid_host", "the request names no host (no Host header, or an empty one); this "
                            "proxy serves only the hosts it is configured for", field="host")
        self._check_listed(host, "host")
        for name, value in kept:
            if name in _HOST_CLAIMS:
                entries = [entry.strip() for entry in value.split(b",")]
            elif name == b"forwarded":
                entries = [entry.strip().encode("latin-1") for entry in forwarded_hosts(value.decode("latin-1"))]
            else:
                continue
            for entry in entries:
                if entry:
                    self._check_listed(entry, name.decode("ascii"))

    def _check_listed(self, host: bytes, field: str) -> None:
        """Refuse ``host`` (as the ``field`` header names it) unless it is ``host[:port]`` whose name one of the
        ``allowed_hosts`` globs matches.

        Raises:
            BodyError: 400 ``invalid_host``.
        """
        if not (_valid_host(host) and any(glob.fullmatch(host_name(host.decode("ascii")))
                                          for glob in self._allowed_hosts)):
            raise BodyError(400, "invalid_host", f"the {field.title()} header ({host[:60].decode('latin-1')!r}) names "
                            "no host this proxy serves", field=field)

    def _response_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The response headers sent on: :func:`_forward_headers`, with ``Location`` and ``Content-Location`` made
        relative when they point into the upstream (:meth:`_relative`)."""
        return [(k, self._relative(v)) if k in _LOCATIONS else (k, v) for k, v in _forward_headers(headers)]

    def _relative(self, url: bytes) -> bytes:
        """``url`` as a path on this proxy when it points into the upstream, as nginx's default ``proxy_redirect``
        does: ``http://10.0.0.5:9000/api/items?a=1`` -> ``/items?a=1`` for the upstream ``http://10.0.0.5:9000/api``;
        any other URL as it is."""
        for origin in self._origins:
            if url[: len(origin)].lower() == origin:
                rest = url[len(origin) :]
                if rest.startswith(self._base_path) and rest[len(self._base_path) :][:1] in (b"", b"/", b"?", b"#"):
                    rest = rest[len(self._base_path) :]
                    rest = rest if rest.startswith(b"/") else b"/" + rest
                    # ``//host`` or ``/\host`` (browsers drop tabs and line breaks) would name another host
                    plain = rest.translate(None, b"\t\r\n")
                    return url if plain[1:2] in (b"/", b"\\") else rest
        return url

    @staticmethod
    async def _body(receive: Receive, idle_s: float) -> AsyncIterator[bytes]:
        deadline = Deadline(idle_s)  # entered around each receive only: the upstream's pace is not the client's
        while True:
            try:
                with deadline:
                    message = await receive()
            except TimeoutError:
                raise _ClientStalled from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return

    async def _relay(self, response: UpstreamResponse, send: Send) -> None:
        """Send ``response`` on: its head, then its body as it arrives.

        Raises:
            UpstreamError: the upstream broke or went silent mid-body. OSError: ``send`` cut the response off.
        """
        await send({"type": "http.response.start", "status": response.status,
                    "headers": self._response_headers(response.headers)})
        ended = False
        async for chunk in response.body():
            ended = response.complete  # a known length's last piece ends the response itself
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # pragma: no cover - proxy_app routes lifespan and websockets itself
            return
        try:
            target = self._target(scope)
            headers, has_body = self._headers(scope)
        except BodyError as exc:
            await refuse_target(send, exc, self.metrics)
            return
        try:
            response = await self._pool.request(scope["method"], target, headers,
                                                self._body(receive, self.config.body_idle_timeout) if has_body else None)
        except _ClientGone:
            return
        except _ClientStalled:
            await send_json(send, 408, {"code": "body_timeout", "message": "the request body stalled for "
                                        f"{self.config.body_idle_timeout:g} s", "field": "body"},
                            [(b"connection", b"close")])
            return
        except UpstreamError as exc:
            self.metrics.count_upstream_error(exc.kind)
            if isinstance(exc, UpstreamBusy):  # load, not a failing upstream: health is not touched
                await send_json(send, 503, {"code": "upstream_busy", "message": f"the proxy is busy ({exc}); retry",
                                            "field": None}, [(b"retry-after", b"1")])
                return
            status, payload = _upstream_failure(exc)
            self.health.failure(payload["code"], str(exc), severity="degraded")  # every replica's: no rerouting helps
            await send_json(send, status, payload)
            return
        self.health.success()
        try:
            relayed = await _while_connected(self._relay(response, send), receive)
        except UpstreamError:
            self.metrics.count_upstream_error("broken_stream")
            raise  # ProxyApp answers 502/504 when nothing reached the client yet, else the connection is aborted
        except OSError:  # the client went away mid-response
            return
        finally:
            await response.aclose()
        if not relayed and not (isinstance(send, ResponseJudge) and send.answered):  # not a policy's end: the client left
            self.metrics.count_disconnect()


async def _until_disconnect(receive: Receive) -> None:
    """Read ``receive`` until ``http.disconnect``; what else comes (the rest of a body the upstream did not read) is
    dropped."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _while_connected(relay: Coroutine[Any, Any, None], receive: Receive) -> bool:
    """Await ``relay`` while watching ``receive`` for ``http.disconnect``, as Starlette's ``StreamingResponse`` does:
    uvicorn's ``send`` returns quietly once the client has left, so a relay would read the upstream to its end (an
    endless stream: for ever, holding an upstream connection and the server's shutdown) and a response policy would
    judge it for nobody. ``True`` when ``relay`` ended; ``False`` when the connection's response ended first (the
    client left, or a response policy in front gave it its whole answer), ``relay`` then cancelled. ``relay``'s errors
    propagate."""
    relaying = asyncio.ensure_future(relay)
    watching = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the request itself is cancelled (a response policy's timed flush blocked the stream)
        relaying.cancel()
        watching.cancel()
        await asyncio.gather(relaying, watching, return_exceptions=True)
    if relaying.cancelled():
        watching.result()  # an error of receive() itself
        return False
    relaying.result()
    return True


def _upstream_failure(exc: UpstreamError) -> tuple[int, dict[str, Any]]:
    """The answer to a request whose upstream failed (not :class:`UpstreamBusy`): ``(status, JSON body)``, 504
    ``upstream_timeout`` or 502 ``upstream_unavailable``."""
    timeout = isinstance(exc, UpstreamTimeout)
    return 504 if timeout else 502, {"code": "upstream_timeout" if timeout else "upstream_unavailable",
                                     "message": str(exc), "field": None}


_W3C = TraceContextTextMapPropagator()


def _client_trace_context(scope: Scope) -> otel_context.Context:
    """The trace context of a request's ``traceparent`` / ``tracestate`` headers (W3C Trace Context only: the
    client's ``baggage`` is not taken); the empty context when they are missing or malformed, or ``traceparent`` is
    sent more than once (W3C Trace Context: several are invalid). Several ``tracestate`` headers are read as one,
    joined with commas."""
    carrier: dict[str, list[str]] = {"traceparent": [], "tracestate": []}
    for name, value in scope.get("headers", ()):
        if name in (b"traceparent", b"tracestate"):
            carrier[name.decode("latin-1")].append(value.decode("latin-1"))
    if len(carrier["traceparent"]) != 1:
        return otel_context.Context()
    with quietly():  # a malformed header is the client's: OpenTelemetry's warnings would quote it
        return _W3C.extract(carrier)


class ProxyApp:
    """Top-level dispatcher: lifespan outside the guard; every ``http`` request first refused if the proxy could not
    send it on (:meth:`ReverseProxy.check`: a bad ``Host`` or target is a 400 no policy judges), its target made
    canonical (:mod:`guard.asgi._target`), then guarded and forwarded. Nothing else is served here: health, metrics and the
    reviewers' API live on the admin listener (:mod:`guard.asgi.admin`), and a request for ``/_guard/health`` on
    this listener is forwarded like any other.

    Attributes:
        guarded: the :class:`GuardMiddleware` (its ``review_store`` and ``metrics`` feed the admin app).
        proxy: the :class:`ReverseProxy` behind it.
        websockets: the :class:`~guard.asgi._websocket.WebSocketRelay` for upgrades.
        guard: the engine.
    """

    def __init__(
        self,
        guarded: GuardMiddleware,
        proxy: ReverseProxy,
        websockets: WebSocketRelay,
        guard: Guard,
        on_startup: Callable[[], Awaitable[None]] | None,
        on_shutdown: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.guarded, self.proxy, self.websockets, self.guard = guarded, proxy, websockets, guard
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            try:
                scope = canonical_scope(scope)
                self.proxy.check_head(scope)
                self.proxy.upgrade_headers(scope)  # refuses what the relay could not send on (a bad Host)
            except BodyError as exc:
                await refuse_invalid_upgrade(scope, send, exc)
                return
            await self.websockets(scope, receive, send)
            return
        if scope["type"] == "http":
            try:
                self.proxy.check(scope)  # a request the proxy would refuse is not judged (nor logged) as allowed
            except BodyError as exc:
                await refuse_target(send, exc, self.proxy.metrics, close=True)
                return
        if not self.proxy.config.trust_traceparent:
            await self._guarded(scope, receive, send)
            return
        token = otel_context.attach(_client_trace_context(scope))
        try:
            await self._guarded(scope, receive, send)
        finally:
            otel_context.detach(token)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The guarded proxy's answer. An upstream that breaks or times out mid-body while nothing has reached the
        client (a response policy holds the response until it is judged) is answered 502 ``upstream_unavailable``
        or 504 ``upstream_timeout``, as one that fails before its head; once the response has started, the client
        connection is aborted (never a truncated body that looks complete)."""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.guarded(scope, receive, tracked)
        except UpstreamError as exc:
            if started:
                logger.warning("upstream broke mid-response (%s); aborting the client connection", exc)
                raise
            status, payload = _upstream_failure(exc)
            logger.warning("upstream broke mid-response (%s) before anything reached the client; answering %d %s",
                           exc, status, payload["code"])
            await send_json(send, status, payload)

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
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    **middleware_options: Any,
) -> ProxyApp:
    """The proxied listener's app: :class:`ReverseProxy` behind :class:`GuardMiddleware`. Serve the admin endpoints
    with :func:`guard.asgi.admin.admin_app` (``review_store=app.guarded.review_store, metrics=app.guarded.metrics``)
    on another address.

    Args:
        guard: the engine (the caller closes it).
        config: upstream and timeouts.
        on_startup: awaited at lifespan startup (e.g. start a policy watcher).
        on_shutdown: awaited at lifespan shutdown, after the upstream pool is closed (e.g. close the Guard).
        **middleware_options: passed to :class:`GuardMiddleware` (``limits``, ``review_store``, ``handoff``, ...).
    """
    metrics: HttpMetrics = middleware_options.pop("metrics", None) or HttpMetrics()
    proxy = ReverseProxy(config, metrics=metrics, judged_overrides=middleware_options.get("method_override") == "judge",
                         tenant_header=middleware_options.get("tenant_header"),
                         client_header=middleware_options.get("client_header"))
    guarded = GuardMiddleware(proxy, guard=guard, metrics=metrics, **middleware_options)
    relay = WebSocketRelay(guard, proxy.base, proxy.upgrade_headers, open_timeout=config.connect_timeout,
                           client_header=guarded.client_header, max_open=config.max_websockets,
                           method_override=guarded.method_override)
    return ProxyApp(guarded, proxy, relay, guard, on_startup, on_shutdown)
