"""Decode through npu_fused_infer_attention_score with host lengths, task-updated per replay.

In bfloat16 with block sizes 16 and 128, what the op takes (float32 and block sizes off 16
are refused: test_fused_inputs.py). Tolerance: the fused runner (the simulator's reference
kernel, float32 math on bfloat16 inputs) against the core's PagedDecodeRunner run eagerly,
rtol = atol = 2e-2: two bfloat16 steps at |logit| ~ 1 (measured worst: one step, 7.8e-3);
against the fused runner run eagerly on the same padded step: bitwise equal.
"""

from __future__ import annotations

import random

import pytest
import torch
from xgraph_ascend.attention import FusedDecodeRunner
from xgraph_ascend.errors import AclRuntimeError

import xgraph
from xgraph import AttentionInputs, Buckets, XGraphError
from xgraph.models import Workload
from xgraph.runners import PagedDecodeRunner

BUCKETS = [1, 2, 4, 8]
DTYPE = torch.bfloat16


def _workloads(backend, n: int = 3, block_size: int = 16):  # type: ignore[no-untyped-def]
    ws = [
        Workload.tiny(
            device=backend.device,
            dtype=DTYPE,
            block_size=block_size,
            num_blocks=96 if block_size == 16 else 48,
            max_blocks=6,
            max_seqs=16,
        )
        for _ in range(n)
    ]
    for w in ws:
        w.randomize_cache(5)
    return ws


@pytest.mark.parametrize("block_size", [16, 128])
def test_replays_with_updated_lengths_match_eager(sim, block_size) -> None:  # type: ignore[no-untyped-def]
    ex_w, ref_w, fused_w = _workloads(sim, block_size=block_size)
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
        assert out.dtype == DTYPE
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
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
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=DTYPE)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, dtype=DTYPE)
    cache = w.cache.layers[0]
    graph, pool = backend.new_graph(), backend.new_pool()
    out = torch.empty_like(q)
    runner.run(q, k, k, out, cache, 0.5)  # warm-up
    with xgraph.graph(graph, pool):
        out = torch.empty_like(q)
        runner.run(q, k, k, out, cache, 0.5)
    return graph, pool, (w, md, q, k, out, runner)


def test_a_replay_whose_update_was_skipped_blocks_its_stream(sim) -> None:  # type: ignore[no-untyped-def]
    """What an NPU does: the replay returns, its stream blocks at the captured ExternalEvent
    wait (the fused op never runs on stale lengths) and a synchronize would hang; the
    simulator's fails with the stream-synchronize timeout instead, naming the wait. A
    record of the event releases the stream: the rest of the graph runs then."""
    graph, pool, (_w, _md, _q, _k, out, _runner) = _captured_decode(sim)
    graph.replay()  # the update runs first: fine
    sim.synchronize()
    expect = out.clone()
    out.zero_()
    graph._replay()  # the driver's replay without the update callbacks: returns
    assert torch.equal(out, torch.zeros_like(out))  # blocked before the op
    for _ in range(2):  # still blocked: every synchronize of it times out
        with pytest.raises(XGraphError, match="ACL_ERROR_RT_STREAM_SYNC_TIMEOUT") as info:
            sim.synchronize()
        assert "ran without the graph task update" in str(info.value)
        assert "synchronize timed out" in str(info.value)  # the adapter's advice
    (update,) = graph._task_updates.items
    update.event.record(sim.update_stream())  # what the skipped update would have done
    assert torch.equal(out, expect)  # the rest ran: the op, on the last update's lengths
    sim.synchronize()
    graph.replay()  # updates run again: the graph is usable
    sim.synchronize()
    graph.reset()
    pool.close()


def test_the_update_uses_this_steps_lengths(sim) -> None:  # type: ignore[no-untyped-def]
    graph, pool, (w, md, q, k, out, runner) = _captured_decode(sim)
    lens = [1, 9, 17, 23]
    md.seq_lens_host = lens  # a later step of the same bucket, planned as executors do
    runner.plan(md)
    graph.replay()
    expect = torch.empty_like(out)
    eager = FusedDecodeRunner(sim)
    eager.plan(md)
    eager.run(q, k, k, expect, w.cache.layers[0], 0.5)
    assert torch.equal(out, expect)
    md.seq_lens_host = lens[:3]  # a step of another bucket cannot update this graph
    runner.plan(md)
    with pytest.raises(XGraphError, match="captured for 4"):
        graph.replay()
    graph.reset()
    pool.close()


def _device_resident(w, step):  # type: ignore[no-untyped-def]
    """The step's metadata as an engine keeps it on the device: int32 lengths and tables."""
    a = step.attn
    return AttentionInputs(
        list(a.query_lens),
        torch.tensor(list(a.seq_lens), dtype=torch.int32),
        a.table(w.cache.dummy_block, w.max_blocks),
        torch.as_tensor(a.slot_mapping),
    )


