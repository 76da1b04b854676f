"""The device check captured as a graph of its own (xgraph.device_check), on the CPU tape.

Device metadata goes down the path an engine with cuda tensors takes (`cpu_is_device`):
the given tensors are copied into the check's raw buffers and its graph, captured once per
(padded sequences, query length), is replayed before the step's graph. Shown here: every
batch composition of a key gives what host metadata gives, bit for bit (outputs, KV cache,
the metadata the step's graph reads) from one capture; the host issues a few ops per step,
not the check's; a check that cannot be captured runs eagerly and still guards; captures
interrupted, failed or torn down leave the books balanced. Planted bad values:
tests/test_device_check_plants.py.
"""

from __future__ import annotations

import collections
import gc
import random
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import xgraph
from xgraph import AttentionInputs
from xgraph.backends.cpu.tape import OpTape
from xgraph.device_check import DeviceCheck
from xgraph.errors import AsleepError, CaptureError
from xgraph.graphs import capturing_graph
from xgraph.models import Step, Workload
from xgraph.testing.faults import books, fail_driver_call

BUCKETS = [1, 2, 4, 8, 16]
MAX_Q = 3
MAX_SEQS = {1: 16, 2: 8, 3: 4}  # the most sequences of q tokens a full graph takes here
FILLS = (-1, 0, 10**6)  # columns past a row's need hold anything (never read)


def pair(seed: int, memory: str | None = None, **kw):  # type: ignore[no-untyped-def]
    """Two executors over equal workloads: device metadata on one, host metadata on the other."""
    ws = [Workload.tiny(num_blocks=96, max_blocks=6, max_seqs=16) for _ in range(2)]
    for w in ws:
        w.randomize_cache(seed)
    att = {"max_query_len": MAX_Q, **kw}
    exs = [
        w.executor(backend="cpu", buckets=BUCKETS, memory=memory, attention=w.attention(**att))
        for w in ws
    ]
    exs[0].planner.attn_check.cpu_is_device = True
    return ws, exs


def tensors(step: Step, w: Workload, width: int, fill: int, int64: bool) -> AttentionInputs:
    """The step's metadata as an engine keeps it: tensors, a table `width` wide."""
    a = step.attn
    dtype = torch.int64 if int64 else torch.int32
    return AttentionInputs(
        list(a.query_lens),
        torch.tensor(list(a.seq_lens), dtype=dtype),
        a.table(fill, width),
        torch.as_tensor(a.slot_mapping).clone(),
    )


def captured(ex) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(padded sequences, query length) of each key whose device check is a graph."""
    return sorted(sq for sq, g in ex.cache.checks() if g is not None)


def padded_seqs(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


def graph_extents(ex, s: int, q: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The metadata a full graph of s sequences of q tokens reads."""
    st_ = ex.planner.staged
    return {
        "seq_lens": st_["seq_lens"][:s],
        "query_start_loc": st_["query_start_loc"][: s + 1],
        "block_tables": st_["block_tables"][:s],
        "slot_mapping": st_["slot_mapping"][: s * q],
    }


def run_both(dw, dex, hex_, step, rng):  # type: ignore[no-untyped-def]
    """One step on both executors, the same tensors on each; the two outputs."""
    need = max(len(r) for r in step.attn.block_tables)
    width, fill = rng.randint(need, dw.max_blocks), rng.choice(FILLS)
    int64 = rng.random() < 0.3
    kw = {"input_ids": step.input_ids, "positions": step.positions}
    out = dex(attn=tensors(step, dw, width, fill, int64), clone=True, **kw)
    ref = hex_(attn=tensors(step, dw, width, fill, int64), clone=True, **kw)
    return out, ref


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**20),
    shapes=st.lists(
        st.tuples(st.sampled_from([1, 1, 2, 3]), st.integers(1, 16)), min_size=3, max_size=9
    ),
)
def test_every_batch_composition_of_a_key_gives_what_host_metadata_gives(seed, shapes):
    (dw, hw), (dex, hex_) = pair(seed)
    rng = random.Random(seed)
    keys = set()
    for q, n in shapes:
        n = min(n, MAX_SEQS[q])  # within a bucket n varies from step to step
        step = dw.step(rng, [q] * n, [rng.randint(q, 20) for _ in range(n)])
        out, ref = run_both(dw, dex, hex_, step, rng)
        assert torch.equal(out, ref)
        s = padded_seqs(n)
        keys.add((s, q))
        for name, v in graph_extents(dex, s, q).items():  # what the step's graph read
            assert torch.equal(v, graph_extents(hex_, s, q)[name]), name
        for a, b in zip(dw.cache.tensors(), hw.cache.tensors()):
            assert torch.equal(a, b)
    assert captured(dex) == sorted(keys)  # one capture per key, whatever the batch
    assert len(dex.cache.checks()) == len(keys)
    assert dex.stats()["hits"] == hex_.stats()["hits"]
    dex.synchronize()  # nothing found
    for ex in (dex, hex_):
        ex.close()
    assert not dex.cache.checks()


