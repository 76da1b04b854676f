"""argparse types of the `xgraph` command line: a bad number is refused while the line is
parsed (one line naming the valid range, exit status 2), never replaced by a default or
passed on to fail later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
PIECEWISE_MIN = 4  # the smallest SGLang-style piecewise size (xgraph.buckets)


def _int(text: str, least: int, most: int | None = None, valid: str = "") -> int:
    """A whole number in [least, most]; `valid` says the range when it is not "at least"."""
    valid = valid or f"a whole number of at least {least}"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give {valid}") from None
    if n < least or (most is not None and n > most):
        raise argparse.ArgumentTypeError(f"{text!r}: give {valid}")
    return n


def _real(text: str, ok: Callable[[float], bool], valid: str) -> float:
    """A finite number for which ok(x) holds; `valid` says which."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {valid}") from None
    if not (math.isfinite(x) and ok(x)):
        raise argparse.ArgumentTypeError(f"{text!r}: give {valid}")
    return x


def positive_int(text: str) -> int:
    """A count or a size: 1 or more."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """A count where 0 means "none" or "all" (the option's help says which)."""
    return _int(text, 0)


def piecewise_max(text: str) -> int:
    """The largest piecewise size: at least the smallest one there is (4); below it the
    list of sizes would be empty."""
    return _int(
        text,
        PIECEWISE_MIN,
        valid=f"a whole number of at least {PIECEWISE_MIN} (the smallest piecewise size)",
    )


def seed(text: str) -> int:
    """A seed of torch's generators: 0 to 2**64 - 1."""
    return _int(text, 0, SEED_MAX, valid="a whole number from 0 to 2**64 - 1")


def non_negative_float(text: str) -> float:
    """A finite number of 0 or more (a temperature)."""
    return _real(text, lambda x: x >= 0, "a finite number of at least 0")


def positive_float(text: str) -> float:
    """A finite number above 0 (an amount of memory in GiB)."""
    return _real(text, lambda x: x > 0, "a finite number above 0")


def probability(text: str) -> float:
    """A number above 0 and at most 1 (top-p: 1 keeps every token)."""
    return _real(text, lambda x: 0 < x <= 1, "a number above 0 and at most 1")


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
