"""The parameterization check over the simulated NPU's task lists.

npu_fused_infer_attention_score takes the sequence lengths as a host list (its tiling follows
them, as CANN 8.3's paged attention picks tiling and kernel from host lengths). Launched
inside a task group that is updated before every replay (FusedDecodeRunner) the task may
differ between captures and the check passes; launched as a plain task it is frozen with
the capture step's lengths, and the check names that task and the argument that changed.
"""

from __future__ import annotations

import torch
from xgraph_ascend.attention import FusedDecodeRunner, _FusedCall

from xgraph import Buckets
from xgraph.models import Workload


def _workload(backend):  # type: ignore[no-untyped-def]
    return Workload.tiny(
        device=backend.device,
        dtype=torch.bfloat16,
        block_size=16,
        num_blocks=64,
        max_blocks=4,
        max_seqs=16,
    )


class FrozenFused(FusedDecodeRunner):
    """The fused op launched as a plain task at capture: no task group, no update."""

    def _record(self, graph, call: _FusedCall) -> None:  # type: ignore[no-untyped-def]
        call.launch(self.lengths(call.q.shape[0]))  # the planted leak


def test_the_task_updated_fused_runner_passes_and_its_task_is_marked(sim) -> None:  # type: ignore[no-untyped-def]
    w = _workload(sim)
    runner = FusedDecodeRunner(sim)
    ex = w.executor(
        backend=sim, buckets=Buckets([1, 2, 4, 8]), attention=w.attention(decode_runner=runner)
    )
    books = sim.runtime.books()
    report = ex.check_parameterization(kind="full")
    assert report.ok and not report.unstable, report
    assert sim.runtime.books() == books and ex.stats()["captures"] == 0
    ex.close()


def test_a_fused_task_frozen_at_capture_is_named_with_its_lengths(sim) -> None:  # type: ignore[no-untyped-def]
    w = _workload(sim)
    runner = FrozenFused(sim)
    ex = w.executor(
        backend=sim, buckets=Buckets([1, 2, 4, 8]), attention=w.attention(decode_runner=runner)
    )
    report = ex.check_parameterization(kind="full")
    layers = w.model.config.num_layers
    tasks = [d for d in report.differences if d.site.launch.kind == "task"]
    assert len(tasks) == layers == len(report.differences)
    d = tasks[0]
    assert d.site.launch.name == "FusedInferAttentionScore" and not d.site.launch.updated
    assert d.field == "arg 4"  # seq_lens, the host list the op's tiling follows
    assert d.first == (1, 1, 1, 1) and d.second == (64, 63, 62, 61)
    assert d.varied == ["sequence lengths"]
    assert d.site.launch.layer.startswith("model.layers.0.self_attn at ")
    assert d.site.launch.layer.endswith("# the planted leak`)")  # the line that launched it
    assert f"task {d.site.position} FusedInferAttentionScore (model.layers.0.self_attn" in str(
        report
    )
    ex.close()
