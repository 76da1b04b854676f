"""The reference attention runners: correct on any torch device, and the shared pieces of others.

`store_kv` writes a step's k/v into the paged cache and `sequence_spans` cuts a step into
its sequences on the host; device runners (an adapter's SDPA or fused kernels) reuse both,
so every runner stores and plans the same way. `runners_for` answers which runners an
executor on a backend runs (the executor asks it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import XGraphError
from .interfaces import AttentionRunner, Backend
from .metadata import AttentionMetadata, KVCache
from .plugins import get_backend

if TYPE_CHECKING:
    from .paging import PagedAttention


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor) -> None:
    """Write the first k.shape[0] tokens' k and v at their cache slots."""
    k_cache, v_cache = kv_cache
    n = k.shape[0]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots[:n], k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots[:n], v)


def context_kv(kv_cache: KVCache, blocks: torch.Tensor, seq_len: int) -> KVCache:
    """A sequence's first seq_len keys and values [seq_len, kv_heads, dim], gathered from
    its blocks (int64 ids of the blocks that hold them)."""
    k_cache, v_cache = kv_cache
    rows = blocks.shape[0] * k_cache.shape[1]
    return (
        k_cache[blocks].reshape(rows, *k_cache.shape[2:])[:seq_len],
        v_cache[blocks].reshape(rows, *v_cache.shape[2:])[:seq_len],
    )


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a step: its query rows [start, start + query_len) and its context."""

    start: int
    query_len: int
    seq_len: int
    row: torch.Tensor  # its block-table row (device)


def sequence_spans(md: AttentionMetadata) -> list[SeqSpan]:
    """The step's sequences, from the host copies of its lengths (runners planned on the host)."""
    spans, start = [], 0
    for i, (ql, sl) in enumerate(zip(md.query_lens_host, md.seq_lens_host)):
        spans.append(SeqSpan(start, ql, int(sl), md.block_tables[i]))  # sl may be np.int32
        start += ql
    return spans


class PlannedRunner(AttentionRunner):
    """Keeps the step's metadata; `run` before any `plan` is an error, not a stale step."""

    def __init__(self) -> None:
        self.md: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self.md = metadata

    def forget(self) -> None:
        self.md = None

    def planned(self) -> AttentionMetadata:
        if self.md is None:
            raise XGraphError(f"{type(self).__name__}.run before plan(): plan each step first.")
        return self.md

    def store_step(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache) -> AttentionMetadata:
        """Store the step's real tokens' k/v (padding rows stay out of the cache)."""
        md = self.planned()
        store_kv(k[: md.num_tokens], v[: md.num_tokens], kv_cache, md.slot_mapping)
        return md


class PagedDecodeRunner(PlannedRunner):
    """Graph-safe decode attention: q query tokens per sequence (1 in decode, 1 + k to verify
    k draft tokens), all data from device.

    Launch shape is fixed by (sequences, query length, block-table width): every sequence
    gathers its whole block-table row; its query j (at position seq_len - q + j) sees keys at
    positions up to its own, masked on the device (scores and values both, so garbage past
    seq_len cannot reach a real row), so neither the sequence lengths nor the block tables
    ever reach the host. The query length is the step's tokens over its sequences.
    """

    graph_safe = True
    max_query_len = 8

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> None:
        md = self.planned()
        store_kv(k, v, kv_cache, md.slot_mapping)
        k_cache, v_cache = kv_cache
        t, hq, d = q.shape
        b = md.num_seqs
        ql = t // b
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        # ids past a row's need are not validated (engines pad rows with anything): clamped,
        # so the gather stays inside the cache; what they point at is masked below
        bt = md.block_tables[:b].long().clamp(0, k_cache.shape[0] - 1)  # [b, w]
        w = bt.shape[1]
        keys = k_cache[bt].reshape(b, w * bs, hkv, d)
        vals = v_cache[bt].reshape(b, w * bs, hkv, d)
        # matmuls in the cache dtype (accumulating in float32), softmax in float32
        qg = q.reshape(b, ql, hkv, hq // hkv, d).to(keys.dtype)
        scores = torch.einsum("bqhgd,blhd->bhgql", qg, keys).float() * scale
        pos = torch.arange(w * bs, device=q.device)
        seq_lens = md.seq_lens[:b, None]
        own = seq_lens - ql + torch.arange(ql, device=q.device)[None, :]  # [b, ql]
        later = pos[None, None, :] > own[:, :, None]  # [b, ql, keys]: causal, and past seq_len
        scores = scores.masked_fill(later[:, None, None], float("-inf"))
        probs = scores.softmax(-1).to(vals.dtype)
        # slots past seq_len (the dummy block, stale or never-written cache) may hold NaN or
        # inf: a zero probability times NaN is NaN, so they are zeroed, not just weighted 0
        vals = vals.masked_fill((pos[None, :] >= seq_lens)[:, :, None, None], 0)
        o = torch.einsum("bhgql,blhd->bqhgd", probs, vals)
        out.copy_(o.reshape(t, hq, d))


class PagedPrefillRunner(PlannedRunner):
    """Prefill / chunked-prefill / mixed attention, planned on the host (not graph-safe).

    Each sequence attends causally over its cached context plus its new tokens; sequence
    boundaries come from the host plan, so the launch differs with the batch composition.
    Rows past the step's real tokens (bucket padding) are zeroed.
    """

    graph_safe = False

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self.spans = sequence_spans(metadata)

    def forget(self) -> None:
        super().forget()
        self.spans = []

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> None:
        n = self.store_step(k, v, kv_cache).num_tokens
        bs, hkv, d = kv_cache[0].shape[1:]
        hq = q.shape[1]
        for s in self.spans:
            start, ql, sl = s.start, s.query_len, s.seq_len
            keys, vals = context_kv(kv_cache, s.row[: -(-sl // bs)].long(), sl)
            qi = q[start : start + ql].reshape(ql, hkv, hq // hkv, d).float()
            scores = torch.einsum("qhgd,lhd->hgql", qi, keys.float()) * scale
            # query j sits at position sl - ql + j and sees keys at positions <= its own
            qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
            kpos = torch.arange(sl, device=q.device)[None, :]
            scores = scores.masked_fill((kpos > qpos)[None, None], float("-inf"))
            o = torch.einsum("hgql,lhd->qhgd", scores.softmax(-1), vals.float())
            out[start : start + ql].copy_(o.reshape(ql, hq, d))
        if out.shape[0] > n:
            out[n:].zero_()


def reference_runners() -> dict[str, AttentionRunner]:
    """Fresh reference runners by role: 'decode' (graph-safe) and 'prefill' (host-planned)."""
    return {"decode": PagedDecodeRunner(), "prefill": PagedPrefillRunner()}


def runners_for(
    backend: str | Backend | None = None, attention: PagedAttention | None = None
) -> tuple[AttentionRunner, AttentionRunner]:
    """The (decode, prefill) runners an executor on `backend` runs: `attention`'s own where
    it names them, else the backend's kernels (`Backend.kernels().attention`), else the
    reference runners; those two are fresh on every call (no plan shared with an executor),
    `attention`'s are returned as given. `backend`: a name, a Backend, or None
    (XGRAPH_BACKEND, else the best available)."""
    runners = {**reference_runners(), **get_backend(backend).kernels().attention}
    decode = attention.decode_runner if attention is not None else None
    prefill = attention.prefill_runner if attention is not None else None
    return decode or runners["decode"], prefill or runners["prefill"]
