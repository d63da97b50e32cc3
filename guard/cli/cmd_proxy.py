"""``guard proxy``: a reverse proxy that judges requests before they reach an HTTP service.

    guard proxy --policy policies/api_abuse_compact.yaml --upstream http://127.0.0.1:9000 [--listen 127.0.0.1:8080]
                [--admin-listen 127.0.0.1:9901] [--tenant-header NAME [--shared-tenant-cache]]
                [--backend compact | local:DIR [--device cuda] [--dtype auto] | http://URL] [--redis-url redis://...]
                [--cache-local-ttl SECONDS] [--review-tokens-env VAR | --review-insecure-loopback]
                [--max-body-bytes N] [--decision-log FILE]
                [--log-input none|redacted|full] [--log-header NAME ...]
                [--client-header x-forwarded-for [--client-hops N]] [--decision-headers brief|full]
                [--canary-interval S]

With ``--redis-url`` the probability cache and the review queue live in Redis (shared by every replica; each replica
answers a cached key from its own copy for ``--cache-local-ttl`` seconds before it reads Redis again); without it both
stay in the process. ``--review-redis-url`` puts the review queue in a Redis of its own (persistent, ``noeviction``).
Redis needs ``$GUARD_STORE_KEY``, the secret that seals what guard writes there.

The admin listener's ``GET /_guard/health`` is readiness (:mod:`guard.asgi.health`: 200 ``ok`` or ``degraded``, 503
``failing`` while no policy is loaded, the backend fails its canaries or refuses the deployment's key or model, or a
model in this process cannot answer them; an upstream that refuses or times out and a remote backend that cannot be
reached are ``degraded``, still 200; codes only, the details for a reviewer token). The backend's canaries (:mod:`guard.backends.selftest`) run at start-up, every
``--canary-interval`` seconds and at the first decision after a policy reload; while they fail the backend gets no model calls and each policy's fail mode decides. A
System One server started with ``--api-keys-env`` gets the key in ``$GUARD_BACKEND_API_KEY``.

Two listeners, one process: ``--listen`` carries the proxied traffic (and the clients' ``/_guard/reviews/<id>``
polls and releases) and nothing else; ``--admin-listen`` (default ``127.0.0.1:9901``) serves ``GET /_guard/live``
(liveness), ``GET /_guard/health`` (readiness, above),
``GET /_guard/metrics`` and the reviewers' API with its console (``/_guard/admin/reviews``). Requests for those paths
on ``--listen`` are forwarded to the upstream like any other.

The reviewers' API is served only with credentials: ``--review-tokens-env VAR`` names a variable holding
``name:token,name:token:tenant|tenant`` (one token per reviewer, each at least 16 characters, optionally scoped to
tenants; ``--tenant-header`` names the trusted header that says a request's tenant). Without tokens,
``--review-insecure-loopback`` serves it to loopback clients only, and only when ``--admin-listen`` is a loopback
address. Slow clients: ``--header-timeout`` (seconds to send a request head) and ``--body-timeout`` (seconds to send a
judged body) close or refuse them.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from guard._urls import named_url
from guard.asgi._responses import DECISION_HEADERS
from guard.asgi.admin import DEFAULT_ADMIN_LISTEN
from guard.asgi.limits import DEFAULT_STREAM_FLUSH_S, DEFAULT_STREAM_HOLD_CHARS, BodyLimits
from guard.asgi.proxy import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_WEBSOCKETS,
    DEFAULT_QUEUE_TIMEOUT_S,
)
from guard.asgi.server import DEFAULT_HEADER_TIMEOUT_S
from guard.backends.options import add_backend_options, open_cli_backend
from guard.cli._args import count, flag_names, positive_int, positive_seconds, seconds
from guard.cli._otel import install_metrics_from_env, install_tracing_from_env, shutdown_providers
from guard.engine.health import DEFAULT_CANARY_INTERVAL_S
from guard.engine.telemetry import LOG_INPUT_MODES, LOGGED_HEADERS
from guard.policy.watch import DEFAULT_RELOAD_INTERVAL_S, PolicyWatcher

__all__ = ["ProxyRuntime", "build", "register", "run"]

DEFAULT_LISTEN = "127.0.0.1:8080"
EXIT_USAGE = 2
#: Environment variables read when ``--redis-url`` / ``--review-redis-url`` are not given.
REDIS_URL_ENV = "GUARD_REDIS_URL"
REVIEW_REDIS_URL_ENV = "GUARD_REVIEW_REDIS_URL"

logger = logging.getLogger("guard.proxy")

#: The config fields the options set, as the flags that set them: a config's ``ValueError`` names its field, the user
#: typed the flag (:func:`guard.cli._args.flag_names`). Each number's own range is checked by its argparse type; what
#: is left are the checks only a config knows (an upstream URL, an allowed host, the head's 1024-byte floor).
_FLAGS = {
    "ProxyConfig.upstream": "--upstream",
    "ProxyConfig.connect_timeout": "--connect-timeout",
    "ProxyConfig.read_timeout": "--read-timeout",
    "ProxyConfig.queue_timeout": "--queue-timeout",
    "ProxyConfig.body_idle_timeout": "--body-timeout",
    "ProxyConfig.max_connections": "--max-connections",
    "ProxyConfig.max_websockets": "--max-websockets",
    "ProxyConfig.max_head_bytes": "--max-head-bytes",
    "ProxyConfig.allowed_hosts": "--allowed-hosts",
    "BodyLimits.body_timeout_s": "--body-timeout",
    "BodyLimits.stream_flush_s": "--stream-flush",
    "BodyLimits.stream_hold_chars": "--stream-hold",
    "CacheConfig.local_ttl": "--cache-local-ttl",
}


def register(subparsers: Any) -> None:
    """Add ``guard proxy``."""
    parser = subparsers.add_parser(
        "proxy",
        help="run a reverse proxy with the guard in front of an HTTP service",
        description="Reverse proxy: requests a policy matches are judged before they are forwarded to --upstream.",
    )
    parser.add_argument("--policy", action="append", required=True, metavar="FILE", help="policy file (repeatable)")
    parser.add_argument("--upstream", required=True, metavar="URL", help="the protected service, e.g. http://app:9000")
    parser.add_argument("--trust-forwarded", action="store_true",
                        help="keep the client's X-Forwarded-* (-Proto, -Host, -Ssl, -Port, ...), Forwarded, X-Real-IP, "
                        "Front-End-Https, X-Url-Scheme, X-Scheme, CloudFront-Forwarded-Proto, X-Arr-Ssl, Forwarded-Proto, "
                        "X-Host and X-Original-Host (guard behind a proxy "
                        "of yours that sets them, e.g. one terminating TLS); default: dropped, and the proxy sets "
                        "X-Forwarded-Proto/-Host itself")
    parser.add_argument("--preserve-host", action="store_true",
                        help="forward the client's Host to the upstream (default: the upstream's host and port)")
    parser.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                        help="comma-separated hosts this proxy serves (api.example.com,*.example.com; no port): a "
                        "request whose Host is none of them, or that has none, is refused with 400 invalid_host, as "
                        "nginx's server_name does (with --trust-forwarded, a X-Forwarded-Host or Forwarded host= "
                        "outside them too); default: any Host, sent on as X-Forwarded-Host")
    parser.add_argument("--trust-traceparent", action="store_true",
                        help="the decision span continues the client's W3C traceparent (a gateway behind your own "
                        "traced edge); default: each decision starts its own trace")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"the proxied listener, default {DEFAULT_LISTEN}")
    parser.add_argument("--admin-listen", default=DEFAULT_ADMIN_LISTEN, metavar="HOST:PORT",
                        help="health, metrics and the reviewers' API (never on --listen); default "
                        f"{DEFAULT_ADMIN_LISTEN}, loopback: bind an internal address for probes and scrapes")
    parser.add_argument("--tenant-header", default=None, metavar="NAME",
                        help="trusted header naming the request's tenant (set by an authenticating layer in front); "
                        "review items carry it, tenant-scoped reviewers see only theirs, and each tenant's "
                        "decisions are cached apart")
    parser.add_argument("--shared-tenant-cache", action="store_true",
                        help="with --tenant-header, share probability-cache entries across tenants (more hits; a "
                        "tenant can then time whether another sent the same text within the cache ttl)")
    parser.add_argument("--header-timeout", type=positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                        help="seconds a client has to send a request head (line and headers) before the connection "
                        f"is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=positive_seconds, default=None, metavar="S",
                        help="seconds a client has to send a judged body (408 after; default BodyLimits, "
                        "30) and the most silence between chunks of a forwarded one")
    parser.add_argument("--stream-flush", type=seconds, default=None, metavar="S",
                        help="seconds a streamed response's bytes wait for a response policy's window to fill before "
                        f"they are judged and sent on (default {DEFAULT_STREAM_FLUSH_S:g}; 0: wait for a full window)")
    parser.add_argument("--stream-hold", type=count, default=None, metavar="CHARS",
                        help="characters at the end of a streamed LLM answer (its events' pieces joined) kept back "
                        "until more follows, so a key streamed token by token is judged whole before any of it "
                        f"leaves (default {DEFAULT_STREAM_HOLD_CHARS}; 0: send each event once judged)")
    add_backend_options(parser, default="compact")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or None, metavar="URL",
                        help="Redis for the cache (and the review queue, without --review-redis-url); "
                        "redis://:PASSWORD@host:port/db or rediss:// for TLS; needs $GUARD_STORE_KEY; default "
                        f"${REDIS_URL_ENV} (the environment keeps a password out of the process's command line)")
    parser.add_argument("--review-redis-url", default=os.environ.get(REVIEW_REDIS_URL_ENV) or None, metavar="URL",
                        help="a separate Redis for the review queue (persistent, noeviction); default "
                        f"${REVIEW_REDIS_URL_ENV}, else --redis-url")
    parser.add_argument(
        "--cache-local-ttl",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="with --redis-url: seconds a cached answer is served from this process before Redis is read again "
        "(0 = read Redis on every hit; default CacheConfig.local_ttl, 1 s)",
    )
    parser.add_argument(
        "--review-tokens-env",
        default=None,
        metavar="VAR",
        help="serve the reviewers' API at /_guard/admin/reviews on --admin-listen; $VAR holds "
        "name:token,name:token:tenant|tenant (one per reviewer, optionally scoped to tenants)",
    )
    parser.add_argument(
        "--review-insecure-loopback",
        action="store_true",
        help="serve the reviewers' API without tokens to loopback clients (only with a loopback --admin-listen)",
    )
    parser.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="N", help="inspection cap (1 MiB)")
    parser.add_argument("--decision-log", default=None, metavar="FILE", help="append JSON-lines decision records")
    parser.add_argument(
        "--log-input",
        default="redacted",
        choices=LOG_INPUT_MODES,
        help="what the decision log keeps of each request: redacted (default: headers other than common ones such "
        "as content-type and user-agent, and query parameters and body fields named like secrets, removed), none (no "
        "input and no state), full (all but the credential headers)",
    )
    parser.add_argument(
        "--log-header",
        action="append",
        default=[],
        metavar="NAME",
        help="with --log-input redacted, also keep this request header's value in the decision log (repeatable)",
    )
    parser.add_argument(
        "--client-header",
        default=None,
        metavar="NAME",
        help="header your proxies append the client's address to (x-forwarded-for); the entry the outermost trusted "
        "proxy appended is used (--client-hops); default the peer address",
    )
    parser.add_argument(
        "--client-hops",
        type=positive_int,
        default=1,
        metavar="N",
        help="how many trusted proxies append to --client-header: the client is its N-th entry from the right (1)",
    )
    parser.add_argument(
        "--decision-headers",
        default="brief",
        choices=DECISION_HEADERS,
        help="brief (default): allowed responses carry x-guard-decision-id (and x-guard-fail-mode when failing "
        "open); full: every decision header (blocked, held and handed-off responses always carry all)",
    )
    parser.add_argument("--connect-timeout", type=positive_seconds, default=5.0, metavar="S",
                        help="upstream connect, seconds")
    parser.add_argument("--read-timeout", type=positive_seconds, default=60.0, metavar="S",
                        help="upstream silence, seconds")
    parser.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help=f"most upstream connections at once (default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-websockets", type=positive_int, default=DEFAULT_MAX_WEBSOCKETS, metavar="N",
                        help=f"most WebSockets relayed at once, each with an upstream connection of its own (default "
                        f"{DEFAULT_MAX_WEBSOCKETS})")
    parser.add_argument("--max-head-bytes", type=positive_int, default=DEFAULT_MAX_HEAD_BYTES, metavar="N",
                        help="most bytes of a request head, headers included (default "
                        f"{DEFAULT_MAX_HEAD_BYTES}; 431 head_too_large past it): raise it for large sign-on cookies")
    parser.add_argument("--queue-timeout", type=positive_seconds, default=DEFAULT_QUEUE_TIMEOUT_S, metavar="S",
                        help="most seconds a request waits for a free upstream connection when all are in use "
                        f"(default {DEFAULT_QUEUE_TIMEOUT_S:g}; then 503 upstream_busy)")
    parser.add_argument(
        "--reload-interval",
        type=seconds,
        default=DEFAULT_RELOAD_INTERVAL_S,
        metavar="S",
        help="seconds between checks of the policy files for changes; 0 turns reloading off "
        f"(default {DEFAULT_RELOAD_INTERVAL_S:g}; a failing reload keeps the last good policies)",
    )
    parser.add_argument(
        "--canary-interval",
        type=seconds,
        default=DEFAULT_CANARY_INTERVAL_S,
        metavar="S",
        help=f"seconds between canary runs of the backend (default {DEFAULT_CANARY_INTERVAL_S:g}; 0: at start-up "
        "and after a policy reload only)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(handler=run)


@dataclass
class ProxyRuntime:
    """What :func:`build` made: the proxied app and the admin app, where each listens, and how to release it all
    (the proxied app's lifespan shutdown calls ``aclose``; call it yourself when it is served without lifespan)."""

    app: Any
    host: str
    port: int
    admin: Any
    admin_host: str
    admin_port: int
    header_timeout: float
    aclose: Callable[[], Awaitable[None]]


def _listen(value: str, option: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{option} {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _allowed_hosts(value: str | None) -> tuple[str, ...]:
    """``--allowed-hosts``: its comma-separated hosts (``ProxyConfig.allowed_hosts`` checks each), ``()`` without it.

    Raises:
        ValueError: the option names no host.
    """
    if value is None:
        return ()
    hosts = tuple(h.strip() for h in value.split(",") if h.strip())
    if not hosts:
        raise ValueError(f"--allowed-hosts {value!r} names no host; e.g. --allowed-hosts api.example.com,*.example.com")
    return hosts


def _decision_log(args: argparse.Namespace) -> Any:
    """The ``--decision-log`` file's :class:`~guard.engine.telemetry.DecisionLog`, or ``None`` without one.

    Raises:
        ValueError: the file cannot be opened for appending (or it is a FIFO no process reads), naming the option
            and the path.
    """
    from guard.engine.telemetry import DecisionLog

    if not args.decision_log:
        return None
    try:
        return DecisionLog(args.decision_log, log_input=args.log_input,
                            logged_headers=LOGGED_HEADERS | {name.lower() for name in args.log_header})
    except OSError as exc:
        reason = {FileNotFoundError: "no such directory", IsADirectoryError: "is a directory, not a file"}.get(
            type(exc), "no reader on FIFO (start the process that reads it first)" if exc.errno == errno.ENXIO
            else exc.strerror or str(exc)
        )
        raise ValueError(f"--decision-log {args.decision_log}: {reason}") from None


def build(args: argparse.Namespace) -> ProxyRuntime:
    """Build the proxy app from parsed arguments (reads the review token from the environment).

    Raises:
        ValueError: naming the option: a bad ``--listen``, ``--upstream``, ``--allowed-hosts``, ``--backend``,
            ``--device``, ``--redis-url`` or ``--review-redis-url`` (a URL the cache or review store cannot use, or no
            ``$GUARD_STORE_KEY`` to seal with); a missing or malformed token variable; a ``--decision-log`` that
            cannot be opened; ``--review-insecure-loopback`` with a non-loopback ``--admin-listen``; an ``OTEL_*``
            variable the telemetry cannot use (the numbers' own ranges are checked by their argparse types).
        PolicyError: an invalid policy file.
    """
    from opentelemetry import metrics as otel_metrics

    from guard.asgi import HttpMetrics
    from guard.asgi.admin import admin_app, reviewer_tokens
    from guard.asgi.health import HealthEndpoint
    from guard.asgi.proxy import ProxyConfig, proxy_app
    from guard.asgi.review_api import is_loopback as _is_loopback
    from guard.asgi.review_api import parse_reviewer_tokens
    from guard.asgi.review_store import MemoryReviewStore, RedisReviewStore, ReviewStore
    from guard.backends import start_backend
    from guard.engine import Guard
    from guard.engine.cache import CacheConfig, MemoryCache, ProbabilityCache, RedisCache
    from guard.engine.health import HealthMonitor
    from guard.errors import ReviewStoreUnavailable
    from guard.policy import load_files

    host, port = _listen(args.listen)
    admin_host, admin_port = _listen(args.admin_listen, "--admin-listen")
    if (admin_host, admin_port) == (host, port) and port != 0:
        raise ValueError("--admin-listen must differ from --listen: the admin endpoints are never on the proxied one")
    overrides: dict[str, Any] = {} if args.body_timeout is None else {"body_timeout_s": args.body_timeout}
    if args.stream_flush is not None:
        overrides["stream_flush_s"] = args.stream_flush or None
    if args.stream_hold is not None:
        overrides["stream_hold_chars"] = args.stream_hold
    try:
        limits = BodyLimits(**overrides)
        config = ProxyConfig(args.upstream, connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
                             max_connections=args.max_connections, queue_timeout=args.queue_timeout,
                             max_websockets=args.max_websockets, max_head_bytes=args.max_head_bytes,
                             body_idle_timeout=limits.body_timeout_s,
                             preserve_host=args.preserve_host, trust_forwarded=args.trust_forwarded,
                             trust_traceparent=args.trust_traceparent,
                             allowed_hosts=_allowed_hosts(args.allowed_hosts))
        cache_config = CacheConfig(local_ttl=args.cache_local_ttl) if args.cache_local_ttl is not None else None
    except ValueError as exc:  # the configs name their fields; the user typed the flags
        raise ValueError(flag_names(str(exc), _FLAGS)) from None
    reviewers = None
    if args.review_tokens_env:
        text = os.environ.get(args.review_tokens_env)
        if not text:
            raise ValueError(f"--review-tokens-env {args.review_tokens_env}: the variable is not set or empty")
        try:
            reviewers = parse_reviewer_tokens(text)
        except ValueError as exc:
            raise ValueError(f"--review-tokens-env {args.review_tokens_env}: {exc}") from None
    if args.review_insecure_loopback and (reviewers is not None or not _is_loopback(admin_host)):
        raise ValueError("--review-insecure-loopback needs a loopback --admin-listen (127.0.0.1, ::1) and no "
                         "--review-tokens-env")
    policies = load_files(*args.policy)  # fail fast on a bad policy, before a model is loaded
    if reviewers is None and not args.review_insecure_loopback:
        _warn_unanswered_escalations(policies.policies)
    local_ttl = {} if args.cache_local_ttl is None else {"local_ttl": args.cache_local_ttl}
    cache_config = CacheConfig(url=args.redis_url, **local_ttl)
    try:  # likewise a Redis URL the cache cannot use, or no store key to seal with
        cache: ProbabilityCache = RedisCache(cache_config) if args.redis_url else MemoryCache(cache_config)
    except ValueError as exc:
        raise ValueError(f"{_url_source(args.redis_url, '--redis-url', REDIS_URL_ENV)}: {exc}") from None
    review_url = args.review_redis_url or args.redis_url
    try:  # and the review store's
        store: ReviewStore = RedisReviewStore.from_url(review_url) if review_url else MemoryReviewStore()
    except ValueError as exc:
        flag, variable = (("--review-redis-url", REVIEW_REDIS_URL_ENV) if args.review_redis_url
                          else ("--redis-url", REDIS_URL_ENV))
        raise ValueError(f"{_url_source(review_url, flag, variable)}: {exc}") from None
    log = _decision_log(args)  # before the model loads: a wrong path shows at once
    install_metrics_from_env()
    install_tracing_from_env()
    backend = open_cli_backend(args)
    guard = Guard(policies, backends=backend, cache=cache, decision_log=log)
    options: dict[str, Any] = {
        # the HTTP counters go where the OTEL_* variables send the engine's (OTLP, /_guard/metrics)
        "metrics": HttpMetrics(meter_provider=otel_metrics.get_meter_provider()),
        "review_store": store,
        "client_header": args.client_header,
        "client_hops": args.client_hops,
        "decision_headers": args.decision_headers,
        "tenant_header": args.tenant_header,
        "cache_per_tenant": not args.shared_tenant_cache,
        "limits": limits,
    }
    if args.max_body_bytes is not None:
        options["max_body_bytes"] = args.max_body_bytes

    watcher = PolicyWatcher(guard.policies, interval_s=args.reload_interval) if args.reload_interval > 0 else None
    monitor = HealthMonitor(guard, interval_s=args.canary_interval)

    async def astart() -> None:
        await start_backend(backend)  # warm up before the first request is timed
        await monitor.start()  # the canaries: a degenerate backend gets no model calls and health says failing
        try:  # a wrong review store address shows now, not at the first escalation
            await store.list_items(limit=1)
        except ReviewStoreUnavailable as exc:
            logger.error("the review store cannot be read (escalated requests will get 503 until it can): %s", exc)
        if watcher is not None:
            watcher.start()

    async def aclose() -> None:
        await monitor.aclose()
        if watcher is not None:
            await watcher.aclose()
        await store.aclose()
        await guard.aclose()

    app = proxy_app(guard, config, on_startup=astart, on_shutdown=aclose, **options)
    health = HealthEndpoint(guard, upstream=app.proxy.health, review_store=store,
                            admin_tokens=reviewer_tokens(reviewers), watcher=watcher)
    admin = admin_app(guard, review_store=store, reviewers=reviewers, insecure_loopback=args.review_insecure_loopback,
                      metrics=app.guarded.metrics, health=health)
    return ProxyRuntime(app=app, host=host, port=port, admin=admin, admin_host=admin_host, admin_port=admin_port,
                        header_timeout=args.header_timeout, aclose=aclose)


def _warn_unanswered_escalations(policies: Any) -> None:
    """Log a warning naming each enforced HTTP policy that can hold requests for review (an ``escalate`` rule, default or
    fail mode) when no reviewer can answer them: such requests wait until their review item expires."""
    for policy in policies:
        outcomes = [rule.outcome for rule in policy.rules] + [policy.default]
        fail_mode = policy.on_error.mode if policy.on_error is not None else None
        escalates = "escalate" in [o.action for o in outcomes] or fail_mode == "escalate"
        if policy.http is not None and policy.mode == "enforce" and escalates:
            logger.warning("policy %r escalates, but the reviewers' API is not served (no --review-tokens-env): "
                           "requests it holds wait unanswered until they expire", policy.id)


def _url_source(url: str, flag: str, variable: str) -> str:
    """What an error about a Redis URL names: ``$VARIABLE`` when ``url`` is the value the option took from it (the
    option was not given), else the option."""
    return f"${variable} (the default of {flag})" if url == os.environ.get(variable) else flag


def run(args: argparse.Namespace) -> int:
    """Serve both listeners until interrupted; returns the exit status (2 for bad arguments, an invalid policy or
    an address that cannot be bound)."""
    from guard.asgi.server import bind_socket, serve_together
    from guard.errors import PolicyError

    try:
        runtime = build(args)
        sockets = [bind_socket(runtime.host, runtime.port), bind_socket(runtime.admin_host, runtime.admin_port)]
    except (ValueError, PolicyError, FileNotFoundError, OSError) as exc:
        print(f"guard proxy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    log = runtime.app.guard.decision_log
    if log is not None:  # logrotate's postrotate: kill -HUP <pid> (the default action of SIGHUP ends the process)
        signal.signal(signal.SIGHUP, lambda signum, frame: log.reopen())
    print(
        f"guard proxy: http://{runtime.host}:{runtime.port} -> {named_url(args.upstream)} "
        f"(policies: {', '.join(args.policy)}; backend: {named_url(args.backend)}); "
        f"admin: http://{runtime.admin_host}:{runtime.admin_port}",
        file=sys.stderr,
    )
    serve_together(runtime.app, runtime.admin, sockets, log_level=args.log_level,
                   header_timeout=runtime.header_timeout,
                   h11_max_incomplete_event_size=max(args.max_head_bytes, DEFAULT_MAX_HEAD_BYTES))
    shutdown_providers()  # the last spans and metrics leave now, within a bound
    return 0
