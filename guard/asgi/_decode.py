"""``Content-Encoding`` decoding with a cap on decoded bytes.

Codings are undone last-applied first (``Content-Encoding: gzip, br`` means gzip was applied, then br). Each layer
stops producing output one byte past ``max_bytes``, so a gzip/deflate/br bomb costs at most the cap in memory and
time and ends in a 413. An unknown coding is a 415; a corrupt or truncated stream is a 400, and so is a gzip header
with a file name, comment or extra field: decoding skips them, while an application that reads the body as received
would read them. For the same reason a request body may not be ``br`` (:data:`REQUEST_ENCODINGS`): a brotli stream's
metadata blocks carry bytes that decoding skips and that cannot be found without decoding the blocks around them.
Nothing undecodable is ever forwarded unjudged.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable

import brotli  # type: ignore[import-untyped]

from guard.errors import BodyError

__all__ = ["REQUEST_ENCODINGS", "SUPPORTED_ENCODINGS", "check_unread_as_sent", "decode_content", "parse_encodings"]

#: Codings decoded (a response's: the client decodes what guard judged, skipping what decoding skips).
SUPPORTED_ENCODINGS = ("br", "deflate", "gzip", "identity", "x-gzip")
#: Codings accepted on a request body, which the application may read as received (Starlette does not undo
#: ``Content-Encoding``): not ``br``, whose metadata blocks (text an application reading the bytes would see, skipped
#: by decoding) cannot be refused the way a gzip header's comment is.
REQUEST_ENCODINGS = ("deflate", "gzip", "identity", "x-gzip")
_FIELD = "content-encoding"


def _bomb(coding: str, limit: int) -> BodyError:
    return BodyError(
        413, "decoded_body_too_large", f"the {coding}-encoded body decodes to more than {limit} bytes, the decoded-size limit; "
        "decoding stopped there", field=_FIELD,
    )


def _corrupt(coding: str, why: str) -> BodyError:
    return BodyError(400, "malformed_encoding", f"the {coding}-encoded body cannot be decoded: {why}", field=_FIELD)


def parse_encodings(header: str, max_layers: int, supported: tuple[str, ...] = SUPPORTED_ENCODINGS) -> list[str]:
    """The codings of a ``Content-Encoding`` value, lower-case, in the order applied, without ``identity``.

    Raises:
        BodyError: 415 for a coding not in ``supported`` (:data:`REQUEST_ENCODINGS` for a request body) or more than
            ``max_layers`` of them.
    """
    if not header:  # the usual case: nothing to undo
        return []
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding == "br" and "br" not in supported:
            raise BodyError(
                415, "unsupported_encoding",
                "Content-Encoding 'br' is not accepted on a request body: a brotli stream can carry bytes that decoding "
                "skips and an application reading the body as received would read; send gzip or deflate",
                field=_FIELD,
            )
        if coding not in supported:
            raise BodyError(
                415, "unsupported_encoding",
                f"Content-Encoding {coding[:40]!r} is not supported; use one of {', '.join(supported)}",
                field=_FIELD,
            )
    if len(codings) > max_layers:
        raise BodyError(
            415, "unsupported_encoding",
            f"Content-Encoding stacks {len(codings)} codings; at most {max_layers} are decoded", field=_FIELD,
        )
    return codings


#: Two word characters in a row: a word or a number, which the few bytes of a tiny compressed body rarely hold
#: (deflate of an empty body is ``03 00``; level-1 zlib of one is ``x\x01\x03\x00...``).
_WORDS = re.compile(r"\w\w")


def check_unread_as_sent(body: bytes, codings: list[str]) -> None:
    """Refuse a request ``body`` sent with ``codings`` whose bytes as received read as text: valid UTF-8 holding a
    word or a number, or a JSON document (``json.loads`` reads UTF-16 and UTF-32 too, found by their zero bytes).
    Starlette, FastAPI and Flask do not undo ``Content-Encoding``: an application reads such a body as sent while
    guard judges it decoded, and a deflate stream can be written to be readable JSON too (``{"...": "<attack>"}``
    that inflates to noise). Real compressed data is not UTF-8 (gzip begins ``1f 8b``); refused besides are now and
    then a deflated body of a dozen bytes or fewer, and deflate at level 0, whose stored blocks carry the text as it is
    (some lengths between 16 and 57 KB give block headers that are valid UTF-8).

    Raises:
        BodyError: 400 ``ambiguous_encoding`` (``field``: ``content-encoding``).
    """
    try:
        readable = _WORDS.search(body.decode("utf-8")) is not None
    except UnicodeDecodeError:
        readable = False
    if not readable:
        try:
            json.loads(body)
        except (ValueError, RecursionError):  # not JSON to the application either (UnicodeDecodeError is a ValueError)
            return
    raise BodyError(
        400, "ambiguous_encoding", f"the body is sent with Content-Encoding {', '.join(codings)[:40]} but its bytes as "
        "sent read as text: an application that does not undo the coding reads that text, not the decoded body "
        "guard would judge; send the body uncompressed", field=_FIELD,
    )


#: gzip header flags (RFC 1952 2.3.1) whose fields decoding skips: FEXTRA, FNAME, FCOMMENT, and the reserved bits.
_SKIPPED_GZIP_FIELDS = 0x04 | 0x08 | 0x10 | 0xE0


def _zlib(data: bytes, limit: int, wbits: int, coding: str) -> bytes:
    out: list[bytes] = []
    total = 0
    while True:  # one iteration per gzip member (RFC 1952 allows several)
        if coding == "gzip" and data[:2] == b"\x1f\x8b" and len(data) >= 4 and data[3] & _SKIPPED_GZIP_FIELDS:
            # their bytes are never judged, but an application that reads the body as received (Starlette does not
            # undo Content-Encoding) parses them: a comment of "&x=..." is a form field to it
            raise _corrupt(coding, "a gzip header carries a file name, comment or extra field (or reserved flags); "
                           "send the body without them")
        d = zlib.decompressobj(wbits)
        try:
            piece = d.decompress(data, limit + 1 - total)
            while True:
                total += len(piece)
                out.append(piece)
                if total > limit:
                    raise _bomb(coding, limit)
                if not d.unconsumed_tail:
                    break
                piece = d.decompress(d.unconsumed_tail, limit + 1 - total)
            piece = d.flush(limit + 1 - total)
        except zlib.error as exc:
            raise _corrupt(coding, str(exc)) from exc
        total += len(piece)
        out.append(piece)
        if total > limit:
            raise _bomb(coding, limit)
        if not d.eof:
            raise _corrupt(coding, "the stream is truncated")
        data = d.unused_data
        if not data or coding == "deflate":
            if data:
                raise _corrupt(coding, f"{len(data)} bytes follow the end of the stream")
            return b"".join(out)


def _gzip(data: bytes, limit: int) -> bytes:
    return _zlib(data, limit, 16 + zlib.MAX_WBITS, "gzip")


def _deflate(data: bytes, limit: int) -> bytes:
    # HTTP "deflate" is the zlib format (RFC 9110 8.4.1.2); some clients send raw deflate, which we accept too.
    if len(data) >= 2 and (data[0] & 0x0F) == 8 and (data[0] << 8 | data[1]) % 31 == 0:
        return _zlib(data, limit, zlib.MAX_WBITS, "deflate")
    return _zlib(data, limit, -zlib.MAX_WBITS, "deflate")


def _brotli(data: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out: list[bytes] = []
    total = 0
    try:
        piece = d.process(data, output_buffer_limit=limit + 1)
        while True:
            total += len(piece)
            out.append(piece)
            if total > limit:
                raise _bomb("br", limit)
            if d.can_accept_more_data():
                break
            piece = d.process(b"", output_buffer_limit=limit + 1 - total)
    except brotli.error as exc:
        raise _corrupt("br", str(exc) or "invalid stream") from exc
    if not d.is_finished():
        raise _corrupt("br", "the stream is truncated")
    return b"".join(out)


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _gzip,
    "x-gzip": _gzip,
    "deflate": _deflate,
    "br": _brotli,
}


def decode_content(body: bytes, codings: list[str], max_bytes: int) -> bytes:
    """Undo ``codings`` (as returned by :func:`parse_encodings`) on ``body``.

    Args:
        body: the received bytes.
        codings: codings in the order they were applied.
        max_bytes: most bytes any layer may decode to.

    Returns:
        The decoded bytes (``body`` itself when there is nothing to undo).

    Raises:
        BodyError: 413 ``decoded_body_too_large`` (bomb), 400 ``malformed_encoding``.
    """
    for coding in reversed(codings):
        if not body:
            break
        body = _DECODERS[coding](body, max_bytes)
    return body
