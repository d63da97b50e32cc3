"""Method overrides: where a request asks an application to run another method than the one it was sent with.

Frameworks read the real method from several places, each in its own way, and guard must find every one it reads:

* headers (:data:`~guard.asgi._subject.METHOD_OVERRIDE_HEADERS`), also spelt with underscores
  (``X_HTTP_Method_Override``): a WSGI or Django server maps ``-`` and ``_`` to the same ``HTTP_...`` key;
* a ``_method`` query parameter or form field, by its name as frameworks decode and read it: percent-escapes and
  ``+`` decoded, pairs split at ``&`` and ``;`` (older Rack), and a name any framework reads as ``_method``
  (:func:`guard._params.readings`: ``.method`` and `` _method`` for PHP, and so Symfony and Laravel; ``[_method]``
  and ``_method]`` for Rack 2; ``[_method]`` for Express);
* a POST body: a urlencoded form, or a body without a media type (Rack reads it as one), or any multipart body
  (Rack parses ``multipart/mixed`` too; read by guard's strict multipart parser, which refuses a body frameworks
  could read differently), and a JSON object's top-level ``_method`` (Laravel reads a body whose ``Content-Type``
  header holds ``/json`` or ``+json`` as its form fields); a name ends at NUL, as PHP ends it.

Forms and JSON are read leniently (any charset, malformed pairs skipped): what this must not do is miss a field a
framework finds.

Under ``method_override="judge"`` a request is judged as the method its override asks for only where every modelled
framework runs that method (:func:`check_judged`): a POST asking for one of :data:`HONOURED_METHODS`, spelt exactly
(ASCII letters in any case; a header's surrounding spaces and tabs aside, which servers trim). Any other override is
honoured by some frameworks and ignored by others, which then run the method as sent, so it is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from urllib.parse import unquote_to_bytes

from starlette.types import Scope

from guard._params import pairs, readings
from guard.asgi._media import parse_params
from guard.asgi._multipart import parse_multipart
from guard.asgi._parse import check_containers
from guard.asgi._subject import METHOD_OVERRIDE_HEADERS
from guard.asgi.limits import BodyLimits
from guard.errors import BodyError

__all__ = ["HONOURED_METHODS", "body_method", "check_judged", "judged_scope", "may_carry_method", "may_name_method",
           "method_override"]

HONOURED_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH", "LINK", "UNLINK"})
"""The methods every modelled framework runs when a POST's override asks for one: Rails' ``Rack::MethodOverride``
honours exactly these (and ignores any other name), Express's ``method-override`` any method Node knows, Symfony and
Laravel any name of letters."""

_OVERRIDE_HEADERS_IN_ORDER = tuple(sorted(METHOD_OVERRIDE_HEADERS))  # the first one found is the one named
_METHOD = ("_method",)
_MEDIA_END = re.compile(r"[\s;,]")


def _is_method_field(name: str) -> bool:
    """Whether some framework reads a field ``name`` (decoded) as the plain ``_method``."""
    return _METHOD in readings(name).values()


def _named(value: str) -> str:
    """The method an override value names, upper-cased as Rack, Express and Symfony compare it; a value with other
    than ASCII characters is kept as it is (Ruby reads ``lınk`` as ``LINK``, Symfony as no method at all)."""
    return value.upper() if value.isascii() else value


def check_judged(where: str, method: str, sent: str) -> None:
    """Refuse an override that ``judge`` cannot judge as the method it asks for: ``method`` (as :func:`method_override`
    and :func:`body_method` give it, asked for by ``where``) on a request sent as ``sent``. Rack, Symfony, Laravel
    and Express (by default) honour an override only on a POST, and only Symfony runs any name: a name outside
    :data:`HONOURED_METHODS`, or an override on another method, leaves some applications running the method as sent,
    which the policies of ``method`` never judged.

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``where``).
    """
    if sent.upper() != "POST":
        raise BodyError(400, "method_override", f"{where} asks a {sent[:20]} request for another method "
                        f"({method[:20]!r}); frameworks honour an override only on a POST: send the request with "
                        "that method instead", field=where)
    if method not in HONOURED_METHODS:
        raise BodyError(400, "method_override", f"{where} asks for {method[:20]!r}, which some frameworks ignore "
                        f"(they run the POST); send one of {', '.join(sorted(HONOURED_METHODS))}", field=where)


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
    as sent) or a ``_method`` query parameter (``where``: ``_method``), else ``None``. ``method`` is upper-case when
    ASCII, as sent otherwise.

    Raises:
        BodyError: 400 ``method_override`` when the overrides name different methods.
    """
    # an empty or blank one asks for nothing (Rack, Symfony); a header's spaces and tabs are trimmed as servers trim
    # them, a field is read as sent (" DELETE" is no method to Rack)
    found = [(name, _named(headers[name].strip(" \t"))) for name in _OVERRIDE_HEADERS_IN_ORDER
             if name in headers and headers[name].strip()]
    found += [(name, _named(value.strip(" \t"))) for name, value in headers.items()
              if "_" in name and name.replace("_", "-") in METHOD_OVERRIDE_HEADERS and value.strip()]
    query: bytes = scope.get("query_string", b"")
    if b"method" in query or (b"%" in query and b"method" in unquote_to_bytes(query)):
        found += [("_method", _named(value)) for name, value in pairs(query.decode("latin-1"))
                  if value and value.strip() and _is_method_field(name)]
    return _one(found, "request") if found else None


