"""argparse types of the `xgraph` command line: a bad number is refused while the line is
parsed (one line, exit status 2), never replaced by a default or passed on to fail later."""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A count or a size: 1 or more."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return n


def non_negative_int(text: str) -> int:
    """A count where 0 means "none" or "all" (the option's help says which)."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 0")
    return n


def non_negative_float(text: str) -> float:
    """A finite number of 0 or more (a temperature)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of at least 0")
    return x


def sizes(text: str) -> list[int]:
    """A comma-separated list of positive sizes, such as 1,8,64 (at least one)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of sizes (for example 1,8,64)"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return values
