"""Decode through npu_fused_infer_attention_score with host lengths, task-updated per replay.

Tolerance: the fused runner (float32 reference kernel of the simulator) against the core's
PagedDecodeRunner in eager mode: rtol = atol = 1e-5 (same math, different summation
order); against the fused runner run eagerly on the same padded step: bitwise equal.
"""

from __future__ import annotations

import random

import pytest
import torch
from xgraph_ascend.attention import FusedDecodeRunner
from xgraph_ascend.errors import AclRuntimeError

import xgraph
from xgraph import Buckets, XGraphError
from xgraph.models import Workload
from xgraph.runners import PagedDecodeRunner

BUCKETS = [1, 2, 4, 8]


def _workloads(backend, n: int = 3):  # type: ignore[no-untyped-def]
    ws = [
        Workload.tiny(device=backend.device, num_blocks=96, max_blocks=6, max_seqs=16)
        for _ in range(n)
    ]
    for w in ws:
        w.randomize_cache(5)
    return ws


def test_replays_with_updated_lengths_match_eager(sim) -> None:  # type: ignore[no-untyped-def]
    ex_w, ref_w, fused_w = _workloads(sim)
    runner = FusedDecodeRunner(sim)
    ex = ex_w.executor(
        backend=sim, buckets=Buckets(BUCKETS), attention=ex_w.attention(decode_runner=runner)
    )
    rng = random.Random(11)
    layers = ex_w.model.config.num_layers
    calls = sim.runtime.faults.calls
    for batch in [3, 1, 4, 3, 8, 2, 3, 7, 1, 4, 3]:
        step = ex_w.decode_step(rng, batch)
        out = ex(**step.kwargs())
        padded = ref_w.padded(step, Buckets(BUCKETS), full=True)
        ref = ref_w.eager(padded, runner=PagedDecodeRunner())[:batch]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        fused = fused_w.eager(padded, runner=FusedDecodeRunner(sim))[:batch]
        assert torch.equal(out, fused)
    s = ex.stats()
    assert s["captures"] == 4 and s["replays"] == 11 and not s["eager"]
    # every replay re-launched each layer's attention through a task update first
    assert calls["aclmdlRICaptureTaskUpdateBegin"] == 11 * layers
    assert calls["aclmdlRICaptureTaskGrpBegin"] == 4 * layers
    ex.close()


def _captured_decode(backend, batch: int = 4):  # type: ignore[no-untyped-def]
    """A graph of one fused attention call, captured on a step of `batch` sequences."""
    (w,) = _workloads(backend, 1)
    rng = random.Random(2)
    step = w.padded(w.decode_step(rng, batch), Buckets([batch]), full=True)
    md = step.attn.metadata(backend.device)
    runner = FusedDecodeRunner(backend)
    runner.plan(md)
    cfg = w.model.config
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim)
    cache = w.cache.layers[0]
    graph, pool = backend.new_graph(), backend.new_pool()
    out = torch.empty_like(q)
    runner.run(q, k, k, out, cache, 0.5)  # warm-up
    with xgraph.graph(graph, pool):
        out = torch.empty_like(q)
        runner.run(q, k, k, out, cache, 0.5)
    return graph, pool, (w, md, q, k, out)


def test_a_replay_whose_update_was_skipped_is_detected(sim) -> None:  # type: ignore[no-untyped-def]
    graph, pool, _ = _captured_decode(sim)
    graph.replay()  # the update runs first: fine
    graph.replay()
    with pytest.raises(XGraphError, match="ACL_ERROR_RT_WAIT_TIMEOUT") as info:
        graph._replay()  # the driver's replay without the update callbacks
    assert "update before this replay was skipped" in str(info.value)
    graph.replay()  # updates run again: the graph is usable
    graph.reset()
    pool.close()


def test_the_update_uses_this_steps_lengths(sim) -> None:  # type: ignore[no-untyped-def]
    graph, pool, (w, md, q, k, out) = _captured_decode(sim)
    lens = [1, 9, 17, 23]
    md.seq_lens_host = lens  # a later step of the same bucket
    graph.replay()
    expect = torch.empty_like(out)
    eager = FusedDecodeRunner(sim)
    eager.plan(md)
    eager.run(q, k, k, expect, w.cache.layers[0], 0.5)
    assert torch.equal(out, expect)
    md.seq_lens_host = lens[:3]  # a step of another bucket cannot update this graph
    with pytest.raises(XGraphError, match="captured for 4"):
        graph.replay()
    graph.reset()
    pool.close()


def test_update_must_match_the_captured_group(sim) -> None:  # type: ignore[no-untyped-def]
    rt = sim.runtime
    g, side, upd = rt.new_graph(), rt.new_stream(), rt.new_stream()
    x = torch.ones(4)
    pool = rt.new_mempool(None)
    with rt.use_stream(side):
        g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        rt.task_group_begin(side)
        y = x * 2  # an aten op inside the group
        handle = rt.task_group_end(side)
        g.capture_end()
    with rt.use_stream(upd):
        rt.task_update_begin(upd, handle)
        with pytest.raises(AclRuntimeError) as info:
            rt.task_update_end(upd)  # issued nothing: count differs
    assert info.value.code == 207019
    g.replay()
    with rt.use_stream(upd), pytest.raises(AclRuntimeError) as info:
        rt.task_update_begin(upd, handle)  # the replay may still run: synchronize first
    assert info.value.code == 107037
    rt.synchronize()
    with rt.use_stream(side), pytest.raises(AclRuntimeError) as info:
        rt.task_group_begin(side)  # not capturing
    assert info.value.code == 107029
    del y
    g.reset()


def test_fused_runner_refuses_a_foreign_graph() -> None:
    cpu = xgraph.get_backend("cpu")
    from xgraph_ascend.backend import AscendSimBackend
    from xgraph_ascend.sim import SimRuntime

    runner = FusedDecodeRunner(AscendSimBackend(SimRuntime()))
    (w,) = _workloads(cpu, 1)
    step = w.padded(w.decode_step(random.Random(0), 2), Buckets([2]), full=True)
    runner.plan(step.attn.metadata())
    cfg = w.model.config
    q = torch.randn(2, cfg.num_heads, cfg.head_dim)
    k = torch.randn(2, cfg.num_kv_heads, cfg.head_dim)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with pytest.raises(XGraphError, match="needs an Ascend graph"):
        with xgraph.graph(graph, pool):
            runner.run(q, k, k, torch.empty_like(q), w.cache.layers[0], 0.5)
    pool.close()
