"""Fused k/v store: a step's k and v rows written at their cache slots in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgraph.adapter import KVCache


@triton.jit
def _store_kernel(
    K,
    V,
    KC,
    VC,
    Slots,
    num_slots,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    s_kcb,
    s_kcs,
    s_kch,
    s_kcd,
    s_vcb,
    s_vcs,
    s_vch,
    s_vcd,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # a slot outside the cache is dropped rather than written past its end (the executor
    # has checked every slot; this only keeps a bad direct call from corrupting memory)
    heads = tl.where((slot >= 0) & (slot < num_slots), HEADS, 0)
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(K + t * s_kt + h[:, None] * s_kh + d[None, :] * s_kd, mask=mask)
    v = tl.load(V + t * s_vt + h[:, None] * s_vh + d[None, :] * s_vd, mask=mask)
    kc = KC + blk * s_kcb + off * s_kcs + h[:, None] * s_kch + d[None, :] * s_kcd
    vc = VC + blk * s_vcb + off * s_vcs + h[:, None] * s_vch + d[None, :] * s_vcd
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor, n: int
) -> None:
    """Write rows [0, n) of k, v [tokens, kv_heads, dim] at slots[:n] of the paged caches
    [blocks, block_size, kv_heads, dim]; one program per token, k and v together."""
    if n <= 0:
        return
    k_cache, v_cache = kv_cache
    heads, dim = k.shape[1], k.shape[2]
    _store_kernel[(n,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k_cache.shape[0] * k_cache.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEADS=heads,
        HEAD_DIM=dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=1 if heads * dim <= 1024 else 4,
    )
