"""Whether decoded bytes are text a model should read (the normaliser's encoded runs, the compact model's digests),
and which characters a reader cannot see (:data:`INVISIBLE`: a body view, text output)."""

from __future__ import annotations

import re

__all__ = ["INVISIBLE", "readable"]

#: What a reader cannot see: control characters (a JSON escape may decode to one), C1 controls, the format characters
#: (Unicode category Cf: bidi controls, zero-width characters, tag characters, the byte order mark), the line and
#: paragraph separators (Zl, Zp), and the other default-ignorable code points (variation selectors, Hangul fillers,
#: the combining grapheme joiner). tests/asgi/test_review_body.py checks it against the running Python's Unicode data.
INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u115f\u1160"
    "\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)


def readable(text: str) -> bool:
    """Whether ``text`` (bytes decoded as UTF-8) is text a model should read: not empty, at least 95 % printable
    (line breaks and tabs count) and at least half letters."""
    if not text:
        return False
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    return printable >= 0.95 * len(text) and sum(ch.isalpha() for ch in text) >= 0.5 * len(text)
