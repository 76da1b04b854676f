"""Outside the happy path: interrupts, threads, teardown without synchronize, injected faults."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import xgraph
from xgraph import Buckets, GraphMemory
from xgraph.buckets import default_sizes
from xgraph.models import Workload
from xgraph.piecewise import PiecewiseGraph
from xgraph.testing.faults import books, fail_driver_call

BUCKETS = [1, 2, 4, 8]
ORIGINAL_TOLIST = torch.Tensor.tolist
ORIGINAL_SDPA = F.scaled_dot_product_attention


def workloads(seed: int = 0, **kw):
    ex_w, ref_w = (Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16, **kw) for _ in range(2))
    for w in (ex_w, ref_w):
        w.randomize_cache(seed)
    return ex_w, ref_w


def assert_no_capture_left_behind():
    assert torch.Tensor.tolist is ORIGINAL_TOLIST
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert not xgraph.safety.host_conversions_blocked()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert xgraph.graphs.capturing_graph() is None
    assert torch.ones(2).tolist() == [1.0, 1.0]


def memory_books(mem: GraphMemory) -> dict:
    phys = mem.physical.stats()
    return {k: phys[k] for k in ("spaces", "chunks", "physical_bytes", "virtual_bytes")}


def check_steps(ex, ex_w, ref_w, rng, batches, full=True):
    buckets = Buckets(BUCKETS)
    for b in batches:
        step = ex_w.decode_step(rng, b) if full else ex_w.prefill_step(rng, [b, 3])
        out = ex(**step.kwargs())
        ref = ref_w.eager(ref_w.padded(step, buckets, full=full))[: step.num_tokens]
        assert torch.equal(out, ref)


def sync_caches(ex_w, ref_w, allowed: set[int]) -> None:
    """Check the two caches differ only at `allowed` slots, then make them equal."""
    for a, b in zip(ex_w.cache.real(), ref_w.cache.real()):
        differ = (a != b).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(differ) <= allowed
        b.copy_(a)


# -- 1. KeyboardInterrupt at each stage of a capture -------------------------------------


class Interrupt:
    """Raises KeyboardInterrupt at the n-th call of whatever it wraps once armed, once."""

    def __init__(self, fn, at: int | None = None) -> None:
        self.fn, self.at, self.calls = fn, at, 0

    def arm(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*args, **kwargs)


STAGES = ["warm-up", "recording", "output copy", "between pieces"]


@pytest.mark.parametrize("stage", STAGES)
def test_keyboard_interrupt_mid_capture_rolls_everything_back(stage, monkeypatch):
    ex_w, ref_w = workloads()
    mem = GraphMemory(xgraph.get_backend("cpu"), "shared-physical")
    piecewise = stage == "between pieces"
    forward = Interrupt(ex_w.model.forward_logits)
    ex = ex_w.executor(
        forward,
        backend="cpu",
        buckets=BUCKETS,
        memory=mem,
        mode="piecewise" if piecewise else "auto",
    )
    rng = random.Random(1)
    check_steps(ex, ex_w, ref_w, rng, [2], full=not piecewise)  # one graph exists already
    before, vm_before = memory_books(mem), books(mem.physical.vm)
    if stage in ("warm-up", "recording"):  # the warm-up is a capture's first forward call
        forward.arm(1 if stage == "warm-up" else 2)
    if stage == "output copy":
        monkeypatch.setattr(ex.cache, "check_outputs", Interrupt(ex.cache.check_outputs, 2))
    if piecewise:  # the second attention call of the capture: one piece done, one open
        cut = Interrupt(PiecewiseGraph.attend, 2)
        monkeypatch.setattr(PiecewiseGraph, "attend", lambda self, *a: cut(self, *a))
    # a bucket not captured yet (the check above used 2 and 8 tokens)
    step = ex_w.decode_step(rng, 4) if not piecewise else ex_w.prefill_step(rng, [1, 1])
    with pytest.raises(KeyboardInterrupt):
        ex(**step.kwargs())
    monkeypatch.undo()
    assert_no_capture_left_behind()
    # the interrupted step may have written its own slots (its warm-up ran), nothing else
    sync_caches(ex_w, ref_w, allowed=set(step.attn.slots().tolist()))
    assert memory_books(mem) == before and books(mem.physical.vm) == vm_before
    assert ex.stats()["failed_keys"] == {} and ex.stats()["eager_keys"] == {}
    check_steps(ex, ex_w, ref_w, rng, [7, 2, 8, 1], full=not piecewise)  # recaptures fine
    other = ex_w.executor(backend="cpu", buckets=BUCKETS, memory=mem)  # same memory, new one
    check_steps(other, ex_w, ref_w, rng, [3])
    other.close()
    ex.close()
    mem.close()
    assert books(mem.physical.vm) == {"reservations": 0, "mappings": 0, "chunks": 0}


STALE_FRAMES = """
import random, sys, traceback
import torch, xgraph
from xgraph import GraphMemory
sys.path.insert(0, {tests!r})
from test_reliability import BUCKETS, workloads
ex_w, _ = workloads()
calls = [0]

