"""Serving guard under uvicorn with a request-head timeout, and two listeners (proxied and admin) in one process.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` (5 s) and caps a request head at
``h11_max_incomplete_event_size`` (16 KiB), but has no timeout for *sending* a head: a client that opens a connection
and sends a byte every few seconds holds it forever (slowloris). :func:`head_timeout_protocol` returns uvicorn's h11
protocol with one more timer: a connection that has not sent a complete request head within ``header_timeout``
seconds of being opened (or of its previous response, plus the keep-alive time) is answered 408 and closed. A
request being served is never cut by it. A request h11 cannot parse (a CR or NUL in a header value) is answered 400
with a JSON ``{code: invalid_http, message, field, errors}``, as guard's other refusals are, and closed; one found
once a response has begun (a malformed chunk of a body being served) only closes the connection. Body timeouts are
the ASGI side's job: guard's body reader (``BodyLimits.body_timeout_s``) and the proxy's forwarding
(``ProxyConfig.body_idle_timeout``).

:func:`server_options` are the uvicorn settings ``guard proxy`` serves with (this protocol; the event loop uvicorn's
``loop="auto"`` picks: uvloop where it is installed, as it is with guard, else asyncio). With the middleware in your
own app::

    uvicorn.run(app, timeout_keep_alive=5, **server_options(10.0))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any
from urllib.parse import unquote_plus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from guard.engine.telemetry import credential_name, secret_shaped

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "bind_socket",
    "filter_server_logs",
    "head_timeout_protocol",
    "masked_target",
    "serve_together",
    "server_options",
    "show_guard_logs",
]

DEFAULT_HEADER_TIMEOUT_S = 10.0
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_INVALID_HTTP_BODY = (b'{"code":"invalid_http","message":"the request is not valid HTTP/1.1 (a header value holding a CR, LF '
                      b'or NUL, a malformed Content-Length, a target that is not ASCII); it was not served",'
                      b'"field":null,"errors":[]}')
_INVALID_HTTP_RESPONSE = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                          b"content-length: %d\r\n\r\n" % len(_INVALID_HTTP_BODY) + _INVALID_HTTP_BODY)


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing connections that take longer than :attr:`header_timeout` to send a head."""

    header_timeout = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head(self.header_timeout)

    def _arm_head(self, delay: float) -> None:
        self._cancel_head()
        self._waiting_cycle = self.cycle
        self._head_timer = self.loop.call_later(delay, self._head_expired)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_cycle:
            self._cancel_head()  # a whole request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._head_timer is None:
            self._arm_head(self.timeout_keep_alive + self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._cancel_head()  # the connection becomes a WebSocket's: no HTTP head is awaited on it any more
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        """Answer a request h11 cannot parse with a JSON error, as guard answers every other refusal (uvicorn's is
        text), and close the connection; once a response has begun, only close it (a second head would be read as
        part of that response's body)."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(_INVALID_HTTP_RESPONSE)
        self.transport.close()

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.get_protocol() is not self:  # handed to another protocol (an upgrade): not this one's
            return
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.cycle is self._waiting_cycle and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def head_timeout_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a request-head timeout of ``header_timeout`` seconds (for ``http=``).

    Raises:
        ValueError: a timeout that is not positive.
    """
    if not header_timeout > 0:
        raise ValueError(f"header_timeout is {header_timeout}; it must be positive seconds")
    return type("HeadTimeoutH11", (_HeadTimeoutH11,), {"header_timeout": float(header_timeout)})


def server_options(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> dict[str, Any]:
    """The ``uvicorn.Config`` settings guard serves with: the request-head timeout protocol, ``loop="auto"``, no
    ``Server``/``Date`` headers or ``X-Forwarded-*`` trust of uvicorn's own, and no WebSocket compression
    (permessage-deflate: a 15 KiB compressed message inflated to 15 MiB in memory before any limit applied).

    Raises:
        ValueError: a timeout that is not positive.
    """
    return {"http": head_timeout_protocol(header_timeout), "loop": "auto", "server_header": False,
            "date_header": False, "proxy_headers": False, "ws_per_message_deflate": False}


class _QueryMask(logging.Filter):
    """Masks uvicorn's access log line's query (:func:`masked_target`: ``/v1?api_key=[redacted]&q=hi``), as the
    decision log and review items show a query."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], masked_target(args[2]), *args[3:])
        return True


_QUERY_SEPARATOR = re.compile(r"([&;])")
#: Fewest characters of a query value read for a secret's shape: no key prefix, token or URL password is shorter,
#: and a head of many short values costs one check for the whole query, not one per value.
SHAPED_VALUE_CHARS = 8


def masked_target(target: str) -> str:
    """A request target (``path?query``) with the value of each query parameter named like a secret
    (:func:`~guard.engine.telemetry.credential_name`) or shaped like one (:func:`~guard.engine.telemetry.secret_shaped`:
    a known key prefix, a JWT, a URL's password, ``Bearer <token>``) written ``[redacted]``; names, other values and
    the path as they were sent. The values are read one by one only when the whole query, decoded, holds such a
    shape, and then only those of at least :data:`SHAPED_VALUE_CHARS` characters."""
    path, _, query = target.partition("?")
    shaped = secret_shaped(unquote_plus(query))
    parts = []
    for part in _QUERY_SEPARATOR.split(query):  # & and ; (some frameworks split on both), kept as sent
        name, equals, value = part.partition("=")
        if equals and (credential_name(unquote_plus(name)) or shaped and len(value) >= SHAPED_VALUE_CHARS
                       and secret_shaped(unquote_plus(value))):
            part = f"{name}=[redacted]"
        parts.append(part)
    return f"{path}?{''.join(parts)}"


class _OneLineClientErrors(logging.Filter):
    """uvicorn logs a client's text frame that is not UTF-8 with a traceback (and closes the connection with 1007, as
    it should): one line is enough for what a client sent, and a client cannot fill the log with tracebacks."""

    MESSAGES = frozenset({"Invalid UTF-8 sequence received from client."})

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.MESSAGES and record.exc_info:
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def filter_server_logs() -> None:
    """Install, once, the access log's query mask (:class:`_QueryMask`) on uvicorn's ``uvicorn.access`` logger and
    the one-line form of a client's protocol errors (:class:`_OneLineClientErrors`) on ``uvicorn.error``."""
    for name, kind in (("uvicorn.access", _QueryMask), ("uvicorn.error", _OneLineClientErrors)):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, kind) for existing in logger.filters):
            logger.addFilter(kind())


