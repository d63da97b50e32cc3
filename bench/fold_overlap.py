"""Text the held-out folds share with the other folds' training records, and usual-split test records that repeat a
training record.

Per fold and question: the held-out records (training and validation records of the fold) whose text a model
trained on every other fold's training records would have read (the same text up to case and punctuation, one
inside the other, or one template with other fillers: ``guard.compact.finetune._shared_texts``), and how many
training texts the fold model leaves out for it since that check. Per test file: the records whose text, up to case
and punctuation, is a training record's for the same question. Reads what ``python -m guard.compact.data`` writes.

    python bench/fold_overlap.py [--data build/compact-data]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from guard.compact.catalog import CATALOG
from guard.compact.finetune import _examples, _normalised, fold_overlap
from guard.compact.records import load_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("build/compact-data"),
                        help="folder with train.jsonl, val.jsonl and test/*.jsonl (default: %(default)s)")
    args = parser.parse_args()
    train, val = load_records(args.data / "train.jsonl"), load_records(args.data / "val.jsonl")
    for fold, overlap in fold_overlap(train, val).items():
        shares = ", ".join(f"{qid.removeprefix('guard.')} {m['shared']}/{m['n']} ({m['shared'] / m['n']:.1%})"
                           for qid, m in overlap["questions"].items())
        print(f"fold {fold}: {shares}; the fold model leaves out {overlap['left_out_texts']} training texts")
    ids = list(CATALOG)
    texts: dict[tuple[str, bool], int] = {}
    examples = _examples(train, ids, texts)
    items = list(texts)
    trained = {(e.question, _normalised(items[e.text][0])) for e in examples}
    for path in sorted((args.data / "test").glob("*.jsonl")):
        test = _examples(load_records(path), ids, texts)
        items = list(texts)
        repeated = sum((e.question, _normalised(items[e.text][0])) in trained for e in test)
        print(f"test/{path.name}: {repeated} of {len(test)} records repeat a training record (same question)")


if __name__ == "__main__":
    main()
