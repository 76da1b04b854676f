"""Pre-capture: which sizes `GraphExecutor.capture` and `warm_up` run, every one checked
before the first runs.

Each size then runs a synthetic step that touches only the dummy slot and block (the
planner builds it, xgraph.synthetic) down the path of every step.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from .buckets import Buckets
from .errors import InputError


def checked_sizes(sizes: Iterable[int] | None, buckets: Buckets, what: str) -> list[int]:
    """The sizes to pre-capture (default: every bucket, largest first), each an int from 1
    to the largest bucket (InputError naming the first that is not)."""
    if sizes is None:
        return sorted(buckets.sizes, reverse=True)
    if isinstance(sizes, (int, str)):
        raise InputError(f"{what}: sizes must be a list of ints, got {sizes!r}.")
    todo, top = [], buckets.max
    for n in sizes:
        try:
            m = operator.index(n)  # ints and numpy ints; not floats or strings
        except TypeError:
            m = None
        if m is None or isinstance(n, bool) or not 1 <= m <= top:
            raise InputError(
                f"{what}: sizes holds {n!r}; each size is a number of tokens, an int from 1 "
                f"to the largest bucket ({top}). Pass sizes in that range, or add a bucket."
            )
        todo.append(m)
    return todo


def query_sizes(
    sizes: Iterable[int] | None, buckets: Buckets, query_len: object, what: str
) -> list[int]:
    """`checked_sizes` for full graphs of `query_len` tokens per sequence (an int >= 1;
    above 1, sizes count sequences, and the default keeps those that fit)."""
    if type(query_len) is not int or query_len < 1:
        raise InputError(
            f"{what}: query_len={query_len!r}; give an int >= 1, the tokens per sequence of "
            "the full graphs to capture (1: decode steps)."
        )
    todo = checked_sizes(sizes, buckets, what)
    if query_len == 1:
        return todo
    top = buckets.max
    if sizes is None:
        return [n for n in todo if n * query_len <= top]
    if max(todo, default=0) * query_len > top:
        raise InputError(
            f"{what}: {max(todo)} sequences of {query_len} tokens are above the largest bucket "
            f"({top}); give at most {top // query_len} sequences."
        )
    return todo
