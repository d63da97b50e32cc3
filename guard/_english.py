"""Common English words, for telling English from text that is not (scrambled, transliterated, another language).

:func:`english_words` is the list in ``guard/data/english_words.txt``: the 4,000 words of two or more letters found in
the most English records of ``data/`` (``tests/test_english_words.py`` makes it and checks it). :func:`ascii_words`
cuts a text into the lower-case ASCII words looked up in it, and :func:`english_share` says how many of them it holds.
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["ascii_words", "english_share", "english_words"]

#: Every ASCII character that is not part of a word (letters, digits, ``@``, ``$``) as a space: :func:`ascii_words`
#: splits on them (a third of the time of a regular expression's ``findall``).
_NOT_WORD = str.maketrans({chr(i): " " for i in range(128) if not (chr(i).isalnum() or chr(i) in "@$")})


@functools.cache
def english_words() -> frozenset[str]:
    """The shipped list of common English words, lower case (read once per process)."""
    text = resources.files("guard").joinpath("data/english_words.txt").read_text(encoding="utf-8")
    return frozenset(line for line in text.splitlines() if line and not line.startswith("#"))


def english_share(words: list[str]) -> float:
    """The share of ``words`` (lower case) that are in :func:`english_words`; 1.0 for no words."""
    if not words:
        return 1.0
    common = english_words()
    return sum(word in common for word in words) / len(words)


def ascii_words(text: str, *, lower: bool = True) -> list[str]:
    """The ASCII words of ``text`` (lower case unless ``lower`` is false): runs of letters, digits, ``@`` and ``$``;
    any other character, ASCII or not, parts them (``café`` gives ``caf``)."""
    words = text.encode("ascii", "replace").decode("ascii").translate(_NOT_WORD)
    return (words.lower() if lower else words).split()
