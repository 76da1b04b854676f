"""Slept memory touched (issue 33, item 8): every range sleep gives back is covered by one
scratch chunk, so reads, writes and eager forwards over slept tensors leave the process
alive, and wake restores every graph with balanced books, also when the driver fails while
mapping or unmapping the scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import xgraph
from xgraph import GraphExecutor, Input
from xgraph.arena import buffer_memory
from xgraph.backends.cpu import CPUBackend, HostVirtualMemory
from xgraph.errors import VirtualMemoryError
from xgraph.testing.faults import books, fail_driver_call
from xgraph.testing.sleep_touch import MARKER


def run_touch(backend: str, env: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    """The touching child (xgraph.testing.sleep_touch) on `backend`: alive, every check met."""
    proc = subprocess.run(
        [sys.executable, "-m", "xgraph.testing.sleep_touch", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -11: SIGSEGV
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(MARKER), proc.stdout[-2000:]
    return json.loads(line[len(MARKER) :])  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend, env", [("cpu", {}), ("dummy", {"XGRAPH_DUMMY_BACKEND": "1"})])
def test_touching_slept_memory_leaves_the_process_alive_and_wake_restores_every_graph(
    backend, env
) -> None:  # type: ignore[no-untyped-def]
    got = run_touch(backend, env)
    assert got["nonzero_bytes_read"] == 0 and got["ranges"] >= 2 and got["step_refused"]
    for check in ("weights_kept", "kv_zeroed", "replays_equal", "no_recapture"):
        assert got[check] is True, check
    assert got["books_balanced"] is True and got["scratch_freed"] is True


# -- the cover contract -------------------------------------------------------------------


def test_one_scratch_chunk_covers_every_range_and_goes_with_the_last_cover() -> None:
    backend = CPUBackend()
    vm = HostVirtualMemory(backend)
    g, start = vm.granularity, books(vm)
    a, b = vm.reserve(4 * g), vm.reserve(64 * g)  # b: more than one 2 MiB piece
    vm.cover(a, 4 * g)
    vm.cover(b, 64 * g)
    assert books(vm) == {"reservations": 2, "mappings": 2, "chunks": 1}
    assert vm.scratch_held() == vm.scratch_bytes == 2 << 20 and vm.covered_bytes() == 68 * g
    ta, tb = backend.as_tensor(a, 4 * g), backend.as_tensor(b + (2 << 20), g)  # 2nd piece
    assert not ta.any() and not tb.any()  # a fresh scratch reads zeros
    ta[:16].fill_(9)  # every range shares the scratch: a write shows at the same offset
    assert torch.equal(tb[:16], torch.full((16,), 9, dtype=torch.uint8))
    chunk = vm.create(g)
    with pytest.raises(VirtualMemoryError, match="covered by the scratch chunk"):
        vm.map(a + g, chunk)
    with pytest.raises(VirtualMemoryError, match="covered by the scratch chunk"):
        vm.cover(a, g)
    vm.uncover(a)
    vm.map(a, chunk)
    with pytest.raises(VirtualMemoryError, match="overlaps the mapping"):
        vm.cover(a, 2 * g)
    del ta, tb
    vm.unmap(a)
    vm.free(chunk)
    vm.release(b)  # a reservation takes its covers with it; the last one frees the scratch
    assert vm.scratch_held() == 0 and vm.covers() == 0
    vm.release(a)
    assert books(vm) == start


# -- failures, with the books balanced ----------------------------------------------------


def mlp_executor(backend, name):  # type: ignore[no-untyped-def]
    w = torch.randn(256, 1024)
    return GraphExecutor(
        lambda x: torch.tanh(x @ w) @ w.T,
        inputs=[Input("x", torch.float32, ("num_tokens", 256))],
        backend=backend,
        buckets=[16, 64],
        name=name,
    )


@pytest.fixture
def engine():  # type: ignore[no-untyped-def]
    """A region of 6 MiB (a cover of three 2 MiB pieces) and an executor on a backend of its
    own, with the books of both VirtualMemory objects and the outputs of every bucket."""
    backend = CPUBackend()
    tag = f"t-touch-{id(backend)}"
    with xgraph.memory_region(tag, backend):
        weights = torch.randn(3 << 19)
    saved = weights.clone()
    ex = mlp_executor(backend, "touch")
    xs = {n: torch.randn(n, 256) for n in (16, 64)}
    before = {n: ex(x=x, clone=True) for n, x in xs.items()}
    vms = (backend.virtual_memory(), buffer_memory(backend))
    yield SimpleNamespace(
        backend=backend, tag=tag, ex=ex, xs=xs, before=before, vms=vms, held=(weights, saved)
    )
    ex.close()


def both(vms):  # type: ignore[no-untyped-def]
    return tuple(books(vm) for vm in vms)


def assert_woken(e) -> None:  # type: ignore[no-untyped-def]
    weights, saved = e.held
    assert torch.equal(weights, saved)  # offloaded: back bit for bit
    for n, x in e.xs.items():
        assert torch.equal(e.ex(x=x), e.before[n])
    assert e.ex.stats()["captures"] == 2  # replayed, not recaptured


def assert_books_agree(e) -> None:  # type: ignore[no-untyped-def]
    """Each VirtualMemory's mapped and covered bytes are those its users hold, and it holds
    a scratch chunk exactly while something is covered."""
    from xgraph.pool_sleep import _asleep
    from xgraph.regions import regions

    pool = e.ex.memory.physical
    extent = _asleep.get(pool)  # None: the failure came before the graph memory's turn
    sets = ([regions(e.backend, [e.tag])[0].segments], [e.ex.arena.segments])
    for vm, held in zip(e.vms, sets):
        segs = [s for r in held for s in r.segments.values()]
        mapped = sum(s.size for s in segs if s.mapped)
        covered = sum(s.size for s in segs if s.covered)
        if held is sets[0]:
            mapped += pool.mapped_bytes
            if extent is not None:
                covered += sum(extent.mapped[s] * pool.chunk_size for s in extent.covered)
        assert (vm.mapped_bytes(), vm.covered_bytes()) == (mapped, covered)
        assert vm.scratch_held() == (vm.scratch_bytes if covered else 0)


@pytest.mark.parametrize(
    "vm_at, call, nth",
    [(0, "_create_chunk", 1), (0, "_map_chunk", 1), (0, "_map_chunk", 2), (1, "_map_chunk", 1)],
)
def test_a_sleep_that_fails_mapping_the_scratch_keeps_exact_books_and_finishes_when_called_again(
    engine, vm_at, call, nth
) -> None:  # type: ignore[no-untyped-def]
    e = engine
    awake = both(e.vms)
    with fail_driver_call(e.vms[vm_at], call, nth=nth) as fault:
        with pytest.raises(VirtualMemoryError, match="injected"):
            xgraph.sleep(e.ex, tags=e.tag, offload=e.tag)
    assert fault.fired
    assert_books_agree(e)  # what failed is booked neither mapped nor covered
    xgraph.sleep(e.ex, tags=e.tag, offload=e.tag)  # finishes the job
    asleep = both(e.vms)
    assert all(
        b["chunks"] == 1 and b["reservations"] == a["reservations"] for a, b in zip(awake, asleep)
    )
    xgraph.wake(e.ex, tags=e.tag)
    assert both(e.vms) == awake
    assert_woken(e)


@pytest.mark.parametrize("vm_at, nth", [(0, 1), (0, 3), (1, 1)])
def test_a_wake_that_fails_unmapping_the_scratch_goes_back_to_sleep(engine, vm_at, nth) -> None:  # type: ignore[no-untyped-def]
    e = engine
    awake = both(e.vms)
    xgraph.sleep(e.ex, tags=e.tag, offload=e.tag)
    asleep = both(e.vms)
    with fail_driver_call(e.vms[vm_at], "_unmap_chunk", nth=nth) as fault:
        with pytest.raises(VirtualMemoryError, match="injected"):
            xgraph.wake(e.ex, tags=e.tag)
    assert fault.fired and both(e.vms) == asleep
    xgraph.wake(e.ex, tags=e.tag)
    assert both(e.vms) == awake and all(vm.scratch_held() == 0 for vm in e.vms)
    assert_woken(e)


def test_closing_an_executor_while_asleep_frees_its_scratch_chunks(engine) -> None:  # type: ignore[no-untyped-def]
    e = engine
    start = both(e.vms)
    other = mlp_executor(e.backend, "other")  # graph memory of its own: its pool sleeps alone
    other(x=e.xs[16])
    other.sleep()
    assert all(vm.scratch_held() > 0 for vm in e.vms)
    other.close()  # no wake: the covers go with the reservations, the scratch with them
    assert both(e.vms) == start and all(vm.scratch_held() == 0 for vm in e.vms)
