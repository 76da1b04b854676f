"""Bucket policies (padded sizes that select a graph) and declared dims.

A dim either shapes the launch (it goes into the graph key, bucketed) or is updatable data
(the graph reads the whole persistent buffer along it and the device reads the real extent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import XGraphError


def default_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_size (max_size itself included)."""
    if max_size < 1:
        raise XGraphError(f"max_size must be >= 1, got {max_size}.")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    sizes += list(range(16, max_size + 1, 16))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def vllm_capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM default capture sizes: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


def sglang_piecewise_sizes(max_size: int = 2048) -> list[int]:
    """SGLang-style piecewise capture sizes: fine steps for small sizes, coarser above."""
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
    ]
    return [s for s in sizes if s <= max_size]


class Buckets:
    """A sorted list of sizes; `pad(n)` is the smallest size >= n, or None above the largest."""

    def __init__(self, sizes: Sequence[int]) -> None:
        s = sorted(set(int(x) for x in sizes))
        if not s or s[0] < 1:
            raise XGraphError(f"Bucket sizes must be positive integers, got {list(sizes)!r}.")
        self.sizes = s
        # a table makes pad() one list index on the hot path
        self._table = [0] * (s[-1] + 1)
        j = 0
        for n in range(1, s[-1] + 1):
            while s[j] < n:
                j += 1
            self._table[n] = s[j]

    @classmethod
    def of(cls, spec: Buckets | Sequence[int] | None, default_max: int) -> Buckets:
        """`spec` as Buckets; None: `default_sizes(default_max)`."""
        if isinstance(spec, Buckets):
            return spec
        if spec is None:
            return cls(default_sizes(default_max))
        if isinstance(spec, int):
            raise XGraphError(
                f"buckets={spec}: give the bucket sizes (a list or xgraph.Buckets), for example "
                f"xgraph.buckets.default_sizes({spec})."
            )
        return cls(spec)

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def pad(self, n: int) -> int | None:
        if n > self.sizes[-1]:
            return None
        return self._table[n] if n > 0 else self.sizes[0]

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.sizes)

    def __repr__(self) -> str:
        return f"Buckets({self.sizes})"


@dataclass(frozen=True)
class Dim:
    """A symbolic dimension of the declared inputs.

    - `buckets` given: shape-determining; its padded size joins the graph key (e.g. the
      number of tokens a collective moves, `num_comm_tokens`).
    - `pad_like="num_tokens"`: padded to the same bucket as that dim (decode: one sequence
      per token); it follows the key, it adds no entropy to it.
    - neither: updatable data; graphs read the buffer's full `max` extent, and the real
      extent is only data (e.g. the width of block tables).
    """

    name: str
    max: int
    buckets: Sequence[int] | None = None
    pad_like: str | None = None

    @property
    def in_key(self) -> bool:
        return self.buckets is not None


@dataclass(frozen=True)
class Input:
    """A declared model input: one persistent buffer of shape `shape` at the dims' maxima.

    `shape` holds ints and dim names ("num_tokens", or names of declared Dims); `fill` is
    written into padding (e.g. a dummy slot for slot mappings, 0 for token ids); `bounds`
    makes the executor refuse values outside [low, high) with an InputError naming the input
    (an index out of range inside a graph would only fail inside the replay, unnamed).
    """

    name: str
    dtype: object  # torch.dtype; kept loose so the dataclass needs no torch import
    shape: tuple[int | str, ...]
    fill: float | int = 0
    bounds: tuple[int, int] | None = None  # valid values lie in [low, high): token ids, positions
