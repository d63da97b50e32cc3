"""The shipped English word list is the one ``data/`` gives (regenerate it with this file as a script)::

    python tests/test_english_words.py > guard/data/english_words.txt
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: How many words the list holds: the most frequent by document frequency.
SIZE = 4000
#: A word whose ROT13 or backwards spelling is this many times as frequent is taken for a scrambled one and left out
#: (``ubj``, ``gb``, ``ng`` from the ROT13 attack records: "how", "to", "at"; ``sti``, ``ot`` written backwards).
SCRAMBLED_RATIO = 10
_ROT13 = str.maketrans(string.ascii_lowercase, string.ascii_lowercase[13:] + string.ascii_lowercase[:13])
HEADER = ("# The 4,000 words of two or more letters found in the most English records of data/ (document frequency,"
          " ties by\n# word; a word whose ROT13 or backwards spelling is 10 times as frequent is left out); read by"
          " guard/_english.py.\n# Made by tests/test_english_words.py.\n")


def word_list(root: Path = ROOT) -> str:
    """The list's text: :data:`HEADER`, then one lower-case word per line, most frequent first."""
    frequency: Counter[str] = Counter()
    for path in sorted((root / "data").rglob("*.jsonl")):
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            if isinstance(row.get("text"), str) and row.get("lang", "en") == "en":
                frequency.update({word for word in re.findall(r"[a-z]+", row["text"].lower()) if len(word) >= 2})
    def scrambled(word: str, count: int) -> bool:
        backwards = frequency.get(word[::-1], 0) if word[::-1] != word else 0
        return max(frequency.get(word.translate(_ROT13), 0), backwards) >= SCRAMBLED_RATIO * count

    ranked = sorted(frequency.items(), key=lambda item: (-item[1], item[0]))
    kept = [word for word, count in ranked if not scrambled(word, count)][:SIZE]
    return HEADER + "".join(f"{word}\n" for word in kept)


def test_the_shipped_list_is_the_one_data_gives() -> None:
    shipped = (ROOT / "guard/data/english_words.txt").read_text(encoding="utf-8")
    assert shipped == word_list(), (
        "regenerate: python tests/test_english_words.py > guard/data/english_words.txt")


if __name__ == "__main__":
    print(word_list(), end="")
