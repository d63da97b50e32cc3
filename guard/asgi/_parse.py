"""Turning decoded body bytes into the judged value: JSON, forms, multipart, text (cases C04, C06, C07).

``parse_body`` returns ``(value, text)``: the value the policy renders into its state (a JSON value, ``{field:
[values]}`` for forms, a ``str`` for text) and every string in it joined by newlines (``HttpSubject.body_text``).
Anything the application could read differently from the guard is refused: JSON that is not UTF-8, has a duplicate
key (unless ``duplicate_keys="collect"``), nests too deep or holds NaN; form text that is not UTF-8.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from guard._json import loads
from guard.asgi._multipart import parse_multipart, parse_params
from guard.asgi.limits import BodyLimits
from guard.errors import BodyError, InvalidJson

__all__ = ["is_json", "parse_body", "strings"]

_UTF8_NAMES = frozenset({"utf-8", "utf8"})
_TEXTUAL = ("text/", "application/xml", "application/x-yaml", "application/yaml", "application/graphql")


def is_json(media: str) -> bool:
    """``application/json`` and every ``+json`` suffix type (``application/problem+json``)."""
    return media == "application/json" or media.endswith("+json")


def strings(value: Any) -> list[str]:
    """Every string leaf of a parsed body, in document order (object values, not keys; file texts).

    One pass with a stack of iterators (no recursion, so any depth is safe); a flat object is a single loop.
    """
    if isinstance(value, str):
        return [value]
    out: list[str] = []
    if not isinstance(value, dict | list):
        return out
    append = out.append
    stack: list[Iterator[Any]] = [iter(value.values() if isinstance(value, dict) else value)]
    while stack:
        for node in stack[-1]:
            if isinstance(node, str):
                append(node)
            elif isinstance(node, dict):
                stack.append(iter(node.values()))
                break
            elif isinstance(node, list):
                stack.append(iter(node))
                break
        else:
            stack.pop()
    return out


def _charset(params: dict[str, str], default: str) -> str:
    name = params.get("charset", default).strip().lower()
    if name in _UTF8_NAMES:  # the usual case, without a codec registry lookup
        return "utf-8"
    try:
        return codecs.lookup(name).name
    except LookupError as exc:
        raise BodyError(415, "unsupported_charset", f"charset {name[:40]!r} is not known", field="content-type") from exc


def _json(body: bytes, params: dict[str, str], limits: BodyLimits) -> Any:
    if _charset(params, "utf-8") != "utf-8":
        raise BodyError(415, "unsupported_charset", f"JSON must be UTF-8; the body declares charset "
                        f"{params['charset'][:40]!r}", field="content-type")
    try:
        return loads(body, max_depth=limits.max_json_depth, duplicate_keys=limits.duplicate_keys)
    except InvalidJson as exc:
        field = "body" if exc.path == "$" else "body" + exc.path[1:]
        raise BodyError(400, f"invalid_json_{exc.reason}" if exc.reason != "syntax" else "invalid_json", str(exc),
                        field=field) from exc


def _urlencoded(body: bytes, limits: BodyLimits) -> dict[str, list[str]]:
    try:
        text = body.decode("ascii")
        pairs = parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict",
                          max_num_fields=limits.max_form_fields)
    except UnicodeDecodeError as exc:
        raise BodyError(400, "invalid_form", f"the form body is not UTF-8 or not percent-encoded (byte offset "
                        f"{exc.start})") from exc
    except ValueError as exc:
        raise BodyError(400, "invalid_form", f"the form has more than {limits.max_form_fields} fields; at most "
                        f"{limits.max_form_fields} are allowed") from exc
    fields: dict[str, list[str]] = {}
    for name, value in pairs:
        fields.setdefault(name, []).append(value)
    return fields


def _text(body: bytes, params: dict[str, str]) -> str:
    charset = _charset(params, "utf-8")
    try:
        return body.decode(charset)
    except UnicodeDecodeError as exc:
        raise BodyError(400, "invalid_text", f"the body is not valid {charset} text (byte offset {exc.start})") from exc


def parse_body(body: bytes, content_type: str, limits: BodyLimits) -> tuple[Any, str]:
    """Parse decoded ``body`` by its ``Content-Type``.

    Returns:
        ``(value, text)``; ``(None, "")`` for an empty body or an opaque one under ``opaque_media="metadata"``.

    Raises:
        BodyError: 400 malformed (JSON, form, multipart, text), 415 unsupported media type or charset.
    """
    if not body:
        return None, ""
    media, params = parse_params(content_type) if ";" in content_type else (content_type.strip().lower(), {})
    value: Any
    if is_json(media):
        value = _json(body, params, limits)
    elif media == "application/x-www-form-urlencoded":
        value = _urlencoded(body, limits)
    elif media == "multipart/form-data":
        if "boundary" not in params:
            raise BodyError(400, "malformed_multipart", "multipart/form-data without a boundary parameter",
                            field="content-type")
        value = parse_multipart(
            body, params["boundary"], max_parts=limits.max_multipart_parts,
            max_part_header_bytes=limits.max_part_header_bytes, max_junk_bytes=limits.max_multipart_junk_bytes,
        )
    elif media.startswith(_TEXTUAL) or (not media and _is_utf8(body)):
        value = _text(body, params)
    elif limits.opaque_media == "metadata":
        return None, ""
    else:
        raise BodyError(415, "unsupported_media_type", f"a {media or 'untyped'} body cannot be inspected; send JSON, "
                        "a form or text, or set opaque_media='metadata'", field="content-type")
    if isinstance(value, str):
        return value, value
    return value, "\n".join(strings(value))


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
