"""Attention runners of the Ascend backend.

Decode defaults to the core's graph-safe PagedDecodeRunner (pure aten, every per-step value
read from device buffers) and prefill to the core's host-planned PagedPrefillRunner, which
runs between the pieces of a piecewise graph. `FusedDecodeRunner` is the vllm-ascend way:
npu_fused_infer_attention_score, whose launch takes the sequence lengths as a HOST list
(read in `plan`: device-resident metadata costs one small device-to-host copy per step,
see `host_lengths`).
Inside a full graph that list would be frozen at capture, so while a graph captures, the
runner launches the op as a graph task group and registers a task update on the graph
(AscendGraph.task_updates): before every replay the op is re-launched through
graph_task_update with the lengths of the step the executor planned, and an ExternalEvent
holds the captured op until its update is in (taskupdate.py). Opt in with
`PagedAttention(decode_runner=FusedDecodeRunner(backend), ...)`.

The op takes float16/bfloat16 only, a paged block size that is a multiple of 16 and an int32
block table, and no non-contiguous tensors. `check_inputs` refuses the rest with an
InputError saying what to change; a non-contiguous query (xgraph's models hand attention a
slice of the merged qkv) is copied to a contiguous buffer before the task group, so the copy
is an ordinary captured op and the group holds the fused op alone, as an update re-issues it.
A graph needs the op's fixed-size workspace (`_npu_fused_infer_attention_score_get_max_workspace`):
without one the op allocates a fresh workspace per launch, and a task update would leave the
captured task pointing at memory freed after the update, so capture is refused instead.
"""

from __future__ import annotations

from typing import Any

import torch

from xgraph.adapter import (
    AttentionMetadata,
    InputError,
    KVCache,
    PlannedRunner,
    XGraphError,
    capturing_graph,
    store_kv,
)

from .graph import AscendGraph
from .runtime import NpuRuntime

DTYPES = (torch.float16, torch.bfloat16)
BLOCK_MULTIPLE = 16  # paged attention over a float16/bfloat16 cache (IFA CheckPABlockSize)


