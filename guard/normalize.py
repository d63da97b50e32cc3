"""Unicode normalisation of the decision state before scoring (case C23).

Obfuscated text must get the same decision as the plain text, while the original stays available for audit (the
subject is never changed; only the copy sent to the model is). :func:`normalize_text` applies, in order:

1. **Unicode tag characters** (U+E0000-U+E007F, "ASCII smuggling"): printable tags U+E0020-U+E007E are decoded to
   the ASCII they shadow, so the model reads the hidden instruction; the rest (language tag, cancel tag) are removed.
   Their presence is flagged (``unicode_tags``): invisible text is suspicious in itself.
2. **NFKC** (UAX #15): full-width Latin, ligatures, superscripts and other compatibility forms fold to plain forms.
3. **Invisible format characters**: zero-width space/joiners, word joiner, BOM, soft hyphen, Mongolian vowel
   separator, and the bidi embedding/override/isolate controls (U+202A-U+202E, U+2066-U+2069, U+200E/U+200F, U+061C)
   are removed (flags ``zero_width``, ``bidi_controls``).
4. **Confusables in mixed-script words**: inside a word that mixes Latin with Cyrillic or Greek letters, look-alike
   letters are mapped to Latin (``Іgnоrе`` -> ``Ignore``; flag ``mixed_script``). Words wholly in one script are left
   alone, so Russian or Greek text is not damaged.
5. **Base64 runs** of at least :data:`MIN_BASE64_CHARS` characters that decode to printable UTF-8 text get the decoded
   text appended as ``[base64: ...]`` (flag ``base64``), so an encoded instruction is read too.

:func:`normalize_value` walks a JSON value and normalises every string (object keys included), returning the new
value and the combined flags.
"""

from __future__ import annotations

import base64
import binascii
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FLAG_NAMES", "MIN_BASE64_CHARS", "Normalized", "normalize_text", "normalize_value"]

#: Flags :func:`normalize_text` can raise; each is ``False``/``0`` when absent.
FLAG_NAMES = ("unicode_tags", "zero_width", "bidi_controls", "mixed_script", "base64")
#: Shortest run of base64 alphabet characters that is tried as encoded text.
MIN_BASE64_CHARS = 24

_TAG_RE = re.compile("[\U000e0000-\U000e007f]")
_ZERO_WIDTH = "\u200b\u200c\u200d\u2060\u2061\u2062\u2063\u2064\ufeff\u00ad\u180e\u034f"
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
_ZERO_WIDTH_RE = re.compile(f"[{_ZERO_WIDTH}]")
_BIDI_RE = re.compile(f"[{_BIDI}]")
_WORD_RE = re.compile(r"\w+")
_BASE64_RE = re.compile(rf"(?<![A-Za-z0-9+/=])[A-Za-z0-9+/]{{{MIN_BASE64_CHARS},}}={{0,2}}(?![A-Za-z0-9+/=])")

# Cyrillic and Greek letters that render like Latin ones (Unicode TR39 confusables, the common subset).
_CONFUSABLES = str.maketrans(
    {
        "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t",
        "у": "y", "х": "x", "ѕ": "s", "і": "i", "ј": "j", "ԁ": "d", "ԛ": "q", "ԝ": "w", "ɡ": "g", "ӏ": "l",
        "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T",
        "У": "Y", "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ԛ": "Q", "Ԝ": "W", "Ӏ": "I",
        "α": "a", "ο": "o", "ρ": "p", "ν": "v", "κ": "k", "ι": "i", "τ": "t", "υ": "u", "χ": "x",
        "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O",
        "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Normalized:
    """Result of normalising one value.

    Attributes:
        value: the normalised copy (same JSON shape as the input).
        flags: counts of what was found, by name in :data:`FLAG_NAMES` (only non-zero entries).
    """

    value: Any
    flags: dict[str, int] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.flags)


def _script(ch: str) -> str | None:
    if not ch.isalpha():
        return None
    if ch < "\u0250":
        return "latin"
    name = unicodedata.name(ch, "")
    if name.startswith("CYRILLIC"):
        return "cyrillic"
    if name.startswith("GREEK"):
        return "greek"
    if name.startswith("LATIN"):
        return "latin"
    return "other"


def _fix_mixed_word(match: re.Match[str], counts: dict[str, int]) -> str:
    word = match.group(0)
    if word.isascii():
        return word
    scripts = {s for s in map(_script, word) if s is not None}
    if "latin" in scripts and scripts & {"cyrillic", "greek"}:
        counts["mixed_script"] = counts.get("mixed_script", 0) + 1
        return word.translate(_CONFUSABLES)
    return word


def _decode_base64(match: re.Match[str], counts: dict[str, int]) -> str:
    token = match.group(0)
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return token
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    if not text or printable < 0.95 * len(text) or sum(ch.isalpha() for ch in text) < 0.5 * len(text):
        return token
    counts["base64"] = counts.get("base64", 0) + 1
    return f"{token} [base64: {text}]"


def _decode_tag(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return chr(code - 0xE0000) if 0xE0020 <= code <= 0xE007E else ""


def normalize_text(text: str) -> Normalized:
    """Normalise one string for scoring (steps 1-5 in the module docstring).

    Args:
        text: the original text.

    Returns:
        :class:`Normalized` with the scoring copy and the flags raised; ``text`` itself is not changed.
    """
    counts: dict[str, int] = {}
    if text.isascii():
        if len(text) >= MIN_BASE64_CHARS:
            text = _BASE64_RE.sub(lambda m: _decode_base64(m, counts), text)
        return Normalized(text, counts)
    tags = len(_TAG_RE.findall(text))
    if tags:
        counts["unicode_tags"] = tags
        text = _TAG_RE.sub(_decode_tag, text)
    text = unicodedata.normalize("NFKC", text)
    for name, pattern in (("zero_width", _ZERO_WIDTH_RE), ("bidi_controls", _BIDI_RE)):
        text, n = pattern.subn("", text)
        if n:
            counts[name] = n
    text = _WORD_RE.sub(lambda m: _fix_mixed_word(m, counts), text)
    if len(text) >= MIN_BASE64_CHARS:
        text = _BASE64_RE.sub(lambda m: _decode_base64(m, counts), text)
    return Normalized(text, counts)


def normalize_value(value: Any) -> Normalized:
    """Normalise every string inside a JSON value (object keys too), keeping its shape and key order.

    Args:
        value: a JSON value (``dict``, ``list``, ``str``, numbers, ``bool``, ``None``).

    Returns:
        :class:`Normalized` with a new value (the input is not modified) and the flags summed over all strings.
    """
    flags: dict[str, int] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            result = normalize_text(item)
            for name, n in result.flags.items():
                flags[name] = flags.get(name, 0) + n
            return result.value
        if isinstance(item, Mapping):
            return {walk(k) if isinstance(k, str) else k: walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item

    return Normalized(walk(value), flags)
