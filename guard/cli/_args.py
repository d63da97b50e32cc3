"""argparse types for numbers whose range a flag needs: a bad value is a usage error naming the flag (exit 2), not a
feature silently turned off (``--canary-interval nan``) or a late failure."""

from __future__ import annotations

import argparse
import math

__all__ = ["fraction", "positive_int", "positive_seconds", "seconds"]


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds, more than 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give more than 0 seconds")
    return value


def positive_int(text: str) -> int:
    """A whole number of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 or more")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value