def check_inputs(q: torch.Tensor, kv_cache: KVCache, table: torch.Tensor) -> None:
    """Refuse what npu_fused_infer_attention_score cannot take, saying what to change."""
    k_cache, v_cache = kv_cache
    fix = "or decode with the core's PagedDecodeRunner, which takes any of these"
    if q.dtype not in DTYPES:
        raise InputError(
            f"FusedDecodeRunner: npu_fused_infer_attention_score takes float16 or bfloat16 "
            f"queries, not {q.dtype}; build the model in bfloat16 or float16, {fix}."
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise InputError(
            f"FusedDecodeRunner: the KV cache is {k_cache.dtype}/{v_cache.dtype} and the query "
            f"{q.dtype}; the runner passes no antiquant scales, so the cache must have the "
            f"query's dtype: build it in {q.dtype}, {fix}."
        )
    block_size = k_cache.shape[1]
    if block_size % BLOCK_MULTIPLE:
        raise InputError(
            f"FusedDecodeRunner: block size {block_size} is not a multiple of "
            f"{BLOCK_MULTIPLE}, which the op's paged attention needs (32 for an int8 cache); "
            f"build the KV cache with block_size=16, 64 or 128, {fix}."
        )
    if table.dtype != torch.int32:
        raise InputError(
            f"FusedDecodeRunner: the block table is {table.dtype}; the op takes int32 block "
            "tables (AttentionMetadata builds int32 ones): convert it with .to(torch.int32)."
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InputError(
            "FusedDecodeRunner: the op takes contiguous KV caches only; allocate the cache "
            f"as one contiguous [blocks, block_size, kv_heads, head_dim] tensor, {fix}."
        )


def host_lengths(md: AttentionMetadata) -> list[int]:
    """The step's kv lengths as the host list the op takes (`actual_seq_lengths_kv`).

    Host metadata gives them as they are. Device-resident metadata (`seq_lens_host` None:
    a full graph's step whose lengths the engine keeps on the NPU) is read back with one
    device-to-host copy of `num_seqs` int32 values per step, in `plan`, outside any capture:
    it waits for the step's staging, device check included, on the current stream, so the
    lengths are the checked ones (a redirected sequence's too). The task-updated replay
    synchronizes the device before its updates anyway; the copy adds one small transfer.
    """
    if md.seq_lens_host is not None:
        return [int(n) for n in md.seq_lens_host]
    return [int(n) for n in md.seq_lens[: md.num_seqs].tolist()]


class _FusedCall:
    """One call site's launch of the fused op; its buffers live as long as the graph does."""

    def __init__(
        self,
        runtime: NpuRuntime,
        q: torch.Tensor,
        kv_cache: KVCache,
        table: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        workspace: torch.Tensor | None,
    ) -> None:
        self.runtime, self.q, self.kv_cache, self.table = runtime, q, kv_cache, table
        self.out, self.scale, self.workspace = out, scale, workspace
        self.lse = torch.empty(1, dtype=q.dtype, device=q.device)  # softmax_lse placeholder

    def launch(self, seq_lens: list[int]) -> None:
        """The op alone: inside a task group this is the one task an update re-issues."""
        k_cache, v_cache = self.kv_cache
        self.runtime.fused_infer_attention(
            self.q,
            k_cache,
            v_cache,
            self.table,
            seq_lens,
            self.out,
            self.lse,
            self.workspace,
            scale=self.scale,
        )


class FusedDecodeRunner(PlannedRunner):
    """Decode through npu_fused_infer_attention_score; host lengths applied by task update."""

    # graph-safe through the task update: the host lengths of each step reach the captured
    # op before its replay (and a replay without its update cannot run, see taskupdate.py)
    graph_safe = True

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self._lens: list[int] = []
        support = type(backend).availability().versions.get("fused decode", "yes")
        if support != "yes":
            raise XGraphError(
                f"FusedDecodeRunner cannot run on {backend.name}: {support} (op-plugin 7.0.0 "
                "or later has both). Upgrade torch_npu, or decode with the core's "
                "PagedDecodeRunner (the backend's default)."
            )
        self.runtime: NpuRuntime = backend.runtime

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._lens = host_lengths(metadata)

    def lengths(self, batch: int) -> list[int]:
        """This step's host kv lengths for a launch of `batch` sequences."""
        self.planned()
        lens = self._lens
        if len(lens) != batch:
            raise XGraphError(
                f"FusedDecodeRunner: the planned step has {len(lens)} sequences but this "
                f"launch was captured for {batch}; plan the step of this graph's bucket."
            )
        return lens

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
        b = q.shape[0]
        table = md.block_tables[:b]
        check_inputs(q, kv_cache, table)
        store_kv(k, v, kv_cache, md.slot_mapping)  # device slots: graph-safe as it is
        # the op takes contiguous tensors only; copies stay outside the task group
        q = q.contiguous()
        dst = (
            out
            if out.is_contiguous()
            else torch.empty_like(out, memory_format=torch.contiguous_format)
        )
        graph = capturing_graph()
        if graph is None:  # eager step or warm-up: launch with this step's lengths
            _FusedCall(self.runtime, q, kv_cache, table, dst, scale, None).launch(self.lengths(b))
        else:
            self._record(graph, _FusedCall(self.runtime, q, kv_cache, table, dst, scale, None))
        if dst is not out:
            out.copy_(dst)

    def _record(self, graph: Any, call: _FusedCall) -> None:
        """During capture: the launch as a task group, updated before every replay."""
        if not isinstance(graph, AscendGraph):
            raise XGraphError(
                f"FusedDecodeRunner needs an Ascend graph to register its task update; the "
                f"graph being captured is a {type(graph).__name__}. Use the core's "
                "PagedDecodeRunner on other backends."
            )
        b = call.q.shape[0]
        k_cache, v_cache = call.kv_cache
        call.workspace = self.runtime.fused_attention_workspace(
            call.q, k_cache, v_cache, call.table, self.lengths(b), scale=call.scale
        )
        if call.workspace is None:
            raise XGraphError(
                "FusedDecodeRunner: this torch_npu has no "
                "_npu_fused_infer_attention_score_get_max_workspace, so the fused op would "
                "allocate a new workspace on every launch and a graph task update would leave "
                "the captured op on memory freed after the update. Upgrade torch_npu "
                "(op-plugin 7.0.0 or later), or decode with the core's PagedDecodeRunner."
            )
        graph.task_updates().record(call.launch, lambda: self.lengths(b))
