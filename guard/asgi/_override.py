"""Method overrides: where a request asks an application to run another method than the one it was sent with.

Frameworks read the real method from several places, each in its own way, and guard must find every one it reads:

* headers (:data:`~guard.asgi._subject.METHOD_OVERRIDE_HEADERS`), also spelt with underscores
  (``X_HTTP_Method_Override``): a WSGI or Django server maps ``-`` and ``_`` to the same ``HTTP_...`` key;
* a ``_method`` query parameter or form field, by its name as frameworks decode it: percent-escapes and ``+``
  decoded, pairs split at ``&`` and ``;`` (older Rack), leading spaces dropped (Rack splits at ``& *``, PHP trims
  them), and ``.``, `` `` or ``[`` read as ``_`` (PHP, and so Symfony and Laravel: ``.method=DELETE``);
* a POST body: a urlencoded form, or a body without a media type (Rack reads it as one), or any multipart body
  (Rack parses ``multipart/mixed`` too), and a JSON object's top-level ``_method`` (Laravel reads a body whose media
  type contains ``/json`` or ``+json`` as its form fields).

Everything here reads leniently (any charset, malformed parts skipped): what it must not do is miss a field a
framework finds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import unquote_plus, unquote_to_bytes

from starlette.types import Scope

from guard.asgi._subject import METHOD_OVERRIDE_HEADERS
from guard.errors import BodyError

__all__ = ["body_method", "may_carry_method", "may_name_method", "method_override"]

_OVERRIDE_HEADERS_IN_ORDER = tuple(sorted(METHOD_OVERRIDE_HEADERS))  # the first one found is the one named
_METHOD_FIELD = re.compile(r" *[_. \[]method")  # ``_method`` as PHP and Rack read a field's name
_PAIRS = re.compile(r"[&;]")
_PART_NAME = re.compile(r'(?<![\w*])name\s*=\s*(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE)
_FILE_PART = re.compile(r"(?<![\w*])filename\*?\s*=", re.IGNORECASE)
_BOUNDARY = re.compile(r'boundary\s*=\s*"?([^";,\s]+)', re.IGNORECASE)


def _is_method_field(name: str) -> bool:
    return _METHOD_FIELD.fullmatch(name) is not None


def _pairs(text: str) -> Iterator[tuple[str, str]]:
    """The ``name=value`` pairs of a query or urlencoded text, split and decoded as the most lenient framework
    does (bad escapes read as U+FFFD)."""
    for pair in _PAIRS.split(text):
        name, _, value = pair.partition("=")
        yield unquote_plus(name, errors="replace"), unquote_plus(value, errors="replace")


def _one(found: list[tuple[str, str]], what: str) -> tuple[str, str] | None:
    """The first ``(where, method)`` of ``found``.

    Raises:
        BodyError: 400 ``method_override`` when they name different methods (frameworks differ on which one wins).
    """
    if len({method for _, method in found}) > 1:
        raise BodyError(400, "method_override", f"the {what} asks for more than one method ("
                        + ", ".join(f"{where}: {method[:20]!r}" for where, method in found[:4]) + "); send one",
                        field=found[0][0])
    return found[0] if found else None


def method_override(scope: Scope, headers: dict[str, str]) -> tuple[str, str] | None:
    """``(where, method)`` when the request's head asks for another method: an override header (``where``: its name
    as sent) or a ``_method`` query parameter (``where``: ``_method``), else ``None``.

    Raises:
        BodyError: 400 ``method_override`` when the overrides name different methods.
    """
    found = [(name, headers[name].strip().upper()) for name in _OVERRIDE_HEADERS_IN_ORDER
             if name in headers and headers[name].strip()]  # an empty one asks for nothing (Rack, Symfony)
    found += [(name, value.strip().upper()) for name, value in headers.items()
              if "_" in name and name.replace("_", "-") in METHOD_OVERRIDE_HEADERS and value.strip()]
    query: bytes = scope.get("query_string", b"")
    if b"method" in query or (b"%" in query and b"method" in unquote_to_bytes(query)):
        found += [("_method", value.strip().upper()) for name, value in _pairs(query.decode("latin-1"))
                  if _is_method_field(name) and value.strip()]
    return _one(found, "request") if found else None


def _multipart_fields(text: str, boundary: str) -> Iterator[tuple[str, str]]:
    """The ``(name, value)`` of each part of a multipart ``text`` that is not a file, read leniently."""
    for part in text.split("--" + boundary)[1:]:
        head, sep, value = part.partition("\r\n\r\n")
        if not sep:
            head, sep, value = part.partition("\n\n")
        name = _PART_NAME.search(head)
        if sep and name is not None and _FILE_PART.search(head) is None:
            yield name.group(1) if name.group(1) is not None else name.group(2), value.removesuffix("\r\n")


def _json_fields(body: bytes) -> Iterator[tuple[str, str]]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return
    if isinstance(value, dict) and isinstance(value.get("_method"), str):
        yield "_method", value["_method"]


def _media(content_type: str) -> str:
    return content_type.partition(";")[0].partition(",")[0].strip().lower()  # Rack splits a media type at "," too


def _is_json(media: str) -> bool:
    return "/json" in media or "+json" in media  # Laravel's isJson(): application/json, text/json, +json types


def may_carry_method(content_type: str) -> bool:
    """Whether a POST body of this ``Content-Type`` is one a framework reads a ``_method`` field from."""
    media = _media(content_type)
    return media in ("", "application/x-www-form-urlencoded") or media.startswith("multipart/") or _is_json(media)


def may_name_method(body: bytes) -> bool:
    """Whether ``body`` can hold a ``_method`` field: it holds ``method``, or escapes that could spell it (percent
    or JSON ``\\u``). Most bodies do not, and are not parsed for it."""
    return b"method" in body or b"%" in body or b"\\u" in body


def body_method(body: bytes, content_type: str) -> str | None:
    """The method a POST body's ``_method`` field asks for (upper-case; see the module doc for which bodies and
    names), ``None`` without one. A body :func:`may_name_method` rules out is not parsed.

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``_method``) when the field names different methods.
    """
    if not may_name_method(body):
        return None
    media = _media(content_type)
    text = body.decode("latin-1")
    if media in ("", "application/x-www-form-urlencoded"):
        fields: Iterator[tuple[str, str]] = _pairs(text)
    elif media.startswith("multipart/"):
        boundary = _BOUNDARY.search(content_type)
        fields = _multipart_fields(text, boundary.group(1)) if boundary else iter(())
    elif _is_json(media):
        fields = _json_fields(body)
    else:
        return None
    found = _one([("_method", value.strip().upper()) for name, value in fields
                  if _is_method_field(name) and value.strip()], "form")
    return found[1] if found else None
