"""The device layer's capture rules on the simulated NPU, in both torch_npu memory eras.

Recapture on a pool whose graphs were all reset (the keeper), a failed capture in
shared-pool mode followed by more captures (a fresh pool: the old id stays routed in the
host allocator), and a second thread that synchronizes, closes an executor or drops a pool
while a capture runs (it waits or works on its own stream; the process never aborts).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from xgraph_ascend.errors import AclRuntimeError

import xgraph
from xgraph.device import book

ERAS = ["owner", "context"]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU()).eval()


def _executor(backend, mlp, memory="shared-pool"):  # type: ignore[no-untyped-def]
    return xgraph.GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=[8, 16, 32],
        memory=memory,
        inputs=[xgraph.Input("x", torch.float32, ("num_tokens", 64))],
    )


@pytest.mark.parametrize("era", ERAS)
def test_a_pool_captures_again_after_every_graph_was_reset(make_sim, era) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim(era=era)
    rt, pool, x = backend.runtime, backend.new_pool(), torch.randn(16)
    outs = []
    for fn in (torch.exp, torch.sin, torch.cos):  # each output kept alive, as an engine does
        graph = backend.new_graph()
        with xgraph.graph(graph, pool):
            y = fn(x)
        graph.replay()
        assert torch.equal(y, fn(x))
        graph.reset()
        outs.append(y)
    # without the layer's keeper graph, torch_npu asserts on exactly this recapture
    side, raw = rt.new_stream(), rt.new_mempool(None)
    with rt.use_stream(side):
        g = rt.new_graph()
        g.capture_begin(pool=raw.id, capture_error_mode="thread_local")
        kept = x * 2
        g.capture_end()
        g.reset()
        with pytest.raises(RuntimeError, match="use_count > 0"):
            rt.new_graph().capture_begin(pool=raw.id, capture_error_mode="thread_local")
    del outs, y, kept
    pool.close()
    assert rt.lib.violations == [] and rt.violations == []


@pytest.mark.parametrize("era", ERAS)
def test_a_failed_capture_in_shared_pool_mode_is_followed_by_more(make_sim, era) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim(era=era)
    rt, mlp = backend.runtime, _mlp()
    ex = _executor(backend, mlp)
    ex(x=torch.randn(8, 64))
    first = ex.memory._shared
    rt.faults.inject("aclmdlRICaptureBegin", 207008)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ex(x=torch.randn(16, 64))  # fails: torch_npu's host allocator keeps routing the id
    assert first.poisoned and first.id in rt.caching.host_routed()
    for n in (32, 8, 32, 16):  # a fresh shared pool serves; the first key still replays
        x = torch.randn(n, 64)
        with torch.no_grad():
            assert torch.equal(ex(x=x), mlp(x))
    s = ex.stats()
    assert set(s["hits"]) == {("full", 8), ("full", 32)} and ex.memory._shared is not first
    ex.close()
    assert rt.books()["routes"] == 0 and rt.lib.violations == [] and rt.violations == []


def _held_capture(backend, started, release, out):  # type: ignore[no-untyped-def]
    x, pool = torch.randn(16), backend.new_pool()
    graph = backend.new_graph()
    graph.capture_begin(pool)
    y = x + 1
    started.set()
    release.wait(30)
    graph.capture_end()
    out.update(graph=graph, pool=pool, x=x, y=y)


@pytest.mark.parametrize("era", ERAS)
def test_other_threads_during_a_capture_never_abort(make_sim, era) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim(era=era)
    rt, mlp = backend.runtime, _mlp()
    ex = _executor(backend, mlp, memory="private")
    for n in (8, 16):
        ex(x=torch.randn(n, 64))  # queued replays, pools that go at close
    started, release, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_held_capture, args=(backend, started, release, out))
    th.start()
    try:
        assert started.wait(30)
        with pytest.raises(AclRuntimeError, match="ACL_ERROR_RT_STREAM_CAPTURED"):
            rt.synchronize()  # ACL's rule: no device synchronize while any stream captures
        backend.synchronize()  # this thread's stream instead
        ex.close()  # synchronizes, closes its pools: parked, not dropped
        assert book(rt).parked() == 2
    finally:
        release.set()
        th.join(30)
    assert book(rt).parked() == 0  # dropped once the capture ended
    assert rt.violations == [] and rt.lib.violations == []
    out["x"].fill_(4)
    out["graph"].replay()
    backend.synchronize()
    assert torch.equal(out["y"], torch.full((16,), 5.0))
    out["graph"].reset()
    out["pool"].close()
