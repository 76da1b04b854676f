"""Two threads on one simulated NPU: what the Ascend review (2026-12-01b, rows 5 and 12)
predicted would collide, each forced to overlap and then checked to work.

- a device synchronize racing a capture begin in another thread (row 5): the begin waits;
- two threads making capture pools at once, whose keeper captures overlap (row 12): each
  captures its keeper on a stream of its own thread;
- two threads replaying task-updated graphs at once (row 12): their update sequences take
  turns on the backend's one update stream (ACL refuses concurrent updates: 107033).

Each overlap is forced by a hook on a simulated call that waits for the other thread; a fix
that serializes the threads makes that wait time out (a bound, not a sleep) and go on.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import torch
from xgraph_ascend.attention import FusedDecodeRunner

import xgraph
from xgraph import Buckets
from xgraph.models import Workload

BOUND = 30  # seconds any thread may take (nothing here hangs)


def _in_threads(*fns: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run each function in a thread of its own; what each returned or raised."""
    outs: list[dict[str, Any]] = [{} for _ in fns]

    def run(fn: Callable[[], Any], out: dict[str, Any]) -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    threads = [threading.Thread(target=run, args=pair) for pair in zip(fns, outs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(BOUND)
        assert not th.is_alive()
    return outs


def _values(outs: list[dict[str, Any]]) -> list[Any]:
    errors = [o["error"] for o in outs if "error" in o]
    assert not errors, errors
    return [o["value"] for o in outs]


def _exp_graph(backend, pool):  # type: ignore[no-untyped-def]
    """A graph of exp captured on `pool`; (graph, input, output)."""
    x = torch.randn(64)
    graph = backend.new_graph()
    with xgraph.graph(graph, pool):
        y = x.exp()
    return graph, x, y


def test_a_capture_begun_during_a_device_synchronize_waits_for_it(sim) -> None:  # type: ignore[no-untyped-def]
    """Row 5: the book's check and the device synchronize are one step, so a capture begun
    in another thread in between waits instead of failing the synchronize with 107027."""
    rt, main = sim.runtime, threading.current_thread()
    pool = sim.new_pool()
    device_sync, inside, began, release = rt.synchronize, *(threading.Event() for _ in range(3))

    def synchronize() -> None:  # the main thread's first device synchronize lingers
        if threading.current_thread() is main and not inside.is_set():
            inside.set()
            began.wait(0.5)  # the other thread's capture begins now, unless it must wait
        device_sync()

    def capture() -> Any:
        x, graph = torch.ones(8), sim.new_graph()
        inside.wait(BOUND)
        graph.capture_begin(pool)
        began.set()
        y = x + 1
        release.wait(BOUND)  # held open until the main thread's synchronize returned
        graph.capture_end()
        return graph, x, y

    rt.synchronize = synchronize
    out: dict[str, Any] = {}
    other = threading.Thread(target=lambda: out.update(value=capture()))
    other.start()
    try:
        sim.synchronize()  # the check passes: nothing captures yet
    finally:
        release.set()
    other.join(BOUND)
    graph, x, y = out["value"]
    x.fill_(2)
    graph.replay()
    sim.synchronize()
    assert torch.equal(y, torch.full((8,), 3.0))
    graph.reset()
    out.clear()
    del y
    pool.close()


def _overlapping(rt, call: str) -> Callable[[], None]:  # type: ignore[no-untyped-def]
    """Hook `rt.<call>` so that the first call (of either thread) waits, at most 2 s, after
    it returned, until the other thread makes the same call; returns the unhook."""
    original = getattr(rt, call)
    arrived = {"n": 0}
    lock, both = threading.Lock(), threading.Event()

    def hooked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            arrived["n"] += 1
            first = arrived["n"] == 1
            if arrived["n"] == 2:
                both.set()
        result = original(*args, **kwargs)
        if first:
            both.wait(2)  # the other thread's call comes now, unless it must wait for ours
        return result

    setattr(rt, call, hooked)
    return lambda: setattr(rt, call, original)


def _keeper_begins_wait_for_each_other(rt, streams: list):  # type: ignore[no-untyped-def]
    """Hook graph creation so that every keeper capture_begin of the next two pools waits
    for the other's (a barrier): the two keepers' captures are open at the same time. The
    stream each begins on goes to `streams`."""
    original, barrier = rt.new_graph, threading.Barrier(2, timeout=5)

    def new_graph() -> Any:
        g = original()
        begin = g.capture_begin

        def capture_begin(*args: Any, **kwargs: Any) -> None:
            streams.append(rt.current_stream())
            begin(*args, **kwargs)
            barrier.wait()  # both captures open: neither ends before the other began

        g.capture_begin = capture_begin
        return g

    rt.new_graph = new_graph
    return lambda: setattr(rt, "new_graph", original)


def test_two_threads_make_capture_pools_at_once(era_sim) -> None:  # type: ignore[no-untyped-def]
    """Row 12: every pool captures a keeper graph when it is made; two threads making pools
    at once capture their keepers at the same time, each on a stream of its own thread (one
    shared keeper stream: the second begin fails with 107027, and its cleanup ends the first
    thread's capture from the wrong thread)."""
    sim = era_sim
    rt, streams = sim.runtime, []
    unhook = _keeper_begins_wait_for_each_other(rt, streams)
    try:
        pools = _values(_in_threads(sim.new_pool, sim.new_pool))
    finally:
        unhook()
    assert len(streams) == 2 and streams[0] is not streams[1]
    for pool in pools:  # each pool captures and replays
        graph, x, y = _exp_graph(sim, pool)
        x.fill_(1)
        graph.replay()
        sim.synchronize()
        assert torch.equal(y, torch.full((64,), 1.0).exp())
        graph.reset()
        del y
        pool.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0), rt.books()


def _fused_executor(backend, seed: int):  # type: ignore[no-untyped-def]
    """A decode executor through FusedDecodeRunner (bfloat16, block 16) and its workload."""
    kw = {"dtype": torch.bfloat16, "block_size": 16, "num_blocks": 64, "max_blocks": 4}
    w = Workload.tiny(device=backend.device, **kw)
    w.randomize_cache(seed)
    runner = FusedDecodeRunner(backend)
    ex = w.executor(
        backend=backend, buckets=Buckets([4]), attention=w.attention(decode_runner=runner)
    )
    return ex, w


def test_two_threads_replay_task_updated_graphs_at_once(sim) -> None:  # type: ignore[no-untyped-def]
    """Row 12: task updates of every graph of a backend go on its one update stream; two
    threads replaying their own task-updated graphs at once take turns there (two updates
    open on one stream: ACL refuses the second with 107033), and each graph decodes what
    the fused runner gives eagerly on the same step."""
    pairs = [_fused_executor(sim, seed) for seed in (3, 4)]
    refs = [_fused_executor(sim, seed)[1] for seed in (3, 4)]  # their workloads: references
    rngs = [random.Random(i) for i in range(2)]

    def step(i: int) -> None:
        (ex, w), ref = pairs[i], refs[i]
        s = w.decode_step(rngs[i], 4)
        expect = ref.eager(ref.padded(s, Buckets([4]), full=True), runner=FusedDecodeRunner(sim))
        assert torch.equal(ex(**s.kwargs()), expect)

    for i in range(2):  # captured one at a time: the overlap forced is the updates'
        step(i)
    unhook = _overlapping(sim.runtime, "task_update_begin")
    try:
        _values(_in_threads(*(lambda i=i: [step(i) for _ in range(4)] for i in range(2))))
    finally:
        unhook()
    for ex, _ in pairs:
        s = ex.stats()
        assert (s["captures"], s["replays"], s["eager"]) == (1, 5, {}), s
        ex.close()
