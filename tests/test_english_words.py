"""The shipped English word list is the one ``data/`` gives (regenerate it with this file as a script)::

    python tests/test_english_words.py > guard/data/english_words.txt
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: How many words the list holds: the most frequent by document frequency.
SIZE = 4000
HEADER = ("# The 4,000 words of two or more letters found in the most English records of data/ (document frequency,"
          " ties by\n# word); read by guard/_english.py. Made by tests/test_english_words.py.\n")


def word_list(root: Path = ROOT) -> str:
    """The list's text: :data:`HEADER`, then one lower-case word per line, most frequent first."""
    frequency: Counter[str] = Counter()
    for path in sorted((root / "data").rglob("*.jsonl")):
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            if isinstance(row.get("text"), str) and row.get("lang", "en") == "en":
                frequency.update({word for word in re.findall(r"[a-z]+", row["text"].lower()) if len(word) >= 2})
    ranked = sorted(frequency.items(), key=lambda item: (-item[1], item[0]))[:SIZE]
    return HEADER + "".join(f"{word}\n" for word, _ in ranked)


def test_the_shipped_list_is_the_one_data_gives() -> None:
    shipped = (ROOT / "guard/data/english_words.txt").read_text(encoding="utf-8")
    assert shipped == word_list(), (
        "regenerate: python tests/test_english_words.py > guard/data/english_words.txt")


if __name__ == "__main__":
    print(word_list(), end="")