def forward(input_ids, positions):
    logits = ex_w.model.forward_logits(input_ids, positions)  # in the capture's memory
    calls[0] += 1
    if calls[0] == 2:  # the recording (the first call is the warm-up)
        raise KeyboardInterrupt
    return logits

memory = GraphMemory(xgraph.get_backend("cpu"), "shared-physical")
ex = ex_w.executor(forward, backend="cpu", buckets=BUCKETS, memory=memory)
try:
    ex(**ex_w.decode_step(random.Random(1), 4).kwargs())
except KeyboardInterrupt as exc:
    tb = exc.__traceback__
seen = 0
for frame, _ in traceback.walk_tb(tb):  # what a printed traceback reads
    for value in list(frame.f_locals.values()):
        if isinstance(value, torch.Tensor):
            repr(value)
            seen += 1
print("read", seen, "tensors")
"""


def test_an_interrupted_captures_traceback_can_be_printed(tmp_path):
    """The rollback releases the capture's memory; the traceback of the interrupt still
    names every frame, and reading whatever its frames hold (as pytest's report of an
    interrupt does) reads no released memory (it faulted the process before)."""
    script = tmp_path / "stale.py"
    script.write_text(STALE_FRAMES.format(tests=os.path.dirname(__file__)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("read ")


# -- 2. a capture in one thread leaves other threads alone -----------------------------


def test_capture_in_one_thread_does_not_disturb_tolist_and_sdpa_in_another():
    ex_w, _ = workloads()
    ex = ex_w.executor(backend="cpu", buckets=default_sizes(64), mode="piecewise")
    stop, errors, calls = threading.Event(), [], [0]
    q = torch.randn(1, 2, 4, 8)

    def other_thread():
        while not stop.is_set():
            try:
                assert torch.arange(3).tolist() == [0, 1, 2]
                F.scaled_dot_product_attention(q, q, q)
                calls[0] += 1
            except Exception as exc:  # any error here is the bug this test is about
                errors.append(repr(exc))

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        ex.capture(kind="piecewise", progress=False)
    finally:
        stop.set()
        t.join()
    assert errors == [] and calls[0] > 0
    assert ex.stats()["captures"] == len(default_sizes(64))

    # and the capturing thread is still guarded
    def reads_host(input_ids, positions):
        n = int(input_ids.sum().item())  # a host read: refused
        return ex_w.model.forward_logits(input_ids, positions) * n

    bad = ex_w.executor(reads_host, backend="cpu", buckets=BUCKETS, on_capture_error="raise")
    with pytest.raises(xgraph.CaptureError, match="_local_scalar_dense"):
        bad(**ex_w.decode_step(random.Random(0), 2).kwargs())
    ex.close()
    bad.close()


# -- 3. one executor, four threads ---------------------------------------------------------


def disjoint_decode_step(w: Workload, thread: int, batch: int, rng: random.Random):
    """Sequence j of `thread` owns block 8 * thread + j alone: threads never share a slot."""
    bs = w.block_size
    rows = [[8 * thread + j] for j in range(batch)]
    lens = [rng.randint(1, bs) for _ in range(batch)]
    slots = [r[0] * bs + n - 1 for r, n in zip(rows, lens)]
    ids = torch.tensor([rng.randrange(w.vocab) for _ in range(batch)])
    attn = xgraph.AttentionInputs([1] * batch, lens, rows, slots)
    return ids, torch.tensor([n - 1 for n in lens]), attn


def test_four_threads_on_one_executor_never_corrupt_anything():
    ex_w, ref_w = workloads(3)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS)
    results, refused, barrier = [], [], threading.Barrier(4)

    def worker(i: int) -> None:
        rng = random.Random(i)
        barrier.wait()
        for _ in range(12):
            ids, pos, attn = disjoint_decode_step(ex_w, i, rng.randint(1, 6), rng)
            try:
                out = ex(input_ids=ids, positions=pos, attn=attn, clone=True)
                results.append((ids, pos, attn, out))
            except xgraph.ConcurrentStepError as exc:
                refused.append(str(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) + len(refused) == 48 and results
    assert all("one step at a time" in r for r in refused)
    for ids, pos, attn, out in results:  # disjoint slots: the order of steps does not matter
        step = xgraph.models.Step(ids, pos, attn)
        ref = ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=True))[: len(ids)]
        assert torch.equal(out, ref)
    for a, b in zip(ex_w.cache.real(), ref_w.cache.real()):
        assert torch.equal(a, b) and not a.isnan().any()
    ex.close()


# -- 4. teardown needs no synchronize from the caller --------------------------------------


@pytest.mark.parametrize("memory", ["shared-physical", "shared-pool", "private"])
def test_close_right_after_queued_replays_waits_for_them(memory):
    ex_w, ref_w = workloads()
    backend = xgraph.get_backend("cpu")
    ex = ex_w.executor(backend=backend, buckets=BUCKETS, memory=memory)
    check_steps(ex, ex_w, ref_w, random.Random(2), [1, 3, 3, 8, 2])
    assert backend.queued > 0  # replays are "in flight" as far as the device queue goes
    ex.close()  # no synchronize first
    assert backend.queued == 0
    vm = backend.virtual_memory()
    assert books(vm) == {"reservations": 0, "mappings": 0, "chunks": 0}


def test_the_cpu_queue_catches_an_unmap_under_queued_work():
    """The ordering check is real: the driver call itself refuses while replays are queued."""
    backend = xgraph.get_backend("cpu")
    vm = backend.virtual_memory()
    a = vm.reserve(vm.granularity)
    c = vm.create(vm.granularity)
    vm.map(a, c)
    backend.queued = 1  # a replay was queued
    with pytest.raises(xgraph.VirtualMemoryError, match="queued since the last synchronize"):
        vm._unmap_chunk(a, vm.granularity)  # what a teardown without waiting would do
    vm.unmap(a)  # the contract waits first
    vm.free(c)
    vm.release(a)


# -- 6. injected driver failures roll back with balanced books -----------------------------


@pytest.mark.parametrize(
    "call,nth",  # the batch-8 capture reserves 1 range, maps 2 chunks, creates 1 (counted)
    [("_reserve_range", 1), ("_map_chunk", 1), ("_create_chunk", 1), ("_map_chunk", 2)],
)
def test_vmm_failure_mid_capture_raises_its_name_and_leaks_nothing(call, nth):
    ex_w, ref_w = workloads()
    backend = xgraph.get_backend("cpu")
    mem = GraphMemory(backend, "shared-physical")
    ex = ex_w.executor(backend=backend, buckets=BUCKETS, memory=mem, on_capture_error="raise")
    rng = random.Random(4)
    check_steps(ex, ex_w, ref_w, rng, [1])
    before, vm_before = memory_books(mem), books(mem.physical.vm)
    step = ex_w.decode_step(rng, 8)
    with fail_driver_call(mem.physical.vm, call, "ENOMEM (injected)", nth=nth) as fault:
        with pytest.raises(xgraph.VirtualMemoryError, match=f"{call} failed: ENOMEM"):
            ex(**step.kwargs())
    assert fault.fired
    sync_caches(ex_w, ref_w, allowed=set(step.attn.slots().tolist()))  # its warm-up ran
    assert memory_books(mem) == before and books(mem.physical.vm) == vm_before
    check_steps(ex, ex_w, ref_w, rng, [1, 8, 5])  # other keys and the failed one both serve
    ex.close()
    mem.close()
    assert books(mem.physical.vm) == {"reservations": 0, "mappings": 0, "chunks": 0}


@pytest.mark.parametrize("call", ["_unmap_chunk", "_release_range", "_free_chunk"])
def test_a_driver_failure_during_teardown_is_reported_and_a_retry_finishes(call):
    ex_w, ref_w = workloads()
    backend = xgraph.get_backend("cpu")
    vm = backend.virtual_memory()
    start = books(vm)
    ex = ex_w.executor(backend=backend, buckets=BUCKETS, memory="shared-physical")
    check_steps(ex, ex_w, ref_w, random.Random(6), [1, 8, 3])
    with fail_driver_call(vm, call, "EBUSY (injected)", nth=2):
        with pytest.raises(xgraph.VirtualMemoryError, match=f"{call} failed: EBUSY"):
            ex.close()
    assert books(vm) != start  # what the driver refused is still booked, nothing else lost
    ex.memory.close()  # the retry
    assert books(vm) == start


# -- block-table columns past a sequence's need --------------------------------------------


@pytest.mark.parametrize("junk", [-1, 10**6])
def test_junk_ids_past_a_rows_need_change_nothing(junk):
    """Engines pad block-table rows with anything past the blocks a sequence uses; those
    columns are not validated, so the decode runner must never follow them."""
    ex_w, ref_w = workloads(seed=5)
    ex = ex_w.executor(buckets=BUCKETS)
    step = ex_w.decode_step(random.Random(5), 3, max_context=9)
    table = step.attn.table(junk, width=ex_w.max_blocks)  # junk in every unused column
    assert (table == junk).any()
    attn = xgraph.AttentionInputs(
        step.attn.query_lens, step.attn.seq_lens, table, step.attn.slot_mapping
    )
    out = ex(input_ids=step.input_ids, positions=step.positions, attn=attn)
    ref = ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=True))[: step.num_tokens]
    assert torch.equal(out, ref)
    ex.close()


# -- 3b. two executors over one graph memory, one thread each ------------------------------


@pytest.mark.parametrize("share", ["GraphMemory", "SharedPhysicalPool"])
def test_two_executors_sharing_memory_in_two_threads_step_one_at_a_time(share):
    """Their graphs share physical memory: steps wait for each other (no error, no mix)."""
    ex_w, ref_w = workloads(7)
    backend = xgraph.get_backend("cpu")
    if share == "GraphMemory":
        shared = GraphMemory(backend, "shared-physical")
    else:
        shared = xgraph.pool.SharedPhysicalPool(backend.virtual_memory())
    exs = [
        ex_w.executor(backend=backend, buckets=BUCKETS, memory=shared, name=f"ex{i}")
        for i in range(2)
    ]
    results, errors, barrier = [], [], threading.Barrier(2)

    def worker(i: int) -> None:
        rng = random.Random(10 + i)
        barrier.wait()
        for _ in range(75):
            ids, pos, attn = disjoint_decode_step(ex_w, i, rng.randint(1, 6), rng)
            try:
                out = exs[i](input_ids=ids, positions=pos, attn=attn, clone=True)
                results.append((ids, pos, attn, out))
            except Exception as exc:  # any error is a failure of this test
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 150
    wrong = 0
    for ids, pos, attn, out in results:  # in the order the steps ran
        step = xgraph.models.Step(ids, pos, attn)
        ref = ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=True))[: len(ids)]
        wrong += not torch.equal(out, ref)
    assert wrong == 0
    for a, b in zip(ex_w.cache.real(), ref_w.cache.real()):
        assert not a.isnan().any() and torch.equal(a, b)
    for ex in exs:
        ex.close()
    shared.close()


def test_a_forward_stepping_an_executor_over_its_own_memory_is_refused():
    """A nested step over the same memory would wait for itself: ConcurrentStepError."""
    ex_w, _ = workloads()
    mem = GraphMemory(xgraph.get_backend("cpu"), "shared-physical")
    inner = ex_w.executor(backend="cpu", buckets=BUCKETS, memory=mem, name="inner")
    step = ex_w.decode_step(random.Random(0), 2)

    def outer_forward(input_ids, positions):
        inner(**step.kwargs())
        return ex_w.model.forward_logits(input_ids, positions)

    outer = ex_w.executor(outer_forward, backend="cpu", buckets=BUCKETS, memory=mem)
    with pytest.raises(xgraph.ConcurrentStepError, match="same graph memory"):
        outer(**ex_w.decode_step(random.Random(1), 2).kwargs())
    assert not mem.steps.locked()
    inner(**step.kwargs())  # both still work, one after the other
    outer.close()
    inner.close()
    mem.close()