def test_rows_an_earlier_step_left_in_the_raw_buffers_are_masked():
    """A bad row of an 8-sequence step stays in the raw buffers when 5 sequences follow in
    the same key: the check reads it only up to the staged count, so nothing is found."""
    (dw, _), (dex, hex_) = pair(7)
    rng = random.Random(7)
    big = dw.decode_step(rng, 8)
    attn = tensors(big, dw, dw.max_blocks, dw.cache.dummy_block, False)
    attn.block_tables[6, 0] = -5
    dex(input_ids=big.input_ids, positions=big.positions, attn=attn)
    with pytest.raises(xgraph.InputError, match=r"block_tables\[6\] = -5"):
        dex.synchronize()
    hex_(**big.kwargs())
    small = dw.decode_step(rng, 5)
    out, ref = run_both(dw, dex, hex_, small, rng)
    assert torch.equal(out, ref)
    dex.synchronize()  # rows 5..7 of the raw buffers were not read as sequences
    assert captured(dex) == [(8, 1)]
    for ex in (dex, hex_):
        ex.close()


class HostOps(TorchDispatchMode):
    """Counts the ops the host issues, a graph's replay as one (the CPU tape re-runs its ops
    on the host, where a GPU graph is one launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.replays = 0
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.inside:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_step(monkeypatch, ex, kwargs) -> HostOps:  # type: ignore[no-untyped-def]
    counter = HostOps()
    replay = OpTape.replay

    def counted(tape: OpTape) -> None:
        counter.replays += 1
        counter.inside += 1
        try:
            replay(tape)
        finally:
            counter.inside -= 1

    monkeypatch.setattr(OpTape, "replay", counted)
    with counter:
        ex(**kwargs)
    monkeypatch.setattr(OpTape, "replay", replay)
    return counter


@pytest.mark.parametrize("batch", [3, 8, 16])
def test_the_host_issues_a_few_ops_per_device_step_not_the_checks(monkeypatch, batch):
    """Issued eagerly, the check cost a step 98 host ops (72 of them computing: kernels on a
    GPU, or scalars) beside the host path's 5, at every batch size; captured: the three
    copies into the raw buffers, the error's copy to the host and one more replay."""
    (dw, _), (dex, hex_) = pair(11)
    step = dw.decode_step(random.Random(11), batch)
    table = dw.max_blocks
    dev = {"attn": tensors(step, dw, table, 0, False)}
    host = {"attn": tensors(step, dw, table, 0, False)}
    tokens = {"input_ids": step.input_ids, "positions": step.positions}
    for ex, attn in ((dex, dev), (hex_, host)):
        ex(**tokens, **attn)  # captures
        ex(**tokens, **attn)
    on_device = count_step(monkeypatch, dex, {**tokens, **dev})
    on_host = count_step(monkeypatch, hex_, {**tokens, **host})
    print(f"\nbatch {batch}: device {dict(on_device.ops)}\nhost {dict(on_host.ops)}")
    assert (on_device.replays, on_host.replays) == (2, 1)  # the check's graph, the step's
    extra = on_device.ops - on_host.ops
    assert extra["aten.copy_.default"] == 4  # three into the raw buffers, the error out
    assert sum(on_device.ops.values()) <= sum(on_host.ops.values()) + 6
    for op in ("aten.sort.stable", "aten.where.self", "aten.gather.default", "aten.cat.default"):
        assert op not in on_device.ops  # the check's own ops run inside its graph
    for ex in (dex, hex_):
        ex.close()


def _refused_end(backend):  # type: ignore[no-untyped-def]
    """A backend whose graphs' capture_end the runtime refuses (for the check only)."""

    class Refusing:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(backend, name)

        def new_graph(self):  # type: ignore[no-untyped-def]
            g = backend.new_graph()

            def end() -> None:
                raise CaptureError("the runtime refused the capture (injected)")

            g._end = end
            return g

    return Refusing()


