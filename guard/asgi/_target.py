"""The request target as guard matches, routes and forwards it: origin-form only, one canonical path.

A request's path is matched against policies, routed by the application and, behind ``guard proxy``, sent to the
upstream. If any two of these read it differently, a request is judged as one path and served as another (``/x/../v1``
matched as ``/x/..`` but served as ``/v1``), or sent somewhere else (``@127.0.0.1:9/admin`` appended to the upstream
URL turns the upstream host into userinfo). So every ``http`` request is reduced to one canonical path first, and that
path is what policies match, what the application routes on and what the proxy forwards:

1. **Origin-form only** (RFC 9112 3.2.1): the path starts with ``/`` and is printable ASCII; the query is printable
   ASCII without ``#``. Absolute-form (``http://x/y``), authority-form (``host:port``), asterisk-form (``*``) and
   anything else (``@host/x``, ``x/y``) are refused.
2. **Refused because servers disagree on them**: a backslash, raw or ``%5C`` (some servers treat it as ``/``); an
   encoded slash ``%2F`` (some decode it before routing, some after); ``;`` (path parameters: Tomcat and Spring strip
   ``;...`` from a segment before routing, so ``/v1;x/chat`` would be served as ``/v1/chat``; send ``%3B`` for a
   literal semicolon); ``#``; a ``%`` not followed by two hex digits; escapes that decode to control characters or to
   bytes that are not UTF-8.
3. **Percent-escapes of unreserved characters** (``A-Z a-z 0-9 - . _ ~``) are decoded (RFC 3986 6.2.2.2), so
   ``%2e%2e`` is a dot segment; every other escape is kept, with upper-case hex (6.2.2.1).
4. **Empty segments are merged** (``//v1//chat`` -> ``/v1/chat``); a trailing slash is kept.
5. **Dot segments are removed** (RFC 3986 5.2.4): ``/a/./b`` -> ``/a/b``, ``/a/../b`` -> ``/b``; ``..`` at the root
   stays at the root.

Under a ``root_path`` (uvicorn ``--root-path``, a Starlette ``Mount``) ``scope["path"]`` is the root path followed by
the path the application routes on; Starlette routes on what follows the root path, or on the whole path when it
does not start with the root path (:mod:`guard._rootpath`). Some servers (hypercorn ``--root-path``, Daphne) leave the
root path out of ``path``: a path that is neither the root path nor below it gets the root path put in front, as
uvicorn does, so policies match ``/api/v1/chat`` under either convention and Starlette still routes it as
``/v1/chat``. A ``root_path`` with a trailing slash (``--root-path /api/``, which uvicorn joins into ``/api//v1/chat``)
loses it, or the merged ``/api/v1/chat`` would no longer be below ``/api/`` and would be routed whole. The root path's
segments are kept as they are (steps 1-3 apply to them) and steps 4-5 apply to what follows: a ``..`` that would climb
above the root path (``/api/../v1/chat`` under ``/api``) is refused rather than removed, or ``/v1/chat`` would be
matched and the application would still route it inside ``/api``.

The result has two forms: :attr:`RequestTarget.path`, percent-decoded (what policies match, and what ASGI
applications route on: Starlette routes on ``scope["path"]``), and :attr:`RequestTarget.raw_path`, the canonical
encoded form sent upstream. Decoding ``raw_path`` once gives ``path``. Refusals are 400 ``invalid_target``.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import quote, unquote

from starlette.types import Scope

from guard._rootpath import root_prefix
from guard._urls import REFUSED_PATH_ESCAPES, is_path_control
from guard.errors import BodyError

__all__ = ["INVALID_TARGET", "RequestTarget", "canonical_path", "canonical_scope", "path_views", "request_target"]

INVALID_TARGET = "invalid_target"

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset("0123456789abcdefABCDEF")
# A path that is already canonical: segments of plain characters, none empty, none starting with "." (so no dot
# segments), no "%", ";" or "\"; an optional trailing slash. Most requests take this path and cost one regex match.
_PLAIN = re.compile(r"(?:/(?!\.)[A-Za-z0-9\-._~!$&'()*+,=:@]+)*/?")
_PLAIN_RAW = re.compile(_PLAIN.pattern.encode())  # the same, for the raw path bytes of the scope
_QUERY = re.compile(rb"[!\"$-~]*")  # printable ASCII without "#"
_QUOTE_SAFE = "/!$&'()*+,;=:@-._~"  # re-encoding a decoded path keeps these as they are (";" is then refused)


class RequestTarget(NamedTuple):
    """The canonical request target.

    Attributes:
        path: the percent-decoded canonical path, e.g. ``/v1/caf\u00e9``.
        raw_path: the canonical path as sent on the wire, e.g. ``b"/v1/caf%C3%A9"``.
    """

    path: str
    raw_path: bytes


def _bad(reason: str, field: str = "path") -> BodyError:
    return BodyError(400, INVALID_TARGET, reason, field=field)


_REFUSED = {
    "\\": "a backslash, which some servers read as '/'",
    ";": (
        "';', which some servers strip with what follows before routing (path parameters); send %3B for a literal "
        "semicolon"
    ),
    "#": "'#'; a fragment is never part of a request target",
}


def _refused(char: str) -> BodyError:
    return _bad(f"the path contains {_REFUSED.get(char, f'{char!r}, which is not printable ASCII')}")


def _segment(segment: str) -> tuple[str, str]:
    """One path segment as (canonical encoded form, decoded form)."""
    if "%" not in segment:
        for char in segment:
            if char in _REFUSED or not "!" <= char <= "~":
                raise _refused(char)
        return segment, segment
    encoded: list[str] = []
    decoded = bytearray()
    i, n = 0, len(segment)
    while i < n:
        char = segment[i]
        if char == "%":
            digits = segment[i + 1 : i + 3]
            if len(digits) != 2 or not set(digits) <= _HEX:
                raise _bad(f"the path has a '%' not followed by two hex digits: {segment[i : i + 3]!r}")
            byte = int(digits, 16)
            if byte in REFUSED_PATH_ESCAPES:
                raise _bad(f"the path contains {REFUSED_PATH_ESCAPES[byte]} (%{digits}), which servers read differently")
            if is_path_control(byte):
                raise _bad(f"the path contains an encoded control character (%{digits})")
            encoded.append(chr(byte) if chr(byte) in _UNRESERVED else f"%{digits.upper()}")
            decoded.append(byte)
            i += 3
            continue
        if char in _REFUSED or not "!" <= char <= "~":
            raise _refused(char)
        encoded.append(char)
        decoded.append(ord(char))
        i += 1
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad("the path's percent-escapes are not UTF-8") from exc
    return "".join(encoded), text


def path_views(path: str, *, fold: bool = True, strip: bool = True) -> tuple[str, ...]:
    """The views of a canonical ``path`` that policies are matched on, in order: without a trailing slash
    (``strip``) and lower-cased (``fold``), then the path as sent when that differs. A policy that matches any view
    judges the request, whose subject has the first view some policy matches
    (:meth:`~guard.policy.PolicyView.matching_views`; ``GuardMiddleware``'s ``trailing_slash`` and ``path_case``,
    whose defaults these are, and ``guard policy test|explain``)."""
    view = (path.rstrip("/") or "/") if strip else path
    view = view.lower() if fold else view
    return (view,) if view == path else (view, path)


def canonical_path(raw: str, root_segments: int = 0) -> RequestTarget:
    """Reduce a raw request path (no query) to its canonical form (steps 1-5 of the module docstring).

    Args:
        raw: the path as received, e.g. ``"/x/../v1//chat"`` (latin-1 text of the wire bytes).
        root_segments: how many leading segments of ``raw`` are the scope's root path (:func:`root_prefix`): they are
            kept as they are, and a ``..`` may not climb above them.

    Returns:
        The canonical :class:`RequestTarget`.

    Raises:
        BodyError: 400 ``invalid_target`` naming what is refused.
    """
    if not raw.startswith("/"):
        raise _bad(
            f"the request target {raw[:60]!r} is not a path starting with '/'; absolute-form, authority-form "
            "and asterisk-form targets are not accepted"
        )
    if _PLAIN.fullmatch(raw):
        return RequestTarget(raw, raw.encode("ascii"))
    segments = [_segment(s) for s in raw[1:].split("/")]
    out = segments[:root_segments]
    last = len(segments) - 1
    for i, (encoded, decoded) in enumerate(segments[root_segments:], root_segments):
        if encoded == "..":
            if len(out) > root_segments:
                out.pop()
            elif root_segments:
                root = "/" + "/".join(d for _, d in out)
                raise _bad(f"the path's '..' climbs above the root path {root!r} the application is served under")
        elif encoded not in ("", "."):
            out.append((encoded, decoded))
            continue
        if i == last:  # a path ending in "/", "/." or "/.." names a directory: keep the trailing slash
            out.append(("", ""))
    return RequestTarget("/" + "/".join(d for _, d in out), ("/" + "/".join(e for e, _ in out)).encode("ascii"))


def request_target(scope: Scope) -> RequestTarget:
    """The canonical target of an ``http`` scope, from ``raw_path`` when it agrees with ``path``.

    ``raw_path`` is what the client sent (it still shows ``%2F`` and ``%5C``); when it is missing, or does not decode
    to ``path`` (an outer layer rewrote the path), ``path`` is what the application routes on, so it is re-encoded and
    used instead.

    Raises:
        BodyError: 400 ``invalid_target`` (field ``path`` or ``query``).
    """
    if _already_canonical(scope):
        return RequestTarget(scope["path"], scope["raw_path"])
    return _rebuilt_target(scope)


def _already_canonical(scope: Scope) -> bool:
    """Check the query string (400 when it is not printable ASCII without ``#``), then say whether the target is the
    usual one: ``raw_path`` already canonical and ``path`` encoded (steps 1-5 change nothing), one regex."""
    query: bytes = scope.get("query_string", b"")
    if query and not _QUERY.fullmatch(query):
        raise _bad("the query string must be printable ASCII without '#'; percent-encode other bytes", "query")
    raw: bytes | bytearray | None = scope.get("raw_path")
    return raw is not None and _plain_path(raw) == scope["path"]


def _plain_path(raw: bytes | bytearray) -> str | None:
    """``raw`` as text when it is already canonical (:data:`_PLAIN`), else ``None``."""
    if raw[:1] != b"/" or _PLAIN_RAW.fullmatch(raw) is None:
        return None
    return raw.decode("ascii")


def _rebuilt_target(scope: Scope) -> RequestTarget:
    """Steps 1-5 on a target that is not already canonical (the query string already checked)."""
    path: str = scope["path"]
    raw: bytes | None = scope.get("raw_path")
    text = raw.decode("latin-1") if raw is not None else None
    if text is None or (text != path and unquote(text) != path):
        text = quote(path, safe=_QUOTE_SAFE)
    # ``text`` decodes to ``path`` segment by segment (an encoded slash, which would break that, is refused), so the
    # root path's segments are the first ones of ``text``
    return canonical_path(text, root_prefix(scope).count("/"))


def canonical_scope(scope: Scope) -> Scope:
    """``scope`` itself when its target is canonical and its ``root_path`` (if any) has no trailing slash and starts
    its ``path``; else a copy with the canonical ``path`` and ``raw_path``, and the ``root_path`` without a trailing
    slash (a ``path`` that does not start with it gets it in front: the module docstring).

    Raises:
        BodyError: 400 ``invalid_target``.
    """
    root: str = scope.get("root_path", "")
    if root and root_prefix(scope) != root:  # a trailing slash, or a path the server left the root path out of
        scope = _rooted(scope)
    if _already_canonical(scope):
        return scope  # what request_target would return, without building it
    target = _rebuilt_target(scope)
    if target.path == scope["path"] and target.raw_path == scope.get("raw_path"):
        return scope
    return {**scope, "path": target.path, "raw_path": target.raw_path}


def _rooted(scope: Scope) -> Scope:
    """``scope`` with its ``root_path`` without a trailing slash, put in front of ``path`` (and of ``raw_path``,
    percent-encoded) when the path is neither it nor below it. A path that does not start with ``/`` is left as it is
    for :func:`canonical_path` to refuse (``*`` under ``/api`` is not ``/api*``)."""
    root: str = scope["root_path"].rstrip("/")
    rooted = {**scope, "root_path": root}
    path: str = scope["path"]
    if root and path.startswith("/") and not root_prefix(rooted):
        rooted["path"] = root + path
        raw: bytes | None = scope.get("raw_path")
        if raw is not None:
            rooted["raw_path"] = quote(root, safe=_QUOTE_SAFE).encode("ascii") + raw
    return rooted
