"""Persistent buffers given back by finalizers on other threads and at unsafe points: each
segment goes exactly once, at a safe point, close() never fails for it, and the books
balance (xgraph.arena). The threads' interleavings are pinned with events, not timing."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from pathlib import Path

import pytest
import torch
from kept_views import executor_with_views

import xgraph
from xgraph.arena import buffer_memory, drain_pending
from xgraph.restorable import RestorableSegments
from xgraph.testing.faults import books, fail_driver_call
from xgraph.testing.sim import SimRuntime

EMPTY = {"reservations": 0, "mappings": 0, "chunks": 0}
WAIT = 10  # seconds: a bound on each pinned wait, never reached when the code is right


@pytest.fixture
def cpu():  # type: ignore[no-untyped-def]
    backend = xgraph.get_backend("cpu")
    gc.collect()
    start = books(buffer_memory(backend)), books(backend.virtual_memory())
    yield backend
    gc.collect()
    assert (books(buffer_memory(backend)), books(backend.virtual_memory())) == start


def test_close_and_a_last_view_dropped_on_another_thread_give_a_segment_back_once(cpu, monkeypatch):  # type: ignore[no-untyped-def]
    """The caller's other thread drops the last view while close() runs: its finalizer and
    close() both reach the segment, one gives it back, the other finds it gone (close()
    raised ValueError and left the graph memory booked before)."""
    ex, kept = executor_with_views(cpu)
    main = threading.current_thread()
    main_in, other_in, other_done = threading.Event(), threading.Event(), threading.Event()
    remove = RestorableSegments.remove

    def pinned(self, address, seg=None):  # type: ignore[no-untyped-def]
        if threading.current_thread() is main:  # close() removes after the other thread
            main_in.set()
            other_done.wait(WAIT)
        else:  # the finalizer's drain has the segment; close() reaches it meanwhile
            other_in.set()
            main_in.wait(WAIT)
        remove(self, address, seg)

    monkeypatch.setattr(RestorableSegments, "remove", pinned)
    arena = ex.holdings.arena
    close = arena.close

    def close_while_dropped() -> None:
        def drop() -> None:
            kept.clear()  # the last views: the finalizer runs on this thread
            other_done.set()

        threading.Thread(target=drop).start()
        assert other_in.wait(WAIT)
        close()

    monkeypatch.setattr(arena, "close", close_while_dropped)
    ex.close()
    assert other_done.is_set()
    assert books(buffer_memory(cpu)) == EMPTY
    assert books(cpu.virtual_memory()) == EMPTY


def test_a_view_collected_inside_close_goes_at_its_end(cpu, monkeypatch):  # type: ignore[no-untyped-def]
    """A collection on the closing thread, inside close()'s own call of the segments (an
    allocation there triggers it), runs the last view's finalizer: it waits, and close()
    gives the segment back at its end (the finalizer freed the range under close() before:
    VirtualMemoryError, the graph memory left booked)."""
    ex, kept = executor_with_views(cpu)
    cycle: list = [list(kept)]
    cycle.append(cycle)  # the views sit in a reference cycle someone else holds
    holder = [cycle]
    kept.clear()
    del cycle
    vm = buffer_memory(cpu)
    cover = vm.cover

    def collecting(address, size):  # type: ignore[no-untyped-def]
        if holder:
            holder.clear()  # the other holder lets go: garbage now
            gc.collect()
        return cover(address, size)

    monkeypatch.setattr(vm, "cover", collecting)
    ex.close()
    assert not holder
    assert books(vm) == EMPTY


def test_a_view_dropped_on_another_thread_waits_for_a_capture_open_elsewhere(cpu):  # type: ignore[no-untyped-def]
    """A finalizer on one thread while a capture of xgraph's is open on another gives
    nothing back (an unmap or a synchronize there breaks a capture in the driver's global
    mode); the next safe point after the capture does."""
    ex, kept = executor_with_views(cpu)
    ex.close()
    vm = buffer_memory(cpu)
    held = books(vm)
    assert held != EMPTY  # the view keeps the range, covered
    inside, dropped = threading.Event(), threading.Event()
    g = cpu.new_graph()
    x = torch.zeros(4)

    def capture() -> None:
        with torch.no_grad(), xgraph.graph(g):
            x.mul_(2)
            inside.set()
            dropped.wait(WAIT)
            assert books(vm) == held  # nothing given back while this capture is open

    t = threading.Thread(target=capture)
    t.start()
    assert inside.wait(WAIT)
    kept.clear()  # the last view, on this thread
    dropped.set()
    t.join(WAIT)
    assert not t.is_alive()
    assert books(vm) == held
    drain_pending()  # what the next arena made or the next finalizer runs: a safe point
    assert books(vm) == EMPTY
    g.reset()


def test_a_finalizer_drains_no_other_backends_arena_inside_its_capture(caplog):  # type: ignore[no-untyped-def]
    """A CPU buffer's last view dropped while a device's stream captures (not xgraph's
    capture) gives back the CPU arena's segment, never the device arena's: that one waits,
    and goes after the capture (before, the CPU finalizer drained every arena there: the
    device refused the synchronize inside the capture, which on a GPU breaks it)."""
    sys.path.insert(0, str(Path(__file__).parent / "dummy_adapter"))
    from xgraph_dummy.backend import DummyBackend

    dev, cpu = DummyBackend(SimRuntime()), xgraph.get_backend("cpu")
    dvm, cvm = buffer_memory(dev), buffer_memory(cpu)
    gc.collect()
    cpu_start = books(cvm)
    exd, kd = executor_with_views(dev)
    exc, kc = executor_with_views(cpu)
    exd.close(), exc.close()
    rt = dev.runtime
    stream, g = rt.new_stream(), rt.new_graph()
    with rt.use_stream(stream):
        g.capture_begin()
        kd.clear()
        held = books(dvm)
        kc.clear()  # the CPU arena's finalizer: a safe point for the CPU arena only
        assert books(dvm) == held != EMPTY
        assert books(cvm) == cpu_start
        g.capture_end()
    g.reset()
    assert rt.violations == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    drain_pending()  # a safe point for the device arena
    assert books(dvm) == EMPTY


def test_a_close_whose_buffers_fail_to_go_still_closes_its_memory_and_a_second_finishes(cpu):  # type: ignore[no-untyped-def]
    """The driver refuses to unmap a persistent buffer at close(): the error is raised, the
    graph memory is closed all the same (it was left booked before, and a second close()
    did nothing), and a second close() gives the buffer's chunk back."""
    ex, kept = executor_with_views(cpu)
    vm, segments = buffer_memory(cpu), ex.holdings.arena.segments
    with fail_driver_call(vm, "_unmap_chunk"), pytest.raises(xgraph.XGraphError):
        ex.close()
    assert books(cpu.virtual_memory()) == EMPTY
    assert segments.resident_bytes > 0
    ex.close()
    assert segments.resident_bytes == 0  # the range kept for the caller's views, covered
    kept.clear()
    assert books(vm) == EMPTY
