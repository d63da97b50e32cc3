"""Run code that must read its input in linear time in a child process killed after a bound: a regular expression
holds the GIL and ignores signals, so only a separate process can be cut off. Linear code takes milliseconds; one that
backtracks over every way of splitting its input takes days, far past a bound a loaded machine cannot reach."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BOUND_S = 60


def runs_in_time(code: str, what: str) -> None:
    """Run ``code`` (Python source) in a child interpreter with this process's import path; fail the test naming
    ``what`` when it runs past :data:`BOUND_S` seconds, or when it raises."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {BOUND_S} s: a pattern reads its input in more than linear time")
