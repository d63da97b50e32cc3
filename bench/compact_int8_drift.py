"""Answer drift of an int8 encoder stack against the float32 one, on labelled records (docs/compact-model.md#latency).

The shipped catalog model's ONNX Runtime graph (float32) is quantised with ONNX Runtime's dynamic int8 quantisation,
per channel, leaving the fine-tuned last layer in float32 (the heads are torch float32 either way). Every record is
answered by both; per question it prints the largest and mean |dp| (p(``true``); severity: expected level / 4) and,
for yes/no questions, the AUROC of each.

Usage::

    python -m guard.compact.data data build/compact-data
    python bench/compact_int8_drift.py build/compact-data/val.jsonl --step 2
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("records", help="labelled JSONL (guard eval's format)")
    parser.add_argument("--step", type=int, default=1, help="answer every N-th record (default 1)")
    args = parser.parse_args()

    import numpy as np
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from sklearn.metrics import roc_auc_score

    from guard.backends.compact import DEFAULT_WEIGHTS, CompactBackend
    from guard.compact.records import load_records
    from guard.compact.runtime import OnnxStack

    torch.set_num_threads(2)
    backend = CompactBackend.from_pretrained(DEFAULT_WEIGHTS, runtime="onnx")
    model = backend.models[0]
    source = str(model.runtime.path)
    last = [n.name for n in onnx.load(source).graph.node if n.op_type == "MatMul" and "layers.5" in n.name]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "int8.onnx"
        quantize_dynamic(source, str(target), weight_type=QuantType.QInt8, nodes_to_exclude=last, per_channel=True)
        sessions = {"float32": model.runtime.session, "int8": OnnxStack(target).session}
    values: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    scores: set[str] = set()  # questions answered with a level, not yes/no
    for record in load_records(args.records)[:: args.step]:
        for name, session in sessions.items():
            model.runtime.session = session
            response = backend.decide_sync(record.request)
            for qid in record.labels:
                answer = response.answers[qid]
                if answer.noul is None:
                    scores.add(qid)
                value = float(answer.score) / 4 if answer.noul is None else float(answer.probabilities["true"])
                values[qid][name].append(value)
        for qid, target_index in record.labels.items():
            values[qid]["label"].append(target_index)
    for qid, columns in values.items():
        exact, quantised, labels = (np.array(columns[k]) for k in ("float32", "int8", "label"))
        drift = np.abs(exact - quantised)
        line = f"{qid:30s} n {len(labels):4d}  |dp| max {drift.max():.3f} mean {drift.mean():.4f}"
        if qid not in scores and len(set(labels.tolist())) == 2:
            positive = labels == 0  # noul prompt order: true, false
            line += (
                f"  AUROC float32 {roc_auc_score(positive, exact):.4f} int8 {roc_auc_score(positive, quantised):.4f}"
            )
        print(line)


if __name__ == "__main__":
    main()
