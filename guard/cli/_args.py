"""argparse types for values whose range a flag needs: a bad value is a usage error naming the flag (exit 2), not a
feature silently turned off (``--canary-interval nan``) or a late failure.

Each raises ``argparse.ArgumentTypeError`` (or ``ValueError`` for text that is no number, which argparse reports as
``invalid <type> value``); argparse prefixes the flag: ``argument --body-timeout: '0' is not a number of seconds above
0``. What only a config can check (one option against another, an upstream URL) it reports naming its field
(``ProxyConfig.max_head_bytes``); :func:`flag_names` writes those as the flags a command maps them to.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping

__all__ = [
    "count",
    "finite",
    "flag_names",
    "fraction",
    "milliseconds",
    "name",
    "non_negative",
    "positive_int",
    "positive_milliseconds",
    "positive_seconds",
    "ratio",
    "seconds",
    "share",
]


def finite(text: str, lowest: float, *, what: str, above: bool = False) -> float:
    """``text`` as a finite number of at least ``lowest`` (more than it with ``above``).

    Raises:
        argparse.ArgumentTypeError: ``'<text>' is not <what>`` for a number out of that range or not finite.
        ValueError: ``text`` is no number.
    """
    value = float(text)
    if not math.isfinite(value) or value < lowest or (above and value == lowest):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    return finite(text, 0, what="a number of seconds (0 or more)")


def positive_seconds(text: str) -> float:
    """A finite number of seconds, more than 0."""
    return finite(text, 0, above=True, what="a number of seconds above 0")


def milliseconds(text: str) -> float:
    """A finite number of milliseconds, 0 or more (returned in milliseconds)."""
    return finite(text, 0, what="a number of milliseconds (0 or more)")


def positive_milliseconds(text: str) -> float:
    """A finite number of milliseconds, more than 0 (returned in milliseconds)."""
    return finite(text, 0, above=True, what="a number of milliseconds above 0")


def positive_int(text: str) -> int:
    """A whole number of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return value


def count(text: str) -> int:
    """A whole number of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return value


def non_negative(text: str) -> float:
    """A finite number, 0 or more (a loss weight)."""
    return finite(text, 0, what="a number of 0 or more")


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value


def share(text: str) -> float:
    """A number from 0 to 1, both included."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 1")
    return value


def ratio(text: str) -> float:
    """A number of 1 or more; ``inf`` for no limit."""
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ratio of 1 or more (inf: no limit)")
    return value


def name(text: str) -> str:
    """A name that is neither empty nor blank, returned as given."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a name")
    return text


#: A config field as its errors name it: ``WorkerConfig.max_body_bytes``, ``BodyLimits.body_timeout_s``.
_FIELD = re.compile(r"\b[A-Z]\w*\.\w+")


def flag_names(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with each config field it names that ``flags`` maps (``{"ProxyConfig.read_timeout":
    "--read-timeout"}``) written as that flag; fields ``flags`` does not hold stay as they are."""
    return _FIELD.sub(lambda m: flags.get(m.group(0), m.group(0)), message)
