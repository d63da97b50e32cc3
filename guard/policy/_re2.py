"""Regular expressions in a policy, compiled with RE2 (``google-re2``): a ``redact`` block's patterns and the
``matches()`` of a rule's ``when``.

RE2 matches in time linear in the text, so no request can make a pattern backtrack (``([a-z0-9]+[._-]?)+@corp\\.com``
against 30 letters takes minutes with Python's ``re``). It has no backreferences or lookaround, and ``\\d``, ``\\w``,
``\\s`` and ``\\b`` are ASCII (``\\pN``, ``\\pL`` for the digits and letters of every script).
"""

from __future__ import annotations

import functools
from typing import Any

import re2

__all__ = ["PATTERN_CACHE_SIZE", "Pattern", "compile_re2", "matches"]

Pattern = Any
"""A compiled RE2 pattern (``re2.compile``'s; the module exports no public type): ``finditer``, ``search`` and
``fullmatch`` as ``re.Pattern`` has them, offsets in characters."""
#: Most compiled patterns :func:`matches` keeps (a pattern a request supplies is compiled on each new one).
PATTERN_CACHE_SIZE = 1024

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a bad pattern is reported as a policy error, not also on stderr


def compile_re2(source: str) -> Pattern:
    """``source`` compiled with RE2.

    Raises:
        ValueError: ``source`` is not valid RE2 syntax (or compiles past RE2's memory budget), with RE2's reason.
    """
    try:
        return re2.compile(source, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"not a valid regular expression (RE2 syntax, linear time: no backreferences or "
                         f"lookaround): {reason}") from None


@functools.lru_cache(maxsize=PATTERN_CACHE_SIZE)
def _cached(source: str) -> Pattern:
    return compile_re2(source)


def matches(text: Any, pattern: Any) -> bool:
    """CEL's ``text.matches(pattern)`` in a rule: whether ``pattern`` (RE2) matches anywhere in ``text``. Each
    pattern is compiled once (up to :data:`PATTERN_CACHE_SIZE` kept); the CEL runtime's own ``matches`` compiles
    its pattern on every call (19 ms for ``\\w{1,40}@\\w{1,40}\\.example``, once per element in an ``exists``).

    Raises:
        TypeError: ``text`` or ``pattern`` is not a string.
        ValueError: ``pattern`` is not valid RE2 syntax (a pattern a request supplied: the message does not quote
            it, since the CEL runtime logs it).
    """
    if not isinstance(text, str) or not isinstance(pattern, str):
        raise TypeError(f"matches() takes a string and a pattern string, not {type(text).__name__} and "
                        f"{type(pattern).__name__}")
    try:
        compiled = _cached(pattern)
    except ValueError:
        raise ValueError("matches() was given a pattern that is not valid RE2 syntax") from None
    return compiled.search(text) is not None