def judged_scope(scope: Scope, headers: dict[str, str], mode: str) -> Scope:
    """The scope a request (or a WebSocket upgrade, sent as a GET) is matched as under the ``method_override`` mode
    ``mode``: as sent, or with the method its head's override asks for (``judge``, :func:`check_judged`); ``headers``
    as :func:`~guard.asgi._subject.header_map` gives them.

    Raises:
        BodyError: 400 ``method_override`` (``field``: where it was asked) for an override under ``refuse``, and
            under ``judge`` for one some frameworks ignore.
    """
    override = method_override(scope, headers) if mode != "ignore" else None
    if override is None:
        return scope
    where, method = override
    if mode == "refuse":
        raise BodyError(400, "method_override", f"{where} asks for another method ({method[:20]!r}); send the "
                        "request with that method instead", field=where)
    check_judged(where, method, scope.get("method", "GET"))
    return {**scope, "method": method}


def _multipart_fields(body: bytes, content_type: str, limits: BodyLimits) -> Iterator[tuple[str, str]]:
    """The ``(name, value)`` of each text part of a multipart body, read by guard's strict parser
    (:func:`~guard.asgi._multipart.parse_multipart`): a body PHP, Rack and guard could split or name differently
    (a repeated ``name`` or ``boundary``, a part without ``Content-Disposition``) is refused, not read leniently.
    Binary file parts are kept as metadata, and a part in a charset or encoding guard does not read (415) ends the
    lookup with no field.

    Raises:
        BodyError: 400: the multipart body or its ``Content-Type`` is malformed or ambiguous.
    """
    try:  # binary file parts are kept as metadata here: an upload is not refused for the lookup's sake
        fields = parse_multipart(body, parse_params(content_type)[1], replace(limits, opaque_media="metadata"))
    except BodyError as exc:
        if exc.status != 400:  # a charset or part encoding guard does not read: no field of it is read either
            return
        raise
    for name, values in fields.items():
        yield from ((name, value) for value in values if isinstance(value, str))


def _json_fields(body: bytes, limits: BodyLimits) -> Iterator[tuple[str, str]]:
    check_containers(body, limits)  # json holds the GIL while it parses
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return
    if isinstance(value, dict) and isinstance(value.get("_method"), str):
        yield "_method", value["_method"]


def _media(content_type: str) -> str:
    """The media type as the most lenient framework ends it: at ``;``, ``,`` (Rack, also after whitespace) or a space
    (PHP)."""
    return _MEDIA_END.split(content_type.strip(), maxsplit=1)[0].lower()


def _is_json(content_type: str) -> bool:
    """Laravel's ``isJson()``: the whole ``Content-Type`` header holds ``/json`` or ``+json``."""
    return "/json" in content_type or "+json" in content_type


def may_carry_method(content_type: str) -> bool:
    """Whether a POST body of this ``Content-Type`` is one a framework reads a ``_method`` field from."""
    media = _media(content_type)
    return (media in ("", "application/x-www-form-urlencoded") or media.startswith("multipart/")
            or _is_json(content_type.lower()))


def may_name_method(body: bytes) -> bool:
    """Whether ``body`` can hold a ``_method`` field: it holds ``method``, or escapes that could spell it (percent
    or JSON ``\\u``). Most bodies do not, and are not parsed for it."""
    return b"method" in body or b"%" in body or b"\\u" in body


def body_method(body: bytes, content_type: str, limits: BodyLimits) -> str | None:
    """The method a POST body's ``_method`` field asks for (upper-case when ASCII, as sent otherwise; see the module
    doc for which bodies and names), ``None`` without one. A body :func:`may_name_method` rules out is not parsed.

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``_method``) when the field names different methods; a
            multipart body guard's parser refuses (:func:`_multipart_fields`); 413 ``body_too_complex`` for a JSON
            body with more ``[`` and ``{`` than ``limits.max_json_containers``.
    """
    if not may_name_method(body):
        return None
    media = _media(content_type)
    if media in ("", "application/x-www-form-urlencoded"):
        fields: Iterator[tuple[str, str | None]] = pairs(body.decode("latin-1"))
    elif media.startswith("multipart/"):
        fields = _multipart_fields(body, content_type, limits)
    elif _is_json(content_type.lower()):
        fields = _json_fields(body, limits)
    else:
        return None
    found = _one([("_method", _named(value)) for name, value in fields
                  if value and value.strip() and _is_method_field(name)], "form")
    return found[1] if found else None
