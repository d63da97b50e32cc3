"""WebSocket passthrough for ``guard proxy``: paths no policy matches are relayed to the upstream, message for message.

An upgrade on a path some policy matches is refused (:mod:`guard.asgi._upgrade`), and so is one with a method
override unless the middleware ignores them (400 ``method_override``, as the middleware refuses it; the handshake
never carries an override header on). Any other upgrade is opened to the upstream (an unreachable or refusing upstream,
one answering with a redirect included, which is not followed: 502 ``upstream_unavailable``, or a close with 1014)
(``ws://`` or ``wss://`` for ``http://`` or ``https://``, the same host, path prefix and path rules as HTTP), the
subprotocol the upstream picks is accepted, and text and binary messages are relayed both
ways until either side closes; the close code goes to the other side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, WebSocketException

from guard.asgi._override import judged_scope
from guard.asgi._subject import ClientHeader, header_map
from guard.asgi._upgrade import deny_upgrade, judged_by, refuse_invalid_upgrade, refuse_judged_upgrade
from guard.engine import Guard
from guard.errors import BodyError

__all__ = ["WebSocketRelay"]

logger = logging.getLogger("guard.proxy")

#: Request headers of the upgrade not sent on to the upstream (the relay makes its own handshake).
_HANDSHAKE = frozenset({b"host", b"connection", b"upgrade", b"sec-websocket-key", b"sec-websocket-version",
                        b"sec-websocket-extensions", b"sec-websocket-protocol", b"content-length"})
_UPSTREAM_UNAVAILABLE = 1014  # "bad gateway"
_TRY_AGAIN_LATER = 1013
#: Close codes no endpoint may send (RFC 6455 7.4.1: 1005, 1006 and 1015 only report what happened), and the code
#: the relay sends the client in their place: 1000 for "no status", 1014 ("bad gateway") for an abnormal end.
_UNSENDABLE = {1005: 1000, 1006: 1014, 1015: 1014}


class _Connect(connect):
    """``websockets``' client connection without redirects: a 3xx to the upstream handshake refuses it, as any other
    status does, rather than being followed (it names a path no policy checked, or another host that would get the
    client's headers). The relay opens it with ``proxy=None``: to the upstream itself, as the HTTP pool connects,
    never through a proxy the environment names (``HTTP_PROXY``, ``ALL_PROXY``)."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        """The handshake's error as it is: never a URI to follow."""
        return exc


class WebSocketRelay:
    """Refuse upgrades on judged paths; relay the others to ``base`` (the proxy's upstream URL).

    Args:
        guard: the engine whose policies say which paths are judged.
        base: the upstream base URL (``http(s)://host[:port][/prefix]``).
        upgrade_headers: the upgrade request's headers to send on, as the proxy sends an HTTP request's
            (:meth:`~guard.asgi.proxy.ReverseProxy.upgrade_headers`); the handshake's own are left out here.
        open_timeout: seconds for the upstream handshake.
        client_header: where the client's address is read, as the middleware reads it.
        max_open: most WebSockets relayed at once; another upgrade is refused (503 ``upstream_busy``, or a close with
            1013) until one ends.
        method_override: the middleware's ``method_override`` mode: an upgrade with an override is refused unless
            ``"ignore"``.
    """

    def __init__(self, guard: Guard, base: httpx.URL, upgrade_headers: Callable[[Scope], list[tuple[bytes, bytes]]],
                 *, open_timeout: float, client_header: ClientHeader | None, max_open: int,
                 method_override: str) -> None:
        self.guard = guard
        self.method_override = method_override
        self.max_open = max_open
        self.open = 0  # WebSockets being relayed (one event loop: no lock)
        self.upgrade_headers = upgrade_headers
        self.open_timeout = open_timeout
        self.client_header = client_header
        scheme = "wss" if base.scheme == "https" else "ws"
        self._base = f"{scheme}://{base.netloc.decode('ascii')}{base.path.rstrip('/')}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            judged_scope(scope, header_map(scope), self.method_override)
        except BodyError as exc:
            await refuse_invalid_upgrade(scope, send, exc)
            return
        policy = judged_by(self.guard, scope, self.client_header)
        if policy is not None:
            await refuse_judged_upgrade(scope, send, policy)
            return
        if (await receive())["type"] != "websocket.connect":
            return
        if self.open >= self.max_open:
            logger.info("websocket refused: %d are relayed already (max_websockets)", self.open)
            await deny_upgrade(scope, send, 503, {"code": "upstream_busy", "message": f"{self.max_open} WebSockets "
                               "are relayed already; try again later", "field": None}, _TRY_AGAIN_LATER)
            return
        self.open += 1
        try:
            await self._open_and_relay(scope, receive, send)
        finally:
            self.open -= 1

    async def _open_and_relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open the upstream WebSocket for an accepted upgrade and relay both ways (502 / 1014 when it cannot be
        opened)."""
        query = scope.get("query_string", b"").decode("latin-1")
        url = self._base + scope["raw_path"].decode("latin-1") + (f"?{query}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.upgrade_headers(scope)
                   if k.lower() not in _HANDSHAKE]
        try:
            upstream = await _Connect(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                                      open_timeout=self.open_timeout, max_size=None, compression=None, proxy=None)
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            code = exc.response.status_code if isinstance(exc, InvalidStatus) else None
            logger.warning("websocket upstream %s refused or unreachable for path %r (%s)", self._base, scope["path"],
                           code or type(exc).__name__)  # never the query: browsers send WebSocket tokens in it
            reason = f"the upstream refused or could not be reached ({code or type(exc).__name__})"
            await deny_upgrade(scope, send, 502, {"code": "upstream_unavailable", "message": reason, "field": None},
                        _UPSTREAM_UNAVAILABLE)
            return
        async with upstream:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            await self._relay(upstream, receive, send)

    @staticmethod
    async def _relay(upstream: ClientConnection, receive: Receive, send: Send) -> None:
        async def client_to_upstream() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    code = message.get("code", 1000)
                    await upstream.close(_UNSENDABLE.get(code, code))
                    return
                if message.get("text") is not None:
                    await upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send(message["bytes"])

        async def upstream_to_client() -> None:
            try:
                async for data in upstream:
                    key = "text" if isinstance(data, str) else "bytes"
                    await send({"type": "websocket.send", key: data})
            except ConnectionClosed:
                pass
            code = upstream.close_code or 1000
            with contextlib.suppress(OSError, RuntimeError, WebSocketException):  # the client may be gone already
                await send({"type": "websocket.close", "code": _UNSENDABLE.get(code, code),
                            "reason": upstream.close_reason or ""})

        tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, OSError):
                    await task

