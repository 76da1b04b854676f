"""The decode fast path (xgraph.steps.DecodePath) against the general planner.

Two planners see the same steps, one with the fast path and one without: for valid decode
steps in every input form (tensors, lists, arrays, ragged or padded block tables, padding)
the fast path plans them itself and both leave the same bytes in the device buffers, bit
for bit; for anything invalid the fast path declines and the general path raises, with the
device buffers untouched.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xgraph
from xgraph import AttentionInputs
from xgraph.models import Step, Workload

BUCKETS = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def w():
    return Workload.tiny(num_blocks=128, max_blocks=6, max_seqs=16)  # block_size 4


@pytest.fixture(scope="module")
def pair(w):
    fast = w.executor(backend="cpu", buckets=BUCKETS)
    general = w.executor(backend="cpu", buckets=BUCKETS)
    general.planner.decode = None
    assert fast.planner.decode is not None
    yield fast.planner, general.planner
    fast.close()
    general.close()


def form(w: Workload, step: Step, rng: random.Random) -> tuple[dict, AttentionInputs]:
    """The step with each attention field in a random form engines use."""
    a = step.attn
    rows = a.block_tables
    if rng.random() < 0.5:  # a padded int32 tensor, as wide as the rows or wider
        width = rng.randint(max(map(len, rows)), w.max_blocks)
        fill = rng.choice([w.cache.dummy_block, 0, -1, 10**6])  # never read: past seq_len
        rows = a.table(fill, width)
        rows = rows.numpy() if rng.random() < 0.2 else rows
    lens = rng.choice([list, lambda x: torch.tensor(x), lambda x: np.array(x)])(a.seq_lens)
    ql = rng.choice([list, lambda x: torch.tensor(x)])(a.query_lens)
    slots = a.slot_mapping if rng.random() < 0.7 else a.slot_mapping.tolist()
    inputs = {"input_ids": step.input_ids, "positions": step.positions}
    return inputs, AttentionInputs(ql, lens, rows, slots)


def offsets(planner, views) -> list:
    base = planner.staged.packed.data_ptr()
    return [(v.data_ptr() - base, tuple(v.shape)) for v in views]


def assert_same_step(fast, general, a, b) -> None:
    assert (a.kind, a.key, a.padded, a.sizes) == (b.kind, b.key, b.padded, b.sizes)
    assert offsets(fast, a.views.values()) == offsets(general, b.views.values())
    ma, mb = a.metadata, b.metadata
    assert (ma.num_tokens, ma.num_seqs) == (mb.num_tokens, mb.num_seqs)
    assert ma.query_lens_host == mb.query_lens_host
    assert list(ma.seq_lens_host) == list(mb.seq_lens_host)
    fields = ("slot_mapping", "seq_lens", "query_start_loc", "block_tables")
    assert offsets(fast, [getattr(ma, f) for f in fields]) == offsets(
        general, [getattr(mb, f) for f in fields]
    )
    assert torch.equal(fast.staged.packed, general.staged.packed)  # every byte, bitwise


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20), batches=st.lists(st.integers(1, 16), min_size=1, max_size=6))
def test_valid_decode_steps_stage_the_same_bytes(w, pair, seed, batches):
    fast, general = pair
    rng = random.Random(seed)
    for b in batches:
        step = w.decode_step(rng, b)
        inputs, attn = form(w, step, rng)
        assert fast.decode.plan(inputs, attn) is not None  # the fast path took it
        assert_same_step(fast, general, fast.plan(inputs, attn), general.plan(inputs, attn))


def corrupt(w: Workload, inputs: dict, attn: AttentionInputs, rng: random.Random, how: str):
    """One way to make a decode step invalid (as lists, so any row can be edited)."""
    ql, sl = list(attn.query_lens), list(attn.seq_lens)
    rows = [list(r) for r in attn.block_tables]
    slots = list(attn.slot_mapping.tolist())
    ids, pos = inputs["input_ids"].clone(), inputs["positions"].clone()
    i = rng.randrange(len(sl))
    bs = w.block_size
    if how == "block id":
        rows[i][rng.randrange((sl[i] - 1) // bs + 1)] = rng.choice(
            [w.cache.dummy_block, w.cache.num_blocks + 3, -2]
        )
    elif how == "slot":
        slots[i] += rng.choice([1, -1, bs])
    elif how == "seq_len":
        sl[i] = rng.choice([0, -1, len(rows[i]) * bs + 1])
    elif how == "short row":
        rows[i] = rows[i][: (sl[i] - 1) // bs]
    elif how == "token id":
        ids[i] = rng.choice([w.vocab, -1])
    elif how == "table dtype":
        return inputs, AttentionInputs(ql, sl, attn.table(0).long(), slots)
    elif how == "slot dtype":
        return inputs, AttentionInputs(ql, sl, rows, torch.tensor(slots, dtype=torch.int32))
    elif how == "slot count":
        slots = [*slots, slots[-1]]
    return {"input_ids": ids, "positions": pos}, AttentionInputs(ql, sl, rows, slots)


HOW = [
    "block id",
    "slot",
    "seq_len",
    "short row",
    "token id",
    "table dtype",
    "slot dtype",
    "slot count",
]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20), batch=st.integers(1, 16), how=st.sampled_from(HOW))
def test_invalid_steps_are_declined_and_refused_with_nothing_written(w, pair, seed, batch, how):
    fast, general = pair
    rng = random.Random(seed)
    step = w.decode_step(rng, batch)
    inputs, attn = corrupt(
        w, {"input_ids": step.input_ids, "positions": step.positions}, step.attn, rng, how
    )
    before = fast.staged.packed.clone()
    assert fast.decode.plan(inputs, attn) is None
    with pytest.raises(xgraph.InputError):
        fast.plan(inputs, attn)
    with pytest.raises(xgraph.InputError):
        general.plan(inputs, attn)
    assert torch.equal(fast.staged.packed, before)
    # the next step sends no byte of the refused one
    ok = w.decode_step(rng, rng.randint(1, batch))
    inputs = {"input_ids": ok.input_ids, "positions": ok.positions}
    assert_same_step(fast, general, fast.plan(inputs, ok.attn), general.plan(inputs, ok.attn))


def test_other_steps_take_the_general_path(w, pair):
    fast = pair[0]
    rng = random.Random(3)
    prefill = w.prefill_step(rng, [3, 1])  # not decode: piecewise
    kwargs = {"input_ids": prefill.input_ids, "positions": prefill.positions}
    assert fast.decode.plan(kwargs, prefill.attn) is None
    assert fast.plan(kwargs, prefill.attn).key == ("piecewise", 4)
    assert fast.decode.bucket(17) is None  # above the buckets: the overflow policy decides


def test_the_executor_serves_decode_through_the_fast_path_and_matches_eager(monkeypatch):
    ex_w, ref_w = (Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16) for _ in range(2))
    for x in (ex_w, ref_w):
        x.randomize_cache(7)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS)

    def general_path(*args, **kwargs):
        raise AssertionError("a decode step took the general path")

    monkeypatch.setattr(xgraph.steps, "validate_inputs", general_path)
    rng = random.Random(7)
    for b in [3, 1, 8, 3, 16, 5, 1]:  # captures and hits alike
        step = ex_w.decode_step(rng, b)
        out = ex(**step.kwargs())
        ref = ref_w.eager(ref_w.padded(step, xgraph.Buckets(BUCKETS), full=True))[:b]
        assert torch.equal(out, ref)
        for a, r in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
            assert torch.equal(a, r)
    assert ex.stats()["hits"] == {("full", 4): 1, ("full", 1): 1, ("full", 8): 1, ("full", 16): 0}
    ex.close()


@pytest.mark.parametrize("bs", [4, 3])  # a block size that is not a power of two too
def test_a_dummy_block_that_is_not_the_last_one(bs):
    """Block 0 reserved: ids are checked with two compares instead of one."""
    layout = xgraph.PagedAttention(
        max_seqs=8, max_blocks_per_seq=4, dummy_slot=0, dummy_block=0, block_size=bs, num_blocks=40
    )
    inputs = [xgraph.Input("x", torch.int64, ("num_tokens",))]
    planners = [
        xgraph.GraphExecutor(
            lambda x: x[:, None].float(),
            inputs=inputs,
            backend="cpu",
            buckets=[1, 2, 4, 8],
            attention=layout,
        ).planner
        for _ in range(2)
    ]
    fast, general = planners
    general.decode = None
    rng = random.Random(11)
    for _ in range(60):
        n = rng.randint(1, 8)
        ids = rng.sample(range(1, 40), 4 * n)
        rows = [ids[4 * i : 4 * i + rng.randint(1, 4)] for i in range(n)]
        sl = [rng.randint(bs * len(r) - bs + 1, bs * len(r)) for r in rows]
        slots = [r[(s - 1) // bs] * bs + (s - 1) % bs for r, s in zip(rows, sl)]
        bad = rng.random() < 0.5
        if bad:
            i = rng.randrange(n)
            rows[i][rng.randrange((sl[i] - 1) // bs + 1)] = rng.choice([0, 40, -1])
        step = ({"x": torch.arange(n)}, AttentionInputs([1] * n, sl, rows, slots))
        if bad:
            assert fast.decode.plan(*step) is None
            with pytest.raises(xgraph.InputError, match="reserved dummy block"):
                general.plan(*step)
        else:
            assert fast.decode.plan(*step) is not None
            assert_same_step(fast, general, fast.plan(*step), general.plan(*step))


def test_declarations_the_fast_path_leaves_to_the_general_path():
    def forward(x, scale):
        return x[:, None].float() * scale

    x = xgraph.Input("x", torch.int64, ("num_tokens",))
    scalar = xgraph.Input("scale", torch.float32, ())
    ex = xgraph.GraphExecutor(forward, inputs=[x, scalar], backend="cpu", buckets=[2, 4])
    assert ex.planner.decode is None  # a dim-less input
    out = ex(x=torch.tensor([1, 2, 3]), scale=torch.tensor(2.0))
    assert out.flatten().tolist() == [2.0, 4.0, 6.0]
    ex.close()
    per_token = xgraph.Input("scale", torch.float32, ("num_tokens",))
    ex = xgraph.GraphExecutor(
        forward, inputs=[x, per_token], backend="cpu", buckets=[2], mode="piecewise"
    )
    assert ex.planner.decode is None  # decode runs piecewise: not the full-graph path
    ex.close()


def test_long_lists_stage_the_same_bytes():
    """Lists of 32 or more ints are packed another way; floats and huge values fall back."""
    w = Workload.tiny(num_blocks=400, max_blocks=6, max_seqs=64)
    fast, general = (w.executor(backend="cpu", buckets=[64]).planner for _ in range(2))
    general.decode = None
    rng = random.Random(5)
    for b in [33, 64, 40, 50]:
        step = w.decode_step(rng, b)
        a = step.attn
        inputs = {"input_ids": step.input_ids, "positions": step.positions}
        as_float = [float(s) for s in a.seq_lens] if b == 40 else list(a.seq_lens)
        attn = AttentionInputs(
            list(a.query_lens), as_float, a.block_tables, a.slot_mapping.tolist()
        )
        assert fast.decode.plan(inputs, attn) is not None
        assert_same_step(fast, general, fast.plan(inputs, attn), general.plan(inputs, attn))
    huge = AttentionInputs([1] * 50, [2**40] * 50, a.block_tables, a.slot_mapping)
    assert fast.decode.plan(inputs, huge) is None
    with pytest.raises(xgraph.InputError):
        general.plan(inputs, huge)
