"""Whether decoded bytes are text a model should read (the normaliser's encoded runs, the compact model's digests)."""

from __future__ import annotations

__all__ = ["readable"]


def readable(text: str) -> bool:
    """Whether ``text`` (bytes decoded as UTF-8) is text a model should read: not empty, at least 95 % printable
    (line breaks and tabs count) and at least half letters."""
    if not text:
        return False
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    return printable >= 0.95 * len(text) and sum(ch.isalpha() for ch in text) >= 0.5 * len(text)
