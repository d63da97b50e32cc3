"""A strict, bounded ``multipart/form-data`` parser for judging form fields (case C07).

The body is already in memory and capped, so the parser works on one ``bytes`` with ``bytes.find`` (linear, in C).
It refuses, at once and with a 400: more than ``max_parts`` parts, a part header block longer than
``max_part_header_bytes`` (or one that never ends), a preamble or epilogue longer than ``max_junk_bytes`` (the
python-multipart advisory input: a megabyte of junk after the closing boundary), a missing closing boundary, a part
without a ``form-data`` name, and text that is not valid in its charset. Field values keep their order.
"""

from __future__ import annotations

import codecs
from typing import Any

from guard.errors import BodyError

__all__ = ["TEXT_FILE_TYPES", "parse_multipart", "parse_params"]

TEXT_FILE_TYPES = ("application/json", "application/xml", "application/x-yaml", "text/")
"""File parts of these media types are read as text and judged; other files are judged by their metadata only."""

_BOUNDARY_CHARS = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ")
_CODE = "malformed_multipart"


def _bad(reason: str, field: str = "body") -> BodyError:
    return BodyError(400, _CODE, reason, field=field)


def parse_params(value: str) -> tuple[str, dict[str, str]]:
    """Split a header value like ``form-data; name="a;b"; filename=x`` into (``form-data``, params).

    Parameter names are lower-cased; quoted values may contain ``;`` and backslash escapes.
    """
    head, _, rest = value.partition(";")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while i < n:
        while i < n and rest[i] in " \t;":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        name = rest[i:eq].strip().lower()
        i = eq + 1
        if i < n and rest[i] == '"':
            i += 1
            chars: list[str] = []
            while i < n and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(rest[i])
                i += 1
            i += 1
            params[name] = "".join(chars)
        else:
            end = rest.find(";", i)
            end = n if end < 0 else end
            params[name] = rest[i:end].strip()
            i = end
    return head.strip().lower(), params


def _text(data: bytes, charset: str, field: str) -> str:
    try:
        return data.decode(codecs.lookup(charset).name)
    except LookupError as exc:
        raise BodyError(415, "unsupported_charset", f"charset {charset[:40]!r} is not known", field=field) from exc
    except UnicodeDecodeError as exc:
        raise _bad(f"the value is not valid {charset} text (byte offset {exc.start})", field) from exc


def _headers(block: bytes) -> dict[str, str]:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad("a part header is not UTF-8") from exc
    out: dict[str, str] = {}
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise _bad(f"a part header line has no name: {line[:60]!r}")
        out[name.strip().lower()] = value.strip()
    return out


def parse_multipart(
    body: bytes, boundary: str, *, max_parts: int, max_part_header_bytes: int, max_junk_bytes: int
) -> dict[str, list[Any]]:
    """Parse a ``multipart/form-data`` body into ``{field: [values]}``.

    Text fields become ``str``. File parts become ``{"filename", "content_type", "size", "text"}`` where ``text`` is
    the decoded content for textual types (:data:`TEXT_FILE_TYPES`) and ``None`` otherwise.

    Raises:
        BodyError: 400 ``malformed_multipart`` for any structural problem or exceeded limit; 415 for an unknown
            charset.
    """
    raw = boundary.encode("latin-1", "replace")
    if not 1 <= len(raw) <= 70 or not set(raw) <= _BOUNDARY_CHARS or raw.endswith(b" "):
        raise _bad(f"the multipart boundary {boundary[:80]!r} is not a valid boundary (1-70 RFC 2046 characters)",
                   "content-type")
    delimiter = b"--" + raw
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise _bad("the body has no opening multipart boundary")
    if start > max_junk_bytes:
        raise _bad(f"the multipart preamble is {start} bytes; at most {max_junk_bytes} are allowed")
    fields: dict[str, list[Any]] = {}
    parts = 0
    pos = start + len(delimiter)
    while True:
        if body[pos : pos + 2] == b"--":
            epilogue = len(body) - (pos + 2)
            if epilogue > max_junk_bytes:
                raise _bad(f"{epilogue} bytes follow the closing multipart boundary; at most {max_junk_bytes} "
                           "are allowed")
            return fields
        while body[pos : pos + 1] in (b" ", b"\t"):
            pos += 1
        if body[pos : pos + 2] != b"\r\n":
            raise _bad("a multipart boundary is not followed by a line break")
        pos += 2
        parts += 1
        if parts > max_parts:
            raise _bad(f"the body has more than {max_parts} multipart parts; at most {max_parts} are allowed")
        if body[pos : pos + 2] == b"\r\n":
            block, content_start = b"", pos + 2
        else:
            end = body.find(b"\r\n\r\n", pos, pos + max_part_header_bytes + 4)
            if end < 0:
                raise _bad(f"a part's header block is longer than {max_part_header_bytes} bytes or never ends")
            block, content_start = body[pos:end], end + 4
        content_end = body.find(b"\r\n" + delimiter, content_start)
        if content_end < 0:
            raise _bad("the body ends without a closing multipart boundary")
        _add_part(fields, _headers(block) if block else {}, body[content_start:content_end])
        pos = content_end + 2 + len(delimiter)


def _add_part(fields: dict[str, list[Any]], headers: dict[str, str], content: bytes) -> None:
    disposition, params = parse_params(headers.get("content-disposition", ""))
    name = params.get("name")
    if disposition != "form-data" or name is None:
        raise _bad("a part has no 'Content-Disposition: form-data; name=...' header")
    media, type_params = parse_params(headers.get("content-type", ""))
    charset = type_params.get("charset", "utf-8")
    where = f"body.{name}"
    if "filename" not in params:
        value: Any = _text(content, charset, where)
    else:
        textual = not media or media.startswith(TEXT_FILE_TYPES)
        value = {
            "filename": params["filename"],
            "content_type": media or None,
            "size": len(content),
            "text": _text(content, charset, where) if textual else None,
        }
    fields.setdefault(name, []).append(value)
