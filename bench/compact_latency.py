"""Latency of the compact CPU model, the served path side by side with the model alone, for each encoder runtime.

Every case runs for the torch runtime (the encoder's dtype: bf16 where the CPU has it), the ONNX Runtime one
(float32) and ONNX Runtime int8 (``guard/compact/runtime.py``), one runtime's calls after the other (interleaved
calls let one runtime's idle threads take the other's time):
  * ``guard-3q``: the served path, ``Guard.evaluate`` on a catalog policy with 3 questions for an HTTP request whose
    body text is the 128-token state (target p50 <= 15 ms on 2 cores); every call is a cache miss (the text changes).
    A 160-position window (the shipped model's) holds it whole, 129 word pieces with the call number (the bench
    prints the window count);
  * ``guard-3q-sentences``: the same served path for a 128-token body of short sentences (a text of one window
    with several sentences is also read sentence by sentence, ``guard.compact.model.segments``: about twice the
    positions);
  * ``short-3q``: the model alone (``decide_sync``), the same state (``{"text": ...}``), 3 catalog questions (one
    encoder pass: a one-string state is read as that string by the pair question too);
  * ``short-1q``: the 128-token text as a plain string state, 1 question;
  * ``long-2000``: a 2,000-token state read whole in overlapping windows, 1 question (target <= 60 ms);
  * ``stack``: the encoder stack alone on the 128-token state's windows, run in length buckets as served
    (``CompactModel.stack_states``; torch also in float32, padded, where it runs bf16).

Usage::

    python bench/compact_latency.py                       # the settings below
    python bench/compact_latency.py --threads 1 --repeats 200
    python bench/compact_latency.py --weights build/catalog  # a checkpoint of your own
    python bench/compact_latency.py --baseline OLD_DIR       # also guard-3q side by side with another checkpoint

With ``--baseline`` the served ``guard-3q`` case also runs for both checkpoints in one process, per runtime, in blocks
of 10 calls alternating between them, and prints both p50s and their ratio (the way to compare two checkpoints on a
noisy machine).

Prints p50/p95/p99 in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

# ---- settings ------------------------------------------------------------------------------------------------------
THREADS = 2
WARMUP = 20  # the first ~10 calls of a fresh process are slow (bf16 kernels get set up)
REPEATS = 50
BLOCK = 10  # calls per block when --baseline alternates two checkpoints
SHORT_TOKENS = 128
LONG_TOKENS = 2000
QUESTIONS = ("guard.prompt_injection", "guard.harmful_request", "guard.refusal")
POLICY = """
policies:
  - id: bench
    version: "1"
    match: {http: {methods: [POST], paths: ["/v1/messages"]}}
    state: {text: body_text}
    questions:
      injection: {catalog: guard.prompt_injection}
      harmful: {catalog: guard.harmful_request}
      refusal: {catalog: guard.refusal}
    rules:
      - {id: injection, when: injection.noul >= 0.85, action: block}
    default: allow