def show_guard_logs(level: str) -> None:
    """Write the ``guard.*`` loggers' records at ``level`` (``info``, ``warning``, ...) and above to stderr, in
    uvicorn's format (``INFO:     guard.policy: policies reloaded: ...``), when neither the ``guard`` logger nor the
    root logger has a handler yet (Python's last-resort handler shows warnings only, so a reload or a canary that
    passes again left no trace). A process that configured logging itself is left as it is."""
    from uvicorn.logging import TRACE_LOG_LEVEL, DefaultFormatter

    logger = logging.getLogger("guard")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(TRACE_LOG_LEVEL if level.lower() == "trace" else level.upper())  # uvicorn's levels


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 literal, or a name).

    Raises:
        OSError: the address cannot be bound (in use, not local), with the address in the message.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


class _Follower(uvicorn.Server):
    """A server that leaves signals to the main one (:class:`_Main` stops it)."""

    def capture_signals(self) -> Any:
        return contextlib.nullcontext()


class _Main(uvicorn.Server):
    """A server whose SIGINT/SIGTERM also stops its follower; the signal is handled here, not raised again after
    shutdown (uvicorn's default), so both servers finish their shutdown."""

    def __init__(self, config: uvicorn.Config, follower: uvicorn.Server) -> None:
        super().__init__(config)
        self.follower = follower

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.follower.should_exit = True
        super().handle_exit(sig, frame)


def serve_together(app: Any, admin: Any, sockets: list[socket.socket], *, log_level: str = "info",
                   header_timeout: float = DEFAULT_HEADER_TIMEOUT_S, **config: Any) -> None:
    """Serve ``app`` on ``sockets[0]`` (with its lifespan) and ``admin`` on ``sockets[1]`` in one event loop,
    until SIGINT or SIGTERM; both with :func:`server_options`. ``config`` goes to both ``uvicorn.Config``."""
    common: dict[str, Any] = {"log_level": log_level, **server_options(header_timeout), **config}
    follower = _Follower(uvicorn.Config(admin, lifespan="off", **common))
    main = _Main(uvicorn.Config(app, lifespan="on", **common), follower)
    filter_server_logs()  # after the configs, which set up uvicorn's loggers
    show_guard_logs(log_level)

    async def both() -> None:
        await asyncio.gather(main.serve(sockets=[sockets[0]]), follower.serve(sockets=[sockets[1]]))

    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(both())
