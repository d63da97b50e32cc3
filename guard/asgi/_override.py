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

A field is found wherever some framework reads it into ``_method``: as the field itself, as a list of it (Express's
``qs`` reads ``_method[]`` and ``_method[0]`` as one, and ``method-override`` runs its first item; so a JSON
``_method`` list) or as a key below it. Under ``refuse`` each such field that asks for a method is refused.

Under ``method_override="judge"`` a request is judged as the method its override asks for only where every modelled
framework runs that method (:func:`check_judged`): a POST asking for one of :data:`HONOURED_METHODS`, spelt exactly
(ASCII letters in any case; a header's surrounding spaces and tabs aside, which servers trim). Any other override is
honoured by some frameworks and ignored by others, which then run the method as sent, so it is refused. So is a
``_method`` field where frameworks would read different methods (:func:`_check_copies`): one spelt other than
``_method`` (``.method`` is ``_method`` to PHP only, ``_method[]`` a list to Express, a string to none), one sent more
than once (Rails reads the last copy, Express the first) unless every copy names the same method, and a blank or
valueless body field beside another override (Rails reads the blank field and runs the POST; Express and Symfony
run what the other override asks for).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

from starlette.types import Scope

from guard._params import FRAMEWORKS, pairs, readings
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
_PLAIN = dict.fromkeys(FRAMEWORKS, _METHOD)  # the readings of the name "_method" itself
_MEDIA_END = re.compile(r"[\s;,]")


class _Copy(NamedTuple):
    """A field some framework reads into ``_method``: its ``name`` as sent (decoded), its ``value`` (``""`` for a
    name without ``=``; a JSON list's first item), and whether every modelled framework reads it as the plain
    ``_method`` string (``plain``)."""

    name: str
    value: str
    plain: bool

    @property
    def asks(self) -> bool:
        """Whether the copy names a method: a value that is not blank."""
        return bool(self.value.strip())


def _form_copies(fields: Iterable[tuple[str, str | None]]) -> list[_Copy]:
    """The fields of ``fields`` (``(name, value)``, decoded) some framework reads into ``_method``: each reading
    (:func:`guard._params.readings`) whose key path starts at ``_method``."""
    copies = []
    for name, value in fields:
        if "method" not in name:  # no reading makes "method" of other letters: most names are not read at all
            continue
        read = readings(name)
        if any(path[:1] == _METHOD for path in read.values()):
            copies.append(_Copy(name, value or "", read == _PLAIN))
    return copies


def _check_copies(copies: list[_Copy], place: str) -> None:
    """Refuse, under ``judge``, ``_method`` fields of one ``place`` (``query``, ``body``) frameworks would read as
    different methods: a copy not every framework reads as the plain ``_method`` string, or more than one copy where
    one is blank (copies naming different methods are refused by :func:`_one`).

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``_method``).
    """
    odd = next((copy for copy in copies if not copy.plain), None)
    if odd is not None:
        raise BodyError(400, "method_override", f"the {place} field {odd.name[:40]!r} is read as _method by some "
                        "frameworks and not others (PHP reads .method as _method, Express runs the first item of "
                        "_method[]; Rails runs the POST); send one field named _method", field="_method")
    if len(copies) > 1 and not all(copy.asks for copy in copies):
        raise BodyError(400, "method_override", f"the {place} holds _method {len(copies)} times, some blank (Rails "
                        "reads the last copy, Express the first); send one", field="_method")


def _field_method(copies: list[_Copy], place: str, judge: bool) -> str | None:
    """The method the ``_method`` fields of one ``place`` (``query``, ``body``) ask for, upper-case when ASCII:
    ``None`` when none does; under ``judge`` (:func:`_check_copies` first) ``""`` for a blank one.

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``_method``): copies name different methods, or under
            ``judge`` frameworks would read them differently.
    """
    if judge:
        _check_copies(copies, place)
        if copies and not copies[0].asks:  # one blank copy (more are refused above)
            return ""
    found = _one([("_method", _named(copy.value)) for copy in copies if copy.asks], place)
    return found[1] if found else None


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


def method_override(scope: Scope, headers: dict[str, str], *, judge: bool = False) -> tuple[str, str] | None:
    """``(where, method)`` when the request's head asks for another method: an override header (``where``: its name
    as sent) or a ``_method`` query parameter (``where``: ``_method``), else ``None``. ``method`` is upper-case when
    ASCII, as sent otherwise. ``judge``: the query's ``_method`` copies are checked as ``judge`` reads them.

    Raises:
        BodyError: 400 ``method_override`` when the overrides name different methods, or under ``judge`` the query's
            ``_method`` copies could be read differently (:func:`_check_copies`).
    """
    # an empty or blank one asks for nothing (Rack, Symfony; a blank query field beside a header too: Rack never
    # reads the query, Express and Symfony read the header); a header's spaces and tabs are trimmed as servers trim
    # them, a field is read as sent (" DELETE" is no method to Rack)
    found = [(name, _named(headers[name].strip(" \t"))) for name in _OVERRIDE_HEADERS_IN_ORDER
             if name in headers and headers[name].strip()]
    found += [(name, _named(value.strip(" \t"))) for name, value in headers.items()
              if "_" in name and name.replace("_", "-") in METHOD_OVERRIDE_HEADERS and value.strip()]
    query: bytes = scope.get("query_string", b"")
    if b"method" in query or (b"%" in query and b"method" in unquote_to_bytes(query)):
        method = _field_method(_form_copies(pairs(query.decode("latin-1"))), "query", judge)
        found += [("_method", method)] if method else []
    return _one(found, "request") if found else None


def judged_scope(scope: Scope, headers: dict[str, str], mode: str) -> Scope:
    """The scope a request (or a WebSocket upgrade, sent as a GET) is matched as under the ``method_override`` mode
    ``mode``: as sent, or with the method its head's override asks for (``judge``, :func:`check_judged`); ``headers``
    as :func:`~guard.asgi._subject.header_map` gives them.

    Raises:
        BodyError: 400 ``method_override`` (``field``: where it was asked) for an override under ``refuse``, and
            under ``judge`` for one some frameworks ignore or read differently.
    """
    override = method_override(scope, headers, judge=mode == "judge") if mode != "ignore" else None
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


def _json_copies(body: bytes, limits: BodyLimits) -> list[_Copy]:
    """A JSON object's top-level ``_method``: a string (Laravel and Express read it), or a list whose first item is
    one (Express runs that item, Laravel refuses the list); none for any other value, which no framework runs."""
    check_containers(body, limits)  # json holds the GIL while it parses
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return []
    field = value.get("_method") if isinstance(value, dict) else None
    if isinstance(field, str):
        return [_Copy("_method", field, True)]
    if isinstance(field, list) and field and isinstance(field[0], str):
        return [_Copy("_method", field[0], False)]
    return []


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


def body_method(body: bytes, content_type: str, limits: BodyLimits, *, judge: bool = False) -> str | None:
    """The method a POST body's ``_method`` field asks for (upper-case when ASCII, as sent otherwise; see the module
    doc for which bodies and names), ``None`` without one; under ``judge``, ``""`` for a blank or valueless field.
    A body :func:`may_name_method` rules out is not parsed.

    Raises:
        BodyError: 400 ``method_override`` (``field``: ``_method``) when the field names different methods, or under
            ``judge`` frameworks would read it differently (:func:`_check_copies`); a multipart body guard's parser
            refuses (:func:`_multipart_fields`); 413 ``body_too_complex`` for a JSON body with more ``[`` and ``{``
            than ``limits.max_json_containers``.
    """
    if not may_name_method(body):
        return None
    media = _media(content_type)
    if media in ("", "application/x-www-form-urlencoded"):
        copies = _form_copies(pairs(body.decode("latin-1")))
    elif media.startswith("multipart/"):
        copies = _form_copies(_multipart_fields(body, content_type, limits))
    elif _is_json(content_type.lower()):
        copies = _json_copies(body, limits)
    else:
        return None
    return _field_method(copies, "body", judge)
