"""Limits on what the ASGI middleware reads and parses before it judges a request.

Every limit is enforced on bytes actually seen, never on what a header claims. Defaults are named constants.

Example:
    >>> BodyLimits(max_body_bytes=256 * 1024, duplicate_keys="collect")
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from guard._json import DEFAULT_MAX_DEPTH, DuplicateKeys

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_DECODED_BYTES",
    "DEFAULT_MAX_ENCODINGS",
    "DEFAULT_MAX_FORM_FIELDS",
    "DEFAULT_MAX_JSON_DEPTH",
    "DEFAULT_MAX_MULTIPART_JUNK_BYTES",
    "DEFAULT_MAX_MULTIPART_PARTS",
    "DEFAULT_MAX_PART_HEADER_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_STREAM_FLUSH_S",
    "DEFAULT_STREAM_HOLD_CHARS",
    "DEFAULT_STREAM_HOLD_S",
    "DEFAULT_STREAM_OVERLAP_BYTES",
    "DEFAULT_STREAM_WINDOW_BYTES",
    "BodyLimits",
    "OpaqueMedia",
]

DEFAULT_BODY_TIMEOUT_S = 30.0
"""Seconds a client has to send a judged body."""
DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Most request-body bytes received for inspection (1 MiB); one more byte is a 413."""
DEFAULT_MAX_DECODED_BYTES = 4 << 20
"""Most bytes a ``Content-Encoding`` may decode to (4 MiB); past it the body is a decompression bomb (413)."""
DEFAULT_MAX_ENCODINGS = 2
"""Most stacked content codings (``gzip, br`` is 2)."""
DEFAULT_MAX_JSON_DEPTH = DEFAULT_MAX_DEPTH
"""Deepest JSON nesting accepted (64)."""
DEFAULT_MAX_FORM_FIELDS = 256
"""Most fields in an ``application/x-www-form-urlencoded`` body."""
DEFAULT_MAX_JSON_CONTAINERS = 262_144
"""Most ``[`` and ``{`` in a body read as JSON or for the JSON in it (each may open an array or object guard parses,
as an application could; about 50 ms of parsing): 4 MiB of ``[]`` lines, 4 KB gzipped, took 3.5 s."""
DEFAULT_MAX_MULTIPART_PARTS = 64
"""Most parts in a ``multipart/form-data`` body."""
DEFAULT_MAX_PART_HEADER_BYTES = 8 * 1024
"""Most bytes in one multipart part's header block."""
DEFAULT_MAX_MULTIPART_JUNK_BYTES = 1024
"""Most bytes of multipart preamble (before the first boundary) and of epilogue (after the closing one)."""

DEFAULT_MAX_RESPONSE_BYTES = 1 << 20
"""Most bytes of a whole (not streamed) upstream response a response policy reads (1 MiB); more is a 502."""
DEFAULT_STREAM_WINDOW_BYTES = 4096
"""Most bytes of a streamed response held back before they are judged and sent on (the sliding window)."""
DEFAULT_STREAM_OVERLAP_BYTES = 256
"""Already-sent bytes judged again with the next window, so a span across two windows is seen whole."""
DEFAULT_STREAM_FLUSH_S = 0.2
"""Most seconds a streamed byte is held back waiting for the window to fill; then what is held is judged and sent on."""
DEFAULT_STREAM_HOLD_CHARS = 64
"""Characters at the end of a stream's joined text (an LLM's answer, token by token) held back until more follows."""
DEFAULT_STREAM_HOLD_S = 1.0
"""Most seconds an event the hold keeps back waits, from its arrival, for more to follow; then it is sent on."""

OpaqueMedia = Literal["reject", "metadata"]
"""What to do with a non-empty body of a media type that cannot be read as text (images, octet-stream):
``reject`` answers 415; ``metadata`` judges the request without its body (the body is still replayed)."""


