"""Attention runners over the Triton kernels of `xgraph_cuda.kernels` (CUDA, or the Triton
interpreter on CPU tensors under TRITON_INTERPRET=1).

`TritonPagedDecodeRunner` is graph-safe: its launches depend only on tensor shapes and read
every per-step value (lengths, block tables, slots) from device, so a full decode graph
records it. `TritonVarlenPrefillRunner` is planned on the host: plan() turns the step's
query lengths into one small tile table, copied to the device once per step and read by
every layer's single attention launch. Both store the step's k/v with one fused launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from xgraph.adapter import AttentionMetadata, KVCache, PlannedRunner, XGraphError

from . import pdl
from .kernels import arena, interpreting, sm_count
from .kernels.decode import paged_decode
from .kernels.prefill import varlen_prefill
from .kernels.store import store_kv
from .kernels.tiles import block_m_for, tile_table

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 32
DECODE_ENV = "XGRAPH_CUDA_DECODE"
DECODE_CHOICES = ("auto", "fused", "split")


def decode_fused() -> bool:
    """Whether XGRAPH_CUDA_DECODE asks for the one-launch decode (auto, fused) or for the
    store, split attention and merge launches (split)."""
    asked = os.environ.get(DECODE_ENV, "auto").strip().lower() or "auto"
    if asked not in DECODE_CHOICES:
        raise XGraphError(
            f"{DECODE_ENV}={asked!r}; use one of {', '.join(DECODE_CHOICES)} (auto, fused: "
            "one launch stores, attends and merges; split: three launches)."
        )
    return asked != "split"


class AttentionKernelError(XGraphError, ValueError):
    """Tensors a Triton attention runner cannot take (shape, dtype, device, layout)."""


def check_inputs(
    runner: str, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, kv_cache: KVCache
) -> None:
    """Raise AttentionKernelError naming what does not fit the kernels, and what to do."""
    k_cache, v_cache = kv_cache
    problem = ""
    if q.dim() != 3 or k.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        problem = (
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, caches {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}: expected [tokens, heads, dim] and two equal "
            "[blocks, block_size, kv_heads, dim] caches"
        )
    elif q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        problem = (
            f"q has {q.shape[1]} heads of dim {q.shape[-1]}, the cache {k_cache.shape[2]} "
            f"kv heads of dim {k_cache.shape[-1]}: dims must match and q heads be a multiple "
            "of kv heads"
        )
    elif out.shape != q.shape:
        problem = f"out {tuple(out.shape)} is not shaped like q {tuple(q.shape)}"
    elif q.dtype not in DTYPES or k_cache.dtype not in DTYPES:
        problem = f"dtypes q {q.dtype}, cache {k_cache.dtype}: the kernels take {DTYPES}"
    elif not interpreting() and not (q.is_cuda and k_cache.is_cuda and k.is_cuda):
        problem = (
            f"tensors on {q.device} / {k_cache.device}: the kernels run on CUDA devices "
            "(or on CPU under TRITON_INTERPRET=1)"
        )
    if problem:
        raise AttentionKernelError(
            f"{runner}: {problem}. Pass tensors that fit, or use the reference runners "
            "(xgraph.runners) for this model."
        )


def _stored_rows(runner: str, md: AttentionMetadata, k: torch.Tensor, n: int) -> int:
    if md.slot_mapping.shape[0] < n or k.shape[0] < n:
        raise AttentionKernelError(
            f"{runner}: {n} tokens to store, but k has {k.shape[0]} rows and slot_mapping "
            f"{md.slot_mapping.shape[0]} slots. Plan the runner on this step's metadata."
        )
    return n


def auto_splits(programs: int, max_context: int, sms: int, block_n: int) -> int:
    """Splits per (sequence, kv head) from shapes only (so a graph keeps one launch): enough
    programs for about two waves, each split at least two key tiles of the widest table. A
    power of two: the split count is compiled into the kernel, and every distinct one is
    another binary the process compiles and loads (device memory it keeps)."""
    if programs >= sms:
        return 1
    want = -(-2 * sms // programs)
    cap = max(1, -(-max_context // (2 * block_n)))
    n = max(1, min(want, cap, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def decode_tiles(programs: int, splits: int, max_context: int, sms: int) -> tuple[int, int]:
    """Key tile and pipeline stages of a 16-bit decode launch from shapes only (`splits` as
    `auto_splits` chose them over 64-key tiles). Where every split's share of the widest
    table is at most two tiles, a program walks a tile or two: one stage (a pipelined loop's
    prologue costs more than it hides). Where the split programs still leave SMs idle,
    32-key tiles: more loads in flight per SM for the same keys. Measured on an H100 over
    contexts of up to 256 tokens in 512-token tables (docs/kernels.md, "The decode
    attention's tiles"); long shares keep the two stages they were tuned with."""
    short = max_context <= 2 * 64 * splits
    block_n = 32 if short and programs * splits < sms else 64
    return block_n, 1 if short and splits > 1 else 2


class TritonPagedDecodeRunner(PlannedRunner):
    """Graph-safe decode attention: q query tokens per sequence (1 + k to verify k draft
    tokens, causal inside the step), grid fixed by shapes.

    `num_splits` fixes the split-KV factor (None: chosen from the shapes and the device).
    `fused`: one launch per decode step's layer (store, attention, merge) where the step has
    one query token per sequence (None: XGRAPH_CUDA_DECODE decides).
    """

    graph_safe = True
    max_query_len = 8

    def __init__(self, num_splits: int | None = None, fused: bool | None = None) -> None:
        super().__init__()
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise AttentionKernelError(
                f"TritonPagedDecodeRunner: num_splits={num_splits}; pass 1..{MAX_SPLITS} or "
                "None (chosen from the shapes)."
            )
        self.num_splits = num_splits
        self.fused = decode_fused() if fused is None else fused

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
        name = type(self).__name__
        check_inputs(name, q, k, out, kv_cache)
        k_cache = kv_cache[0]
        t, b = q.shape[0], md.num_seqs
        if not b or t % b:
            raise AttentionKernelError(
                f"{name}: {t} query tokens for {b} sequences; a decode step has the same "
                "number of tokens for every sequence. Plan the runner on this step's metadata."
            )
        # like the reference decode runner: every row (padding too, to the dummy slot)
        n = _stored_rows(name, md, k, k.shape[0])
        one = self.fused and t == b == n and k.stride(-1) == 1 and v.stride(-1) == 1
        if not one:
            store_kv(k, v, kv_cache, md.slot_mapping, n)
        programs, sms = t * k_cache.shape[2], sm_count(q.device)
        context = md.block_tables.shape[1] * k_cache.shape[1]
        wide = k_cache.dtype == torch.float32  # 4-byte rows: 32-key tiles, two stages
        splits = self.num_splits or auto_splits(programs, context, sms, 32 if wide else 64)
        block_n, stages = (32, 2) if wide else decode_tiles(programs, splits, context, sms)
        counts = None
        if self.fused and splits > 1 and programs <= arena.SIZE:
            counts = arena.counts(q.device)  # None inside a process's first capture
        tables, seq_lens = md.block_tables[:b], md.seq_lens[:b]
        store = (k, v, md.slot_mapping) if one else None
        # a programmatic edge only where the (token, kv head) programs fit the SMs: measured
        # on an H100, edges into Qwen3-0.6B's batch-64 attention (512 programs) cost 10%
        on = pdl.launch_options(q.is_cuda, attribute=programs < sms)
        paged_decode(
            q,
            kv_cache,
            seq_lens,
            tables,
            out,
            scale,
            splits,
            block_n,
            num_stages=stages,
            query_len=t // b,
            store=store,
            counts=counts,
            pdl=on,
        )


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel; block_m is the tile table's row count."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_configs(dtype: torch.dtype, dim: int, planned_m: int) -> list[PrefillConfig]:
    """Configs to try in order (a later one when the device runs out of shared memory).
    16-bit, dim <= 128: what measured fastest on an H200 (16-row tiles: 32-key steps)."""
    if dtype == torch.float32 or dim > 128:  # 4-byte or wide rows: smaller tiles
        return [PrefillConfig(planned_m, 32, 4, 2), PrefillConfig(16, 16, 4, 1)]
    first = PrefillConfig(planned_m, 32 if planned_m <= 16 else 64, 4, 2)
    return [first, PrefillConfig(planned_m, 32, 4, 1), PrefillConfig(16, 16, 4, 1)]


class TritonVarlenPrefillRunner(PlannedRunner):
    """Prefill / chunked-prefill / mixed attention in one launch per layer, planned on host."""

    graph_safe = False
    _chosen: dict[tuple, PrefillConfig] = {}  # (dtype, dim, planned_m) -> config that ran

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[int, torch.Tensor] = {}
        self._planned_m = 16
        self._max_seq = 0

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._planned_m = block_m_for(max(metadata.query_lens_host, default=0))
        self._max_seq = max(metadata.seq_lens_host, default=0)
        self._tables = {}
        self._table(self._planned_m)  # one host->device copy per step, shared by every layer

    def _table(self, block_m: int) -> torch.Tensor:
        t = self._tables.get(block_m)
        if t is None:
            md = self.planned()
            host = tile_table(md.query_lens_host, md.seq_lens_host, block_m)
            t = self._tables[block_m] = host.to(md.block_tables.device)
        return t

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
        name = type(self).__name__
        check_inputs(name, q, k, out, kv_cache)
        n = _stored_rows(name, md, k, md.num_tokens)
        k_cache = kv_cache[0]
        if self._max_seq > md.block_tables.shape[1] * k_cache.shape[1]:
            raise AttentionKernelError(
                f"{name}: a sequence of {self._max_seq} tokens does not fit a block table of "
                f"{md.block_tables.shape[1]} blocks of {k_cache.shape[1]}. Widen the table."
            )
        store_kv(k, v, kv_cache, md.slot_mapping, n)
        key = (k_cache.dtype, q.shape[-1], self._planned_m)
        chosen = self._chosen.get(key)
        configs = [chosen] if chosen is not None else prefill_configs(*key)
        for i, cfg in enumerate(configs):
            try:
                varlen_prefill(
                    q,
                    kv_cache,
                    self._table(cfg.block_m),
                    md.seq_lens,
                    md.block_tables,
                    out,
                    n,
                    scale,
                    cfg.block_m,
                    cfg.block_n,
                    cfg.num_warps,
                    cfg.num_stages,
                )
            except OutOfResources:
                if i == len(configs) - 1:
                    raise
                continue
            self._chosen[key] = cfg
            return
