"""Strict JSON parsing cost: ``guard._json.loads`` (UTF-8 only, duplicate keys, depth, finite numbers, lone
surrogates) against ``json.loads`` alone, on bodies the worker and the middleware may get.

Three bodies of about 5 MB: 1.3 million ``[0]`` arrays (every value nested, so a Python walk of the tree would cost
seconds), the same with one valid surrogate-pair escape (which makes the surrogate check run), and flat prose. For
each, the fastest of ``--repeats`` runs in CPU time of this process (``time.process_time``) and the ratio.

    python bench/json_strict.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from guard._json import loads


def _fastest(parse: Callable[[str], object], text: str, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        started = time.process_time()
        parse(text)
        runs.append(time.process_time() - started)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    arrays = ",".join(["[0]"] * 1_300_000)
    bodies = {
        "1.3 M small arrays": '{"model": "m", "state": {"a": [' + arrays + "]}}",
        "same + a surrogate pair": '{"model": "m", "state": {"a": [' + arrays + '], "b": "\\ud83d\\ude00"}}',
        "flat prose": json.dumps({"model": "m", "state": {"text": "All work and no play. " * 240_000}}),
    }
    for name, text in bodies.items():
        strict, plain = _fastest(loads, text, args.repeats), _fastest(json.loads, text, args.repeats)
        print(f"{name:26s} {len(text) / 1e6:4.1f} MB  guard._json.loads {strict * 1000:7.0f} ms  "
              f"json.loads {plain * 1000:7.0f} ms  ratio {strict / plain:4.2f}")


if __name__ == "__main__":
    main()
