"""Lifetimes: memory never closes under an open executor, dropped executors give everything
back, and a failed reservation is a failed capture like any other.

`python tests/test_lifetime.py 2000` prints the numbers of N executors dropped without
close() in one process (the CI test below drops fewer).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import xgraph
from xgraph import Buckets, GraphMemory
from xgraph.backends.cpu.vmm import resident_bytes
from xgraph.models import Workload
from xgraph.testing.faults import books, fail_driver_call

BUCKETS = [1, 2, 4, 8]
EMPTY = {"reservations": 0, "mappings": 0, "chunks": 0}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: a segfault fails the test instead of pytest."""
    env = {**os.environ, "XGRAPH_BACKEND": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


def workload(seed: int = 0) -> Workload:
    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
    w.randomize_cache(seed)
    return w


# -- 1. closing memory under an open executor ----------------------------------------------

CLOSE_UNDER_EXECUTOR = """
import random, torch, xgraph
from xgraph.models import Workload
from xgraph.testing.faults import books

w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
backend = xgraph.get_backend("cpu")
rng = random.Random(0)

for what in ("pool", "memory"):
    pool = xgraph.pool.SharedPhysicalPool(backend.virtual_memory())
    mem = xgraph.GraphMemory(backend, physical=pool) if what == "memory" else pool
    ex = w.executor(backend=backend, buckets=[1, 2, 4], memory=mem, name="decode")
    ex(**w.decode_step(rng, 2).kwargs())  # captured ('full', 2)
    target = mem if what == "memory" else pool
    try:
        target.close()
    except xgraph.errors.MemoryInUseError as exc:
        print(what, "refused:", exc)
    out = ex(**w.decode_step(rng, 2).kwargs())  # a replay: the memory is still there
    print(what, "replayed", bool(torch.isfinite(out).all()))
    try:
        pool.close()  # the pool under a memory is refused as well
    except xgraph.errors.MemoryInUseError as exc:
        print(what, "pool refused:", exc)
    ex.close()
    if what == "memory":
        mem.close()
    pool.close()
    print(what, "closed in order", books(backend.virtual_memory()))

# a graph captured by hand on a space of a pool, the pool closed: the replay is refused
pool = xgraph.pool.SharedPhysicalPool(backend.virtual_memory())
native = backend.new_pool(segments=pool.new_space())
x = torch.ones(4096)
g = backend.new_graph()
with xgraph.graph(g, pool=native):
    y = x * 2 + 1
pool.close()
try:
    g.replay()
except xgraph.PoolClosedError as exc:
    print("hand graph refused:", exc)
g.reset()
native.close()

# the same through a GraphMemory with no executor: its close() closes the native pools
mem = xgraph.GraphMemory(backend, "shared-physical")
lease = mem.begin()
g = backend.new_graph()
with xgraph.graph(g, pool=lease.pool):
    y = x * 3
mem.close()
try:
    g.replay()
except xgraph.PoolClosedError as exc:
    print("memory graph refused:", exc)
print("books", books(backend.virtual_memory()))
"""


def test_closing_memory_under_an_open_executor_is_refused_and_nothing_replays_unmapped():
    r = run_python(CLOSE_UNDER_EXECUTOR)
    assert r.returncode == 0, f"exit {r.returncode} (-11 is a segfault): {r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    for what in ("pool", "memory"):
        refused = next(x for x in lines if x.startswith(f"{what} refused:"))
        assert "'decode'" in refused and "Close them first" in refused
        assert f"{what} replayed True" in lines
        assert any(x.startswith(f"{what} pool refused:") and "'decode'" in x for x in lines)
        assert f"{what} closed in order {EMPTY}" in lines
    assert any(x.startswith("hand graph refused:") for x in lines)
    assert any(x.startswith("memory graph refused:") for x in lines)
    assert lines[-1] == f"books {EMPTY}"


def test_an_executor_refuses_a_closed_memory_at_construction():
    backend = xgraph.get_backend("cpu")
    w = workload()
    mem = GraphMemory(backend, "shared-physical")
    mem.close()
    with pytest.raises(xgraph.PoolClosedError, match="GraphMemory is closed"):
        w.executor(backend=backend, buckets=BUCKETS, memory=mem)
    pool = xgraph.pool.SharedPhysicalPool(backend.virtual_memory())
    pool.close()
    with pytest.raises(xgraph.PoolClosedError, match="SharedPhysicalPool is closed"):
        w.executor(backend=backend, buckets=BUCKETS, memory=pool)


# -- 2. executors dropped without close() ---------------------------------------------------


def maps_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def drop_executors(n: int, w: Workload) -> dict[str, float]:
    """Make, use and drop `n` executors without close(); what the process holds after,
    against before (after a few executors made and dropped, so lazy setup is not counted)."""
    backend = xgraph.get_backend("cpu")
    vm = backend.virtual_memory()
    step = w.decode_step(random.Random(0), 3)

    def one() -> None:
        ex = w.executor(backend=backend, buckets=BUCKETS)  # default memory: shared-physical
        ex(**step.kwargs())  # one capture, its replay

    for _ in range(10):
        one()
    gc.collect()
    before = (resident_bytes(), maps_count(), vm.backed_bytes(), books(vm))
    for _ in range(n):
        one()
    gc.collect()
    after = (resident_bytes(), maps_count(), vm.backed_bytes(), books(vm))
    return {
        "executors": n,
        "rss_mib": (after[0] - before[0]) / 2**20,
        "maps": after[1] - before[1],
        "memfd_mib": (after[2] - before[2]) / 2**20,
        "books_equal": after[3] == before[3],
    }


@pytest.mark.slow
def test_executors_dropped_without_close_give_everything_back():
    w, ref = workload(), workload()
    d = drop_executors(200, w)  # `python tests/test_lifetime.py 2000` for the full count
    print(f"\n{d}")
    assert d["books_equal"] and d["maps"] <= 2 and d["memfd_mib"] == 0
    assert d["rss_mib"] < 4
    # a capture with the default memory mode still works, and equals eager
    for t, s in zip(ref.cache.tensors(), w.cache.tensors()):
        t.copy_(s)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    step = w.decode_step(random.Random(9), 5)
    out = ex(**step.kwargs())
    assert ex.stats()["captures"] == 1 and ex.memory.mode.value == "shared-physical"
    assert torch.equal(out, ref.eager(ref.padded(step, Buckets(BUCKETS), full=True))[:5])
    ex.close()


class Owner:
    """An object that owns an executor, as a model wrapper does."""

    def __init__(self, w: Workload) -> None:
        self.executor = w.executor(backend="cpu", buckets=BUCKETS, name="owned")


def test_an_owner_dropped_releases_its_executors_memory():
    w = workload()
    vm = xgraph.get_backend("cpu").virtual_memory()
    start = books(vm)
    gc.disable()  # reference counting alone releases it: no cycle holds an executor
    try:
        owner = Owner(w)
        owner.executor(**w.decode_step(random.Random(1), 2).kwargs())
        assert books(vm) != start
        del owner
        assert books(vm) == start
    finally:
        gc.enable()


def test_an_executor_dropped_over_shared_memory_leaves_it_closable():
    w = workload()
    backend = xgraph.get_backend("cpu")
    mem = GraphMemory(backend, "shared-physical")
    ex = w.executor(backend=backend, buckets=BUCKETS, memory=mem, name="dropped")
    ex(**w.decode_step(random.Random(1), 2).kwargs())
    assert mem.users() == ["dropped"]
    del ex
    assert mem.users() == []
    mem.close()
    assert books(backend.virtual_memory()) == EMPTY


VIEWS_PAST_CLOSE = """
import gc, torch, xgraph
from xgraph import GraphExecutor, Input
from xgraph.arena import buffer_memory
from xgraph.testing.faults import books

backend = xgraph.get_backend("cpu")
vm = buffer_memory(backend)
kept = []

def forward(x):
    kept.append(x)  # a view of the executor's persistent input buffer
    if x.shape[0] == 8:
        raise ValueError("the forward failed")
    return x * 2

ex = GraphExecutor(forward, inputs=[Input("x", torch.float32, ("num_tokens", 4096))],
                   backend=backend, buckets=[4, 8], on_capture_error="raise")
ex(x=torch.ones(3, 4096))
try:
    ex(x=torch.ones(7, 4096))
except ValueError as exc:
    err = exc
ex.close()
print("held", books(vm))
seen = [float(t.sum()) for t in kept]  # before the fix: a read of unmapped memory
tb = err.__traceback__
while tb is not None:  # what a printed traceback reads: every frame's tensors
    seen += [float(v.sum()) for v in list(tb.tb_frame.f_locals.values())
             if isinstance(v, torch.Tensor)]
    tb = tb.tb_next
print("read", len(seen), sum(seen))
del kept[:], err
gc.collect()
print("dropped", books(vm))
"""


def test_views_of_the_input_buffers_outlive_close_and_go_with_the_last_one():
    """A caller's views of the persistent buffers past close() (the forward's arguments in
    a kept traceback) read the scratch chunk instead of faulting (the process died of
    SIGSEGV before); the range, the cover and the scratch go when the last view does."""
    run = run_python(VIEWS_PAST_CLOSE)
    assert run.returncode == 0, run.stderr[-2000:]
    held, read, dropped = run.stdout.splitlines()
    # the buffer's own chunk went back at close: what is left is its range and the scratch
    assert held == "held {'reservations': 1, 'mappings': 1, 'chunks': 1}"
    n, total = read.split()[1:]
    assert int(n) >= 4 and float(total) == 0.0  # the scratch reads zeros, not the ones
    assert dropped == f"dropped {EMPTY}"


INTERRUPTED_REPLAY = """
import torch, xgraph
from xgraph import GraphExecutor, Input

ex = GraphExecutor(lambda x: (x * 2 + 1).sin(),
                   inputs=[Input("x", torch.float32, ("num_tokens", 4096))],
                   backend=xgraph.get_backend("cpu"), buckets=[8])
ex(x=torch.ones(5, 4096))  # captured
tape = ex.cache.entries[next(iter(ex.cache.entries))].graph.graph.tape

def interrupted(*args, **kwargs):  # Ctrl-C inside an op of the replay, its args in graph memory
    raise KeyboardInterrupt

func, *rest = tape._program[-1]
tape._program[-1] = (interrupted, *rest)
try:
    ex(x=torch.ones(5, 4096))
except KeyboardInterrupt as exc:
    err = exc
ex.close()  # the graph memory goes
seen, tb = [], err.__traceback__
while tb is not None:  # what a printed traceback reads: every frame's tensors
    for v in list(tb.tb_frame.f_locals.values()):
        for t in v if isinstance(v, tuple) else (v,):
            if isinstance(t, torch.Tensor):
                seen.append(float(t.float().sum()))
    tb = tb.tb_next
print("read", len(seen))
"""


def test_a_replay_interrupted_leaves_no_view_of_graph_memory_in_its_traceback():
    """Ctrl-C inside a host-driven replay (the CPU tape, a piecewise graph's pieces): the
    replay's frames held views of graph memory, which close() releases, and a traceback
    printed after it (pytest reprs every frame's arguments) read them: SIGSEGV. Their locals
    go; the user's own frames keep theirs."""
    run = run_python(INTERRUPTED_REPLAY)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("read ")


def test_close_drops_the_executors_own_views_of_its_buffers():
    """Nothing of the executor keeps a view of its buffers past close: the planner's staging,
    the device check and the runners' last plans go (the caller's own runner forgets its
    plan), so the buffers' memory is given back at once, executor and runner still alive."""
    from xgraph.arena import buffer_memory
    from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

    w = workload()
    backend = xgraph.get_backend("cpu")
    vm = buffer_memory(backend)
    gc.collect()
    start = books(vm)
    mine = PagedDecodeRunner()
    attention = w.attention(decode_runner=mine, prefill_runner=PagedPrefillRunner())
    ex = w.executor(backend=backend, buckets=BUCKETS, attention=attention)
    rng = random.Random(3)
    ex(**w.decode_step(rng, 3).kwargs())  # a full graph: the decode runner planned
    ex(**w.prefill_step(rng, [5, 2]).kwargs())  # a piecewise graph: the prefill runner
    assert mine.md is not None and books(vm) != start
    ex.close()
    assert mine.md is None and attention.prefill_runner.spans == []
    assert ex.decode_runner is None and ex.prefill_runner is None
    assert books(vm) == start  # no view left: nothing covered, nothing deferred


def test_a_finalizer_never_raises_and_logs_the_failure(caplog):
    w = workload()
    backend = xgraph.get_backend("cpu")
    vm = backend.virtual_memory()
    ex = w.executor(backend=backend, buckets=BUCKETS, name="failing")
    ex(**w.decode_step(random.Random(1), 2).kwargs())
    memory = ex.memory
    with caplog.at_level(logging.ERROR, "xgraph"):
        with fail_driver_call(vm, "_unmap_chunk", "EBUSY (injected)", nth=1):
            del ex  # released here, by reference counting: nothing may escape
    assert "failing: releasing graph memory of a dropped executor failed" in caplog.text
    assert "EBUSY" in caplog.text
    memory.close()  # the retry finishes
    assert books(vm) == EMPTY


AT_EXIT = """
import atexit
state = {}
atexit.register(lambda: print("at exit:", state["books"](), state["order"]))  # runs last

import random, xgraph
from xgraph.models import Workload
from xgraph.testing.faults import books

backend = xgraph.get_backend("cpu")
vm = backend.virtual_memory()
order = state["order"] = []
state["books"] = lambda: books(vm)
sync, unmap = backend.synchronize, vm.unmap
w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
keep = [w.executor(backend=backend, buckets=[1, 2, 4], name=f"ex{i}") for i in range(3)]
mem = xgraph.GraphMemory(backend, "shared-physical")
shared = w.executor(backend=backend, buckets=[1, 2], memory=mem, name="shared")
for ex in [*keep, shared]:
    ex(**w.decode_step(random.Random(0), 2).kwargs())
print("before exit:", books(vm))
backend.synchronize = lambda: (order.append("synchronize"), sync())[1]
vm.unmap = lambda address: (order.append("unmap"), unmap(address))[1]
"""


def test_executors_alive_at_exit_are_released_in_order():
    r = run_python(AT_EXIT)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("before exit:") and "'chunks': 0" not in lines[0]
    # the user's own GraphMemory stays the user's; everything the executors own is gone
    assert lines[1].startswith("at exit: {'reservations': 1, 'mappings': 1, 'chunks': 1} [")
    order = eval(lines[1].split("} ", 1)[1])  # our own printed list
    assert order[0] == "synchronize" and order.count("unmap") == 3  # wait, then unmap


# -- 2b. reservations -----------------------------------------------------------------------


def test_a_capture_reserves_what_it_can_use_and_the_default_is_defined_once():
    backend = xgraph.get_backend("cpu")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert backend.capture_space_bytes() == ram
    pool = xgraph.pool.SharedPhysicalPool(backend.virtual_memory())
    gran = pool.chunk_size
    assert pool.space_bytes == -(-ram // gran) * gran
    pool.close()
    assert not hasattr(xgraph.pool, "DEFAULT_SPACE_BYTES")
    assert xgraph.interfaces.FALLBACK_CAPTURE_SPACE_BYTES == 1 << 36


@pytest.mark.parametrize("how", ["injected", "address space exhausted"])
@pytest.mark.parametrize("policy", ["eager", "raise"])
def test_a_failed_reservation_follows_the_capture_error_policy(how, policy):
    w, ref = workload(), workload()
    backend = xgraph.get_backend("cpu")
    vm = backend.virtual_memory()
    # 2**47 bytes is the whole user address space of x86-64 and arm64: mmap refuses it
    pool = xgraph.pool.SharedPhysicalPool(vm, space_bytes=(1 << 47) if how != "injected" else None)
    ex = w.executor(backend=backend, buckets=BUCKETS, memory=pool, on_capture_error=policy)
    vm_before, pool_before = books(vm), pool.stats()
    step = w.decode_step(random.Random(3), 3)
    expected = ref.eager(ref.padded(step, Buckets(BUCKETS), full=True))[:3]
    fault = fail_driver_call(vm, "_reserve_range", "ENOMEM (injected)")
    with fault if how == "injected" else warnings.catch_warnings():
        if policy == "raise":
            with pytest.raises(xgraph.VirtualMemoryError, match="reserve"):
                ex(**step.kwargs())
        else:
            with pytest.warns(xgraph.XGraphWarning, match="runs eagerly"):
                out = ex(**step.kwargs())
            assert torch.equal(out, expected)
            assert ("full", 4) in ex.stats()["eager_keys"]
    assert books(vm) == vm_before and pool.stats() == pool_before  # rolled back
    assert ex.stats()["captures"] == 0 and ("full", 4) in ex.stats()["failed_keys"]
    ex.close()
    pool.close()
    assert books(vm) == EMPTY


if __name__ == "__main__":  # python tests/test_lifetime.py [N]
    torch.set_num_threads(1)
    print(drop_executors(int(sys.argv[1]) if len(sys.argv) > 1 else 2000, workload()))
    ex = workload().executor(backend="cpu", buckets=BUCKETS)
    ex(**workload().decode_step(random.Random(0), 3).kwargs())
    print("a capture afterwards:", ex.stats()["captures"], ex.memory.mode.value)
