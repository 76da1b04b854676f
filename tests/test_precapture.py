"""Pre-capture's cost (xgraph.capture): `GraphExecutor.capture` does not replay its synthetic
steps, a capture after `warm_up` of the same step skips its own warm-up, and every key's
first real step is still right (bitwise equal to eager on the CPU backend). On the
simulated device: what one capture session asks of the runtime. The op guard's per-op
memo never hides a host read."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from xgraph_dummy.backend import DummyBackend

import xgraph
from xgraph.models import Workload
from xgraph.safety import check_op
from xgraph.testing.sim import SimRuntime
from xgraph.testing.sim.graph import SimGraph

SIZES = [1, 2, 4, 8]
aten = torch.ops.aten


def _counting(w: Workload, calls: list[int]):  # type: ignore[no-untyped-def]
    """The model's forward, noting the tokens of each call (warm-ups and recordings)."""

    def forward(**kw):  # type: ignore[no-untyped-def]
        calls.append(int(kw["input_ids"].shape[0]))
        return w.model.forward_logits(**kw)

    return forward


def _but_dummy(w: Workload) -> list[torch.Tensor]:
    d = w.cache.dummy_block
    return [torch.cat([t[:d], t[d + 1 :]]) for t in w.cache.tensors()]


def _graphs(recording) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for part in recording.describe() if part != "runner")


def _steps(w: Workload, mode: str, rng: random.Random) -> list:
    """One step of each bucket's size (no padding: eager runs the same shapes)."""
    if mode == "full":
        return [w.decode_step(rng, n, max_context=24) for n in (4, 1, 8, 2)]
    return [w.prefill_step(rng, q) for q in ([3, 1], [1], [5, 3], [2])]


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_precapture_replays_nothing_and_first_real_steps_equal_eager(mode):
    w, ref = Workload.tiny(), Workload.tiny()
    for x in (w, ref):
        x.randomize_cache(3)
    ex = w.executor(backend="cpu", buckets=SIZES, mode=mode)
    eager = ref.executor(backend="cpu", buckets=SIZES, mode="eager")
    ex.capture(kind=mode, progress=False)
    s = ex.stats()
    assert s["captures"] == 4 and s["replays"] == 0 and s["capture_parts"]["replay"] == 0
    assert s["capture_parts"]["record"] > 0
    for step in _steps(w, mode, random.Random(0)):  # each key's first real step: a replay
        assert torch.equal(ex(**step.kwargs()), eager(**step.kwargs()))
    s = ex.stats()
    assert s["captures"] == 4 and s["replays"] == 4 and not s["eager"]
    for a, b in zip(_but_dummy(w), _but_dummy(ref)):
        assert torch.equal(a, b)
    ex.close()
    eager.close()


def test_a_capture_after_warm_up_skips_its_warm_up():
    w, ref, calls = Workload.tiny(), Workload.tiny(), []
    ex = w.executor(_counting(w, calls), backend="cpu", buckets=SIZES)
    ex.warm_up(SIZES)
    assert calls == [1, 2, 4, 8] and ex.stats()["eager"] == {"warm-up": 4}
    calls.clear()
    ex.capture(progress=False)  # largest first
    # 8: the first capture warms up anyway (its warm-up fixes the output buffers); the rest
    # record only, planned as their warm-ups would have planned them
    assert calls == [8, 8, 4, 2, 1]
    eager = ref.executor(backend="cpu", buckets=SIZES, mode="eager")
    for step in _steps(w, "full", random.Random(1)):
        assert torch.equal(ex(**step.kwargs()), eager(**step.kwargs()))
    assert ex.stats()["captures"] == 4 and ex.stats()["replays"] == 4
    ex.close()
    eager.close()


def test_only_the_same_synthetic_step_skips_its_warm_up():
    w, calls = Workload.tiny(), []
    ex = w.executor(_counting(w, calls), backend="cpu", buckets=SIZES)
    ex.warm_up([8, 3, 2])
    calls.clear()
    ex.capture([8, 4], progress=False)  # 4 was warmed as 3 tokens padded: other inputs
    assert calls == [8, 8, 4, 4]
    calls.clear()
    rng = random.Random(2)
    ex(**w.decode_step(rng, 2).kwargs())  # a real step's capture: its own inputs, warmed
    assert calls == [2, 2]
    calls.clear()
    ex.capture([3], progress=False)  # key 4 is captured: nothing recorded again
    assert calls == [] and ex.stats()["captures"] == 3
    ex.close()


def test_a_warm_up_in_another_thread_is_not_reused():
    """Each thread captures on its own capture stream; a warm-up sets up that stream's."""
    w, calls = Workload.tiny(), []
    ex = w.executor(_counting(w, calls), backend="cpu", buckets=SIZES)
    ex.capture([8], progress=False)  # the first capture: the output buffers
    t = threading.Thread(target=ex.warm_up, args=([4],))
    t.start()
    t.join()
    calls.clear()
    ex.capture([4], progress=False)
    assert calls == [4, 4]
    ex.close()


def test_a_capture_session_on_the_simulated_device(monkeypatch):
    """What capture() asks of the runtime: no replay, one empty_cache (before the output
    buffers), at most one synchronize per graph begun; the memory plan replays nothing."""
    backend = DummyBackend(SimRuntime())
    rt, calls = backend.runtime, {"synchronize": 0, "empty_cache": 0, "replay": 0, "begin": 0}

    def counted(name, fn):  # type: ignore[no-untyped-def]
        def call(*a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(rt, "synchronize", counted("synchronize", rt.synchronize))
    monkeypatch.setattr(rt, "empty_cache", counted("empty_cache", rt.empty_cache))
    monkeypatch.setattr(SimGraph, "replay", counted("replay", SimGraph.replay))
    monkeypatch.setattr(SimGraph, "capture_begin", counted("begin", SimGraph.capture_begin))
    w = Workload.tiny()
    for mode in ("full", "piecewise"):
        calls.update(dict.fromkeys(calls, 0))
        ex = w.executor(backend=backend, buckets=SIZES, mode=mode)
        xgraph.predict_graph_memory(ex)
        assert calls["replay"] == 0
        calls.update(dict.fromkeys(calls, 0))
        ex.capture(kind=mode, progress=False)
        per_key = 1 if mode == "full" else w.model.config.num_layers + 1  # pieces
        graphs = sum(_graphs(ex.graph(k)) for k in ex.stats()["keys"])
        assert graphs == 4 * per_key
        assert calls["replay"] == 0 and calls["empty_cache"] == 1
        # each key's pool captures its keeper graph once (xgraph.device.pool)
        assert calls["begin"] == graphs + 4 and calls["synchronize"] <= graphs
        ex(**w.decode_step(random.Random(0), 4).kwargs())  # a real step replays its key
        assert calls["replay"] == per_key
        ex.close()
    assert rt.violations == []


def test_the_op_guards_memo_never_hides_a_host_read():
    x, idx, mask = torch.ones(3), torch.tensor([0, 2]), torch.tensor([True, False, True])
    for _ in range(2):  # the second time through the memo
        check_op(aten.add.Tensor, (x, x), {})
        check_op(aten.index.Tensor, (x, [idx]), {})
    with pytest.raises(xgraph.CaptureError, match="item"):
        check_op(aten._local_scalar_dense.default, (x,), {})
    with pytest.raises(xgraph.CaptureError, match="boolean mask"):
        check_op(aten.index.Tensor, (x, [mask]), {})
    with pytest.raises(xgraph.CaptureError, match="repeat_interleave"):
        check_op(aten.repeat_interleave.Tensor, (idx,), {})
