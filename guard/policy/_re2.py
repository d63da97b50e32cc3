"""Regular expressions in a policy, compiled with RE2 (``google-re2``): a ``redact`` block's patterns and the
``matches()`` of a rule's ``when``.

RE2 matches in time linear in the text, so no request can make a pattern backtrack (``([a-z0-9]+[._-]?)+@corp\\.com``
against 30 letters takes minutes with Python's ``re``). It has no backreferences, lookaround or ``(?x)``. RE2's own
``\\d``, ``\\s`` and ``\\w`` are ASCII; here they are Unicode, as in the CEL runtime's (Rust) ``matches()``
(:func:`unicode_classes`: ``\\d`` also matches ``１`` and ``١``, ``\\s`` a no-break space), so an attacker's
full-width digits or no-break spaces do not slip past a pattern. ``\\b`` stays ASCII.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import re2

__all__ = [
    "CANDIDATE_MAX_MEM", "MAX_MEM", "REQUEST_MAX_MEM", "REQUEST_PROGRAM", "Pattern", "compile_re2", "matcher",
    "unicode_classes",
]

Pattern = Any
"""A compiled RE2 pattern (``re2.compile``'s; the module exports no public type): ``finditer``, ``search`` and
``fullmatch`` as ``re.Pattern`` has them, offsets in characters."""

#: RE2's memory budget for a pattern written in the policy (a ``redact`` pattern, a literal a rule's ``matches()``
#: is given): room for the DFA of ``\w{1,40}@\w{1,40}\.example`` (Unicode classes), which at RE2's 8 MiB default
#: falls back to its slower engine (``docs/benchmarks.md``). Memory a pattern's DFA takes is kept while the policy is
#: loaded: 16 MiB at most each.
MAX_MEM = 16 << 20
#: RE2's budget for a pattern a rule may compute, compiled at load (possibly many: see
#: :func:`guard.policy.rules.rule_patterns`): enough for the Unicode ``\w{1,40}@\w{1,40}\.example`` (2 MiB).
CANDIDATE_MAX_MEM = 4 << 20
#: RE2's budget for a pattern a request supplies (compiled on each call): small, so a pattern whose DFA would be
#: large (``[\w.]{1,200}@...``) is refused quickly rather than compiled (``docs/benchmarks.md``).
REQUEST_MAX_MEM = 1 << 20
#: Most RE2 program instructions one :func:`matcher` (one per request) compiles for the patterns the request
#: supplies, together: compiling takes about 0.5 us an instruction, and the 7 characters ``\w{40}0`` are 55,000 of
#: them (30 ms), so a 7 KB body list of such patterns in an ``exists`` held the event loop 10 s. ``^user00001$`` is 4.
#: Past it, ``matches()`` fails and the policy's fail mode decides.
REQUEST_PROGRAM = 1 << 17


@functools.cache
def _options(max_mem: int) -> Any:
    options = re2.Options()
    options.log_errors = False  # a bad pattern is reported as a policy error, not also on stderr
    options.max_mem = max_mem
    return options


#: The Unicode classes of Rust's regex (which the CEL runtime's ``matches()`` uses), as items of an RE2 class:
#: ``\d`` is ``\p{Nd}``; ``\s`` the White_Space property (tab to carriage return, U+0085 and the separators
#: ``\p{Z}``); ``\w`` letters, letter numbers, marks, decimal digits, connector punctuation and the joiners.
#: Each begins and ends with a ``\p{..}`` item, so a ``-`` written next to one is a literal, as in Rust.
_CLASSES = {
    "d": r"\p{Nd}",
    "s": r"\p{Z}\t-\r \x{85}\p{Z}",
    "w": r"\p{L}\x{200C}\x{200D}\p{Nl}\p{M}\p{Nd}\p{Pc}",
}


def unicode_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\s``, ``\\w`` and their negations written as Unicode classes RE2 reads
    (:data:`_CLASSES`); ``\\Q...\\E``, ``\\p{...}`` and ``[:alpha:]`` are left as they are. Inside ``[...]``,
    ``\\S`` and ``\\W`` stay RE2's ASCII ones (a class cannot be taken out of a class: ``[\\s\\S]`` is still
    every character).
    """
    out: list[str] = []
    i, end, in_class = 0, len(pattern), False
    while i < end:
        char = pattern[i]
        if char == "\\" and i + 1 < end:
            escaped = pattern[i + 1]
            if escaped == "Q":  # literal text up to \E
                stop = pattern.find("\\E", i + 2)
                stop = end if stop == -1 else stop + 2
                out.append(pattern[i:stop])
                i = stop
                continue
            if escaped in _CLASSES:
                out.append(_CLASSES[escaped] if in_class else f"[{_CLASSES[escaped]}]")
            elif escaped in "DSW":
                if not in_class:
                    out.append(f"[^{_CLASSES[escaped.lower()]}]")
                elif escaped == "D":
                    out.append(r"\P{Nd}")
                else:
                    out.append(pattern[i : i + 2])
            else:
                out.append(pattern[i : i + 2])  # \p, \x, \b, an escaped character: its argument follows as written
            i += 2
            continue
        if in_class:
            if pattern.startswith("[:", i) and (stop := pattern.find(":]", i + 2)) != -1:  # a POSIX class: [:alpha:]
                out.append(pattern[i : stop + 2])
                i = stop + 2
                continue
            in_class = char != "]"
            out.append(char)
            i += 1
            continue
        if char == "[":  # "[", "[^", then a "]" right after them is a literal "]"
            start = i + 1 + (pattern.startswith("^", i + 1))
            start += pattern.startswith("]", start)
            out.append(pattern[i:start])
            in_class = True
            i = start
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _compile(source: str, options: Any) -> Pattern:
    try:
        return re2.compile(unicode_classes(source), options)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"not a valid regular expression (RE2 syntax, linear time: no backreferences or "
                         f"lookaround): {reason}") from None


