"""GraphExecutor on the CPU backend: decode through full graphs equals eager, bit for bit.

Tolerance for the unpadded comparison (different matmul row counts may round differently):
float32, rtol = atol = 1e-5.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xgraph
from xgraph import Buckets, Dim, GraphExecutor, Input
from xgraph.models import TOKEN_INPUTS, Workload
from xgraph.runners import PagedPrefillRunner

BUCKETS = [1, 2, 4, 8, 16]
RTOL = ATOL = 1e-5


def three_workloads(seed: int) -> tuple[Workload, Workload, Workload]:
    """Same weights and initial cache: through the executor, eager padded, eager unpadded."""
    ws = [Workload.tiny(num_blocks=128, max_blocks=6, max_seqs=24) for _ in range(3)]
    for w in ws:
        w.randomize_cache(seed)
    return ws[0], ws[1], ws[2]


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**20),
    batches=st.lists(st.integers(1, 20), min_size=3, max_size=8),
    memory=st.sampled_from(["shared-physical", "shared-pool", "private"]),
)
def test_decode_sequence_equals_eager(seed, batches, memory):
    ex_w, pad_w, raw_w = three_workloads(seed)
    buckets = Buckets(BUCKETS)
    ex = ex_w.executor(backend="cpu", buckets=buckets, memory=memory)
    rng = random.Random(seed)
    for batch in batches:
        step = ex_w.decode_step(rng, batch)
        before = [t.clone() for t in ex_w.cache.real()]
        out = ex(**step.kwargs())

        padded = pad_w.padded(step, buckets, full=True) if batch <= buckets.max else step
        ref_padded = pad_w.eager(padded)[:batch]
        ref_raw = raw_w.eager(step)
        assert out.shape == ref_raw.shape
        assert torch.equal(out, ref_padded), f"batch {batch}: not bitwise equal to padded eager"
        torch.testing.assert_close(out, ref_raw, rtol=RTOL, atol=ATOL)

        # the whole cache, dummy block included, matches the padded eager run bit for bit
        for a, b in zip(ex_w.cache.tensors(), pad_w.cache.tensors()):
            assert torch.equal(a, b)
        # real blocks match the unpadded run: padding never wrote into them
        for a, b in zip(ex_w.cache.real(), raw_w.cache.real()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        written = set(step.attn.slot_mapping.tolist())
        for old, new in zip(before, ex_w.cache.real()):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) <= written, "a slot outside this step's slots changed"
    s = ex.stats()
    assert s["replays"] + sum(s["eager"].values()) >= len(batches)
    if any(b > buckets.max for b in batches):
        assert s["eager"]["above largest bucket"] == sum(b > buckets.max for b in batches)
    ex.close()


def test_persistent_input_bytes_stay_one_max_shape_set():
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    w.randomize_cache(0)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    expected = 16 * 8 * 2  # input_ids and positions, int64, 16 tokens
    expected += 16 * 8 + 24 * 4 + 25 * 4 + 24 * 6 * 4  # slot mapping, seq lens, qsl, tables
    expected += 2 * 8  # the device check's counts (sequences, table width), int64
    assert ex.stats()["persistent_bytes"] == expected
    rng = random.Random(0)
    seen = []
    for batch in [1, 3, 7, 12, 16, 2]:
        ex(**w.decode_step(rng, batch).kwargs())
        seen.append(ex.stats()["persistent_bytes"])
    out_bytes = 16 * w.vocab * 4  # one persistent output buffer, max bucket rows
    assert seen == [expected + out_bytes] * len(seen)
    assert len(ex.stats()["keys"]) == 5  # five buckets captured, inputs still one set
    ex.close()


def item_on_one_path(w: Workload):
    def forward(input_ids, positions):
        h = w.model.forward_logits(input_ids, positions)
        if input_ids.shape[0] == 8:  # only the 8-token bucket takes this path
            h = h * (h[0, 0].item() != 12345.0)  # host read: not capturable
        return h

    return forward


def test_host_read_on_one_path_falls_back_for_that_key_only():
    w, ref = Workload.tiny(max_blocks=6, max_seqs=24), Workload.tiny(max_blocks=6, max_seqs=24)
    for x in (w, ref):
        x.randomize_cache(1)
    ex = w.executor(item_on_one_path(w), backend="cpu", buckets=BUCKETS)
    rng = random.Random(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in [5, 3, 6, 16, 7, 1, 8, 2]:
            step = w.decode_step(rng, batch)
            before = ex.stats()["graph_bytes"] if batch == 5 else None
            out = ex(**step.kwargs())
            if batch == 5:  # the failed capture was rolled back completely
                assert ex.stats()["graph_bytes"] == before
            expected = ref.eager(
                ref.padded(step, Buckets(BUCKETS), full=True), forward=item_on_one_path(ref)
            )[:batch]
            assert torch.equal(out, expected)
    ours = [c for c in caught if issubclass(c.category, xgraph.XGraphWarning)]
    assert len(ours) == 1 and "('full', 8)" in str(ours[0].message)
    assert "item()" in str(ours[0].message)
    s = ex.stats()
    assert s["eager"] == {"capture failed": 1, "capture failed earlier": 3}
    assert ("full", 8) not in s["hits"] and set(s["hits"]) == {("full", k) for k in (1, 2, 4, 16)}
    for a, b in zip(w.cache.tensors(), ref.cache.tensors()):
        assert torch.equal(a, b)
    ex.close()


def test_host_read_under_strict_policy_raises_and_keeps_the_rest_working():
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(item_on_one_path(w), backend="cpu", buckets=BUCKETS, on_capture_error="raise")
    rng = random.Random(2)
    ex(**w.decode_step(rng, 2).kwargs())
    bytes_before = ex.stats()["graph_bytes"]
    with pytest.raises(xgraph.CaptureError, match=r"item\(\)"):
        ex(**w.decode_step(rng, 6).kwargs())
    assert ex.stats()["graph_bytes"] == bytes_before
    assert ex.stats()["keys"] == [("full", 2)]
    ex(**w.decode_step(rng, 2).kwargs())
    assert ex.stats()["hits"][("full", 2)] == 1
    ex.close()


class CommModel(torch.nn.Module):
    """A layer whose launch depends on a second dim (tokens sent by a collective)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, comm):
        return x @ self.w + comm.sum(0, keepdim=True)


