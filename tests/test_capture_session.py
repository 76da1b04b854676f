"""The capture session (xgraph.capture_session): while `capture` and `warm_up` run, the
garbage collector is frozen and off, and no collection runs; afterwards it is as it was,
whatever way the capture ended (done, failed, KeyboardInterrupt)."""

from __future__ import annotations

import gc
import weakref

import pytest

import xgraph
from xgraph.capture_session import YOUNG, active, capture_session
from xgraph.models import Workload

SIZES = [1, 2, 4, 8]


def _observing(  # type: ignore[no-untyped-def]
    w: Workload, seen: list, fail: BaseException | None = None, ran: list | None = None
):
    """A forward that records the collector's state (and the collections run so far, from
    `ran`), and raises `fail` when it captures."""
    runs = []

    def forward(**kw):  # type: ignore[no-untyped-def]
        runs.append(1)
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0, active()))
        if ran is not None:
            seen.append(len(ran))
        garbage = [[[]] for _ in range(20000)]  # enough to pass the collector's thresholds
        del garbage
        if fail is not None and len(runs) > 1:  # the warm-up passes, the recording fails
            raise fail
        return w.model.forward_logits(**kw)

    return forward


@pytest.fixture
def collections():  # type: ignore[no-untyped-def]
    """How many collections ran (gc.callbacks), as a list that grows."""
    ran: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            ran.append(info["generation"])

    gc.callbacks.append(count)
    yield ran
    gc.callbacks.remove(count)


def test_no_collection_runs_while_graphs_are_captured(collections):
    w, seen = Workload.tiny(), []
    ex = w.executor(_observing(w, seen, ran=collections), backend="cpu", buckets=SIZES)
    assert gc.isenabled()
    before = len(collections)
    ex.capture(progress=False)
    states, counts = seen[0::2], seen[1::2]
    assert len(states) == 2 * len(SIZES)  # a warm-up and a recording per size
    assert all(s == (False, True, True) for s in states)  # off, frozen, in a session
    assert set(counts) == {before + 1}  # only the collection when the session opened
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not active()
    seen.clear()
    ex.warm_up(SIZES)
    assert len(seen) == 2 * len(SIZES) and len(set(seen[1::2])) == 1
    assert gc.isenabled()
    ex.close()


@pytest.mark.parametrize("fail", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_collector_is_restored_after_a_failed_capture(fail):
    w, seen = Workload.tiny(), []
    ex = w.executor(
        _observing(w, seen, fail), backend="cpu", buckets=SIZES, on_capture_error="raise"
    )
    want = KeyboardInterrupt if isinstance(fail, KeyboardInterrupt) else xgraph.CaptureError
    with pytest.raises(want):
        ex.capture(progress=False)
    assert seen[-1] == (False, True, True)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not active()
    ex.close()


def test_a_disabled_collector_stays_disabled_and_sessions_nest():
    gc.disable()
    try:
        with capture_session():
            with capture_session():
                assert not gc.isenabled() and gc.get_freeze_count() > 0
            assert active() and gc.get_freeze_count() > 0  # the outer one still holds
        assert not gc.isenabled() and gc.get_freeze_count() == 0 and not active()
    finally:
        gc.enable()
    with pytest.raises(ValueError), capture_session():
        raise ValueError("inside")
    assert gc.isenabled() and not active()


class _Node:
    """A reference cycle's member (a weak reference says when it is freed)."""

    def __init__(self) -> None:
        self.me = self


def test_a_session_collects_the_last_steps_garbage_but_does_not_walk_the_old_heap(collections):
    old = _Node()
    gc.collect()  # `old` survives into the oldest generation: the heap a model lives in
    old_ref, young_ref = weakref.ref(old), weakref.ref(_Node())  # the new one is garbage
    del old
    before = len(collections)
    with capture_session():
        assert young_ref() is None  # the young cycle died when the session opened
        assert old_ref() is not None  # the old one waits for a full collection
    assert collections[before:] == [YOUNG]  # one collection, of the young generations only
    gc.collect()
    assert old_ref() is None