def compile_re2(source: str, *, max_mem: int = MAX_MEM) -> Pattern:
    """``source`` compiled with RE2, its ``\\d``, ``\\s``, ``\\w`` Unicode (:func:`unicode_classes`), within
    ``max_mem`` bytes of RE2 memory.

    Raises:
        ValueError: ``source`` is not valid RE2 syntax (or compiles past the memory budget), with the reason.
    """
    return _compile(source, _options(max_mem))


def matcher(patterns: Mapping[str, Pattern]) -> Callable[[Any, Any], bool]:
    """CEL's ``text.matches(pattern)`` for rules whose patterns were compiled at load (``patterns``: source ->
    :func:`compile_re2`): whether the pattern matches anywhere in ``text``. A pattern the request supplies is
    compiled within :data:`REQUEST_MAX_MEM`, once per matcher, :data:`REQUEST_PROGRAM` instructions in all (the CEL
    runtime's own ``matches`` compiled every pattern on every call: 19 ms for ``\\w{1,40}@\\w{1,40}\\.example``,
    once per element in an ``exists``).

    The function raises TypeError when ``text`` or ``pattern`` is not a string, and ValueError for a pattern that is
    not valid RE2 syntax (without quoting it: the CEL runtime logs the message, and the pattern may be a request's).
    """

    supplied: dict[str, Pattern] = {}  # a request's pattern -> compiled
    spent = 0  # RE2 instructions compiled for them

    def matches(text: Any, pattern: Any) -> bool:
        nonlocal spent
        if not isinstance(text, str) or not isinstance(pattern, str):
            raise TypeError(f"matches() takes a string and a pattern string, not {type(text).__name__} and "
                            f"{type(pattern).__name__}")
        compiled = patterns.get(pattern) or supplied.get(pattern)
        if compiled is None:
            if spent >= REQUEST_PROGRAM:
                raise ValueError(f"matches() was given patterns the request supplies past {REQUEST_PROGRAM} RE2 "
                                 "instructions")
            try:
                compiled = _compile(pattern, _options(REQUEST_MAX_MEM))
            except ValueError:
                raise ValueError("matches() was given a pattern that is not valid RE2 syntax") from None
            supplied[pattern] = compiled
            spent += compiled.programsize
        return compiled.search(text) is not None

    return matches
