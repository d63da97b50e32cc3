"""Homoglyph-insensitive comparison for rules: the UTS #39 skeleton (Unicode Technical Standard #39, section 4).

Rules compare state values as received (``state.user == "admin"`` does not match a Cyrillic ``"\\u0430dmin"``). A
rule that wants "looks the same" says so with the CEL functions :data:`FUNCTIONS` registers:

* ``skeleton(x)`` (or ``x.skeleton()``): the skeleton of the string ``x``;
* ``confusable(x, y)``: ``skeleton(x) == skeleton(y)``, the standard's definition of "x and y are confusable".

The skeleton of ``x``: ``x`` in NFKC, then NFD (the standard's data leaves most compatibility forms to NFKC, which
identifiers get per UAX #31: full-width ``ｄ`` and circled ``ⓓ`` have no prototype of their own); every
Default_Ignorable_Code_Point removed (zero-width space and joiners, soft hyphen, bidi controls, variation selectors,
tag characters, Hangul fillers); every character replaced by its prototype from ``data/confusables.txt`` (Cyrillic
``а`` -> ``a``, mathematical bold ``𝐚`` -> ``a``, ``m`` -> ``rn``, ``1`` -> ``l``); then NFD again. Skeletons are for
comparing, not for display, and they keep case (``"Admin"`` and ``"admin"`` differ).

The table (6,311 mappings) is read from the data file on the first call, once per process (about 30 ms); a call
then costs about 1 us for short ASCII text (one ``str.translate``), 2 us for short text that is not.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from importlib.resources import files
from typing import Any

__all__ = ["CONFUSABLES_FILE", "FUNCTIONS", "confusable", "skeleton", "unicode_version"]

#: The UTS #39 data, shipped unchanged with its licence (``data/README.md`` names its version and digest).
CONFUSABLES_FILE = "data/confusables.txt"

#: Default_Ignorable_Code_Point (Unicode DerivedCoreProperties.txt), removed before the prototypes are applied.
_DEFAULT_IGNORABLE_RE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164"
    "\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)


def _data() -> str:
    return files("guard.policy").joinpath(CONFUSABLES_FILE).read_text(encoding="utf-8-sig")


@functools.cache
def _prototypes() -> dict[int, str]:
    """Source code point -> prototype string, from the data lines ``SOURCE ; TARGET... ; MA # comment``."""
    table: dict[int, str] = {}
    for line in _data().splitlines():
        fields = line.split("#", 1)[0].split(";")
        if len(fields) < 2:
            continue  # a comment or a blank line
        table[int(fields[0], 16)] = "".join(chr(int(code, 16)) for code in fields[1].split())
    return table


def unicode_version() -> str:
    """The Unicode version of the shipped confusables data, from its header (``"13.0.0"``)."""
    match = re.search(r"^# Version: (\S+)", _data(), re.MULTILINE)
    return match.group(1) if match else "unknown"


def skeleton(text: str) -> str:
    """The UTS #39 skeleton of ``text`` (see the module docstring).

    Raises:
        TypeError: ``text`` is not a string (a rule error: the policy's fail mode decides).
    """
    if not isinstance(text, str):
        raise TypeError(f"skeleton() takes a string, got {type(text).__name__}")
    if text.isascii():
        return text.translate(_prototypes())  # NFKC and NFD change no ASCII text; no ASCII character is ignorable
    stripped = _DEFAULT_IGNORABLE_RE.sub("", unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text)))
    return unicodedata.normalize("NFD", stripped.translate(_prototypes()))


def confusable(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are confusable: their skeletons are equal (UTS #39 section 4).

    Raises:
        TypeError: either is not a string.
    """
    return skeleton(a) == skeleton(b)


#: The rule functions, by CEL name (registered in every rule context by :mod:`guard.policy.rules`).
FUNCTIONS: dict[str, Callable[..., Any]] = {"confusable": confusable, "skeleton": skeleton}
