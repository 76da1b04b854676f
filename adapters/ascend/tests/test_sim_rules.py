"""The runtime rules the simulated torch_npu enforces, one test each, on raw runtime calls.

Each rule is one the torch_npu and CANN runtime sources show (docs/ascend.md, "What the
sources settle"); the tests drive the simulated runtime directly, without the device layer
that copes with them, so each test shows the rule holding:
- a synchronize while any stream captures fails with 107027, in every capture mode and from
  every thread, and the capture goes on (hicann/runtime context.cc:1225-1233);
- the MemPoolContext-era MemPool holds no use and has no `use_count` or `snapshot`; a pool
  released by every graph stays cached (until an empty_cache) and a capture on it asserts
  `use_count > 0`, in the device allocator (<= 2.12) or the host allocator's record (>= 2.13);
- a failed capture_begin or capture_end leaves the pool id routed in the host allocator,
  which no binding undoes (NPUGraph.cpp: begin_allocate_to_pool before the ACL begin, its
  end after the ACL end's error check);
- an owner-era MemPool dropped during a capture is a recorded violation (its destructor
  synchronizes the device, which throws inside it: the process aborts);
- a failed aclmdlRICaptureEnd, and one from another thread (107038), take the stream out of
  capture (hicann/runtime context_aclgraph.cc:478-490, capture_model_utils.cc:75-86).
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from xgraph_ascend.errors import AclRuntimeError
from xgraph_ascend.sim.caching import SimContextMemPool

ERAS = ["owner", "context"]
MODES = ["global", "thread_local", "relaxed"]


def _in_thread(fn):  # type: ignore[no-untyped-def]
    """Run `fn` in another thread; what it returned or raised."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    th.join(30)
    assert not th.is_alive()
    return out


def _raised(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def _sync_calls(rt, side):  # type: ignore[no-untyped-def]
    """What a synchronize can be: (name, call, whether it is refused during the capture)."""
    other = rt.new_stream()
    return [
        ("device", rt.synchronize, True),
        ("the capturing stream", side.synchronize, True),
        ("another stream", other.synchronize, False),
    ]


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["capturing thread", "another thread"])
def test_a_synchronize_during_a_capture_is_refused_and_the_capture_goes_on(  # type: ignore[no-untyped-def]
    make_sim, era, mode, where
) -> None:
    rt = make_sim(era=era).runtime
    mempool, side, x = rt.new_mempool(None), rt.new_stream(), torch.ones(4)
    g = rt.new_graph()
    with rt.use_stream(side):
        g.capture_begin(pool=mempool.id, capture_error_mode=mode)
        y = x + 1
        for what, call, refused in _sync_calls(rt, side):
            err = _in_thread(call).get("error") if where == "another thread" else _raised(call)
            if refused:
                assert isinstance(err, AclRuntimeError) and err.code == 107027, (what, err)
            else:
                assert err is None, (what, err)
        y = y * 2  # still recorded: the refusals did not end or invalidate the capture
        g.capture_end()
    x.fill_(3)
    g.replay()
    rt.synchronize()
    assert torch.equal(y, torch.full((4,), 8.0))
    g.reset()


def test_the_context_era_mempool_holds_no_use_and_cannot_count(make_sim) -> None:  # type: ignore[no-untyped-def]
    rt = make_sim(era="context").runtime
    mempool = rt.new_mempool(None)
    assert isinstance(mempool, SimContextMemPool) and mempool.id[0] == 0
    assert not hasattr(mempool, "use_count") and not hasattr(mempool, "snapshot")
    assert rt.caching.pools() == 0  # the first capture on the id makes the pool
    owner = make_sim(era="owner").runtime.new_mempool(None)
    assert owner.use_count() == 1 and owner.snapshot() == [
        {"segment_pool_id": owner.id, "total_size": 0}
    ]


