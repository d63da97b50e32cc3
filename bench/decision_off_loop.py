"""How long one decision on a large body holds the event loop, with its state rendered and its rules run inline or
on a thread (``guard.engine.guard.INLINE_DECISION_CHARS``).

A rules-only policy reads a JSON body's text with the four payload detectors (``sqli``, ``xss``, ``code_exec``,
``path_traversal``). A ticker task sleeps 1 ms at a time on the same loop while one decision runs; its worst gap is
how long every other request on that loop waited. Each body size runs both ways side by side, three times, and the
median is printed. On a thread, the loop still waits for the longest single C call the rules make while holding the
GIL (one regular-expression search over the whole text), not for the whole decision.

    python bench/decision_off_loop.py [--sizes 65536,262144,1048576]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import guard.engine.guard as engine
from guard.backends.fixture import FixtureBackend
from guard.engine import Guard
from guard.policy import load_text
from guard.subject import HttpSubject

POLICY = """
policies:
  - id: payloads
    version: 1
    match: {http: {}}
    state: {text: {from: body_text}}
    rules:
      - id: payload
        when: sqli(state.text) || xss(state.text) || code_exec(state.text) || path_traversal(state.text)
        action: block
"""
#: Text that makes ``xss`` read every character: tags that never close.
UNIT = "<a "


async def _one(guard: Guard, subject: HttpSubject) -> tuple[float, float]:
    """``(decision ms, worst loop gap ms)`` for one decision of ``subject``."""
    gaps: list[float] = []
    running = True

    async def tick() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    await guard.aevaluate(subject)
    took = time.perf_counter() - started
    running = False
    await ticker
    return took * 1000, max(gaps) * 1000


async def main(sizes: list[int]) -> None:
    guard = Guard(load_text(POLICY), backends=FixtureBackend())
    inline_chars = engine.INLINE_DECISION_CHARS
    print(f"{'chars':>9}  {'way':<9} {'decision ms':>12} {'worst loop gap ms':>18}")
    for size in sizes:
        subject = HttpSubject(method="POST", path="/notes", body={"text": (UNIT * (size // len(UNIT) + 1))[:size]},
                              content_type="application/json")  # fmt: skip
        runs: dict[str, list[tuple[float, float]]] = {"inline": [], "thread": []}
        for _ in range(3):
            for way, measured in runs.items():
                engine.INLINE_DECISION_CHARS = 1 << 62 if way == "inline" else inline_chars
                measured.append(await _one(guard, subject))
        engine.INLINE_DECISION_CHARS = inline_chars
        for way, measured in runs.items():
            took = statistics.median(m[0] for m in measured)
            gap = statistics.median(m[1] for m in measured)
            print(f"{size:>9}  {way:<9} {took:>12.0f} {gap:>18.0f}")
    await guard.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,262144,1048576", help="body text sizes in characters")
    asyncio.run(main([int(size) for size in parser.parse_args().sizes.split(",")]))
