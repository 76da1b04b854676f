"""The torch-style device layer over the simulated runtime: every failure path, in CI.

Each test builds a fresh simulated device (its books start empty) and a TorchBackend over
it (the dummy adapter's), injects the failure, and checks what the layer promises: the
error, balanced books, no broken runtime rule, and that the device keeps capturing.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from kept_views import executor_with_views
from xgraph_dummy.backend import DummyBackend

import xgraph
from xgraph.device import book
from xgraph.testing.sim import SimError, SimRuntime


@pytest.fixture
def backend():  # type: ignore[no-untyped-def]
    b = DummyBackend(SimRuntime())
    yield b
    assert b.runtime.violations == []


def _capture(backend, pool, fn, x):  # type: ignore[no-untyped-def]
    graph = backend.new_graph()
    with torch.no_grad(), xgraph.graph(graph, pool):
        y = fn(x)
    return graph, y


def _replays(backend, graph, x, y, fn) -> None:  # type: ignore[no-untyped-def]
    x.copy_(torch.randn(x.shape))
    graph.replay()
    backend.synchronize()
    assert torch.equal(y, fn(x))


def _captures_on_a_new_pool(backend, x) -> None:  # type: ignore[no-untyped-def]
    """The device captures again: a fresh pool, a graph that replays right, all given back."""
    pool = backend.new_pool()
    graph, y = _capture(backend, pool, torch.exp, x)
    _replays(backend, graph, x, y, torch.exp)
    graph.reset()
    del y
    pool.close()


def _clean(backend) -> None:  # type: ignore[no-untyped-def]
    books = backend.runtime.books()
    assert books == dict.fromkeys(books, 0), books


def test_a_failed_begin_gives_back_the_routing_and_poisons_the_pool(backend) -> None:  # type: ignore[no-untyped-def]
    rt, x = backend.runtime, torch.randn(16)
    pool = backend.new_pool()
    base = pool.use_count()
    rt.faults.inject("capture_begin", 9)
    with pytest.raises(xgraph.CaptureError, match="capture_begin refused"):
        _capture(backend, pool, torch.exp, x)
    assert rt.caching.routes() == 0 and pool.use_count() == base  # routing and use undone
    assert pool.poisoned and pool.id in rt.caching.host_routed()  # what no binding undoes
    with pytest.raises(xgraph.XGraphError, match="takes no more captures"):
        _capture(backend, pool, torch.exp, x)
    pool.close()
    _captures_on_a_new_pool(backend, x)
    _clean(backend)


@pytest.mark.parametrize("fault, by_driver", [("capture_end", 0), ("capture_end_refused", 1)])
def test_a_failed_end_leaves_no_stream_capturing_and_the_stream_replaced(  # type: ignore[no-untyped-def]
    backend, fault, by_driver
) -> None:
    """A failed end takes the stream out of capture (ACL, CUDA); an end refused before it ran
    leaves the stream capturing, and the layer ends that through the driver, once."""
    rt, x = backend.runtime, torch.randn(16)
    old = backend.capture_stream()
    pool = backend.new_pool()  # its keeper is a capture too
    calls = rt.faults.calls["capture_end_refused"]  # counted at every capture_end
    rt.faults.inject(fault, 9)
    with pytest.raises(xgraph.CaptureError, match="capture_end refused"):
        _capture(backend, pool, torch.exp, x)
    assert rt.faults.calls["capture_end_refused"] - calls == 1  # capture_end ran once
    assert rt.faults.calls["end_capture"] == by_driver and not rt.is_capturing(old)
    assert backend.capture_stream() is not old and pool.poisoned
    assert rt.caching.routes() == 0 and book(rt).parked() == 0
    rt.synchronize()  # no stream is left capturing: the device synchronizes again
    pool.close()
    _captures_on_a_new_pool(backend, x)
    _clean(backend)


def test_a_capture_that_cannot_be_ended_leaves_a_working_device(backend) -> None:  # type: ignore[no-untyped-def]
    """The end refused before it ran and the driver refusing too: no runtime the sources
    show leaves a stream capturing once its end ran, but the layer copes with one."""
    rt, x = backend.runtime, torch.randn(16)
    old, pool = backend.capture_stream(), backend.new_pool()
    rt.faults.inject("capture_end_refused", 9)
    rt.faults.inject("end_capture", 9, times=1000)  # the driver cannot end it either, for now
    with pytest.raises(xgraph.CaptureError):
        _capture(backend, pool, torch.exp, x)
    assert rt.is_capturing(old)  # stuck: a device synchronize fails while it captures
    with pytest.raises(SimError, match="STREAM_CAPTURED"):
        rt.synchronize()
    backend.synchronize()  # the layer synchronizes this thread's stream instead
    new = backend.capture_stream()
    assert new is not old
    second = backend.new_pool()
    graph, y = _capture(backend, second, torch.exp, x)
    assert not rt.is_capturing(new)
    _replays(backend, graph, x, y, torch.exp)
    graph.reset()
    pool.close()
    second.close()
    assert book(rt).parked() == 2  # never dropped while a stream captures (it would abort)
    rt.faults.clear()  # the driver can end it now: the layer asks again, then drops them
    backend.synchronize()
    assert not rt.is_capturing(old) and book(rt).parked() == 0
    del y
    rt.empty_cache()
    _clean(backend)


def test_the_keeper_lets_a_pool_capture_again_after_every_graph_reset(backend) -> None:  # type: ignore[no-untyped-def]
    x, pool = torch.randn(16), backend.new_pool()
    outs = []
    for fn in (torch.exp, torch.sin, torch.cos):
        graph, y = _capture(backend, pool, fn, x)
        _replays(backend, graph, x, y, fn)
        graph.reset()
        outs.append(y)  # a live block of the pool, too
    del outs, y
    pool.close()
    _clean(backend)


def test_without_a_keeper_the_simulator_refuses_the_recapture(backend) -> None:  # type: ignore[no-untyped-def]
    """The rule the keeper answers is enforced: a raw torch-style graph on a raw MemPool."""
    rt = backend.runtime
    mempool, side, x = rt.new_mempool(None), rt.new_stream(), torch.randn(16)
    with rt.use_stream(side):
        g = rt.new_graph()
        g.capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        y = x * 2
        g.capture_end()
        g.reset()
        with pytest.raises(RuntimeError, match="use_count > 0"):
            rt.new_graph().capture_begin(pool=mempool.id, capture_error_mode="thread_local")
    rt.end_allocate_to_pool(mempool.id)  # what the device layer undoes after such a failure
    rt.release_pool(mempool.id)
    del y, mempool


def test_shared_pool_mode_replaces_a_poisoned_pool(backend) -> None:  # type: ignore[no-untyped-def]
    rt = backend.runtime
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU()).eval()
    ex = xgraph.GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=[4, 8, 16],
        memory="shared-pool",
        inputs=[xgraph.Input("x", torch.float32, ("num_tokens", 32))],
    )
    ex(x=torch.randn(4, 32))
    rt.faults.inject("capture_end", 9)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ex(x=torch.randn(8, 32))  # fails, falls back for that key
    for n in (16, 4, 16, 8):  # a new key captures on a fresh shared pool; the old key replays
        x = torch.randn(n, 32)
        with torch.no_grad():
            assert torch.equal(ex(x=x), mlp(x))
    s = ex.stats()
    assert set(s["hits"]) == {("full", 4), ("full", 16)} and ("full", 8) in s["failed_keys"]
    assert ex.memory.stats()["native_pools"] == 2
    ex.close()
    _clean(backend)


def test_a_pool_closed_before_its_graph_is_parked_until_the_reset(backend) -> None:  # type: ignore[no-untyped-def]
    rt, x, pool = backend.runtime, torch.randn(16), backend.new_pool()
    graph, y = _capture(backend, pool, torch.exp, x)
    pool.close()
    assert book(rt).parked() == 1 and rt.caching.pools() == 1
    graph.reset()
    assert book(rt).parked() == 0
    del y
    rt.empty_cache()
    _clean(backend)


def _capture_in_thread(backend, started, release, go=None):  # type: ignore[no-untyped-def]
    """A second thread that begins a capture (`started`) and holds it until `release` is
    set; returned once it began, or with `go`, once it is ready to begin (its pool made: a
    new pool's keeper graph is a capture of its own) and waits for `go` to be set."""
    out, ready = {}, threading.Event()

    def run() -> None:
        x, pool = torch.randn(16), backend.new_pool()
        graph = backend.new_graph()
        ready.set()
        if go is not None:
            go.wait(10)
        graph.capture_begin(pool)
        y = x + 1
        started.set()
        release.wait(10)
        graph.capture_end()
        out.update(graph=graph, pool=pool, x=x, y=y)

    th = threading.Thread(target=run)
    th.start()
    assert (started if go is None else ready).wait(10)
    return th, out


def test_other_threads_synchronize_close_and_drop_pools_while_a_capture_runs(backend) -> None:  # type: ignore[no-untyped-def]
    rt, started, release = backend.runtime, threading.Event(), threading.Event()
    pool = backend.new_pool()
    graph, y = _capture(backend, pool, torch.exp, torch.randn(16))
    graph.replay()
    th, out = _capture_in_thread(backend, started, release)
    try:
        with pytest.raises(SimError, match="STREAM_CAPTURED"):
            rt.synchronize()  # the rule: no device synchronize while any stream captures
        backend.synchronize()  # stream-level instead
        backend.empty_cache()  # skipped: it would synchronize the device
        graph.reset()
        pool.close()  # parked: dropping a MemPool now would abort a real process
        assert book(rt).parked() == 1
    finally:
        release.set()
        th.join(10)
    assert book(rt).parked() == 0 and rt.violations == []  # dropped once the capture ended
    out["x"].fill_(2)
    out["graph"].replay()  # the other thread's capture is whole
    backend.synchronize()
    assert torch.equal(out["y"], torch.full((16,), 3.0))
    out["graph"].reset()
    out["pool"].close()
    del y, out
    rt.empty_cache()
    _clean(backend)


def test_a_capture_begun_during_a_device_synchronize_waits_for_it(backend) -> None:  # type: ignore[no-untyped-def]
    """The check for other threads' captures and the device synchronize are one step: a
    capture another thread begins in between waits for the synchronize instead of making it
    fail (a device synchronize fails while any stream captures: ACL 107027)."""
    from xgraph.graphs import _disable_compiler_once

    _disable_compiler_once()  # the first guard imports torch._dynamo: not in the timed waits
    rt, main = backend.runtime, threading.current_thread()
    device_sync, inside, began, release = rt.synchronize, *(threading.Event() for _ in range(3))

    def synchronize() -> None:  # the main thread's first device synchronize lingers
        if threading.current_thread() is main and not inside.is_set():
            inside.set()
            began.wait(0.5)  # the other thread's capture begins now, unless it must wait
        device_sync()

    rt.synchronize = synchronize
    th, out = _capture_in_thread(backend, began, release, go=inside)
    backend.synchronize()  # the check passed: nothing captures yet
    assert began.wait(10)  # then the other thread's capture began
    release.set()
    th.join(10)
    out["x"].fill_(1)
    out["graph"].replay()
    backend.synchronize()
    assert torch.equal(out["y"], torch.full((16,), 2.0))
    out["graph"].reset()
    out["pool"].close()
    del out
    rt.empty_cache()
    _clean(backend)


def test_pool_readings_wait_for_another_threads_routed_capture(backend) -> None:  # type: ignore[no-untyped-def]
    """A routed capture's segment requests run Python inside the caching allocator's mutex,
    and torch's MemPool readings hold the GIL while they wait for it: on a real device the
    two deadlock. So a reading (and a new pool) in another thread waits until the routed
    capture ends, and the capture itself reads its own pool at once."""
    from xgraph.memory import GraphMemory

    memory = GraphMemory(backend, "shared-physical")
    lease = memory.begin()
    other = backend.new_pool()
    inside, release, order = threading.Event(), threading.Event(), []

    def capture() -> None:
        graph = backend.new_graph()
        with torch.no_grad(), xgraph.graph(graph, lease.pool):
            y = torch.zeros(64).add_(1)  # a segment request, routed to the memory's chunks
            assert lease.pool.use_count() is not None  # its own reading: no wait
            inside.set()
            release.wait(10)
            order.append("capture ended")
        graph.reset()
        del y

    th = threading.Thread(target=capture)
    th.start()
    assert inside.wait(10)
    reader = threading.Thread(target=lambda: order.append(("read", other.use_count())))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and order == []  # waiting for the routed capture
    release.set()
    th.join(10)
    reader.join(10)
    assert order[0] == "capture ended" and order[1][0] == "read"
    other.close()
    memory.close()


def test_a_view_dropped_inside_a_foreign_capture_is_given_back_after(backend, caplog):
    """A closed executor's buffer still viewed keeps its range until the view goes; a view
    that goes inside a capture xgraph did not begin (a raw runtime graph on this thread's
    stream) must not synchronize or unmap there (the runtime refuses a synchronize while a
    stream captures): its memory goes at the next safe point."""
    from xgraph.arena import buffer_memory
    from xgraph.testing.faults import books

    vm = buffer_memory(backend)
    start = books(vm)
    ex, kept = executor_with_views(backend)
    ex.close()
    held = books(vm)
    assert held != start
    rt = backend.runtime
    stream, g = rt.new_stream(), rt.new_graph()
    with rt.use_stream(stream), caplog.at_level("ERROR", "xgraph"):
        g.capture_begin()
        assert backend.stream_capturing()
        kept.clear()  # the last view goes inside the foreign capture
        inside = books(vm)
        g.capture_end()
    g.reset()
    assert inside == held and not caplog.records  # deferred: no synchronize attempted there
    assert not backend.stream_capturing()
    later = xgraph.GraphExecutor(
        lambda x: x + 1,
        inputs=[xgraph.Input("x", torch.float32, ("num_tokens", 4))],
        backend=backend,
        buckets=[16],
    )  # a new arena: a safe point
    later.close()
    assert books(vm) == start
