"""What the out-of-competence check costs per state, and how much of it the per-segment language test adds.

Times :func:`guard.compact.competence.assess` (the whole check, as ``CompactModel.answer`` runs it once per request)
and its segment pass alone, interleaved, on English texts of the sizes requests come in: a 128-token request, and
the first 2,000 / 8,000 / 32,000 characters of CPython docstrings joined (benign technical prose). Prints the median
microseconds of each and the segment pass's share.

    python bench/competence_cost.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUEST = ("Hi, I was charged twice for my subscription this month. Could you check the invoice from March 3rd and "
           "refund the duplicate payment to my card? I have attached the receipt. Also, please update my billing "
           "address to 12 Elm Street, Springfield, because I moved last week and the old one is no longer valid.")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed calls of each, interleaved (default 30)")
    args = parser.parse_args()

    from guard.compact import competence

    docs = " ".join(json.loads(line)["text"] for line in (ROOT / "data/benign_requests/python_docs.jsonl").open())
    texts = {"request (128 tokens)": REQUEST, **{f"{n:,} characters": docs[:n] for n in (2000, 8000, 32000)}}
    print(f"{'text':22s} {'assess (us)':>12s} {'segments (us)':>14s} {'share':>6s}")
    for name, text in texts.items():
        competence.assess(text)  # the language model loads once
        whole, segments = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            competence.assess(text)
            middle = time.perf_counter()
            competence._other_language_segment(text)
            whole.append(middle - started)
            segments.append(time.perf_counter() - middle)
        w, s = statistics.median(whole) * 1e6, statistics.median(segments) * 1e6
        print(f"{name:22s} {w:12.0f} {s:14.0f} {s / w:6.0%}")


if __name__ == "__main__":
    main()
