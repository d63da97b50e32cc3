"""The worker load benchmark on a GPU, at Clef-flash's real dimensions with random bf16 weights.

Same closed loop and exactly-once check as ``bench/worker_load.py`` (batching on vs ``--max-batch 1``, side by side,
concurrency 1/8/32/64), but each worker process builds the Clef-flash-shaped model of ``bench/clef_gpu_latency.py``
(backbone hidden 4096, 32 layers, vocabulary 248,320; joint schema head W 1024) directly on the device instead of
loading a checkpoint, and requests carry longer states (about 1,000 prompt tokens with the golden tokenizer, whose ids
are valid rows of the real vocabulary). Weights are random, so answers mean nothing; the compute is the real model's.
No ``torch.cuda.synchronize`` is needed around requests: each answer is built from logits copied back to the CPU, so a
response cannot leave before its GPU work finished.

Both workers are resident on the GPU at once (about 20 GB each at full size); only one receives traffic at a time.

Usage (repository root; not part of CI)::

    python bench/worker_gpu_load.py                                    # CUDA, full size
    python bench/worker_gpu_load.py --device cpu --scale 8 --concurrency 1 8 --requests-per-level 16 \\
        --check-requests 64                                             # CPU dry run at 1/8 width
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import worker_load  # the bench directory is not a package: found through sys.path above
from clef_latency import DEFAULT_MODEL

# ---- settings -------------------------------------------------------------------------------------------------------
CONCURRENCY = (1, 8, 32, 64)
REQUESTS_PER_LEVEL = 512
CHECK_REQUESTS = 10_000
STATE_REPEAT = 24  # ~1,000 prompt tokens per request
MAX_BATCH = 32
MAX_BATCH_TOKENS = 65_536
MAX_WAIT_MS = 2.0
# ----------------------------------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Worker role: build the random Clef-flash-shaped model on ``--device`` and serve it on ``--uds``."""
    import torch
    import transformers
    import uvicorn

    from guard.backends.batcher import BatcherConfig
    from guard.backends.local import LocalBackend
    from guard.worker.app import WorkerConfig, create_app

    transformers.logging.set_verbosity_error()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --device cpu --scale 8 for a dry run")
    config = BatcherConfig(
        max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms, max_queue=4096
    )

    def load() -> LocalBackend:
        from clef_gpu_latency import build_model

        model = build_model(args.device, args.scale, Path(args.tokenizer))
        return LocalBackend(model, batcher_config=config)

    app = create_app(load, config=WorkerConfig(model_name="clef-flash-random"))
    uvicorn.run(app, uds=args.uds, log_level="warning", lifespan="on")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this (CPU dry runs: 8)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_MODEL), help="checkpoint dir whose tokenizer encodes")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--requests-per-level", type=int, default=REQUESTS_PER_LEVEL)
    parser.add_argument("--check-requests", type=int, default=CHECK_REQUESTS)
    parser.add_argument("--state-repeat", type=int, default=STATE_REPEAT, help="sentences of state per request")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH)
    parser.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS)
    parser.add_argument("--max-wait-ms", type=float, default=MAX_WAIT_MS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--uds", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    import torch

    role = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve",
        "--device",
        args.device,
        "--scale",
        str(args.scale),
        "--tokenizer",
        args.tokenizer,
        "--max-batch-tokens",
        str(args.max_batch_tokens),
    ]
    batched = [*role, "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    single = [*role, "--max-batch", "1", "--max-wait-ms", "0"]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "CPU"
    title = (
        f"guard worker, Clef-flash shape 1/{args.scale} random bf16 on {where}, batched = --max-batch {args.max_batch} "
        f"--max-wait-ms {args.max_wait_ms:g}, state x{args.state_repeat}, {args.requests_per_level} timed requests "
        f"per level, torch {torch.__version__}"
    )
    worker_load.run(
        batched,
        single,
        concurrency=args.concurrency,
        per_level=args.requests_per_level,
        check_requests=args.check_requests,
        body=partial(worker_load.make_body, state_repeat=args.state_repeat),
        title=title,
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
