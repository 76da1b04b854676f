"""What both attention kernels share: gathering key/value rows from their pages, and one
step of the online (streaming) softmax in float32 with base-2 exponents."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_slots(table_row, pos, valid, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """(block id, offset in the block) of each key position, as int64 (large caches)."""
    if MASKED:
        # positions past the context read no table entry: garbage there is never followed
        blk = tl.load(table_row + pos // PAGE, mask=valid, other=0)
    else:
        blk = tl.load(table_row + pos // PAGE)
    return blk.to(tl.int64), (pos % PAGE).to(tl.int64)


@triton.jit
def load_rows(Cache, blk, slot, d, mask, s_b, s_s, s_d):
    """Rows [positions, dim] of one kv head of a paged cache; masked entries read as 0."""
    ptr = Cache + blk[:, None] * s_b + slot[:, None] * s_s + d[None, :] * s_d
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def softmax_step(acc, m, den, s, v, PRECISION: tl.constexpr):
    """Fold scores s [rows, keys] (log2 units, -inf where masked) and values v [keys, dim]
    into the running (acc, max, denominator). Every row must have one finite score by its
    first step: its max then stays finite, so exp2 never sees -inf - -inf."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, den
