"""What npu_fused_infer_attention_score refuses, in the simulator and in FusedDecodeRunner.

The simulated op refuses what the real one does (float32, a block size off 16, an int8 cache
without antiquant scales, non-contiguous tensors, a non-int32 block table) with 161002
ACLNN_ERR_PARAM_INVALID. The runner refuses the same inputs first, with an InputError that
says what to change and before it writes the KV cache; it makes a non-contiguous query
contiguous outside the task group; it refuses to capture without the op's fixed workspace.
"""

from __future__ import annotations

import random

import pytest
import torch
from xgraph_ascend.attention import FusedDecodeRunner
from xgraph_ascend.backend import AscendSimBackend
from xgraph_ascend.errors import AclRuntimeError
from xgraph_ascend.sim import SimRuntime
from xgraph_ascend.sim import availability as sim_availability

import xgraph
from xgraph import Buckets, InputError, XGraphError
from xgraph.interfaces import Availability
from xgraph.models import Workload

B, HQ, HKV, D = 2, 4, 2, 16


def _op_args(dtype=torch.bfloat16, block_size=16, table_dtype=torch.int32, cache_dtype=None):  # type: ignore[no-untyped-def]
    cache = torch.randn(8, block_size, HKV, D).to(cache_dtype or dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=table_dtype)
    q = torch.randn(B, HQ, D).to(dtype)
    return q, cache, cache.clone(), table


def _launch(rt, q, k, v, table) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.empty(B, HQ, D, dtype=q.dtype)
    lse = torch.empty(1, dtype=q.dtype)
    rt.fused_infer_attention(q, k, v, table, [5, 17], out, lse, None, scale=0.25)
    return out


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"dtype": torch.float32}, "only float16/bfloat16"),
        ({"block_size": 4}, "blocksize 4 should be 16 aligned"),
        ({"block_size": 24}, "blocksize 24 should be 16 aligned"),
        ({"cache_dtype": torch.int8}, "blocksize 16 should be 32 aligned"),
        ({"cache_dtype": torch.int8, "block_size": 32}, "antiquant_scale"),
        ({"table_dtype": torch.int64}, "int32"),
    ],
)
def test_the_simulated_op_refuses_what_the_npu_op_refuses(kw, why) -> None:  # type: ignore[no-untyped-def]
    rt = SimRuntime()
    with pytest.raises(AclRuntimeError, match=why) as info:
        _launch(rt, *_op_args(**kw))
    assert info.value.code == 161002 and "ACLNN_ERR_PARAM_INVALID" in str(info.value)


def test_the_simulated_op_refuses_non_contiguous_tensors() -> None:
    rt = SimRuntime()
    q, k, v, table = _op_args(block_size=128)
    merged = torch.randn(B, HQ + 2 * HKV, D, dtype=q.dtype)  # as a model's merged qkv
    with pytest.raises(AclRuntimeError, match="non-contiguous query"):
        _launch(rt, merged[:, :HQ], k, v, table)
    with pytest.raises(AclRuntimeError, match="non-contiguous key/value"):
        _launch(rt, q, k.transpose(2, 3), v, table)
    out = _launch(rt, merged[:, :HQ].contiguous(), k, v, table)  # what the runner passes
    assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())


def _planned_runner(backend, w, batch: int = 2):  # type: ignore[no-untyped-def]
    step = w.padded(w.decode_step(random.Random(3), batch), Buckets([batch]), full=True)
    runner = FusedDecodeRunner(backend)
    runner.plan(step.attn.metadata(backend.device))
    cfg = w.model.config
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim).to(w.cache.dtype)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim).to(w.cache.dtype)
    return runner, q, k


@pytest.mark.parametrize(
    "kw, words",
    [
        ({}, ["float16 or bfloat16", "not torch.float32", "PagedDecodeRunner"]),  # tiny's default
        ({"dtype": torch.bfloat16}, ["block size 4 is not a multiple of 16", "block_size=16"]),
        ({"dtype": torch.float16, "block_size": 24}, ["block size 24"]),
    ],
)
def test_the_runner_refuses_what_the_op_cannot_take(sim, kw, words) -> None:  # type: ignore[no-untyped-def]
    w = Workload.tiny(device=sim.device, num_blocks=32, max_blocks=4, **kw)
    w.randomize_cache(1)
    before = [t.clone() for t in w.cache.tensors()]
    runner, q, k = _planned_runner(sim, w)
    with pytest.raises(InputError) as info:
        runner.run(q, k, k, torch.empty_like(q), w.cache.layers[0], 0.25)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, w.cache.tensors()))  # cache untouched


