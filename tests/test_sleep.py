"""Sleep and wake on the CPU backend beyond the conformance class (`SleepTests`, run on the
CPU by tests/test_cpu_conformance.py): shared memory, threads, refusals, regions' placement,
random sequences."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kept_views import executor_with_views

import xgraph
from xgraph import GraphExecutor, GraphMemory, Input, XGraphError
from xgraph.backends.cpu import CPUBackend
from xgraph.errors import AsleepError, ConcurrentStepError, VirtualMemoryError
from xgraph.models import Workload
from xgraph.testing.faults import books, fail_driver_call


def test_executors_sharing_graph_memory_sleep_and_wake_together(cpu):
    mem = GraphMemory(cpu, "shared-physical")
    a, b = (mlp_executor_on(cpu, mem, name) for name in ("a", "b"))
    x = torch.randn(16, 256)
    ya, yb = a(x=x, clone=True), b(x=x, clone=True)
    a.sleep()  # b's graphs use the same physical memory
    with pytest.raises(AsleepError, match="b is asleep"):
        b(x=x)
    late = mlp_executor_on(cpu, mem, "late")  # made while the memory sleeps: asleep too
    with pytest.raises(AsleepError):
        late(x=x)
    b.wake()
    assert torch.equal(a(x=x), ya) and torch.equal(b(x=x), yb)
    for ex in (a, b, late):
        ex.close()
    mem.close()


def mlp_executor_on(backend, memory, name):  # type: ignore[no-untyped-def]
    w = torch.randn(256, 256)
    return GraphExecutor(
        lambda x: torch.tanh(x @ w),
        inputs=[Input("x", torch.float32, ("num_tokens", 256))],
        backend=backend,
        buckets=[16],
        memory=memory,
        name=name,
    )


def test_sleep_needs_shared_physical_memory(cpu):
    ex = mlp_executor_on(cpu, "shared-pool", "pooled")
    ex(x=torch.randn(16, 256))
    with pytest.raises(XGraphError, match="needs 'shared-physical' graph memory"):
        ex.sleep()
    ex.close()
    with pytest.raises(XGraphError, match="is closed"):
        ex.wake()


def test_sleep_waits_for_a_step_in_flight_on_another_thread(cpu):
    started, release, order = threading.Event(), threading.Event(), []
    w = torch.randn(256, 256)

    def forward(x):  # type: ignore[no-untyped-def]
        if x.shape[0] > 16:  # the eager step above the largest bucket: it waits here
            started.set()
            release.wait(timeout=30)
            order.append("step done")
        return x @ w

    ex = GraphExecutor(
        forward, inputs=[Input("x", torch.float32, ("num_tokens", 256))], backend=cpu, buckets=[16]
    )
    ex(x=torch.randn(16, 256))
    stepper = threading.Thread(target=lambda: ex(x=torch.randn(40, 256)))
    stepper.start()
    assert started.wait(timeout=30)
    sleeper = threading.Thread(target=lambda: (ex.sleep(), order.append("slept")))
    sleeper.start()
    sleeper.join(timeout=0.5)
    assert sleeper.is_alive() and order == []  # sleep waits for the step
    release.set()
    stepper.join(timeout=30)
    sleeper.join(timeout=30)
    assert order == ["step done", "slept"]
    ex.wake()
    ex.close()


def test_sleep_inside_a_step_is_refused(cpu):
    holder: list[GraphExecutor] = []

    def forward(x):  # type: ignore[no-untyped-def]
        if x.shape[0] > 16:
            holder[0].sleep()
        return x * 2

    ex = GraphExecutor(
        forward, inputs=[Input("x", torch.float32, ("num_tokens", 4))], backend=cpu, buckets=[16]
    )
    holder.append(ex)
    with pytest.raises(ConcurrentStepError, match="inside a step"):
        ex(x=torch.randn(20, 4))
    ex(x=torch.randn(3, 4))  # nothing was given back
    ex.close()


def test_buffers_collected_inside_a_driver_call_are_given_back_at_the_next_safe_point(cpu):
    import gc

    from xgraph.arena import buffer_memory

    vm = buffer_memory(cpu)
    gc.collect()
    start = books(vm)
    ex = mlp_executor_on(cpu, None, "dropped")
    ex(x=torch.randn(16, 256))
    with vm._lock:  # as if collected inside a VirtualMemory call of this thread
        del ex
        gc.collect()
    assert books(vm) != start  # not safe there: deferred, though its arena is gone
    gc.collect()
    later = mlp_executor_on(cpu, None, "later")  # a new arena: a safe point
    later.close()
    assert books(vm) == start


def test_a_view_dropped_while_the_driver_still_captures_is_given_back_after(cpu, monkeypatch):
    """A closed executor's buffer kept by a view keeps its range until the view goes; a view
    that goes at the end of a capture, after the op guard is gone but before the driver's
    capture ends (where a CUDA synchronize or unmap would break the capture), waits for the
    next safe point."""
    from xgraph.arena import buffer_memory
    from xgraph.backends.cpu.graph import CPUGraph

    vm = buffer_memory(cpu)
    start = books(vm)
    ex, kept = executor_with_views(cpu)
    ex.close()
    held = books(vm)
    assert held != start  # covered: its range, the cover, the scratch chunk
    assert float(sum(t.sum() for t in kept)) == 0.0  # reads the scratch chunk, not freed memory
    seen = []
    end = CPUGraph._end

    def dropping_end(self):  # type: ignore[no-untyped-def]
        kept.clear()  # the last views go here, inside the driver's capture
        seen.append(books(vm))
        end(self)

    monkeypatch.setattr(CPUGraph, "_end", dropping_end)
    g = cpu.new_graph()
    with xgraph.graph(g):
        torch.ones(4) * 2
    g.reset()
    monkeypatch.undo()
    assert seen == [held] and books(vm) == held  # not inside the capture: deferred
    later = mlp_executor_on(cpu, None, "later")  # a new arena: a safe point
    later.close()
    assert books(vm) == start


# -- regions ----------------------------------------------------------------------------


def test_tensors_made_in_a_region_live_in_its_segments():
    backend = CPUBackend()
    with xgraph.memory_region("t-place", backend) as region:
        a = torch.zeros(4096)
        b = torch.randn(300, 7) * 2  # an op's fresh result moves too
        view = a[10:20]  # a view stays a view
    c = torch.zeros(8)  # outside the block: torch's own memory
    inside = [(s, s + n) for s, n in region.segments.ranges()]

    def placed(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in inside)

    assert placed(a) and placed(b) and placed(view) and not placed(c)
    assert view.data_ptr() == a.data_ptr() + 40
    held = region.nbytes
    del a, b, view
    with xgraph.memory_region("t-place", backend):
        d = torch.ones(4096)  # freed blocks serve later allocations of the region
    assert placed(d) and region.nbytes == held


def test_region_blocks_do_not_nest_capture_or_allocate_asleep():
    backend = CPUBackend()
    with xgraph.memory_region("t-outer", backend):
        with pytest.raises(XGraphError, match="do not nest"):
            with xgraph.memory_region("t-inner", backend):
                pass
        g = backend.new_graph()
        with pytest.raises(XGraphError, match="Capture outside the block"):
            with xgraph.graph(g):
                torch.ones(3) * 2
        kept = torch.arange(10.0)
    xgraph.sleep(tags="t-outer", backend=backend)  # weights-less: nothing offloaded
    with pytest.raises(AsleepError, match="wake"):
        with xgraph.memory_region("t-outer", backend):
            pass
    xgraph.wake(tags="t-outer", backend=backend)
    assert not kept.any()  # dropped: back as zeros


def test_unknown_tags_and_offload_typos_are_refused():
    backend = CPUBackend()
    with xgraph.memory_region("weights", backend):
        w = torch.ones(1000)
    with pytest.raises(XGraphError, match=r"no memory region has the tag\(s\) \['kv'\]"):
        xgraph.sleep(tags=["kv"], backend=backend)
    with pytest.raises(XGraphError, match="offload names \\['weight'\\]"):
        xgraph.sleep(offload="weight", backend=backend)
    report = xgraph.sleep(backend=backend)  # default offload: "weights"
    assert report.offloaded_bytes == report.released_bytes > 0
    xgraph.wake(backend=backend)
    assert torch.equal(w, torch.ones(1000))


def test_a_region_wake_that_fails_in_the_driver_rolls_back():
    backend = CPUBackend()
    vm = backend.virtual_memory()
    with xgraph.memory_region("weights", backend):
        ws = [torch.randn(50_000) for _ in range(4)]
    keep = [t.clone() for t in ws]
    xgraph.sleep(backend=backend)
    asleep = books(vm)
    for call in ("_create_chunk", "_map_chunk"):
        with fail_driver_call(vm, call, nth=2), pytest.raises(VirtualMemoryError):
            xgraph.wake(backend=backend)
        assert books(vm) == asleep
    xgraph.wake(backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ws, keep))


# -- random sequences -------------------------------------------------------------------

OPS = st.lists(
    st.sampled_from(["decode", "prefill", "sleep", "sleep-graphs", "wake", "bad-wake"]),
    min_size=4,
    max_size=12,
)


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    """A tiny model in regions of its own backend, an executor over it, and a twin model
    that never sleeps (the eager reference)."""
    from xgraph import PagedKVCache
    from xgraph.models import Qwen3Model

    backend = CPUBackend()
    with xgraph.memory_region("weights", backend):
        model = Qwen3Model.build("tiny", num_blocks=1, block_size=4)
    c = model.config
    with xgraph.memory_region("kv_cache", backend):
        model.kv_cache = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 256, 4)
    w, ref = Workload(model, 8, 16), Workload.tiny(num_blocks=256, max_blocks=8, max_seqs=16)
    ex = w.executor(backend=backend, buckets=[1, 2, 4, 8, 16])
    yield backend, w, ref, ex
    ex.close()


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, seed=st.integers(0, 10_000))
def test_random_sequences_of_steps_sleeps_and_wakes_match_eager(engine, ops, seed):
    from xgraph.buckets import Buckets

    backend, w, ref, ex = engine
    rng = random.Random(seed)
    vm = backend.virtual_memory()
    asleep = False
    for op in ops:
        if op in ("decode", "prefill"):
            if asleep:
                with pytest.raises(AsleepError):
                    ex(**w.decode_step(rng, 1).kwargs())
                continue
            for t, r in zip(w.cache.tensors(), ref.cache.tensors()):
                r.copy_(t)
            step = (
                w.decode_step(rng, rng.randint(1, 16))
                if op == "decode"
                else w.prefill_step(rng, [rng.randint(1, 6) for _ in range(rng.randint(1, 3))])
            )
            out = ex(**step.kwargs())
            full = step.attn.is_decode  # a prefill of one token per sequence is decode
            expected = ref.eager(ref.padded(step, Buckets([1, 2, 4, 8, 16]), full=full))
            assert torch.equal(out, expected[: step.num_tokens])
        elif op == "sleep":  # graphs, buffers and both regions (kept)
            xgraph.sleep(ex, offload=("weights", "kv_cache"))
            asleep = True
        elif op == "sleep-graphs":
            ex.sleep()
            asleep = True
        elif op == "bad-wake" and asleep:
            before = books(vm)
            with fail_driver_call(vm, "_map_chunk", nth=rng.randint(1, 3)) as fault:
                try:
                    xgraph.wake(ex)
                except VirtualMemoryError:
                    assert books(vm) == before
            asleep = fault.fired  # a fault that fired left it asleep
        else:
            xgraph.wake(ex)
            asleep = False
    xgraph.wake(ex)
