"""Attention runners over the Triton kernels of `xgraph_cuda.kernels` (CUDA, or the Triton
interpreter on CPU tensors under TRITON_INTERPRET=1).

`TritonPagedDecodeRunner` is graph-safe: its launches depend only on tensor shapes and read
every per-step value (lengths, block tables, slots) from device, so a full decode graph
records it (a store launch, then the attention launch). `TritonVarlenPrefillRunner` is
planned on the host: plan() turns the step's query lengths into one small tile table,
copied to the device once per step, and each layer is a single launch that stores the
layer's k/v and attends. Prefill runs eagerly between graph pieces, once per layer, so its
per-call host work is kept small: inputs are checked once per tensor layout and the launch
constants of a layout are worked out once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from xgraph.errors import XGraphError
from xgraph.metadata import AttentionMetadata, KVCache
from xgraph.runners import PlannedRunner

from .kernels import interpreting
from .kernels.decode import paged_decode
from .kernels.prefill import PrefillLaunch, PrefillStep
from .kernels.store import store_kv
from .kernels.tiles import TileBuffer, block_m_for

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 32


class AttentionKernelError(XGraphError, ValueError):
    """Tensors a Triton attention runner cannot take (shape, dtype, device, layout)."""


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             kv_cache: KVCache) -> str:  # fmt: skip
    """What does not fit the kernels ('' when everything does)."""
    k_cache, v_cache = kv_cache
    if q.dim() != 3 or k.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return (
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, caches {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}: expected [tokens, heads, dim] and two equal "
            "[blocks, block_size, kv_heads, dim] caches"
        )
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        return (
            f"q has {q.shape[1]} heads of dim {q.shape[-1]}, the cache {k_cache.shape[2]} "
            f"kv heads of dim {k_cache.shape[-1]}: dims must match and q heads be a multiple "
            "of kv heads"
        )
    if k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape:
        return (
            f"k {tuple(k.shape)}, v {tuple(v.shape)}: expected both [tokens, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] like the cache's kv heads"
        )
    if out.shape != q.shape:
        return f"out {tuple(out.shape)} is not shaped like q {tuple(q.shape)}"
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES:
        return f"dtypes q {q.dtype}, cache {k_cache.dtype}: the kernels take {DTYPES}"
    tensors = (q, k, v, out, k_cache, v_cache)
    if not interpreting() and not all(t.is_cuda for t in tensors):
        return (
            f"tensors on {q.device} / {k_cache.device}: the kernels run on CUDA devices "
            "(or on CPU under TRITON_INTERPRET=1)"
        )
    return ""


def check_inputs(runner: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, kv_cache: KVCache) -> None:  # fmt: skip
    """Raise AttentionKernelError naming what does not fit the kernels, and what to do."""
    problem = _problem(q, k, v, out, kv_cache)
    if problem:
        raise AttentionKernelError(
            f"{runner}: {problem}. Pass tensors that fit, or use the reference runners "
            "(xgraph.runners) for this model."
        )


def layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:  # fmt: skip
    """Everything check_inputs and the launch constants depend on: shapes, strides, dtypes
    and devices (the key their verdicts are kept under)."""
    return (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device, out.shape, out.stride(), out.dtype,
        out.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
    )  # fmt: skip


def _too_few_rows(runner: str, md: AttentionMetadata, rows: int, n: int) -> None:
    if md.slot_mapping.shape[0] < n or rows < n:
        raise AttentionKernelError(
            f"{runner}: {n} tokens to store, but the inputs have {rows} rows and slot_mapping "
            f"{md.slot_mapping.shape[0]} slots. Plan the runner on this step's metadata."
        )


_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device (a small fixed number in the interpreter)."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def auto_splits(programs: int, max_context: int, sms: int, block_n: int) -> int:
    """Splits per (sequence, kv head) from shapes only (so a graph keeps one launch): enough
    programs for about two waves, each split at least two key tiles of the widest table."""
    if programs >= sms:
        return 1
    want = -(-2 * sms // programs)
    cap = max(1, -(-max_context // (2 * block_n)))
    return max(1, min(want, cap, MAX_SPLITS))


class TritonPagedDecodeRunner(PlannedRunner):
    """Graph-safe decode attention: one query token per sequence, grid fixed by shapes.

    `num_splits` fixes the split-KV factor (None: chosen from the shapes and the device).
    """

    graph_safe = True

    def __init__(self, num_splits: int | None = None) -> None:
        super().__init__()
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise AttentionKernelError(
                f"TritonPagedDecodeRunner: num_splits={num_splits}; pass 1..{MAX_SPLITS} or "
                "None (chosen from the shapes)."
            )
        self.num_splits = num_splits
        self._splits: dict[tuple, tuple[int, int]] = {}  # (table width, layout) -> launch

    def _launch_for(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, kv_cache: KVCache) -> tuple[int, int]:  # fmt: skip
        """(splits, block_n) of a layout, checked once."""
        check_inputs(type(self).__name__, q, k, v, out, kv_cache)
        k_cache = kv_cache[0]
        block_n = 32 if k_cache.dtype == torch.float32 else 64
        splits = self.num_splits
        if splits is None:
            context = key[0] * k_cache.shape[1]
            splits = auto_splits(q.shape[0] * k_cache.shape[2], context, sm_count(q.device),
                                 block_n)  # fmt: skip
        self._splits[key] = (splits, block_n)
        return splits, block_n

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            kv_cache: KVCache, scale: float) -> None:  # fmt: skip
        md = self.planned()
        key = (md.block_tables.shape[1], layout(q, k, v, out, *kv_cache))
        launch = self._splits.get(key) or self._launch_for(key, q, k, v, out, kv_cache)
        # like the reference decode runner: every row (padding too, to the dummy slot)
        n = k.shape[0]
        _too_few_rows(type(self).__name__, md, n, n)
        store_kv(k, v, kv_cache, md.slot_mapping, n)
        b = q.shape[0]
        paged_decode(q, kv_cache, md.seq_lens[:b], md.block_tables[:b], out, scale, *launch)


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
    """Prefill / chunked-prefill / mixed attention, k/v store included, in one launch per
    layer, planned on host."""

    graph_safe = False
    _chosen: dict[tuple, PrefillConfig] = {}  # (dtype, dim, planned_m) -> config that ran

    def __init__(self) -> None:
        super().__init__()
        self._launches: dict[tuple, PrefillLaunch] = {}  # (planned_m, layout) -> launch
        self._buffers: dict[int, TileBuffer] = {}  # block_m -> persistent tile table
        self._steps: dict[int, PrefillStep] = {}  # block_m -> this step's plan
        self._checked: PrefillLaunch | None = None  # the launch this step's checks passed
        self._planned_m = 16
        self._max_seq = 0

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._planned_m = block_m_for(max(metadata.query_lens_host, default=0))
        self._max_seq = max(metadata.seq_lens_host, default=0)
        self._steps = {}
        self._checked = None
        self._step(self._planned_m)  # one host->device copy per step, shared by every layer

    def _step(self, block_m: int) -> PrefillStep:
        step = self._steps.get(block_m)
        if step is None:
            md = self.planned()
            buf = self._buffers.get(block_m)
            if buf is None:
                buf = self._buffers[block_m] = TileBuffer(md.block_tables.device)
            n = buf.build(md.query_lens_host, md.seq_lens_host, block_m)
            bt = md.block_tables
            step = PrefillStep(buf.table, n, md.slot_mapping, bt, bt.stride(0), md.num_tokens)
            self._steps[block_m] = step
        return step

    def _check_step(self, launch: PrefillLaunch) -> None:
        """This step against a layout: rows to store, a block table wide enough."""
        md, name = self.planned(), type(self).__name__
        _too_few_rows(name, md, min(launch.rows, launch.k_rows), md.num_tokens)
        if self._max_seq > md.block_tables.shape[1] * launch.page:
            raise AttentionKernelError(
                f"{name}: a sequence of {self._max_seq} tokens does not fit a block table of "
                f"{md.block_tables.shape[1]} blocks of {launch.page}. Widen the table."
            )
        self._checked = launch

    def _first_run(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, kv_cache: KVCache, scale: float) -> None:  # fmt: skip
        """Check a new layout, then launch the first config the device can run."""
        check_inputs(type(self).__name__, q, k, v, out, kv_cache)
        kind = (kv_cache[0].dtype, q.shape[-1], self._planned_m)
        configs = [self._chosen[kind]] if kind in self._chosen else prefill_configs(*kind)
        for i, cfg in enumerate(configs):
            launch = PrefillLaunch(q, k, v, out, kv_cache, cfg.block_m, cfg.block_n,
                                   cfg.num_warps, cfg.num_stages)  # fmt: skip
            self._check_step(launch)
            try:
                launch(q, k, v, out, kv_cache, self._step(cfg.block_m), scale)
            except OutOfResources:
                if i == len(configs) - 1:
                    raise
                continue
            self._chosen[kind] = cfg
            self._launches[key] = launch
            return

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            kv_cache: KVCache, scale: float) -> None:  # fmt: skip
        self.planned()
        key = (self._planned_m, layout(q, k, v, out, *kv_cache))
        launch = self._launches.get(key)
        if launch is None:
            self._first_run(key, q, k, v, out, kv_cache, scale)
            return
        if launch is not self._checked:
            self._check_step(launch)
        launch(q, k, v, out, kv_cache, self._step(launch.block_m), scale)