def test_device_resident_metadata_decodes_as_host_metadata_does(sim) -> None:  # type: ignore[no-untyped-def]
    """A full graph's step with device metadata (`seq_lens_host` None) reads the lengths the
    op takes as a host list back from the device in `plan`: captures and task-updated
    replays give bit for bit what host metadata gives, and the caches agree."""
    dev_w, host_w = _workloads(sim, 2)
    exs = [
        w.executor(
            backend=sim,
            buckets=Buckets(BUCKETS),
            attention=w.attention(decode_runner=FusedDecodeRunner(sim)),
        )
        for w in (dev_w, host_w)
    ]
    exs[0].planner.attn_check.cpu_is_device = True  # host tensors count as the NPU's
    rng = random.Random(3)
    for batch in [3, 1, 4, 3, 8, 2]:
        step = dev_w.decode_step(rng, batch)
        kw = {"input_ids": step.input_ids, "positions": step.positions}
        out = exs[0](attn=_device_resident(dev_w, step), **kw)
        assert torch.equal(out, exs[1](attn=step.attn, **kw))
        for a, b in zip(dev_w.cache.tensors(), host_w.cache.tensors()):
            assert torch.equal(a, b)
    s = exs[0].stats()
    assert s["captures"] == 4 and s["replays"] == 6 and not s["eager"], s
    for ex in exs:
        ex.synchronize()  # the device check found nothing
        ex.close()


def _group_of_one_task(rt):  # type: ignore[no-untyped-def]
    """A captured graph whose task group holds one device task (an event record); the
    group's handle, the event and an update stream."""
    g, side, upd = rt.new_graph(), rt.new_stream(), rt.new_stream()
    x, event = torch.ones(4), rt.external_event()
    pool = rt.new_mempool(None)
    with rt.use_stream(side):
        g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        y = x * 2
        rt.task_group_begin(side)
        event.record(side)
        handle = rt.task_group_end(side)
        g.capture_end()
    return g, (side, upd), (handle, event), (x, y, pool)


def test_update_must_match_the_captured_group(sim) -> None:  # type: ignore[no-untyped-def]
    """A count or kernel-type mismatch is 507000, as the runtime reports it (207019 means a
    driver that cannot update the op at all)."""
    rt = sim.runtime
    g, (side, upd), (handle, event), keep = _group_of_one_task(rt)
    with rt.use_stream(upd):
        rt.task_update_begin(upd, handle)
        with pytest.raises(AclRuntimeError) as info:
            rt.task_update_end(upd)  # issued nothing: the count differs
    assert info.value.code == 507000 and "task group update error" in str(info.value)
    with rt.use_stream(upd):
        rt.task_update_begin(upd, handle)
        event.reset(upd)  # one task, of another kind
        with pytest.raises(AclRuntimeError) as info:
            rt.task_update_end(upd)
    assert info.value.code == 507000 and "kernel type error" in str(info.value)
    with rt.use_stream(upd):
        rt.task_update_begin(upd, handle)
        event.record(upd)  # the group's task again: accepted
        rt.task_update_end(upd)
    with rt.use_stream(side), pytest.raises(AclRuntimeError) as info:
        rt.task_group_begin(side)  # not capturing
    assert info.value.code == 107029
    g.reset()
    del keep


def test_a_driver_that_cannot_update_says_to_upgrade(sim) -> None:  # type: ignore[no-untyped-def]
    graph, pool, _ = _captured_decode(sim)
    sim.runtime.faults.inject("aclmdlRICaptureTaskUpdateBegin", 207019)
    with pytest.raises(XGraphError, match="ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP") as info:
        graph.replay()
    assert "(207019)" in str(info.value) and "upgrade the HDK/driver" in str(info.value)
    graph.replay()  # the next update goes through
    graph.reset()
    pool.close()


def test_an_update_while_a_replay_may_run_is_a_recorded_violation(sim) -> None:  # type: ignore[no-untyped-def]
    """The runtime does not check (StreamBeginTaskUpdate): on hardware the race is silent, so
    the simulator records it instead of failing the call (107037 comes only from
    aclmdlRIDestroy)."""
    rt = sim.runtime
    g, (_side, upd), (handle, event), keep = _group_of_one_task(rt)
    g.replay()  # busy until the next synchronize
    with rt.use_stream(upd):
        rt.task_update_begin(upd, handle)
        event.record(upd)
        rt.task_update_end(upd)
    violations = rt.lib.violations[:]
    rt.lib.violations.clear()  # the sim fixture fails on any left
    assert len(violations) == 1 and "synchronize" in violations[0]
    g.reset()
    del keep


def test_fused_runner_refuses_a_foreign_graph() -> None:
    cpu = xgraph.get_backend("cpu")
    from xgraph_ascend.backend import AscendSimBackend
    from xgraph_ascend.sim import SimRuntime

    runner = FusedDecodeRunner(AscendSimBackend(SimRuntime()))
    (w,) = _workloads(cpu, 1)
    step = w.padded(w.decode_step(random.Random(0), 2), Buckets([2]), full=True)
    runner.plan(step.attn.metadata())
    cfg = w.model.config
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, dtype=DTYPE)
    k = torch.randn(2, cfg.num_kv_heads, cfg.head_dim, dtype=DTYPE)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with pytest.raises(XGraphError, match="needs an Ascend graph"):
        with xgraph.graph(graph, pool):
            runner.run(q, k, k, torch.empty_like(q), w.cache.layers[0], 0.5)
    pool.close()
