"""Attention runners of the Ascend backend.

Decode defaults to the core's graph-safe PagedDecodeRunner (pure aten, every per-step value
read from device buffers) and prefill to the core's host-planned PagedPrefillRunner, which
runs between the pieces of a piecewise graph. `FusedDecodeRunner` is the vllm-ascend way:
npu_fused_infer_attention_score, whose launch takes the sequence lengths as a HOST list.
Inside a full graph that list would be frozen at capture, so while a graph captures, the
runner launches the op as a graph task group and registers a task update on the graph
(AscendGraph.task_updates): before every replay the op is re-launched through
graph_task_update with the lengths of the step the executor planned, and an ExternalEvent
holds the captured op until its update is in (taskupdate.py). Opt in with
`PagedAttention(decode_runner=FusedDecodeRunner(backend), ...)`.
"""

from __future__ import annotations

from typing import Any

import torch

from xgraph.errors import XGraphError
from xgraph.graphs import capturing_graph
from xgraph.metadata import KVCache
from xgraph.runners import PlannedRunner, store_kv

from .graph import AscendGraph
from .runtime import NpuRuntime


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
        self.runtime: NpuRuntime = backend.runtime

    def lengths(self, batch: int) -> list[int]:
        """This step's host kv lengths for a launch of `batch` sequences."""
        md = self.planned()
        lens = [int(n) for n in md.seq_lens_host]
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
        store_kv(k, v, kv_cache, md.slot_mapping)  # device slots: graph-safe as it is
        b = q.shape[0]
        graph = capturing_graph()
        if graph is None:  # eager step or warm-up: launch with this step's lengths
            _FusedCall(self.runtime, q, kv_cache, md.block_tables[:b], out, scale, None).launch(
                self.lengths(b)
            )
            return
        if not isinstance(graph, AscendGraph):
            raise XGraphError(
                f"FusedDecodeRunner needs an Ascend graph to register its task update; the "
                f"graph being captured is a {type(graph).__name__}. Use the core's "
                "PagedDecodeRunner on other backends."
            )
        k_cache, v_cache = kv_cache
        table = md.block_tables[:b]
        ws = self.runtime.fused_attention_workspace(
            q, k_cache, v_cache, table, self.lengths(b), scale=scale
        )
        call = _FusedCall(self.runtime, q, kv_cache, table, out, scale, ws)
        graph.task_updates().record(call.launch, lambda: self.lengths(b))