@pytest.mark.parametrize(
    "how, memory",
    [
        ("capture_end refused", "shared-physical"),
        ("map of the pool failed", "shared-physical"),
        ("map of the pool failed", "private"),
    ],
)
def test_a_check_that_cannot_be_captured_runs_eagerly_and_still_guards(how, memory, monkeypatch):
    vm = xgraph.get_backend("cpu").virtual_memory()
    before = books(vm)
    (dw, _), (dex, hex_) = pair(12, memory=memory)
    rng = random.Random(12)
    first = dw.decode_step(rng, 3)
    a = first.attn
    lists = AttentionInputs(a.query_lens, a.seq_lens, a.block_tables, a.slot_mapping.tolist())
    hex_(**first.kwargs())
    dex(input_ids=first.input_ids, positions=first.positions, attn=lists)  # on the host
    assert captured(dex) == []  # the step's graph only
    if how == "capture_end refused":  # the key is captured: only its check's graph is new
        monkeypatch.setattr(dex.backend, "new_graph", _refused_end(dex.backend).new_graph)
        fault = None
    else:
        fault = fail_driver_call(vm, "_map_chunk", nth=1)
        fault.__enter__()
    try:
        with pytest.warns(xgraph.XGraphWarning, match="could not be captured") as warned:
            out, ref = run_both(dw, dex, hex_, dw.decode_step(rng, 4), rng)
        assert warned[0].filename == __file__  # the step call's line
    finally:
        if fault is not None:
            fault.__exit__(None, None, None)
        monkeypatch.undo()
    assert torch.equal(out, ref) and captured(dex) == []
    assert [g for _, g in dex.cache.checks()] == [None]  # its ops, issued eagerly
    bad = dw.decode_step(rng, 3)  # the eager check redirects and names as the graph does
    attn = tensors(bad, dw, dw.max_blocks, 0, False)
    attn.slot_mapping[2] = -4
    before_kv = [t.clone() for t in dw.cache.tensors()]
    dex(input_ids=bad.input_ids, positions=bad.positions, attn=attn)
    for b, t in zip(before_kv, dw.cache.tensors()):
        slot = bad.attn.slot_mapping[2]
        flat_b, flat_t = b.reshape(-1, *b.shape[2:]), t.reshape(-1, *t.shape[2:])
        assert torch.equal(flat_b[slot], flat_t[slot])
    with pytest.raises(xgraph.InputError, match=r"slot_mapping\[2\] = -4"):
        dex.synchronize()
    for ex in (dex, hex_):
        ex.close()
    assert books(vm) == before


def test_an_interrupt_while_the_check_captures_leaves_nothing_and_the_next_step_captures(
    monkeypatch,
):
    vm = xgraph.get_backend("cpu").virtual_memory()
    before = books(vm)
    (dw, _), (dex, hex_) = pair(13)
    rng = random.Random(13)
    real = DeviceCheck._check

    def interrupted(self, *args):  # type: ignore[no-untyped-def]
        if capturing_graph() is not None:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(DeviceCheck, "_check", interrupted)
    step = dw.decode_step(rng, 5)
    with pytest.raises(KeyboardInterrupt):
        attn = tensors(step, dw, dw.max_blocks, 0, False)
        dex(input_ids=step.input_ids, positions=step.positions, attn=attn)
    assert dex.cache.checks() == [] and dex.stats()["keys"] == []  # the key rolled back
    monkeypatch.setattr(DeviceCheck, "_check", real)
    out, ref = run_both(dw, dex, hex_, step, rng)
    assert torch.equal(out, ref) and captured(dex) == [(8, 1)]
    for ex in (dex, hex_):
        ex.close()
    assert books(vm) == before


def test_an_executor_dropped_without_close_gives_the_checks_graphs_back():
    vm = xgraph.get_backend("cpu").virtual_memory()
    before = books(vm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", xgraph.XGraphWarning)  # the check captured
        (dw, _), (dex, hex_) = pair(14)
        rng = random.Random(14)
        for n in (2, 5, 9):
            run_both(dw, dex, hex_, dw.decode_step(rng, n), rng)
    assert len(captured(dex)) == 3
    del dex, hex_
    gc.collect()
    assert books(vm) == before


def test_sleep_gives_back_the_checks_memory_and_wake_replays_it():
    """The check's graphs take their pools from the executor's graph memory and its raw
    buffers live in the executor's arena: sleep gives them back with the rest, and after
    wake every key's check replays (no recapture), equal to host metadata."""
    vm = xgraph.get_backend("cpu").virtual_memory()
    before = books(vm)
    (dw, _), (dex, hex_) = pair(15)
    rng = random.Random(15)
    steps = [
        dw.step(rng, [q] * n, [rng.randint(q, 20) for _ in range(n)])
        for q, n in [(1, 3), (1, 7), (2, 4), (1, 6)]
    ]
    for s in steps:
        run_both(dw, dex, hex_, s, rng)
    check = dex.planner.device_check
    graphs = [g for _, g in dex.cache.checks()]
    raw = check._raw.seq_lens.data_ptr()
    assert dex.stats()["persistent_bytes"] - hex_.stats()["persistent_bytes"] == check.nbytes()
    released = dex.sleep().released_bytes
    assert released >= hex_.sleep().released_bytes + check.nbytes()  # the raw buffers too
    with pytest.raises(AsleepError):
        run_both(dw, dex, hex_, steps[0], rng)
    dex.wake()
    hex_.wake()
    for s in steps:
        out, ref = run_both(dw, dex, hex_, s, rng)
        assert torch.equal(out, ref)
    assert [g for _, g in dex.cache.checks()] == graphs  # kept, as the raw buffers are
    assert check._raw.seq_lens.data_ptr() == raw
    dex.synchronize()
    for ex in (dex, hex_):
        ex.close()
    assert books(vm) == before
