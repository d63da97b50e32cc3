"""A strict, bounded ``multipart/form-data`` parser for judging form fields (parser differentials).

The body is already in memory and capped, so the parser works on one ``bytes`` with ``bytes.find`` (linear, in C).
The guard must read the fields the application's parser reads (python-multipart, under Starlette and FastAPI; other
parsers behind ``guard proxy``), or refuse the body. Refused at once, with a 400 ``malformed_multipart`` unless said:

* a boundary that is not 1-70 RFC 2046 ``bchars`` (not ending in a space), or whose parameter is ambiguous (a
  backslash, a repeat, ``boundary*=``: see :mod:`guard.asgi._media`);
* 400 ``invalid_content_type``: a part's ``Content-Disposition`` or ``Content-Type`` whose parameters are ambiguous
  in the same ways (``name="a"; x="\\\\"; filename="f"`` has a filename to guard and none to python-multipart);
* a preamble (bytes before the first delimiter) longer than ``max_junk_bytes`` or holding a line that starts with
  ``--``: parsers differ on which delimiter-like line opens the body (python-multipart skips only leading line
  breaks); an epilogue longer than ``max_junk_bytes`` (the python-multipart advisory input);
* more than ``max_parts`` parts; a part header block longer than ``max_part_header_bytes`` or one that never ends;
  a header line that is not ``token: value`` ended by CRLF (a leading space is obsolete line folding, which some
  parsers join and others reject); a repeated part header; a part without ``Content-Disposition: form-data;
  name=...``; a delimiter not followed by ``--`` or by optional spaces and CRLF;
* 415 ``unsupported_encoding``: a ``Content-Transfer-Encoding`` other than ``7bit``, ``8bit`` or ``binary`` (RFC 7578
  4.7 deprecates it; Go's ``mime/multipart`` decodes ``quoted-printable``, most parsers do not);
* 415 ``unsupported_charset``: a charset other than UTF-8 or US-ASCII on the request or on a part (Starlette decodes
  every field with the request's charset and ignores the part's); 400 for text that is not valid in it;
* 415 ``unsupported_media_type``: a binary file part (a filename with a media type that is not text, or with none and
  content that is not UTF-8) under ``opaque_media="reject"``, the default, as for a binary body; under
  ``opaque_media="metadata"`` it is kept as metadata only and not judged.

Field values keep their order.
"""

from __future__ import annotations

import re
from typing import Any

from guard.asgi._media import charset, is_textual, parse_params
from guard.asgi.limits import BodyLimits
from guard.errors import BodyError

__all__ = ["FILE_TEXT", "parse_multipart"]

FILE_TEXT = "text"
"""Key of a file part's decoded text (``None`` for a binary file under ``opaque_media="metadata"``)."""

_BOUNDARY_CHARS = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PLAIN_TRANSFER = frozenset({"7bit", "8bit", "binary"})
_CODE = "malformed_multipart"


def _bad(reason: str, field: str = "body") -> BodyError:
    return BodyError(400, _CODE, reason, field=field)


def _text(data: bytes, codec: str, field: str) -> str:
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        raise _bad(f"the value is not valid {codec} text (byte offset {exc.start})", field) from exc


def _headers(block: bytes) -> dict[str, str]:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad("a part header is not UTF-8") from exc
    out: dict[str, str] = {}
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep or not _HEADER_NAME.fullmatch(name):
            raise _bad(f"a part header line is not 'Name: value': {line[:60]!r}")
        if "\r" in value or "\n" in value:
            raise _bad("a part header line has a line break that is not CRLF")
        key = name.lower()
        if key in out:
            raise _bad(f"a part repeats the {name[:40]!r} header; parsers differ on which one counts")
        out[key] = value.strip(" \t")
    return out


def _boundary(params: dict[str, str]) -> bytes:
    if "boundary" not in params:
        raise _bad("multipart/form-data without a boundary parameter", "content-type")
    raw = params["boundary"].encode("latin-1", "replace")
    if not 1 <= len(raw) <= 70 or not set(raw) <= _BOUNDARY_CHARS or raw.endswith(b" "):
        raise _bad(
            f"the multipart boundary {params['boundary'][:80]!r} is not a valid boundary (1-70 RFC 2046 characters)",
            "content-type",
        )
    return raw


