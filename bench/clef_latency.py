"""Latency of one Clef decision on CPU: p50/p95/p99 at 128/512/2048 state tokens x 1/8/64 questions, head share.

One decision = encode (tokenize, spans) + backbone prefill + joint schema head + readout, batch size 1, measured with
``time.perf_counter`` after a warm-up. The head's share is its time over the whole decision, measured in the same
runs (backbone and head are timed separately inside each decision).

Usage::

    python bench/clef_latency.py                                   # golden tiny checkpoint, float32, CPU
    python bench/clef_latency.py --model /models/clef-flash --dtype bfloat16 --repeats 5

The state is a synthetic ticket log a little longer than N tokens, cut to exactly N state tokens (``max_state_tokens``); questions cycle through
noul, a 4-option choice and a 5-level score. ``input tokens`` in the table includes system prompt, schema and suffix,
whose size depends on the checkpoint's tokenizer (the tiny fixture's 777-token vocabulary makes the schema long).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# ---- settings -------------------------------------------------------------------------------------------------------
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "clef-golden" / "checkpoint"
STATE_TOKENS = (128, 512, 2048)
QUESTIONS = (1, 8, 64)
WARMUP = 2
REPEATS = 10
MAX_LENGTH = 16384
# ---------------------------------------------------------------------------------------------------------------------

_STATE_LINE = (
    "Ticket {i}: the customer reports that the card was charged twice for order {i} and asks for a refund today; "
    "the agent checked the payment log, found a retry after a timeout, and the account is marked VIP. "
)


def build_request(questions: int, state_tokens: int, processor: Any) -> Any:
    """A request whose state has at least ``state_tokens`` tokens (cut to exactly that many at encode time), with
    ``questions`` questions cycling through noul, a 4-option choice and a 5-level score."""
    from guard.systemone import SystemOneRequestV1

    kinds: list[dict[str, Any]] = [
        {"type": "noul", "instructions": "Does the customer threaten to cancel?"},
        {
            "type": "choice",
            "instructions": "Which queue should own this ticket?",
            "criteria": {"billing": "Charges and refunds", "technical": "Bugs", "sales": None, "other": None},
        },
        {
            "type": "score",
            "instructions": "How urgent is a reply?",
            "criteria": ["later", "week", "day", "hour", "now"],
        },
    ]
    per_line = len(processor.encode_texts([_STATE_LINE.format(i=1000)])[0])
    lines = state_tokens // per_line + 2
    body = {
        "model": "bench",
        "state": "".join(_STATE_LINE.format(i=1000 + i) for i in range(lines)),
        "questions": {f"q{i}": kinds[i % 3] for i in range(questions)},
    }
    return SystemOneRequestV1.from_json(body, profile="reference")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (``q`` in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def decide_once(model: Any, request: Any, state_tokens: int, sync: Callable[[], None]) -> tuple[float, float, int]:
    """One decision; returns (total seconds, head seconds, input tokens)."""
    from guard.clef.encoding import collate, encode_record

    start = time.perf_counter()
    record = encode_record(request, model.processor, max_length=MAX_LENGTH, max_state_tokens=state_tokens)
    with torch.inference_mode():
        batch = collate([record], model.processor.pad_token_id, model.device)
        hidden = model.hidden_states(batch).to(model.dtype)
        sync()
        head_start = time.perf_counter()
        logits = model.head(
            hidden, batch["input_ids"], batch["attention_mask"], [record], model.backbone.get_output_embeddings().weight
        )
        logits = [[z.cpu() for z in per_record] for per_record in logits]
        sync()
        head_end = time.perf_counter()
    model.answer(request, record, logits[0])
    end = time.perf_counter()
    return end - start, head_end - head_start, len(record.input_ids)


def measure_table(
    model: Any,
    *,
    state_tokens: tuple[int, ...] = STATE_TOKENS,
    questions: tuple[int, ...] = QUESTIONS,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    sync: Callable[[], None] = lambda: None,
) -> list[dict[str, float]]:
    """Measure every (state tokens, questions) cell; returns one row per cell (milliseconds)."""
    rows = []
    for n_questions in questions:
        for n_state in state_tokens:
            request = build_request(n_questions, n_state, model.processor)
            for _ in range(warmup):
                decide_once(model, request, n_state, sync)
            totals, heads = [], []
            tokens = 0
            for _ in range(repeats):
                total, head, tokens = decide_once(model, request, n_state, sync)
                totals.append(total * 1000)
                heads.append(head * 1000)
            rows.append(
                {
                    "state_tokens": n_state,
                    "questions": n_questions,
                    "input_tokens": tokens,
                    "p50_ms": statistics.median(totals),
                    "p95_ms": percentile(totals, 95),
                    "p99_ms": percentile(totals, 99),
                    "head_p50_ms": statistics.median(heads),
                    "head_share": sum(heads) / sum(totals),
                }
            )
    return rows


def print_table(rows: list[dict[str, float]], title: str) -> None:
    print(f"\n{title}\n")
    print("| state tokens | questions | input tokens | p50 ms | p95 ms | p99 ms | head p50 ms | head share |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['state_tokens']} | {r['questions']} | {r['input_tokens']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} "
            f"| {r['p99_ms']:.1f} | {r['head_p50_ms']:.2f} | {100 * r['head_share']:.1f} % |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()

    import transformers

    from guard.clef.model import ClefModel

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    started = time.perf_counter()
    model = ClefModel.from_pretrained(args.model, dtype=dtype)
    load_s = time.perf_counter() - started
    rows = measure_table(model, repeats=args.repeats)
    print_table(rows, f"{args.model} · {args.dtype} · CPU · {torch.get_num_threads()} threads · load {load_s:.2f} s")


if __name__ == "__main__":
    main()