def test_the_runner_refuses_mismatched_caches_and_tables(sim) -> None:  # type: ignore[no-untyped-def]
    w = Workload.tiny(device=sim.device, dtype=torch.bfloat16, block_size=16, num_blocks=32)
    runner, q, k = _planned_runner(sim, w)
    k_cache, v_cache = w.cache.layers[0]
    with pytest.raises(InputError, match="must have the query's dtype"):
        runner.run(q.half(), k.half(), k.half(), torch.empty_like(q.half()), (k_cache, v_cache), 1)
    with pytest.raises(InputError, match="contiguous KV caches"):
        strided = (k_cache.transpose(2, 3), v_cache)
        runner.run(q, k, k, torch.empty_like(q), strided, 0.25)
    runner.md.block_tables = runner.md.block_tables.long()
    with pytest.raises(InputError, match="int32 block tables"):
        runner.run(q, k, k, torch.empty_like(q), (k_cache, v_cache), 0.25)


def test_an_executor_on_the_shipped_defaults_gets_the_documented_error(sim) -> None:  # type: ignore[no-untyped-def]
    w = Workload.tiny(device=sim.device)  # float32, block size 4
    ex = w.executor(
        backend=sim,
        buckets=Buckets([1, 2, 4]),
        attention=w.attention(decode_runner=FusedDecodeRunner(sim)),
    )
    with pytest.raises(InputError, match="float16 or bfloat16"):
        ex(**w.decode_step(random.Random(0), 3).kwargs())
    ex.close()
    assert sim.runtime.books() == dict.fromkeys(sim.runtime.books(), 0)


def test_the_task_group_holds_the_fused_op_alone(sim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The model's query is a slice of the merged qkv: the runner copies it before the group,
    so the group holds one task, the one an update re-issues."""
    rt = sim.runtime
    groups = []
    end = rt.task_group_end
    monkeypatch.setattr(rt, "task_group_end", lambda s: groups.append(end(s)) or groups[-1])
    w = Workload.tiny(device=sim.device, dtype=torch.bfloat16, block_size=16, num_blocks=48)
    w.randomize_cache(2)
    ex = w.executor(
        backend=sim,
        buckets=Buckets([4]),
        attention=w.attention(decode_runner=FusedDecodeRunner(sim)),
    )
    rng = random.Random(4)
    for _ in range(3):
        ex(**w.decode_step(rng, 4).kwargs())
    assert len(groups) == w.model.config.num_layers
    assert all([t.kind for t in g.tasks] == ["FusedInferAttentionScore"] for g in groups)
    ex.close()


def test_no_workspace_query_means_no_capture(sim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Without the max-workspace query the op allocates per launch: capture is refused rather
    than falling back to workspace=None; eager launches still run."""
    w = Workload.tiny(device=sim.device, dtype=torch.bfloat16, block_size=16, num_blocks=32)
    monkeypatch.setattr(sim.runtime, "fused_attention_workspace", lambda *a, **kw: None)
    runner, q, k = _planned_runner(sim, w)
    cache = w.cache.layers[0]
    runner.run(q, k, k, torch.empty_like(q), cache, 0.25)  # eager: the op's own workspace
    graph, pool = sim.new_graph(), sim.new_pool()
    with pytest.raises(XGraphError, match="_npu_fused_infer_attention_score_get_max_workspace"):
        with xgraph.graph(graph, pool):
            runner.run(q, k, k, torch.empty_like(q), cache, 0.25)
    pool.close()
    assert sim.runtime.books() == dict.fromkeys(sim.runtime.books(), 0)


class _NoFusedOp(AscendSimBackend):
    @classmethod
    def availability(cls) -> Availability:
        base = sim_availability()
        versions = {**base.versions, "fused decode": "no: this torch_npu lacks torch_npu.x"}
        return Availability(True, base.reason, versions)


def test_the_runner_refuses_a_backend_without_the_fused_op() -> None:
    with pytest.raises(XGraphError, match=r"lacks torch_npu\.x") as info:
        FusedDecodeRunner(_NoFusedOp(SimRuntime()))
    assert "PagedDecodeRunner" in str(info.value)