def _capture_on(rt, pool_id, side, fn):  # type: ignore[no-untyped-def]
    g = rt.new_graph()
    with rt.use_stream(side):
        g.capture_begin(pool=pool_id, capture_error_mode="thread_local")
        y = fn()
        g.capture_end()
    return g, y


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("live_block", [True, False])
def test_a_pool_released_by_every_graph_refuses_a_capture(make_sim, era, live_block) -> None:  # type: ignore[no-untyped-def]
    """The keeper's rule: which allocator asserts depends on the era, and in the context era a
    released pool stays cached (live blocks or not) until an empty_cache."""
    rt = make_sim(era=era).runtime
    mempool, side, x = rt.new_mempool(None), rt.new_stream(), torch.randn(512)
    g, y = _capture_on(rt, mempool.id, side, lambda: x * 2)
    g.reset()
    if not live_block:
        del y
    # the owner era's MemPool keeps its use; the context era's pool is only freeable
    assert rt.caching.use_count(mempool.id) == (1 if era == "owner" else 0)
    assert rt.caching.pool_bytes(mempool.id) > 0  # cached in both eras, live block or not
    which = "the host allocator's record" if era == "owner" else "still cached"
    with pytest.raises(RuntimeError, match=f"use_count > 0.*{which}"):
        _capture_on(rt, mempool.id, side, lambda: x * 3)
    if era == "owner":  # the device allocator took the routing and a use before the host's
        rt.end_allocate_to_pool(mempool.id)
        rt.release_pool(mempool.id)
    assert rt.caching.routes() == 0


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("call", ["aclmdlRICaptureBegin", "aclmdlRICaptureEnd"])
def test_a_failed_begin_or_end_leaves_the_pool_id_routed_in_the_host_allocator(  # type: ignore[no-untyped-def]
    make_sim, era, call
) -> None:
    rt = make_sim(era=era).runtime
    mempool, side, x = rt.new_mempool(None), rt.new_stream(), torch.randn(16)
    rt.faults.inject(call, 207008)
    g = rt.new_graph()
    with rt.use_stream(side), pytest.raises(AclRuntimeError) as info:
        g.capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        x + 1
        g.capture_end()
    assert info.value.code == 207008
    assert not rt.is_capturing(side)  # a failed end took the stream out of capture
    g.reset()
    assert rt.books()["model_ris"] == 0  # and made no model
    # every binding there is: the thread's device routing and the capture's use
    rt.end_allocate_to_pool(mempool.id)
    rt.release_pool(mempool.id)
    rt.empty_cache()  # the device allocator forgets a released pool: only the host record is left
    assert rt.caching.routes() == 0 and mempool.id in rt.caching.host_routed()
    with pytest.raises(RuntimeError, match="already recording to mempool_id"):
        _capture_on(rt, mempool.id, side, lambda: x + 2)
    rt.end_allocate_to_pool(mempool.id)
    rt.release_pool(mempool.id)
    fresh = rt.new_mempool(None)  # another pool id captures
    g, y = _capture_on(rt, fresh.id, side, lambda: x + 2)
    g.replay()
    assert torch.equal(y, x + 2) and rt.books()["routes"] == 0
    g.reset()


def test_an_owner_era_mempool_dropped_during_a_capture_is_a_violation(make_sim) -> None:  # type: ignore[no-untyped-def]
    rt = make_sim(era="owner").runtime
    doomed, mempool, side = rt.new_mempool(None), rt.new_mempool(None), rt.new_stream()
    g = rt.new_graph()
    with rt.use_stream(side):
        g.capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        del doomed  # in another thread or this one: ~MemPool synchronizes the device
        g.capture_end()
    assert len(rt.violations) == 1 and "the process aborts" in rt.violations[0]
    rt.violations.clear()
    g.reset()
    del mempool  # no capture runs: its destructor gives its use back
    assert rt.violations == [] and rt.caching.pools() == 1  # the dropped-too-early one's


def test_a_context_era_pool_goes_back_only_at_an_empty_cache(make_sim) -> None:  # type: ignore[no-untyped-def]
    """Its MemPool's destructor does nothing: a bare one's released pool keeps its segments
    until an empty_cache; the adapter's runtime empties the cache when a MemPool it made goes
    (the device layer drops them only when no capture runs), which frees both."""
    rt = make_sim(era="context").runtime
    side, x = rt.new_stream(), torch.randn(1 << 16)
    for made_by_runtime, left in ((False, 1), (True, 0)):
        mempool = rt.new_mempool(None) if made_by_runtime else SimContextMemPool()
        g, y = _capture_on(rt, mempool.id, side, lambda: x * 2)
        g.reset()
        del y, mempool
        assert rt.books()["mallocs"] == left, made_by_runtime


def test_an_end_from_another_thread_takes_the_stream_out_of_capture(make_sim) -> None:  # type: ignore[no-untyped-def]
    """aclmdlRICaptureEnd from a thread that did not begin the capture (thread_local mode)
    returns 107038 and ends the capture (hicann/runtime capture_model_utils.cc:75-86,
    context_aclgraph.cc:529-531): later ops of the capturing thread are not recorded, its
    own end then fails (107029: not capturing), and the stream captures again after."""
    rt = make_sim().runtime
    mempool, side, x = rt.new_mempool(None), rt.new_stream(), torch.ones(4)
    g = rt.new_graph()
    with rt.use_stream(side):
        g.capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        y = x + 1

        def end_elsewhere() -> int:
            ri = ctypes.c_void_p()
            return rt.acl.aclmdlRICaptureEnd(rt.stream_handle(side), ctypes.byref(ri))

        assert _in_thread(end_elsewhere)["value"] == 107038
        assert not rt.is_capturing(side)
        z = y * 2  # runs, not recorded
        with pytest.raises(AclRuntimeError) as info:
            g.capture_end()
    assert info.value.code == 107029 and torch.equal(z, torch.full((4,), 4.0))
    g.reset()
    rt.end_allocate_to_pool(mempool.id)  # what the device layer undoes after a failed end
    rt.release_pool(mempool.id)
    fresh = rt.new_mempool(None)  # the stream captures again (a fresh pool id: the failed
    g, y = _capture_on(rt, fresh.id, side, lambda: x + 2)  # end left the old one routed)
    x.fill_(5)
    g.replay()
    assert torch.equal(y, torch.full((4,), 7.0)) and rt.books()["model_ris"] == 1
    g.reset()
