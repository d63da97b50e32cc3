"""``guard decide``: answer one System One request with a local Clef checkpoint and print the response JSON.

Usage::

    guard decide --model DIR [--dtype auto|float32|bfloat16] [--device cpu|cuda] [--max-length N]
                 [--confidence reference|workers-ai|jev] [--profile reference|workers-ai] [--raw] [FILE]

The request is read from FILE (or stdin when FILE is absent or ``-``; a pipe such as ``<(...)`` too), at most
:data:`MAX_REQUEST_BYTES` (8 MiB, the worker's largest body: more exits 2), parsed strictly (UTF-8, object key order kept,
duplicate keys rejected), validated with ``--profile`` (default ``reference``: it accepts what the reference
``systemone()`` accepts and reports the reference's messages) and answered. The response is printed with numbers
rounded to 4 decimals; a state cut to fit ``--max-length`` adds ``usage.state_tokens_dropped`` (as the worker
does) and a warning on stderr. ``--raw`` adds a ``raw`` object: ``input_tokens`` and, per question, the option ids in prompt
order with unrounded float32 logits and probabilities. Invalid input exits 2 with one line naming the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from guard.backends.options import add_device_options, device, torch_dtype
from guard.cli._output import write_utf8
from guard.errors import GuardError, InvalidJson, RequestValidationError

__all__ = ["register", "run"]

EXIT_INVALID = 2
EXIT_FAILED = 1
#: Largest request read: the worker's largest request body (``guard.worker.app.DEFAULT_MAX_BODY_BYTES``).
MAX_REQUEST_BYTES = 8 << 20


def register(subparsers: Any) -> None:
    """Add the ``decide`` subcommand."""
    parser = subparsers.add_parser(
        "decide",
        help="answer one System One request with a local Clef checkpoint",
        description="Read one System One request (JSON) from FILE or stdin and print the response JSON.",
    )
    parser.add_argument("file", nargs="?", default="-", metavar="FILE", help="request JSON file (default: stdin)")
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (release layout)")
    add_device_options(parser)
    parser.add_argument("--max-length", type=int, default=None, metavar="N", help="prompt limit (default 16384)")
    parser.add_argument(
        "--confidence", choices=("reference", "workers-ai", "jev"), default="reference", help="confidence formula"
    )
    parser.add_argument(
        "--profile", choices=("reference", "workers-ai"), default="reference", help="request validation rules"
    )
    parser.add_argument("--raw", action="store_true", help="add prompt-order option ids, logits and probabilities")
    parser.set_defaults(handler=run)


def _fail(message: str, code: int) -> int:
    print(f"guard decide: {message}", file=sys.stderr)
    return code


def _read(file: str) -> bytes:
    """The request's bytes, at most :data:`MAX_REQUEST_BYTES`: a FIFO (``<(...)``) or stdin is read too, capped, so
    ``/dev/zero`` or an endless pipe is refused instead of filling memory.

    Raises:
        OSError: it cannot be read.
        FileRefused: it is a folder, stdin is closed, or it holds more than :data:`MAX_REQUEST_BYTES`.
    """
    from guard._readfile import FileRefused, read_capped

    if file != "-":
        return read_capped(file, MAX_REQUEST_BYTES, streams=True)
    if sys.stdin is None:  # the process was started with stdin closed (``<&-``)
        raise FileRefused("it is closed; give the request as FILE")
    data = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
    if len(data) > MAX_REQUEST_BYTES:
        raise FileRefused(f"it holds more than {MAX_REQUEST_BYTES} bytes; at most {MAX_REQUEST_BYTES}")
    return data


def run(args: argparse.Namespace) -> int:
    """Handler: returns 0 on success, 2 for invalid input or arguments, 1 when the model cannot run."""
    from guard import _json
    from guard._readfile import FileRefused
    from guard.systemone import SystemOneRequestV1

    if args.max_length is not None and args.max_length < 1:
        return _fail(f"--max-length must be a positive integer, got {args.max_length}", EXIT_INVALID)
    model_dir = Path(args.model)
    if not model_dir.is_dir():  # before the request is read: a misspelt path shows at once, stdin or not
        what = "not a directory" if model_dir.exists() else "the directory does not exist"
        return _fail(f"--model {args.model}: {what}", EXIT_INVALID)
    source = "stdin" if args.file == "-" else args.file
    try:
        raw = _read(args.file)
        if not raw.strip():
            return _fail(f"{source} is empty: expected one System One request (a JSON object)", EXIT_INVALID)
        request = SystemOneRequestV1.from_json(_json.loads(raw), profile=args.profile)
    except OSError as exc:
        return _fail(f"cannot read {args.file}: {exc.strerror or exc}", EXIT_INVALID)
    except FileRefused as exc:
        return _fail(f"cannot read {source}: {exc}", EXIT_INVALID)
    except InvalidJson as exc:  # its message names the fault ("invalid JSON: ...", "duplicate key ...")
        return _fail(f"{source}: {exc}", EXIT_INVALID)
    except RequestValidationError as exc:
        return _fail(f"invalid request: {exc}", EXIT_INVALID)

    try:
        dtype = torch_dtype(args)
    except ValueError as exc:
        return _fail(str(exc), EXIT_INVALID)
    try:
        model = _load(args.model, dtype, device(args))
    except (OSError, ValueError) as exc:
        return _fail(f"cannot load model from {args.model}: {exc}", EXIT_INVALID)
    except Exception as exc:  # noqa: BLE001 - a damaged checkpoint: safetensors, tokenizers and config errors
        return _fail(f"cannot load model from {args.model}: {type(exc).__name__}: {exc}", EXIT_INVALID)
    try:
        record = model.encode(request, max_length=args.max_length)
        (logits,) = model.forward_records([record])
    except RequestValidationError as exc:
        return _fail(f"invalid request: {exc}", EXIT_INVALID)
    except GuardError as exc:
        return _fail(str(exc), EXIT_FAILED)
    response = model.answer(request, record, logits, confidence_profile=args.confidence)
    body_out: dict[str, Any] = response.served_json()
    dropped = response.usage.state_tokens_dropped
    if dropped:  # also in the printed usage, as the worker answers it
        print(f"guard decide: warning: the state was cut to fit --max-length ({args.max_length or model.max_length} tokens): "
              f"{dropped} state tokens were not read (usage.state_tokens_dropped)", file=sys.stderr)
    if args.raw:
        body_out["raw"] = _raw(record, logits)
    write_utf8(json.dumps(body_out, ensure_ascii=False) + "\n")
    return 0


def _load(path: str, dtype: Any, where: str) -> Any:
    import transformers

    from guard.clef.model import ClefModel

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return ClefModel.from_pretrained(path, dtype=dtype, device=where)


def _raw(record: Any, logits: Any) -> dict[str, Any]:
    import torch

    questions = {}
    for question, z in zip(record.questions, logits, strict=True):
        questions[question.question_id] = {
            "option_ids": list(question.option_ids),
            "logits": [float(v) for v in z.tolist()],
            "probabilities": [float(v) for v in torch.softmax(z.float(), dim=-1).tolist()],
        }
    return {"input_tokens": len(record.input_ids), "questions": questions}
