"""Prefill attention over the paged KV cache with torch's scaled_dot_product_attention.

Same semantics as xgraph.attention.PagedPrefillRunner (the reference): store the step's k/v
at their slots, then each sequence attends causally over its cached context, query j of a
sequence sitting at position seq_len - query_len + j; rows past the real tokens are zeroed.
SDPA picks a fused kernel where it can, and computes in the input dtype.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from xgraph.errors import XGraphError
from xgraph.interfaces import AttentionRunner
from xgraph.metadata import AttentionMetadata

# SDPA broadcasts kv heads over query heads itself from torch 2.5 on
_HAS_GQA = torch.__version__ >= "2.5"


def _store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
) -> None:
    k_cache, v_cache = kv_cache
    n = k.shape[0]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots[:n], k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots[:n], v)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    groups: int,
) -> torch.Tensor:
    """q [1, hq, ql, d], k/v [1, hkv, sl, d] -> [1, hq, ql, d]; mask None means square causal."""
    kwargs: dict = {"scale": scale}
    if groups > 1:
        if _HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    # fused float32 kernels on the GPU may round through TF32; the math path keeps float32
    # numerics (its matmuls follow torch.backends.cuda.matmul), like the reference runner
    exact = q.dtype == torch.float32 and q.is_cuda
    with sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext():
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


class SDPAPrefillRunner(AttentionRunner):
    """Prefill / chunked-prefill / mixed attention through SDPA, planned on the host."""

    graph_safe = False

    def __init__(self) -> None:
        self.md: AttentionMetadata | None = None
        # (query start, query len, seq len, block-table row, mask or None for square causal)
        self._plan: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = []
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}  # (seq, block size) -> ids

    def plan(self, metadata: AttentionMetadata) -> None:
        self.md = metadata
        self._blocks = {}
        plan, start = [], 0
        device = metadata.block_tables.device
        for i, (ql, sl) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
            mask = None
            if ql != sl:
                # once per step, not per layer: query j at position sl - ql + j sees keys <= it
                qpos = torch.arange(sl - ql, sl, device=device)[:, None]
                kpos = torch.arange(sl, device=device)[None, :]
                mask = kpos <= qpos
            plan.append((start, ql, sl, metadata.block_tables[i], mask))
            start += ql
        self._plan = plan

    def _block_ids(self, i: int, row: torch.Tensor, sl: int, bs: int) -> torch.Tensor:
        ids = self._blocks.get((i, bs))
        if ids is None:
            ids = self._blocks[(i, bs)] = row[: -(-sl // bs)].long()
        return ids

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        md = self.md
        if md is None:
            raise XGraphError("SDPAPrefillRunner.run before plan(): plan each step first.")
        n = md.num_tokens
        _store_kv(k[:n], v[:n], kv_cache, md.slot_mapping)
        k_cache, v_cache = kv_cache
        bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        hq = q.shape[1]
        for i, (start, ql, sl, row, mask) in enumerate(self._plan):
            if ql == 0:
                continue
            ids = self._block_ids(i, row, sl, bs)
            nb = ids.shape[0]
            keys = k_cache[ids].reshape(nb * bs, hkv, d)[:sl].transpose(0, 1).unsqueeze(0)
            vals = v_cache[ids].reshape(nb * bs, hkv, d)[:sl].transpose(0, 1).unsqueeze(0)
            qi = q[start : start + ql].transpose(0, 1).unsqueeze(0)
            if keys.dtype != qi.dtype:
                keys, vals = keys.to(qi.dtype), vals.to(qi.dtype)
            o = _sdpa(qi, keys, vals, mask, scale, hq // hkv)
            out[start : start + ql].copy_(o[0].transpose(0, 1))
        if out.shape[0] > n:
            out[n:].zero_()