def parse_multipart(body: bytes, params: dict[str, str], limits: BodyLimits) -> dict[str, list[Any]]:
    """Parse a ``multipart/form-data`` body into ``{field: [values]}``.

    Text fields become ``str``. File parts become ``{"filename", "content_type", "size", "text"}``: ``text`` is the
    decoded content for textual types (and untyped UTF-8 files), ``None`` for a binary file kept as metadata.

    Args:
        body: the decoded body bytes.
        params: the request ``Content-Type`` parameters (``boundary``, optional ``charset``).
        limits: ``max_multipart_parts``, ``max_part_header_bytes``, ``max_multipart_junk_bytes``, ``opaque_media``.

    Raises:
        BodyError: 400 ``malformed_multipart`` (structure, limits, invalid text); 415 ``unsupported_charset``,
            ``unsupported_encoding`` or ``unsupported_media_type`` (see the module docstring).
    """
    raw = _boundary(params)
    codec = charset(params)
    delimiter = b"--" + raw
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise _bad("the body has no opening multipart boundary")
    if start > limits.max_multipart_junk_bytes:
        raise _bad(f"the multipart preamble is {start} bytes; at most {limits.max_multipart_junk_bytes} are allowed")
    if start and any(line.startswith(b"--") for line in body[:start].splitlines()):
        raise _bad(
            "the multipart preamble holds a line starting with '--'; parsers differ on which delimiter opens the body"
        )
    fields: dict[str, list[Any]] = {}
    parts = 0
    pos = start + len(delimiter)
    while True:
        if body[pos : pos + 2] == b"--":
            epilogue = len(body) - (pos + 2)
            if epilogue > limits.max_multipart_junk_bytes:
                raise _bad(
                    f"{epilogue} bytes follow the closing multipart boundary; at most "
                    f"{limits.max_multipart_junk_bytes} are allowed"
                )
            return fields
        while body[pos : pos + 1] in (b" ", b"\t"):
            pos += 1
        if body[pos : pos + 2] != b"\r\n":
            raise _bad("a multipart boundary is not followed by a line break")
        pos += 2
        parts += 1
        if parts > limits.max_multipart_parts:
            raise _bad(
                f"the body has more than {limits.max_multipart_parts} multipart parts; at most "
                f"{limits.max_multipart_parts} are allowed"
            )
        if body[pos : pos + 2] == b"\r\n":
            block, content_start = b"", pos + 2
        else:
            end = body.find(b"\r\n\r\n", pos, pos + limits.max_part_header_bytes + 4)
            if end < 0:
                raise _bad(f"a part's header block is longer than {limits.max_part_header_bytes} bytes or never ends")
            block, content_start = body[pos:end], end + 4
        content_end = body.find(b"\r\n" + delimiter, content_start)
        if content_end < 0:
            raise _bad("the body ends without a closing multipart boundary")
        _add_part(fields, _headers(block) if block else {}, body[content_start:content_end], codec, limits)
        pos = content_end + 2 + len(delimiter)


def _add_part(
    fields: dict[str, list[Any]], headers: dict[str, str], content: bytes, codec: str, limits: BodyLimits
) -> None:
    disposition, params = parse_params(headers.get("content-disposition", ""), "body")
    name = params.get("name")
    if disposition != "form-data" or name is None:
        raise _bad("a part has no 'Content-Disposition: form-data; name=...' header")
    where = f"body.{name}"
    transfer = headers.get("content-transfer-encoding", "binary").lower()
    if transfer not in _PLAIN_TRANSFER:
        raise BodyError(
            415,
            "unsupported_encoding",
            f"the part {name[:40]!r} has Content-Transfer-Encoding "
            f"{transfer[:40]!r}; send the content as it is (binary)",
            field=where,
        )
    media, type_params = parse_params(headers.get("content-type", ""), where)
    if charset(type_params, where) == "ascii":
        codec = "ascii"
    if "filename" not in params:
        fields.setdefault(name, []).append(_text(content, codec, where))
        return
    text: str | None = None
    if is_textual(media):
        text = _text(content, codec, where)
    elif not media:
        try:
            text = content.decode(codec)
        except UnicodeDecodeError:
            text = None
    if text is None and limits.opaque_media == "reject":
        raise BodyError(
            415,
            "unsupported_media_type",
            f"the file part {name[:40]!r} is a {media or 'untyped'} "
            "binary that cannot be inspected; send text, or set opaque_media='metadata'",
            field=where,
        )
    fields.setdefault(name, []).append(
        {"filename": params["filename"], "content_type": media or None, "size": len(content), FILE_TEXT: text}
    )