"""
SENTENCES = (  # taken in turn until the sentences state has SHORT_TOKENS tokens
    "Please check the balance of my savings account.", "I want to know when the next payment is due.",
    "My salary arrives on the fifth of each month.", "Last month I was charged a late fee by mistake.",
    "Could you tell me whether that fee was refunded?", "I also need a statement for my landlord.",
    "Thanks for your help with all of this.", "I will be travelling next week, so email is best.",
)
STATE_WORDS = (  # repeated until the state has SHORT_TOKENS / LONG_TOKENS tokens
    "please check the balance of my savings account and tell me when the next payment is due because I want to "
    "plan the monthly budget carefully"
)
# --------------------------------------------------------------------------------------------------------------------


def _state(encoder: object, tokens: int) -> str:
    words = STATE_WORDS.split()
    text, n = [], 0
    while n < tokens:
        text.append(words[len(text) % len(words)])
        n = len(encoder.token_ids(" ".join(text)))  # type: ignore[attr-defined]
    return " ".join(text)


def _sentences(encoder: object, tokens: int) -> str:
    text: list[str] = []
    while len(encoder.token_ids(" ".join(text))) < tokens:  # type: ignore[attr-defined]
        text.append(SENTENCES[len(text) % len(SENTENCES)])
    return " ".join(text)


def _percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"p50 {pick(0.5):7.2f}  p95 {pick(0.95):7.2f}  p99 {pick(0.99):7.2f}  mean {statistics.mean(ordered):7.2f}"


def _time(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch CPU threads (default {THREADS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed calls per case (default {WARMUP})")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"timed calls per case (default {REPEATS})")
    parser.add_argument("--weights", default=None, help="a catalog checkpoint directory (default: the shipped one)")
    parser.add_argument("--baseline", default=None, help="another catalog checkpoint to run guard-3q side by side with")
    args = parser.parse_args()
    if min(args.threads, args.repeats) < 1 or args.warmup < 0:
        parser.error("--threads and --repeats must be >= 1, --warmup >= 0")

    import copy

    import onnxruntime
    import torch

    from guard.backends.compact import DEFAULT_WEIGHTS, CompactBackend
    from guard.compact.catalog import CATALOG
    from guard.compact.encoder import TextEncoder
    from guard.compact.runtime import choose
    from guard.engine import Guard
    from guard.policy import load_text
    from guard.subject import HttpSubject
    from guard.systemone import SystemOneRequestV1

    def timed(fn: Callable[[], object]) -> list[float]:
        return _time(fn, args.warmup, args.repeats)

    torch.set_num_threads(args.threads)
    weights = args.weights or DEFAULT_WEIGHTS
    backends = {name: CompactBackend.from_pretrained(weights, runtime=name) for name in ("torch", "onnx", "onnx-int8")}
    encoder = backends["torch"].models[0].encoder
    short, long = _state(encoder, SHORT_TOKENS), _state(encoder, LONG_TOKENS)
    sentences = _sentences(encoder, SHORT_TOKENS)
    print(f"threads {torch.get_num_threads()}, torch encoder dtype {encoder.dtype}, cpu "
          f"{torch.backends.cpu.get_cpu_capability()}, onnxruntime {onnxruntime.__version__}, "
          f"auto picks {choose('auto')}")

    def request(state: object, qids: tuple[str, ...]) -> SystemOneRequestV1:
        return SystemOneRequestV1.from_json(
            {"model": "compact", "state": state, "questions": {q: CATALOG[q].to_json() for q in qids}}
        )

    calls = iter(range(10**9))
    cases = {
        "short-3q (128 tok, 3 questions)": request({"text": short}, QUESTIONS),  # the state guard-3q sends
        "short-1q (128 tok, 1 question)": request(short, QUESTIONS[:1]),
        "long-2000 (2000 tok, 1 question)": request(long, QUESTIONS[:1]),
    }
    usage = backends["torch"].decide_sync(request({"text": f"{short} 99999"}, QUESTIONS)).usage
    print(f"guard-3q: {usage.state_tokens} tokens (with the call number), {usage.windows} window(s)")
    usage = backends["torch"].decide_sync(request({"text": f"{sentences} 99999"}, QUESTIONS)).usage
    print(f"guard-3q-sentences: {usage.state_tokens} tokens, {usage.windows} segments (the text, each sentence)")
    ids, mask, _, _ = encoder.window_batch([short])

    def served_by(backend: CompactBackend, body: str = short) -> Callable[[], object]:
        guard = Guard(load_text(POLICY), backends=backend)

        def served() -> object:
            text = f"{body} {next(calls)}"  # a new state each call (the number is one more token): never a cache hit
            return guard.evaluate(HttpSubject(method="POST", path="/v1/messages", content_type="application/json",
                                              body={"message": text}, body_text=text))

        return served

    for name, backend in backends.items():
        print(f"{'guard-3q (Guard.evaluate, 3q), ' + name:40s} {_percentiles(timed(served_by(backend)))} ms")
        print(f"{'guard-3q-sentences, ' + name:40s} {_percentiles(timed(served_by(backend, sentences)))} ms")
        for case, req in cases.items():
            samples = timed(lambda backend=backend, req=req: backend.decide_sync(req))
            print(f"{case + ', ' + name:40s} {_percentiles(samples)} ms")
        model = backend.models[0]
        samples = timed(lambda model=model: model.stack_states(ids, mask))  # windows in length buckets, as served
        print(f"{'stack (128 tok), ' + name:40s} {_percentiles(samples)} ms")
    if encoder.dtype != torch.float32:
        fp32 = TextEncoder(copy.deepcopy(encoder.model), encoder.tokenizer, encoder.config, torch.float32)
        top = copy.deepcopy(backends["torch"].models[0].head).float()
        with torch.inference_mode():
            samples = timed(lambda: top.encode(fp32.lower(ids, mask, top=len(top.top)), mask))
        print(f"{'stack (128 tok), torch float32':40s} {_percentiles(samples)} ms")
    if args.baseline:
        print(f"guard-3q side by side, blocks of {BLOCK} calls alternating: baseline {args.baseline}, weights {weights}")
        for name, backend in backends.items():
            pair = {"baseline": served_by(CompactBackend.from_pretrained(args.baseline, runtime=name)),
                    "weights": served_by(backend)}
            for fn in pair.values():
                _time(fn, args.warmup, 0)
            samples = {label: [] for label in pair}
            for _ in range(max(1, args.repeats // BLOCK)):
                for label, fn in pair.items():
                    samples[label] += _time(fn, 0, BLOCK)
            base, new = statistics.median(samples["baseline"]), statistics.median(samples["weights"])
            print(f"{'guard-3q, ' + name:40s} baseline p50 {base:7.2f}  weights p50 {new:7.2f}  "
                  f"baseline / weights {base / new:.2f}")


if __name__ == "__main__":
    main()
