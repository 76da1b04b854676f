"""The device layer's capture rules on the simulated NPU, in both torch_npu memory eras.

Recapture on a pool whose graphs were all reset (the keeper), a failed capture in
shared-pool mode followed by more captures (a fresh pool: the old id stays routed in the
host allocator), and a second thread that synchronizes, closes an executor or drops a pool
while a capture runs (it waits or works on its own stream; the process never aborts).
"""

from __future__ import annotations

import random
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
@pytest.mark.parametrize("call", ["aclmdlRICaptureBegin", "aclmdlRICaptureEnd"])
def test_a_failed_capture_in_shared_pool_mode_is_followed_by_more(make_sim, era, call) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim(era=era)
    rt, mlp = backend.runtime, _mlp()
    ex = _executor(backend, mlp)
    ex(x=torch.randn(8, 64))
    first = ex.memory._shared
    rt.faults.inject(call, 207008)
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
    assert ("full", 16) in s["failed_keys"] and call in s["failed_keys"][("full", 16)]
    ex.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0), rt.books()
    assert rt.violations == [] and rt.lib.violations == []


def _held_capture(backend, started, release, out):  # type: ignore[no-untyped-def]
    x, pool = torch.randn(16), backend.new_pool()
    graph = backend.new_graph()
    graph.capture_begin(pool)
    y = x + 1
    started.set()
    release.wait(30)
    graph.capture_end()
    out.update(graph=graph, pool=pool, x=x, y=y)


def _fused_decode(backend):  # type: ignore[no-untyped-def]
    """A decode executor through FusedDecodeRunner (task-updated replays), its graph for a
    batch of 4 captured; and a step function that checks it against the eager runner."""
    from xgraph_ascend.attention import FusedDecodeRunner

    from xgraph import Buckets
    from xgraph.models import Workload

    kw = {"dtype": torch.bfloat16, "block_size": 16, "num_blocks": 64, "max_blocks": 4}
    w, ref = Workload.tiny(device=backend.device, **kw), Workload.tiny(**kw)
    w.randomize_cache(3)
    ref.randomize_cache(3)
    buckets = Buckets([4])
    attention = w.attention(decode_runner=FusedDecodeRunner(backend))
    ex = w.executor(backend=backend, buckets=buckets, attention=attention)
    rng = random.Random(5)

    def step() -> None:
        s = w.decode_step(rng, 4)
        expect = ref.eager(ref.padded(s, buckets, full=True), runner=FusedDecodeRunner(backend))
        assert torch.equal(ex(**s.kwargs()), expect)

    step()  # captured
    return ex, step


@pytest.mark.parametrize("era", ERAS)
def test_other_threads_during_a_capture_never_abort(make_sim, era) -> None:  # type: ignore[no-untyped-def]
    """While a capture runs in one thread, another synchronizes (directly: ACL's 107027, the
    documented error; through the backend: its own stream), replays a task-updated graph
    (whose update synchronizes), closes executors and memory and drops a pool: nothing is
    dropped under the capture (parked instead), no rule is broken, and the capture is whole."""
    backend = make_sim(era=era)
    rt, mlp = backend.runtime, _mlp()
    ex = _executor(backend, mlp, memory="private")
    for n in (8, 16):
        ex(x=torch.randn(n, 64))  # queued replays, pools that go at close
    mem = xgraph.GraphMemory(backend)  # shared-physical (owner era) or shared-pool (context)
    shared = _executor(backend, mlp, memory=mem)
    shared(x=torch.randn(32, 64))
    decode, decode_step = _fused_decode(backend)
    pool, x = backend.new_pool(), torch.randn(16)
    graph = backend.new_graph()
    with xgraph.graph(graph, pool):
        y = x.exp()
    graph.replay()
    graph.reset()
    del y
    started, release, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_held_capture, args=(backend, started, release, out))
    th.start()
    try:
        assert started.wait(30)
        with pytest.raises(AclRuntimeError, match="ACL_ERROR_RT_STREAM_CAPTURED"):
            rt.synchronize()  # ACL's rule: no device synchronize while any stream captures
        backend.synchronize()  # this thread's stream instead
        decode_step()  # its task update synchronizes first: this thread's stream too
        s = decode.stats()
        assert (s["captures"], s["replays"], s["eager"]) == (1, 2, {}), s
        decode.close()
        ex.close()  # synchronizes, closes its pools: parked, not dropped
        shared.close()
        mem.close()  # unmaps and frees its chunks (owner era) after the same synchronize
        pool.close()  # a pool dropped by hand
        assert book(rt).parked() == 2 + 1 + 1 + 1  # ex's two, decode's, mem's, the pool
        assert rt.violations == [] and rt.lib.violations == []  # no MemPool dropped
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
    other_pool = out["pool"]
    del out  # its output too: a live block keeps its segment cached
    other_pool.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0), rt.books()
