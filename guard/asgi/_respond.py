"""Judging the application's (or upstream's) response for response policies (``match.http.response``).

:class:`ResponseJudge` wraps ``send`` for one request whose request conditions a response policy accepts. It holds
``http.response.start`` back, picks every watching policy whose ``response`` conditions accept the status, headers
and media type (none: the response passes untouched; several: their verdicts combine as a request's do; a repeated
``Content-Type``, ``Content-Length`` or ``Content-Encoding`` that any copy would have a policy watch, or a part of
a body, 206 or ``multipart/byteranges``, though the request went on without ``Range``: 502
``response_uninspectable`` before any byte), then judges the body in one of two ways (either way a stream's events,
or those of a body that holds them, are joined as its client joins them: :mod:`guard.asgi._deltas`):

* **whole** (a ``Content-Length`` and not ``text/event-stream``): the body is read up to
  ``BodyLimits.max_response_bytes``, decoded (``Content-Encoding``) and parsed like a request body, and judged once.
  allow: sent as it came; redact: sent re-encoded with the spans replaced (new ``Content-Length``, no
  ``Content-Encoding``); block: the client gets ``{code: response_blocked, ...}`` with the rule's status instead.
* **streamed** (``text/event-stream``, or no ``Content-Length``: chunked): a sliding window. Bytes are held back
  until ``stream_window_bytes`` have arrived or the stream ends; the held text, after the last
  ``stream_overlap_bytes`` already sent, is judged (HTML and XML also as a parser reads it, as a whole body is);
  then it is sent on (for SSE only up to the last complete event, so an event is never split from its end).
  Nothing is sent before it was judged, so nothing after a blocked span leaves.
  A block before anything was sent is a plain JSON block; after, an SSE stream gets an ``event: error`` and an
  ``event: guard_blocked``, each with the block's JSON as data, and ends; a chunked stream that is not SSE is cut
  off without its last chunk, so the client sees an incomplete body, never one that looks whole. Redact replaces spans in the window before it is sent
  (a span reaching past the window waits for the next one). A compressed stream is not judged (502).
  A slow stream does not wait for the window to fill: ``stream_flush_s`` after the first byte that was not judged yet
  arrived, a flusher task judges what is held as it stands and sends on what may go, by the same rules (whole SSE
  events; all but the overlap of a chunked stream). A block it finds cuts the response off: the application's call
  is cancelled. :meth:`ResponseJudge.run` runs the application's call next to the flusher.

Every judgement is a verdict of its own (``phase: response``), recorded like a request's; an allowed or redacted
response carries ``x-guard-response-decision-id``.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import contextlib
import dataclasses
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.types import Message, Scope, Send

from guard._json import is_json_media, json_readings
from guard._markup import is_markup, is_xml, with_markup_reading
from guard.asgi._decode import decode_content, parse_encodings
from guard.asgi._deltas import AI_DATA_STREAM_HEADER, JSON_LINES, DeltaJoiner, joiner_for
from guard.asgi._media import (
    charset,
    charset_guessed,
    check_html_charset,
    check_html_escapes,
    check_xml_encoding,
    is_textual,
    parse_params,
)
from guard.asgi._metrics import HttpMetrics
from guard.asgi._parse import encode_body, parse_body
from guard.asgi._responses import HeaderList, send_json, verdict_headers
from guard.asgi.limits import BodyLimits
from guard.engine import Guard, verdicts
from guard.engine.ids import new_decision_id
from guard.errors import BodyError
from guard.policy import Policy
from guard.policy.loader import policy_subjects
from guard.policy.redact import apply_redactions
from guard.subject import HttpSubject, judged_strings
from guard.verdict import Verdict

__all__ = [
    "RESPONSE_BLOCKED",
    "RESPONSE_UNINSPECTABLE",
    "SSE_BLOCK_EVENT",
    "ResponseJudge",
    "StreamStopped",
    "watched_scope",
    "whole_stream_subject",
]

logger = logging.getLogger("guard.asgi")

RESPONSE_BLOCKED = "response_blocked"
RESPONSE_UNINSPECTABLE = "response_uninspectable"
#: The SSE event name a blocked stream ends with.
SSE_BLOCK_EVENT = "guard_blocked"
_RESPONSE_ID = b"x-guard-response-decision-id"
_SSE = "text/event-stream"
#: The end of a server-sent event: two line ends (CRLF, LF or CR; a CR at the end of the text counts as one).
_EVENT_END = re.compile(r"(?:\r\n|\r(?!\n)|\n){2}")
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class StreamStopped(OSError):
    """Raised to the application's ``send`` to cut a response that was already started off (a chunked stream
    blocked mid-way): like a client that left, so Starlette's responses and the proxy stop streaming. After a block
    that completed the response (JSON, or an SSE error event) later messages are dropped instead."""


#: ASGI extensions that send a response body the server reads itself (a file path, a file descriptor): a watched
#: response's scope does not offer them (:func:`watched_scope`), and an app that sends one anyway is refused.
_UNREADABLE_SENDS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})
#: The ASGI extension and message of response trailers (headers after the body, which no policy reads): a watched
#: response's scope does not offer it, and trailers an app sends anyway are dropped, never passed on unjudged.
_TRAILERS = "http.response.trailers"
#: Request headers that ask for part of a response (RFC 9110 14.2, 13.1.5): a watched request goes on without them.
_RANGE_HEADERS = frozenset({b"range", b"if-range"})
#: A partial response's media type (RFC 9110 14.6): several ranges of the body, each with its own head.
_BYTERANGES = "multipart/byteranges"


def watched_scope(scope: Scope) -> Scope:
    """``scope`` as the application (or the proxy's upstream) gets it for a request whose response a policy judges:
    without the extensions whose body guard cannot read (so Starlette's ``FileResponse`` sends body messages) or whose
    trailers no policy reads, and without ``Range`` and ``If-Range``, so the answer is the whole body (200): a range is a piece no rule sees whole
    (the ``SECRE`` and ``T-PLAN`` of two requests), and a 206 that comes anyway is refused."""
    extensions = scope.get("extensions") or {}
    if any(name in extensions for name in (*_UNREADABLE_SENDS, _TRAILERS)):
        scope = {**scope, "extensions": {k: v for k, v in extensions.items()
                                         if k not in _UNREADABLE_SENDS and k != _TRAILERS}}
    headers = scope["headers"]
    if any(name.lower() in _RANGE_HEADERS for name, _ in headers):
        scope = {**scope, "headers": [(k, v) for k, v in headers if k.lower() not in _RANGE_HEADERS]}
    return scope


#: Bytes at the start of a streamed HTML or XML response searched for the charset it names (the HTML prescan's).
_SNIFF_BYTES = 1024


def _stream_charset_problem(content_type: str) -> str | None:
    """Why a streamed response's declared charset cannot be judged (``None`` for UTF-8, US-ASCII or none)."""
    try:
        charset(parse_params(content_type)[1])
    except BodyError as exc:
        return exc.reason
    return None


#: Headers that say how a response's body is read: sent more than once, they have no one reading (the copies joined
#: name no media type), so a response a policy could watch that repeats one is refused.
_FRAMING = ("content-type", "content-length", "content-encoding")


def _headers(raw: list[tuple[bytes, bytes]]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The headers (repeated ones joined with ``", "``), and the copies of each :data:`_FRAMING` header sent more than
    once."""
    out: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    for k, v in raw:
        name, value = k.decode("latin-1").lower(), v.decode("latin-1")
        if name in out:
            if name in _FRAMING:
                repeated.setdefault(name, [out[name]]).append(value)
            out[name] = f"{out[name]}, {value}"
        else:
            out[name] = value
    return out, repeated


def _media_of(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


class ResponseJudge:
    """``send`` for one request's response: judged by every watching policy it matches (see the module doc). Give
    it to the application and await the application's call through :meth:`run`.

    Args:
        guard: the engine. request: the request's head subject. watching: the response policies that watch it.
        send: the next ``send``. limits: read limits and the stream window. metrics: counters.
        headers: added to the application's ``http.response.start`` (the request's decision headers).
        cache_scope: the request's cache scope (its tenant; ``Guard.aevaluate(cache_scope=...)``), or ``None``.
        views: policy id to the view of the request a watching policy matched where it is not ``request``
            (:attr:`~guard.policy.loader.ViewMatch.views`): that policy judges the response with that path.
    """

    def __init__(
        self, guard: Guard, request: HttpSubject, watching: tuple[Policy, ...], send: Send, limits: BodyLimits,
        metrics: HttpMetrics, headers: HeaderList = (), *, cache_scope: str | None = None,
        views: Mapping[str, HttpSubject] | None = None,
    ) -> None:
        self.guard, self.request, self.watching, self.send = guard, request, watching, send
        self.cache_scope = cache_scope
        self.views = views or {}
        self.limits, self.metrics, self.extra = limits, metrics, headers
        self.mode = "start"  # start -> pass | whole | stream -> done
        self.policies: tuple[Policy, ...] = ()
        self.policy: Policy | None = None
        self.head: HttpSubject | None = None
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.sse = False
        self.started = False  # http.response.start was sent on
        self.held = ""  # stream: received, not yet sent
        self.held_bytes = 0
        self.judge_at = 0  # held bytes the next window waits for, after one that could send nothing (doubles)
        self.tail = ""  # stream: the end of what was sent, judged again with the next window
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.deltas: DeltaJoiner | None = None  # stream of events: their pieces joined as the client joins them
        self.lines = False  # stream: one JSON document per line (sent on up to the last line end)
        self.framed = False  # stream: JSON Lines or JSON, sent on up to the last complete line or array element
        self.sent_chars = 0  # stream: characters of the decoded stream sent on
        self.arrivals: list[tuple[int, float]] = []  # stream: (offset, loop time) where each unsent chunk began
        self.received_chars = 0  # stream: characters of the decoded stream received
        # stream: the first bytes of HTML or XML, where a <meta charset> or an XML declaration names the charset a
        # client decodes it with (the stream is read as UTF-8), and the check that refuses one naming another
        self.prefix = b""
        self.sniff: Callable[..., None] | None = None
        self.escapes = False  # stream: every chunk is checked for an ESC byte (charset_guessed, check_html_escapes)
        self.lock = asyncio.Lock()  # stream: one judgement at a time, the application's send or the flusher's
        self.due: float | None = None  # stream: loop time by which what is held gets judged (None: all judged)
        self.hold_due: float | None = None  # stream: loop time when the first event the hold keeps back may go
        self.pending = asyncio.Event()  # set while ``due`` or ``hold_due`` is
        self.rearmed = asyncio.Event()  # set when a deadline moves earlier: the flusher may wait for a later one
        self.app: asyncio.Future[None] | None = None
        self.flusher: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None  # what ended the flusher (a cut-off, a client gone, a bug)

    async def run(self, response: Awaitable[None]) -> None:
        """Await the application's call (``app(scope, receive, judge)``, possibly wrapped) next to the flusher of a
        streamed response; cancelled when a flush blocks the stream or cannot send. Re-raises what broke the flusher
        unless it was the client's connection (an ``OSError``: the cut-off itself, or a client that left)."""
        self.app = asyncio.ensure_future(response)
        try:
            await self.app
        except asyncio.CancelledError:
            if self.failure is None:  # not ours: the request itself is cancelled
                raise
        finally:
            if self.flusher is not None:
                self.flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.flusher
        if self.failure is not None and not isinstance(self.failure, OSError):
            raise self.failure

    @property
    def answered(self) -> bool:
        """Whether the client has its whole answer: the response's end, or the judge's own (a block, a refusal);
        what the application sends from then on is dropped. A proxy relaying an upstream stream stops reading it
        then, as when the client left."""
        return self.mode == "done"

    async def __call__(self, message: Message) -> None:
        mode = self.mode
        if mode == "pass":
            # a judged response passed on as sent (a binary stream judged on its head) announced no trailers
            if self.policy is None or message["type"] != _TRAILERS:
                await self.send(message)
        elif mode == "done":  # the client has its whole answer (or its block): the rest is dropped
            return
        elif message["type"] == "http.response.start":
            await self._start(message)
        elif message["type"] in _UNREADABLE_SENDS:  # a file the server sends itself: guard never sees its bytes
            self.mode = "done"
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"a {message['type']} response cannot be "
                                         "judged; send the body as http.response.body messages"))
        elif message["type"] == _TRAILERS:  # not judged: dropped (the start sent on announces none)
            return
        elif message["type"] != "http.response.body":
            await self.send(message)
        elif mode == "whole":
            await self._whole(message)
        else:
            async with self.lock:
                if self.mode == "stream":  # the flusher may have ended it meanwhile
                    await self._stream(message)

    async def _start(self, message: Message) -> None:
        if self.extra:
            message = {**message, "headers": [*message.get("headers", ()), *self.extra]}
        headers, repeated = _headers(message.get("headers", []))
        media = _media_of(headers.get("content-type", ""))
        head = self.request.with_body(None, "", phase="response", status=message["status"], headers=headers,
                                      content_type=media, query=self.request.query,
                                      repeated_headers=())  # the upstream's repeated headers are read joined
        if repeated:
            await self._refuse_repeated(message, head, repeated)
            return
        if head.status == 206 or media == _BYTERANGES:
            await self._refuse_partial(message, head)
            return
        self.policies = tuple(p for p in self.watching if p.matches(head))  # every one decides (docs/policies.md)
        self.policy = self.policies[0] if self.policies else None  # records a response that cannot be judged
        if self.policy is None:
            self.mode = "pass"
            await self.send(message)
            return
        if message.get("trailers"):  # trailers are dropped (no policy reads them): the server is not to wait for any
            message = {k: v for k, v in message.items() if k != "trailers"}
        self.head, self.start = head, message
        self.sse = media == _SSE
        textual = self.sse or not media or is_textual(media)
        if "content-length" in headers and not self.sse:
            self.mode = "whole"
        elif "content-encoding" in headers:
            self.mode = "done"
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, "a compressed streamed response cannot be "
                                         "judged; serve it uncompressed", field="content-encoding"))
        elif not textual and self.limits.opaque_media != "metadata":
            self.mode = "done"  # as a whole body of this media type is: read as UTF-8 text it would pass unread
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"a streamed {media} response cannot be "
                                         "judged; serve text or JSON, or set opaque_media='metadata'",
                                         field="content-type"))
        elif not textual:  # opaque_media="metadata": judged on its head, as a whole body is, then sent byte for byte
            verdict = await self._judge(head)
            if _stops(verdict):
                self.mode = "done"
                await self._block(verdict)
            else:
                self.mode = "pass"
                await self._send_start(verdict)
        elif (unreadable := _stream_charset_problem(headers.get("content-type", ""))) is not None:
            self.mode = "done"  # the stream is read as UTF-8: text in another charset would pass unread
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"the response cannot be judged: {unreadable}",
                                         field="content-type"))
        else:
            self.mode = "stream"
            # what is sent is the judged text (masked, re-encoded): an SSE body's Content-Length no longer holds
            self.start = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                 if k.lower() != b"content-length"]}
            data_stream = AI_DATA_STREAM_HEADER in headers and not self.sse
            self.lines = media in JSON_LINES or data_stream
            self.deltas = joiner_for(media, context_chars=self.limits.stream_overlap_bytes,
                                     max_event_chars=self.limits.max_response_bytes, data_stream=data_stream)
            self.framed = self.deltas is not None
            if self.deltas is None:  # text, HTML, XML, untyped: read as SSE too, as a client's SSE parser reads it
                self.deltas = _joiner(media, self.limits)
            params = parse_params(headers.get("content-type", ""))[1]
            if is_xml(media):  # a declaration is read once its closing quote came: partial changes nothing
                self.sniff = lambda prefix, partial: check_xml_encoding(prefix)
            elif media == "text/html" and "charset" not in params:
                self.sniff = check_html_charset  # a declared charset overrides <meta>, as in browsers
            self.escapes = charset_guessed(media, params)
            if self.limits.stream_flush_s is not None and self.app is not None:
                self.flusher = asyncio.ensure_future(self._flush())

    async def _refuse_repeated(self, message: Message, head: HttpSubject, repeated: dict[str, list[str]]) -> None:
        """Refuse (502) a response that repeats a :data:`_FRAMING` header when a watching policy accepts it under
        any reading of the copies (each alone, or joined); else send it on untouched, as any response no policy
        watches."""
        readings = [head]
        for name, copies in repeated.items():
            for value in copies:
                headers = {**head.headers, name: value}
                media = _media_of(value) if name == "content-type" else head.content_type
                readings.append(dataclasses.replace(head, headers=headers, content_type=media))
        policies = tuple(p for p in self.watching if any(p.matches(reading) for reading in readings))
        if not policies:
            self.mode = "pass"
            await self.send(message)
            return
        self.mode, self.policies, self.policy, self.head, self.start = "done", policies, policies[0], head, message
        names = " and ".join(repeated)
        await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"the response repeats {names}; a response sent "
                                     "with more than one cannot be judged", field=next(iter(repeated))))

    async def _refuse_partial(self, message: Message, head: HttpSubject) -> None:
        """Refuse (502) a part of a response (a 206, or ``multipart/byteranges``), which comes only from an
        application that answers a range though the request went on without ``Range`` (:func:`watched_scope`): every
        watching policy would judge a piece of the body, none of them the whole. Recorded under the first policy
        that accepts the response read as a whole 200, else the first watching one."""
        whole = dataclasses.replace(head, status=200)
        policies = tuple(p for p in self.watching if p.matches(whole)) or self.watching
        self.mode, self.policies, self.policy, self.head, self.start = "done", policies, policies[0], head, message
        await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, "the response is a part of its body (206 Partial "
                                     "Content or multipart/byteranges), which cannot be judged whole; serve the "
                                     "whole body", field="status" if head.status == 206 else "content-type"))

    # Whole bodies ----------------------------------------------------------------------------------------------

    async def _whole(self, message: Message) -> None:
        chunk = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self.limits.max_response_bytes:
            self.mode = "done"
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"the response has more than "
                                         f"{self.limits.max_response_bytes} bytes, the response inspection limit"))
            return
        self.chunks.append(chunk)
        if message.get("more_body", False):
            return
        self.mode = "done"
        assert self.head is not None and self.start is not None
        body, headers = b"".join(self.chunks), self.head.headers
        try:
            encoding = headers.get("content-encoding")
            codings = parse_encodings(encoding, self.limits.max_encodings) if encoding else None
            decoded = decode_content(body, codings, self.limits.max_decoded_bytes) if codings else body
            value, text = parse_body(decoded, headers.get("content-type", ""), self.limits)
        except BodyError as exc:
            await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"the response cannot be judged: {exc.reason}",
                                         field=exc.field))
            return
        joiner = _whole_joiner(self.head.content_type, decoded, self.limits,
                               data_stream=AI_DATA_STREAM_HEADER in headers)
        joined: tuple[tuple[str, ...], ...] = ()
        if joiner is not None:  # a stream sent whole (JSON Lines, a JSON array of events, SSE): joined as streamed
            joiner.feed(decoded.decode("utf-8", "replace"), final=True)
            if joiner.overflow is not None:
                await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, f"the response cannot be judged: "
                                             f"{joiner.overflow}"))
                return
            joined = joiner.readings()
            text = "\n".join([text, *("".join(p) for p in joined)])
        verdict = await self._judge(self.head.with_body(value, text, deltas=joined))
        if _stops(verdict):
            await self._block(verdict)
            return
        start_headers = list(self.start.get("headers", []))
        if verdict.action == "redact" and verdict.redactions:
            try:
                body = encode_body(apply_redactions(value, verdict.redactions), headers.get("content-type", ""),
                                   decoded)
            except BodyError as exc:
                await self._refuse(BodyError(502, exc.code, exc.reason, field=exc.field))
                return
            drop = (b"content-length", b"content-encoding")
            start_headers = [(k, v) for k, v in start_headers if k.lower() not in drop]
            start_headers.append((b"content-length", str(len(body)).encode()))
        start_headers.append((_RESPONSE_ID, verdict.decision_id.encode("latin-1", "replace")))
        await self.send({**self.start, "headers": start_headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    # Streams ---------------------------------------------------------------------------------------------------

    async def _stream(self, message: Message) -> None:
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if b"\x00" in chunk or (not self.held_bytes and not self.tail and chunk.startswith(_UTF16_BOMS)):
            # text in UTF-16 or UTF-32 (json.loads reads them by their zero bytes or byte-order mark): read as UTF-8
            # it would pass unjudged, as a whole body in them is refused
            await self._give_up("the streamed response is not UTF-8 text (it holds NUL bytes or a UTF-16 byte-order "
                                "mark); it cannot be judged", "a streamed response that is not UTF-8 cannot be judged")
            return
        if (self.sniff is not None or self.escapes) and chunk:
            try:
                if self.sniff is not None and len(self.prefix) < _SNIFF_BYTES:
                    self.prefix += chunk[: _SNIFF_BYTES - len(self.prefix)]
                    self.sniff(self.prefix, partial=len(self.prefix) < _SNIFF_BYTES and more)
                if self.escapes:
                    check_html_escapes(chunk)
            except BodyError as exc:
                await self._give_up(f"the response cannot be judged: {exc.reason}",
                                    "a streamed response read in a charset other than UTF-8 cannot be judged")
                return
        if chunk:
            decoded = self.decoder.decode(chunk)
            self.arrivals.append((self.received_chars, asyncio.get_running_loop().time()))
            self.received_chars += len(decoded)
            self.held += decoded
            self.held_bytes += len(chunk)
            if self.deltas is not None:
                self.deltas.feed(decoded)
                if self.deltas.overflow is not None:
                    await self._give_up(f"the response cannot be judged: {self.deltas.overflow}",
                                        "a streamed response whose events guard cannot follow cannot be judged")
                    return
            if self.due is None and self.flusher is not None and self.limits.stream_flush_s is not None:
                self.due = asyncio.get_running_loop().time() + self.limits.stream_flush_s
                self.pending.set()
                self.rearmed.set()
        if not more:
            decoded = self.decoder.decode(b"", final=True)
            self.held += decoded
            if self.deltas is not None:
                self.deltas.feed(decoded, final=True)
                if self.deltas.overflow is not None:
                    await self._give_up(f"the response cannot be judged: {self.deltas.overflow}",
                                        "a streamed response whose events guard cannot follow cannot be judged")
                    return
        if self.held_bytes >= max(self.limits.stream_window_bytes, self.judge_at) or not more:
            await self._window(final=not more)

    async def _flush(self) -> None:
        """The flusher: whenever bytes have waited ``stream_flush_s`` unjudged, judge the held text as it stands. A
        block ends the application's call (it has nothing more to send), as does a failed send; what ended it is
        kept in :attr:`failure` for :meth:`run`."""
        loop = asyncio.get_running_loop()
        try:
            while self.mode == "stream":
                await self.pending.wait()
                deadlines = [t for t in (self.due, self.hold_due) if t is not None]
                wait = min(deadlines, default=0.0) - loop.time()
                if wait > 0:
                    self.rearmed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.rearmed.wait(), wait)
                    continue  # a window judged meanwhile, or a new deadline, moves the deadlines
                async with self.lock:
                    if self.mode == "stream" and deadlines and loop.time() >= min(deadlines):
                        await self._window(final=False)
                        if self.mode == "done":  # blocked: the client has its block, the rest is not read
                            raise StreamStopped("the response was blocked by policy")
                    elif self.due is None and self.hold_due is None:
                        self.pending.clear()
        except Exception as exc:  # noqa: BLE001 - handed to run(), which re-raises what is not a connection error
            self.failure = exc
            self.mode = "done"
            if self.app is not None:
                self.app.cancel()

    async def _window(self, *, final: bool) -> None:
        """Judge the tail already sent plus what is held; send on what may go."""
        assert self.head is not None
        self.due = None  # everything held is judged now
        self.hold_due = None
        self.pending.clear()
        context, text = len(self.tail), self.tail + self.held
        joined = self.deltas.readings() if self.deltas is not None else ()
        verdict = await self._judge(_window_subject(self.head, text, joined))
        if _stops(verdict):
            self.mode = "done"
            await self._stop(verdict)
            return
        hold = None if final else self._hold_from()
        free = len(text) if final else self._boundary(text, context)
        end = self._before_hold(context, free, hold)
        if end < free:  # the hold keeps events back
            assert hold is not None
            self._time_hold(hold)
        spans = verdict.redactions if verdict.action == "redact" else ()
        cut = next((r for r in spans if r.start < end < r.end), None) if not final else None
        while cut is not None:  # a span reaches past what may go now: send up to before it, wait for the rest
            if self.sse:
                end = self._before_hold(context, self._boundary(text[: cut.start], context), hold)
            else:
                end = cut.start
            cut = next((r for r in spans if r.start < end < r.end), None)
        if end <= context and not final:
            # nothing may go yet (an event longer than the window): judge again once the held text has doubled, so
            # an event of n bytes costs O(n) to judge, not one judgement of all of it per chunk
            self.judge_at = min(2 * self.held_bytes, self.limits.max_response_bytes + 1)
            if self.held_bytes > self.limits.max_response_bytes:
                await self._give_up("a streamed event is longer than the response inspection limit",
                                    "a streamed event is too large to judge")
            return
        piece = [r for r in spans if r.end > context and r.start < end]
        out = text[context:end]
        if piece:
            shifted = tuple(dataclasses.replace(r, start=max(r.start, context) - context, end=r.end - context)
                        for r in piece)
            out = apply_redactions(out, shifted)
        await self._send_start(verdict)
        await self.send({"type": "http.response.body", "body": out.encode("utf-8"), "more_body": not final})
        sent = text[:end]
        self.sent_chars += end - context
        if self.deltas is not None:
            self.deltas.mark(self.sent_chars)
        # the chunks wholly sent are forgotten; the one the unsent text begins in is kept
        del self.arrivals[:max(bisect.bisect_right(self.arrivals, (self.sent_chars, math.inf)) - 1, 0)]
        self.tail = sent[max(len(sent) - self.limits.stream_overlap_bytes, 0):]  # none with an overlap of 0
        self.held = text[end:]
        self.held_bytes = len(self.held.encode("utf-8"))
        # the next full window waits for half a window of new bytes, or as many as are held if that is more: events
        # the hold keeps back (large ones, such as logprobs) are not judged again for every small event after them
        self.judge_at = self.held_bytes + max(self.limits.stream_window_bytes // 2, self.held_bytes)
        if final:
            self.mode = "done"

    async def _give_up(self, reason: str, cut: str) -> None:
        """End a stream that cannot be judged: a 502 ``response_uninspectable`` (``reason``) when nothing was sent
        yet, else the connection is cut (:class:`StreamStopped` with ``cut``)."""
        self.mode = "done"
        await self._refuse(BodyError(502, RESPONSE_UNINSPECTABLE, reason))
        if self.started:
            raise StreamStopped(cut)

    def _hold_from(self) -> int | None:
        """The offset from which events wait for what follows them (:meth:`DeltaJoiner.hold_from`), leaving out the
        events that began to arrive ``stream_hold_s`` ago or earlier: they go now."""
        if self.deltas is None or not self.limits.stream_hold_chars:
            return None
        since = asyncio.get_running_loop().time() - self.limits.stream_hold_s
        fresh = next((at for at, time in self.arrivals if time > since), None)
        return None if fresh is None else self.deltas.hold_from(self.limits.stream_hold_chars, after=fresh)

    def _time_hold(self, hold: int) -> None:
        """Wake the flusher when the first event kept back from ``hold`` on has waited ``stream_hold_s``."""
        if self.flusher is None:
            return
        arrived = next(time for at, time in reversed(self.arrivals) if at <= hold)
        self.hold_due = arrived + self.limits.stream_hold_s
        self.pending.set()
        self.rearmed.set()

    def _boundary(self, text: str, context: int) -> int:
        """Where the text that may be sent now ends: SSE after the last complete event; JSON Lines and JSON after
        the last complete line or array element (:attr:`DeltaJoiner.complete_to`; never into an array element still
        arriving); else all but the overlap (kept back so a span that continues in the next chunk is masked whole;
        JSON Lines with no complete line in a full window, too)."""
        if self.sse:
            return max((m.end() for m in _EVENT_END.finditer(text, context)), default=context)
        read = context
        if self.framed and self.deltas is not None:  # JSON Lines and JSON: the last complete line or array element, else line
            read = max(self.deltas.complete_to - self.sent_chars + context, text.rfind("\n") + 1,
                       text.rfind("\r") + 1)
            if (open_from := self.deltas.open_from) is not None:  # never part of an array element still arriving
                read = min(read, max(open_from - self.sent_chars + context, context))
        if read > context:
            return min(read, len(text))
        if self.lines and len(text) - context < self.limits.stream_window_bytes:  # the line is still arriving
            return context
        return max(len(text) - self.limits.stream_overlap_bytes, context)

    def _before_hold(self, context: int, end: int, hold: int | None) -> int:
        """``end`` (in a text starting ``context`` characters before what was sent ends), not past ``hold``, where
        the events start that wait for what follows them (:meth:`_hold_from`), unless more than
        ``max_response_bytes`` are held. The hold is bounded by the characters of the joined text and
        ``stream_hold_s``, not by the window: events with large data beside their text (logprobs, ``n`` answers
        interleaved) keep more than a window back."""
        if hold is None or self.held_bytes > self.limits.max_response_bytes:
            return end
        return min(end, max(hold - self.sent_chars + context, context))

    async def _send_start(self, verdict: Verdict) -> None:
        if self.started:
            return
        self.started = True
        assert self.start is not None
        headers = [*self.start.get("headers", []), (_RESPONSE_ID, verdict.decision_id.encode("latin-1", "replace"))]
        await self.send({**self.start, "headers": headers})

    async def _stop(self, verdict: Verdict) -> None:
        """A blocked stream: a JSON block when nothing was sent; else SSE ``error`` and ``guard_blocked`` events and
        the end, or (not SSE) an abort."""
        if not self.started:
            await self._block(verdict)
            return
        if not self.sse:
            logger.info("response of %s %r blocked mid-stream (policy %s); cutting the connection",
                        self.request.method, self.request.path, verdict.policy_id)
            raise StreamStopped("the response was blocked by policy mid-stream")
        # an ``error`` event (Anthropic's SDKs raise only on that name, OpenAI's on data with an ``error``), then
        # guard's own event; both carry the block with an ``error`` object of the shape both SDKs read
        payload = {"type": "error", **_block_payload(verdict)}
        payload["error"] = {"type": RESPONSE_BLOCKED, "message": payload["message"], "code": RESPONSE_BLOCKED}
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        events = f"event: error\ndata: {data}\n\nevent: {SSE_BLOCK_EVENT}\ndata: {data}\n\n".encode()
        await self.send({"type": "http.response.body", "body": events, "more_body": False})

    # Verdicts --------------------------------------------------------------------------------------------------

    async def _judge(self, subject: HttpSubject) -> Verdict:
        verdict = await self.guard.aevaluate(subject, policies=self.policies, cache_scope=self.cache_scope,
                                             views=policy_subjects(subject, self.views))
        self.metrics.count_response(verdict.policy_id or "", verdict.action)
        return verdict

    async def _block(self, verdict: Verdict) -> None:
        status = (verdict.status if verdict.action == "block" else None) or (503 if verdict.fail_mode else 403)
        await send_json(self.send, status, _block_payload(verdict), verdict_headers(verdict))

    async def _refuse(self, exc: BodyError) -> None:
        """A response that cannot be judged: recorded as a verdict, answered 502 (or nothing, once started)."""
        assert self.policy is not None and self.head is not None
        verdict = verdicts.refused(self.policy, decision_id=new_decision_id(), rule=exc.code, status=exc.status,
                                   message=exc.reason, error=exc.code, phase="response")
        self.guard.record(verdict, self.head, policy=self.policy)
        self.metrics.count_response(self.policy.id, "block")
        if not self.started:
            await send_json(self.send, exc.status, {"code": exc.code, "message": exc.reason, "field": exc.field,
                                                    "policy": self.policy.id, "rule": exc.code,
                                                    "decision_id": verdict.decision_id}, verdict_headers(verdict))


def _window_subject(head: HttpSubject, text: str, joined: tuple[tuple[str, ...], ...]) -> HttpSubject:
    """The subject a stream's window ``text`` is judged as: the text as the body; as ``body_text``, the text (for
    HTML or XML followed by what a parser reads from it, as a whole body's: :func:`guard._markup.with_markup_reading`),
    what a client's JSON parser reads from it (decoded) and each of the events' joined texts (``joined``,
    :meth:`DeltaJoiner.joined`, also the subject's ``deltas``)."""
    read = with_markup_reading(text) if is_markup(head.content_type) else text
    judged = "\n".join([read, *judged_strings(json_readings(text, piece=True)), *("".join(p) for p in joined)])
    return head.with_body(text, judged, deltas=joined)


def whole_stream_subject(head: HttpSubject, text: str, limits: BodyLimits) -> HttpSubject:
    """The subject a streamed response that came whole (``text``, of ``head.content_type``) is judged as: one window,
    its events joined as they would be (``guard policy test``'s streamed responses)."""
    joiner = _joiner(head.content_type, limits, data_stream=AI_DATA_STREAM_HEADER in head.headers)
    if joiner is not None:
        joiner.feed(text, final=True)
    return _window_subject(head, text, joiner.readings() if joiner is not None else ())


def _joiner(media: str, limits: BodyLimits, *, data_stream: bool = False) -> DeltaJoiner | None:
    """The joiner of a stream of ``media`` under ``limits`` (:func:`~guard.asgi._deltas.joiner_for`; ``data_stream``:
    the response has the Vercel AI SDK's data stream header); for text of another kind (``text/*``, HTML, XML,
    untyped: not binary), an SSE joiner, as a client's SSE parser reads any body (OpenAI's SDK does not look at the
    Content-Type)."""
    joiner = joiner_for(media, context_chars=limits.stream_overlap_bytes, max_event_chars=limits.max_response_bytes,
                        data_stream=data_stream)
    if joiner is None and (not media or is_textual(media)):
        joiner = DeltaJoiner(sse=True, context_chars=limits.stream_overlap_bytes,
                             max_event_chars=limits.max_response_bytes)
    return joiner


def _whole_joiner(media: str, body: bytes, limits: BodyLimits, *, data_stream: bool) -> DeltaJoiner | None:
    """The joiner a whole body's events are read with, when it holds a stream's: the Vercel AI SDK's data stream
    (``data_stream``: the response has its header), text with SSE ``data:`` lines (a client's SSE parser reads any
    body). ``None`` for JSON and JSON Lines (a list endpoint's or an export's records are no stream's pieces: joined,
    neighbouring values made a card number a redact rule refused), a form or opaque bytes."""
    if data_stream:
        return _joiner(media, limits, data_stream=True)
    if ((not media or is_textual(media)) and not is_json_media(media) and media not in JSON_LINES
            and b"data" in body):
        return _joiner(media, limits)
    return None


def _stops(verdict: Verdict) -> bool:
    """Whether the response may not go: every action but allow and redact stops it (a response policy cannot escalate
    or hand off, the loader refuses both; a verdict that says so anyway is not a reason to send the body on)."""
    return verdict.action not in ("allow", "redact")


def _block_payload(verdict: Verdict) -> dict[str, Any]:
    return {
        "code": RESPONSE_BLOCKED,
        "message": verdict.message or "The response was blocked by policy.",
        "policy": verdict.policy_id,
        "rule": verdict.rule,
        "decision_id": verdict.decision_id,
    }