def comm_executor(**kw):
    m = CommModel().eval()
    ex = GraphExecutor(
        m.forward,
        backend="cpu",
        buckets=[1, 2, 4, 8],
        inputs=[
            Input("x", torch.float32, ("num_tokens", 8)),
            Input("comm", torch.float32, ("num_comm_tokens", 8), fill=0.0),
        ],
        dims=[Dim("num_comm_tokens", max=64, buckets=[16, 32, 64])],
        **kw,
    )
    return m, ex


def test_composite_key_separates_equal_token_counts():
    m, ex = comm_executor()
    x = torch.randn(3, 8)
    for c in (10, 20, 12, 30):
        comm = torch.randn(c, 8)
        out = ex(x=x, comm=comm)
        with torch.no_grad():
            assert torch.allclose(out, m(x, comm), rtol=1e-6, atol=1e-6)
    assert ex.stats()["keys"] == [("full", 4, 16), ("full", 4, 32)]
    assert ex.stats()["hits"] == {("full", 4, 16): 1, ("full", 4, 32): 1}
    g16, g32 = ex.graph(("full", 4, 16)), ex.graph(("full", 4, 32))
    assert g16 is not g32
    ex.close()


def test_bad_inputs_are_refused_before_anything_is_written():
    _, ex = comm_executor(on_overflow="raise")
    ex(x=torch.randn(2, 8), comm=torch.randn(4, 8))
    snapshot = {k: v.clone() for k, v in ex.planner.staged.items()}
    bad = [
        (dict(x=torch.randn(2, 8, dtype=torch.float64), comm=torch.randn(4, 8)), "dtype"),
        (dict(x=torch.randn(2, 8, device="meta"), comm=torch.randn(4, 8)), "is on meta"),
        (dict(x=torch.randn(2, 7), comm=torch.randn(4, 8)), "dim 1 is 7, declared 8"),
        (dict(x=torch.randn(2, 8)), "missing ['comm']"),
        (dict(x=torch.randn(2, 8), comm=torch.randn(4, 8), extra=torch.ones(1)), "unknown"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(xgraph.InputError) as info:
            ex(**kwargs)
        assert needle in str(info.value)
    with pytest.raises(xgraph.BucketOverflowError, match="largest bucket 8"):
        ex(x=torch.randn(9, 8), comm=torch.randn(4, 8))
    for k, v in ex.planner.staged.items():
        assert torch.equal(v, snapshot[k])
    ex.close()


def test_outputs_are_views_until_the_next_step_unless_cloned():
    m, ex = comm_executor()
    x1, x2, comm = torch.randn(3, 8), torch.randn(3, 8), torch.randn(4, 8)
    a = ex(x=x1, comm=comm)
    kept = ex(x=x1, comm=comm, clone=True)
    ex(x=x2, comm=comm)
    with torch.no_grad():
        assert torch.equal(kept, m(x1, comm))
        assert torch.equal(a, m(x2, comm))  # the view shows the newer step
    ex.close()


def test_precapture_with_progress_and_stats():
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    ex.capture(progress=False)
    s = ex.stats()
    assert s["captures"] == len(BUCKETS) and s["capture_seconds"] > 0
    assert sorted(s["keys"]) == [("full", b) for b in BUCKETS]
    # the synthetic steps only touched the dummy block
    for t in w.cache.real():
        assert not t.any()
    ex.close()


def test_token_inputs_declaration_is_what_the_model_takes():
    assert [i.name for i in TOKEN_INPUTS] == ["input_ids", "positions"]


def test_construction_refuses_inconsistent_declarations():
    w = Workload.tiny(max_blocks=6, max_seqs=24)

    class NotGraphSafe(PagedPrefillRunner):
        pass

    with pytest.raises(xgraph.XGraphError, match="not graph-safe"):
        w.executor(
            backend="cpu", buckets=BUCKETS, attention=w.attention(decode_runner=NotGraphSafe())
        )
    w.executor(
        backend="cpu",
        buckets=BUCKETS,
        mode="piecewise",
        attention=w.attention(decode_runner=NotGraphSafe()),
    ).close()
    with pytest.raises(xgraph.XGraphError, match="taken by the step call"):
        GraphExecutor(
            lambda attn: attn,
            backend="cpu",
            buckets=[1, 2],
            inputs=[Input("attn", torch.float32, ("num_tokens",))],
        )
    with pytest.raises(xgraph.XGraphError, match="below its largest padded size 64"):
        comm_executor_with(Dim("num_comm_tokens", max=32, buckets=[16, 32, 64]))


def comm_executor_with(dim):
    return GraphExecutor(
        CommModel().forward,
        backend="cpu",
        buckets=[1, 2, 4, 8],
        inputs=[
            Input("x", torch.float32, ("num_tokens", 8)),
            Input("comm", torch.float32, (dim.name, 8)),
        ],
        dims=[dim],
    )


def test_capture_failure_warning_points_at_the_callers_line():
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(item_on_one_path(w), backend="cpu", buckets=BUCKETS)
    with pytest.warns(xgraph.XGraphWarning) as record:
        ex(**w.decode_step(random.Random(9), 8).kwargs())
    assert record[0].filename == __file__
    assert ("full", 8) in ex.stats()["failed_keys"]
    ex.close()


@pytest.mark.parametrize("size", [-1, 0, 17, 2.5, "4", True])
@pytest.mark.parametrize("call", ["capture", "warm_up"])
def test_pre_capture_refuses_sizes_outside_the_buckets(call, size):
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    before = [t.clone() for t in w.cache.tensors()]
    with pytest.raises(
        xgraph.InputError, match=r"sizes holds .* from 1 to the largest bucket \(16\)"
    ):
        getattr(ex, call)([4, size])  # checked before the first size runs
    assert ex.stats()["captures"] == 0 and ex.stats()["eager"] == {}
    assert all(torch.equal(a, b) for a, b in zip(before, w.cache.tensors()))
    ex.capture([16, 3], progress=False)  # in range: captured (3 padded to 4)
    assert ex.stats()["keys"] == [("full", 16), ("full", 4)]
    ex.close()


@pytest.mark.parametrize("field,value", [("input_ids", 256), ("positions", 2048)])
def test_the_models_inputs_refuse_an_index_outside_its_table(field, value):
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(backend="cpu", buckets=BUCKETS)  # Workload.inputs() is model.inputs()
    assert [i.bounds for i in w.model.inputs()] == [(0, 256), (0, 2048)]
    step = w.decode_step(random.Random(0), 3)
    ex(**step.kwargs())
    bad = dict(step.kwargs())
    bad[field] = bad[field].clone()
    bad[field][1] = value
    with pytest.raises(xgraph.InputError, match=f"'{field}'.*{value}.*outside its bounds"):
        ex(**bad)
    ex.close()


def _unbounded_executor(w: Workload) -> GraphExecutor:
    """An executor of the workload whose integer inputs declare no bounds."""
    return GraphExecutor(
        w.model.forward_logits,
        inputs=TOKEN_INPUTS,  # no bounds declared
        backend="cpu",
        buckets=BUCKETS,
        attention=w.attention(),
    )


def _with_bad_index(step, field: str, value: int) -> dict:
    """The step's arguments with `field`'s first entry set to `value`."""
    kwargs = dict(step.kwargs())
    kwargs[field] = kwargs[field].clone()
    kwargs[field][0] = value
    return kwargs


@pytest.mark.parametrize("field,value", [("input_ids", 256), ("positions", 4096)])
def test_an_undeclared_bad_index_in_a_replay_is_an_error_and_the_graph_survives(field, value):
    w, ref = (Workload.tiny(max_blocks=6, max_seqs=24) for _ in range(2))
    ex = _unbounded_executor(w)
    rng = random.Random(1)
    first = w.decode_step(rng, 3)
    ex(**first.kwargs())  # captured ('full', 4)
    ref.eager(ref.padded(first, Buckets(BUCKETS), full=True))
    kwargs = _with_bad_index(w.decode_step(rng, 3), field, value)
    with pytest.raises(
        xgraph.errors.ReplayError, match="without bounds: input_ids, positions"
    ) as e:
        ex(**kwargs)
    assert "bounds=(low, high)" in str(e.value) and "IndexError" in str(e.value)
    # the cached graph still serves valid steps, bit for bit, and the cache was not touched
    for t, s in zip(w.cache.tensors(), ref.cache.tensors()):
        assert torch.equal(t, s)
    for _ in range(3):
        step = w.decode_step(rng, 3)
        out = ex(**step.kwargs())
        assert torch.equal(out, ref.eager(ref.padded(step, Buckets(BUCKETS), full=True))[:3])
    assert ex.stats()["hits"] == {("full", 4): 4}
    ex.close()


@pytest.mark.parametrize("field,value", [("input_ids", 256), ("positions", 4096)])
def test_an_undeclared_bad_index_before_its_keys_capture_is_the_replays_error(field, value):
    """The warm-up of a key not captured yet meets the bad index first: the same error and
    hint a replay gives, nothing captured, and the key captures at its next valid step."""
    w, ref = (Workload.tiny(max_blocks=6, max_seqs=24) for _ in range(2))
    ex = _unbounded_executor(w)
    rng = random.Random(2)
    kwargs = _with_bad_index(w.decode_step(rng, 3), field, value)
    with pytest.raises(
        xgraph.errors.ReplayError, match="without bounds: input_ids, positions"
    ) as e:
        ex(**kwargs)
    assert "IndexError" in str(e.value) and "in the warm-up before its capture" in str(e.value)
    assert ex.stats()["keys"] == [] and ex.stats()["failed_keys"] == {}
    for t, s in zip(w.cache.tensors(), ref.cache.tensors()):
        assert torch.equal(t, s)
    step = w.decode_step(rng, 3)
    out = ex(**step.kwargs())
    assert torch.equal(out, ref.eager(ref.padded(step, Buckets(BUCKETS), full=True))[:3])
    assert ex.stats()["keys"] == [("full", 4)]
    ex.close()


@pytest.mark.parametrize("query_len", [0, -1, 2.0, True])
def test_capture_refuses_a_query_length_that_is_not_an_int_of_at_least_one(query_len):
    w = Workload.tiny(max_blocks=6, max_seqs=24)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    with pytest.raises(xgraph.InputError, match=rf"query_len={query_len!r}; give an int >= 1"):
        ex.capture([2], query_len=query_len)
    assert ex.stats()["keys"] == []  # refused before anything ran
    ex.close()


def test_close_raises_what_a_device_check_found_once_everything_is_given_back():
    """An engine that closes right after a step whose device metadata was bad learns of it:
    close() releases everything, then raises the InputError synchronize() would have."""
    from xgraph import AttentionInputs

    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
    mem = xgraph.GraphMemory(xgraph.get_backend("cpu"), "shared-physical")
    ex = w.executor(backend="cpu", buckets=BUCKETS, memory=mem)
    ex.planner.attn_check.cpu_is_device = True  # tensors take the device-metadata path
    step = w.decode_step(random.Random(4), 3)
    a = step.attn
    table = a.table(0, w.max_blocks)
    table[1, 0] = -7  # a block id outside the cache, found on the "device"
    attn = AttentionInputs(a.query_lens, torch.tensor(a.seq_lens), table, a.slots())
    ex(input_ids=step.input_ids, positions=step.positions, attn=attn)
    with pytest.raises(xgraph.InputError, match=r"block_tables\[1\] = -7"):
        ex.close()
    assert ex.closed and ex.persistent_bytes() == 0 and mem.users() == []
    ex.close()  # idempotent, and the error is not raised twice
    mem.close()
