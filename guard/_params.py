"""Query parameter and form field names as web frameworks read them.

A framework stores a parameter under a *key path*: ``q[a][b]=1`` fills ``q`` -> ``a`` -> ``b``, ``q[]=1`` appends
to the list ``q``. Four readings are modelled, each as its parser has it:

* ``PHP`` (``php_register_variable_ex``, and so Symfony and Laravel): leading spaces dropped, the name ends at NUL,
  `` `` and ``.`` before the first ``[`` read as ``_``; ``[`` opens an index a ``]`` closes (``q[]`` appends, a space
  right after ``[`` is skipped there), and an index is followed only by another ``[``: the rest is ignored. A first
  ``[`` no ``]`` closes is read as ``_`` with every later `` ``, ``.`` and ``[`` (``q[x`` is ``q_x``); a name that
  starts with ``[`` is dropped.
* ``Rack 2`` (``Rack::QueryParser#normalize_params`` of Rack 2, Rails up to 7.0): the key is the first run of
  characters that are not brackets, after any leading brackets and before any trailing ``]`` (``[q]``, ``]q``,
  ``q]`` are ``q``), and the rest is read again as nested keys (``q[x`` is ``q`` -> ``x``); Rack 2 also splits a
  query at ``;`` (:func:`pairs`).
* ``Rack 3`` (Rails 7.1 on): the key runs to the first ``[`` after its first character, and the rest nests
  (``q[x`` is ``q`` -> ``[x``).
* ``qs`` (Express 4's query and ``urlencoded({extended: true})`` parser): the parent is what comes before the first
  ``[...]`` segment, each later ``[...]`` is a child wherever it stands (``[q]`` is ``q``, ``q[a]b[c]`` is ``q`` ->
  ``a`` -> ``c``), five deep, the rest one more key; ``[]`` and an index up to 20 append (qs drops a list's holes);
  qs ends a name at ``]=`` when a piece holds one, ``%5D=`` too (:func:`qs_names`). ``qs 6.15`` (from 6.15.4:
  Express 4.22 and 5) reads balanced brackets as one child (``q[a[b]]`` is ``q`` -> ``a[b]``) and an unclosed one
  as a child too (``q[`` is ``q`` -> ``[``).

Each reading stops where its parser stops: PHP drops a name with more than 64 indices (``max_input_nesting_level``),
Rack 2 and Rack 3 refuse a request with a name more than 100 and 32 keys deep (``param_depth_limit``), so none of
them reads it; the readings loop, so a name nested thousands deep costs time linear in its length.

The enforcement points use these to find a field under a spelling an application reads as the one a policy judges
(``guard/policy/_state.py``) or as ``_method`` (``guard/asgi/_override.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from itertools import islice
from urllib.parse import unquote_plus

__all__ = ["APPEND", "FRAMEWORKS", "QS", "KeyPath", "fills", "is_plain", "labels", "pairs", "qs_names", "readings", "shown"]

#: The component of a key path that appends to a list (``q[]``).
APPEND = None
#: A key path: the keys from the top-level name down, :data:`APPEND` for ``[]``.
KeyPath = tuple[str | None, ...]

_PHP_BASE = str.maketrans({" ": "_", ".": "_"})
_PHP_UNCLOSED = str.maketrans({" ": "_", ".": "_", "[": "_"})
_C_SPACE = frozenset(" \t\n\v\f\r")  # C's isspace
_RACK2_KEY = re.compile(r"[\[\]]*([^\[\]]+)\]*")
_RACK2_APPEND_CHILD = re.compile(r"\[\]\[([^\[\]]+)\]|\[\](.+)", re.DOTALL)
_QS_SEGMENT = re.compile(r"\[[^\[\]]*\]")
_QS_DEPTH = 5
_QS_INDICES = frozenset(str(index) for index in range(21))
#: How many keys deep each parser reads a name (PHP's ``max_input_nesting_level``, Rack's ``param_depth_limit``).
_PHP_DEPTH = 64
_RACK2_DEPTH = 100
_RACK3_DEPTH = 32
_PAIRS = re.compile(r"[&;] *")
_PLAIN = re.compile(r"[A-Za-z0-9_-]+")
_QS_BRACKET_ESCAPES = re.compile(r"%5[BbDd]")
_BRACKET_STEP = {"[": 1, "]": -1}


def _php(name: str) -> KeyPath | None:
    name = name.partition("\x00")[0].lstrip(" ")
    bracket = name.find("[")
    if bracket < 0:
        return (name.translate(_PHP_BASE),) if name else None
    if bracket == 0:
        return None
    base = name[:bracket].translate(_PHP_BASE)
    path: list[str | None] = [base]
    at = bracket
    while True:  # ``at``: a ``[``
        start = at + 1
        close = start + 1 if name[start : start + 1] in _C_SPACE else start
        if name[close : close + 1] == "]":
            path.append(APPEND)
        else:
            close = name.find("]", close)
            if close < 0:  # no ']': the first '[' is read as '_'; a later one ends the name at the index before it
                return (f"{base}_{name[start:].translate(_PHP_UNCLOSED)}",) if len(path) == 1 else tuple(path)
            path.append(name[start:close])
        if name[close + 1 : close + 2] != "[":
            return tuple(path) if len(path) <= _PHP_DEPTH + 1 else None
        if len(path) > _PHP_DEPTH:  # more indices than PHP reads: it drops the parameter
            return None
        at = close + 1


def _rack2(name: str) -> KeyPath | None:
    path: list[str | None] = []
    for _ in range(_RACK2_DEPTH):  # one pass per key, as Rack 2 recurses once per key
        match = _RACK2_KEY.match(name)
        if match is None:
            return tuple(path) or None
        key, after = match.group(1), name[match.end() :]
        if after == "":
            return (*path, key)
        if after == "[":
            return (*path, name)
        if after == "[]":
            return (*path, key, APPEND)
        child = _RACK2_APPEND_CHILD.fullmatch(after)
        if child is not None:
            path += (key, APPEND)
            name = child.group(1) or child.group(2)
        else:
            path.append(key)
            name = after
    return None  # deeper than Rack 2 reads: it refuses the request (ParamsTooDeepError)


def _rack3(name: str) -> KeyPath | None:
    path: list[str | None] = []
    for depth in range(_RACK3_DEPTH):  # one pass per key, as Rack 3 recurses once per key
        if depth == 0:
            start = name.find("[", 1)
            key, after = (name[:start], name[start:]) if start > 0 else (name, "")
        elif name.startswith("[]"):
            key, after = "[]", name[2:]
        elif name.startswith("[") and (close := name.find("]", 1)) > 0:
            key, after = name[1:close], name[close + 1 :]
        else:
            key, after = name, ""
        if not key:
            return tuple(path) or None
        if after == "":
            return (*path, APPEND if key == "[]" and depth else key)
        if after == "[":
            return (*path, name)
        if after == "[]":
            return (*path, key, APPEND)
        if after.startswith("[]"):
            inner = after[3:-1]
            name = inner if (after[2:3] == "[" and after.endswith("]") and inner and "[" not in inner
                             and "]" not in inner) else after[2:]
            path += (key, APPEND)
        else:
            path.append(key)
            name = after
    return None  # deeper than Rack 3 reads: it refuses the request (ParamsTooDeepError)


def _qs_key(key: str) -> str | None:
    """A segment's key: ``[]`` and an index up to qs's ``arrayLimit`` (20, spelt as JavaScript prints the number:
    ``05`` is a key) make a list, whose holes qs drops (``q[5]`` is the list's first item), so both append."""
    return APPEND if key == "" or key in _QS_INDICES else key


def _qs(name: str) -> KeyPath | None:
    segments = list(islice(_QS_SEGMENT.finditer(name), _QS_DEPTH + 1))
    parent = name[: segments[0].start()] if segments else name
    path: list[str | None] = [parent] if parent else []
    path += [_qs_key(s.group()[1:-1]) for s in segments[:_QS_DEPTH]]
    if len(segments) > _QS_DEPTH:
        path.append(name[segments[_QS_DEPTH].start() :])  # the rest, one key
    return tuple(path) if path else None


def _qs_balanced(name: str) -> KeyPath | None:
    """qs from 6.15.4 (``splitKeyIntoSegments``): the parent runs to the first ``[``; from there each group of
    balanced brackets is a child, its outer brackets dropped (``q[a[b]]`` is ``q`` -> ``a[b]``), five deep; a group
    no ``]`` closes, and what is left past five, is one more key (``q[`` is ``q`` -> ``[``)."""
    start = name.find("[")
    parent = name if start < 0 else name[:start]
    path: list[str | None] = [parent] if parent else []
    while start >= 0 and len(path) - bool(parent) < _QS_DEPTH:
        level, close = 0, -1
        for at in range(start, len(name)):
            level += _BRACKET_STEP.get(name[at], 0)
            if level == 0:
                close = at
                break
        if close < 0:
            break
        path.append(_qs_key(name[start + 1 : close]))
        start = name.find("[", close + 1)
    if start >= 0:
        path.append(name[start:])
    return tuple(path) if path else None


#: Each framework's reading of a parameter name: its key path, ``None`` when it drops the parameter. ``qs`` is qs up
#: to 6.15.3 (Express 4.21's), ``qs 6.15`` qs from 6.15.4 (Express 4.22 and 5): both are in use.
FRAMEWORKS: dict[str, Callable[[str], KeyPath | None]] = {
    "PHP": _php, "Rack 2": _rack2, "Rack 3": _rack3, "qs": _qs, "qs 6.15": _qs_balanced,
}
#: The readings of qs (Express), which ends a name at ``]=`` (:func:`qs_names`).
QS = ("qs", "qs 6.15")


def readings(name: str) -> dict[str, KeyPath]:
    """The key path each framework of :data:`FRAMEWORKS` stores a parameter ``name`` (decoded) under; a framework
    that drops it is left out. ``"q[]"`` -> every framework ``("q", APPEND)``; ``"[q]"`` -> Rack 2 and qs ``("q",)``,
    Rack 3 ``("[q]",)``, PHP none."""
    out = {}
    for framework, read in FRAMEWORKS.items():
        path = read(name)
        if path is not None:
            out[framework] = path
    return out


def is_plain(name: str) -> bool:
    """Whether ``name`` (decoded) is made only of ASCII letters, digits, ``_`` and ``-``: every framework of
    :data:`FRAMEWORKS` reads such a name as itself (``("q",)``), so of two different plain names neither
    :func:`fills` the other's place."""
    return _PLAIN.fullmatch(name) is not None


def _same_key(sent: str | None, read: str | None) -> bool:
    """Whether a key path component ``sent`` can fill the place of ``read``: equal, or a ``[]`` appending where the
    other names a list index (``q[]`` fills ``q[0]``)."""
    if sent == read:
        return True
    index = read if sent is APPEND else sent if read is APPEND else None
    return index is not None and index.isascii() and index.isdigit()


def fills(sent: KeyPath, read: KeyPath) -> bool:
    """Whether a parameter stored under ``sent`` fills the place an application reads under ``read`` (both one
    framework's :func:`readings`): ``read`` is a prefix of ``sent``, a trailing ``[]`` of ``read`` standing for the
    whole list. ``q[]`` and ``q[x][y]`` fill ``q``; ``filter[search][]`` fills ``filter[search]``, but neither
    ``filter[status]`` nor ``filter`` does."""
    while len(read) > 1 and read[-1] is APPEND:
        read = read[:-1]
    return len(sent) >= len(read) and all(_same_key(s, r) for s, r in zip(sent, read, strict=False))


def shown(path: KeyPath) -> str:
    """A key path as PHP spells it: ``("filter", "search")`` -> ``filter[search]``, ``("q", APPEND)`` -> ``q[]``."""
    return str(path[0] or "") + "".join(f"[{key or ''}]" for key in path[1:])


def labels(frameworks: Collection[str]) -> tuple[str, ...]:
    """The frameworks of :data:`FRAMEWORKS` named as users know them, in that order: ``PHP``, ``Rails`` (both Rack
    versions; ``Rails (Rack 2)`` or ``Rails (Rack 3)`` for one) and ``Express`` (qs)."""
    rails = [f for f in ("Rack 2", "Rack 3") if f in frameworks]
    out = ["PHP"] if "PHP" in frameworks else []
    if rails:
        out.append("Rails" if len(rails) == 2 else f"Rails ({rails[0]})")
    return (*out, "Express") if any(qs in frameworks for qs in QS) else tuple(out)


def pairs(text: str) -> Iterator[tuple[str, str | None]]:
    """The ``name=value`` pairs of a query or urlencoded text (latin-1 text of its bytes), split as Rack 2 splits a
    query, the most lenient parser: at ``&`` and ``;`` and the spaces after them, then percent-escapes and ``+``
    decoded as UTF-8 (bad escapes read as U+FFFD). Empty pieces are skipped; a piece without ``=`` has the value
    ``None`` (Rack 2's ``nil``)."""
    for pair in _PAIRS.split(text):
        if pair:
            name, equals, value = pair.partition("=")
            yield unquote_plus(name, errors="replace"), unquote_plus(value, errors="replace") if equals else None


def qs_names(text: str) -> Iterator[str]:
    """The parameter names qs (Express) reads from a query or urlencoded form (latin-1 text of its bytes): ``%5B``
    and ``%5D`` (any case) read as ``[`` and ``]`` first, as qs does before it splits (``lib/parse.js`` since qs
    6.12.2), then pieces split at ``&``, a piece's name ending at its first ``]=`` when it holds one (``q[=]=x`` and
    ``q[=%5D=x`` name ``q[=]``), else at its first ``=``, then percent-escapes and ``+`` decoded. Empty pieces are
    skipped."""
    if "%5" in text:
        text = _QS_BRACKET_ESCAPES.sub(lambda m: "[" if m.group() in ("%5B", "%5b") else "]", text)
    for piece in text.split("&"):
        if piece:
            bracket = piece.find("]=")
            name = piece[: bracket + 1] if bracket >= 0 else piece.partition("=")[0]
            yield unquote_plus(name, errors="replace")
