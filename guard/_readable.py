"""Whether decoded bytes are text a model should read (the normaliser's encoded runs, the compact model's digests),
base64 as those readers decode it (:func:`base64_bytes`), and which characters a reader cannot see (:data:`INVISIBLE`:
a body view, text output)."""

from __future__ import annotations

import base64
import re

__all__ = ["INVISIBLE", "base64_bytes", "readable"]

#: What a reader cannot see: control characters (a JSON escape may decode to one), C1 controls, the format characters
#: (Unicode category Cf: bidi controls, zero-width characters, tag characters, the byte order mark), the line and
#: paragraph separators (Zl, Zp), and the other default-ignorable code points (variation selectors, Hangul fillers,
#: the combining grapheme joiner). tests/asgi/test_review_body.py checks it against the running Python's Unicode data.
INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u115f\u1160"
    "\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)


_FROM_BASE64URL = str.maketrans("-_", "+/")


def base64_bytes(chars: str) -> bytes:
    """``chars``, base64 or base64url with its ``=`` padding or without it, decoded strictly.

    Raises:
        ValueError: a character outside both alphabets, or a length no encoding has (``binascii.Error``).
    """
    data = chars.rstrip("=").translate(_FROM_BASE64URL)
    return base64.b64decode(data + "=" * (-len(data) % 4), validate=True)


def readable(text: str) -> bool:
    """Whether ``text`` (bytes decoded as UTF-8) is text a model should read: not empty, at least 95 % printable
    (line breaks and tabs count) and at least half letters."""
    if not text:
        return False
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    return printable >= 0.95 * len(text) and sum(ch.isalpha() for ch in text) >= 0.5 * len(text)