@dataclass(frozen=True)
class BodyLimits:
    """Caps and parsing rules for guarded request bodies.

    Attributes:
        max_body_bytes: most received bytes (wire form, before decoding); 413 above.
        max_decoded_bytes: most bytes after ``Content-Encoding`` decoding; 413 above.
        max_encodings: most stacked content codings; 415 above.
        max_json_depth: deepest JSON nesting; 400 above.
        max_json_containers: most ``[`` and ``{`` characters in a body read as JSON or for the JSON in it (JSON,
            untyped, text and form bodies; counted before any parsing); 413 ``body_too_complex`` above.
        duplicate_keys: ``reject`` (400, the default) or ``collect`` (every value of a repeated key is judged; a
            state pointer that reads one refuses the request, 400 ``state_ambiguous``).
        max_form_fields: most urlencoded fields; 400 above.
        max_multipart_parts: most multipart parts; 400 above.
        max_part_header_bytes: most bytes of one part's header block; 400 above.
        max_multipart_junk_bytes: most preamble bytes and most epilogue bytes; 400 above.
        opaque_media: see :data:`OpaqueMedia`.
        body_timeout_s: most seconds to receive a judged body, from its first read to its last byte; 408
            ``body_timeout`` after (a stalled near-limit body is not held indefinitely).
        max_response_bytes: most bytes of a whole upstream response read for a response policy; 502 above.
        stream_window_bytes: most bytes of a streamed response (SSE, chunked) held back before judging.
        stream_overlap_bytes: bytes judged twice across consecutive windows (0 or more, below
            ``stream_window_bytes``).
        stream_flush_s: seconds after which held-back stream bytes are judged and sent on without waiting for the
            window to fill (a slow token stream); ``None``: only a full window or the end of the stream does.
        stream_hold_chars: characters at the end of a stream's joined text (the pieces an LLM API streams at one
            place of its events, :mod:`guard.asgi._deltas`) whose events wait for what follows before they are
            sent, so a span cut across events (a key streamed token by token) is judged with that many characters of
            itself before any of it leaves; ``0``: events go as soon as they are judged.
        stream_hold_s: most seconds an event the hold keeps back waits, from its arrival, for the text after it (a
            slow model, a stream that pauses, or one of whole messages such as notifications); then it is sent on.
            Needs ``stream_flush_s`` (without it, events wait for a full window or the end of the stream).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
    max_encodings: int = DEFAULT_MAX_ENCODINGS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_json_containers: int = DEFAULT_MAX_JSON_CONTAINERS
    duplicate_keys: DuplicateKeys = "reject"
    max_form_fields: int = DEFAULT_MAX_FORM_FIELDS
    max_multipart_parts: int = DEFAULT_MAX_MULTIPART_PARTS
    max_part_header_bytes: int = DEFAULT_MAX_PART_HEADER_BYTES
    max_multipart_junk_bytes: int = DEFAULT_MAX_MULTIPART_JUNK_BYTES
    opaque_media: OpaqueMedia = "reject"
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    stream_window_bytes: int = DEFAULT_STREAM_WINDOW_BYTES
    stream_overlap_bytes: int = DEFAULT_STREAM_OVERLAP_BYTES
    stream_flush_s: float | None = DEFAULT_STREAM_FLUSH_S
    stream_hold_chars: int = DEFAULT_STREAM_HOLD_CHARS
    stream_hold_s: float = DEFAULT_STREAM_HOLD_S

    def __post_init__(self) -> None:
        if not (isinstance(self.body_timeout_s, (int, float)) and self.body_timeout_s > 0):
            raise ValueError(f"BodyLimits.body_timeout_s is {self.body_timeout_s!r}; it must be positive seconds")
        flush = self.stream_flush_s
        if flush is not None and (isinstance(flush, bool) or not isinstance(flush, (int, float)) or not flush > 0):
            raise ValueError(f"BodyLimits.stream_flush_s is {flush!r}; it must be positive seconds or None")
        wait = self.stream_hold_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise ValueError(f"BodyLimits.stream_hold_s is {wait!r}; it must be positive seconds")
        hold = self.stream_hold_chars
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise ValueError(f"BodyLimits.stream_hold_chars is {hold!r}; it must be a non-negative integer")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("max_") and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"BodyLimits.{f.name} is {value!r}; it must be a positive integer")
        if self.max_decoded_bytes < self.max_body_bytes:
            raise ValueError(
                f"BodyLimits.max_decoded_bytes ({self.max_decoded_bytes}) is below max_body_bytes "
                f"({self.max_body_bytes}); a plain body could never be inspected"
            )
        window, overlap = self.stream_window_bytes, self.stream_overlap_bytes
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"BodyLimits.stream_window_bytes is {window!r}; it must be a positive integer")
        if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
            raise ValueError(f"BodyLimits.stream_overlap_bytes is {overlap!r}; it must be a non-negative integer")
        if self.stream_overlap_bytes >= self.stream_window_bytes:
            raise ValueError(
                f"BodyLimits.stream_overlap_bytes ({self.stream_overlap_bytes}) must be below stream_window_bytes "
                f"({self.stream_window_bytes})"
            )
        if self.duplicate_keys not in ("reject", "collect"):
            raise ValueError(f"BodyLimits.duplicate_keys is {self.duplicate_keys!r}; use 'reject' or 'collect'")
        if self.opaque_media not in ("reject", "metadata"):
            raise ValueError(f"BodyLimits.opaque_media is {self.opaque_media!r}; use 'reject' or 'metadata'")
