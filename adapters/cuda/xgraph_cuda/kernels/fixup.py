"""Split-K (or split-KV) without a second kernel: the last program of a tile to finish sums
every program's partial, in split order.

Each program of a tile stores its float32 partial in its own slot of a workspace, then
(after a barrier, so every thread's stores are issued) increments the tile's arrival count
with one acquire-release atomic. The program that sees SPLIT - 1 arrived before it is the
last: every other partial is visible to it, and it adds them all in the fixed order 0 ..
SPLIT - 1 (whichever program arrives last, the sum is the same bits: replays are bitwise
repeatable) and resets the count to zero for the next launch. Workspace loads bypass L1
(`.cg`), which may hold no line another multiprocessor wrote.

The counts live in a per-device arena that is zero at rest (`arena.counts`): kernels that
use it run one after another on the stream, each leaving its counts at zero.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot(Part, tile, split, SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The workspace slot of (tile, split): ROWS rows of BLOCK_M float32 values."""
    return Part + (tile * SPLIT + split).to(tl.int64) * (ROWS * BLOCK_M)


@triton.jit
def publish(at, acc, row0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store acc [BLOCK_N, BLOCK_M] at rows row0 .. row0 + BLOCK_N of a slot."""
    offs = (row0 + tl.arange(0, BLOCK_N))[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(at + offs, acc)


@triton.jit
def publish_row(at, v, row: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store v [BLOCK_M] as row `row` of a slot."""
    tl.store(at + row * BLOCK_M + tl.arange(0, BLOCK_M), v)


@triton.jit
def arrive(Count, tile, SPLIT: tl.constexpr):
    """Whether this program is the tile's last to arrive; the last resets the count."""
    tl.debug_barrier()  # every thread of the program has issued its partial's stores
    seen = tl.atomic_add(Count + tile, 1, sem="acq_rel", scope="gpu")
    last = seen == SPLIT - 1
    tl.store(Count + tile, 0, mask=last)  # every program of the tile has arrived
    return last


@triton.jit
def gather(
    Part,
    tile,
    row0: tl.constexpr,
    SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Rows row0 .. row0 + BLOCK_N of the tile's slots, summed in split order."""
    offs = (row0 + tl.arange(0, BLOCK_N))[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(slot(Part, tile, s, SPLIT, ROWS, BLOCK_M) + offs, cache_modifier=".cg")
    return total


@triton.jit
def gather_row(
    Part, tile, row: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr
):
    """Row `row` of the tile's slots, summed in split order."""
    offs = row * BLOCK_M + tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(slot(Part, tile, s, SPLIT, ROWS, BLOCK_M) + offs, cache_modifier=".cg")
    return total
