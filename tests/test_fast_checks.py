"""The fast forms of the step checks accept exactly what the general forms accept: the decode
path of the attention checks (xgraph.decode_check), so every step is refused with the same
error, host tensors of the usual form viewed at once (xgraph.step_fields), and the token
inputs' bounds through Python's min and max (xgraph.validation)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgraph import AttentionInputs, InputError, PagedAttention, step_attention
from xgraph.decode_check import FEW, SET_CHECK, distinct
from xgraph.step_attention import AttentionCheck
from xgraph.step_fields import host_fields
from xgraph.validation import SMALL, any_true, outside

BS, WIDTH, BLOCKS = 4, 6, 501  # the dummy is block 500, the cache's last


def _checks(
    block_size: int = BS, dummy: int = BLOCKS - 1, width: int = WIDTH
) -> tuple[AttentionCheck, AttentionCheck]:
    """(with the fast path, without it) over one layout."""
    layout = PagedAttention(
        max_seqs=80,
        max_blocks_per_seq=width,
        dummy_slot=dummy * block_size,
        dummy_block=dummy,
        block_size=block_size,
        num_blocks=BLOCKS,
    )
    fast, general = (AttentionCheck("ex", layout, 80, torch.device("cpu")) for _ in range(2))
    general.decode = None
    return fast, general


def _outcome(check: AttentionCheck, attn: AttentionInputs, n: int) -> str:
    try:
        check.check(attn, n)
    except InputError as exc:
        return f"InputError: {exc}"
    return "passed"


def _valid(rng: np.random.Generator, n: int, w: int, bs: int = BS, longest: int = 0) -> tuple:
    """A decode step of n sequences over distinct blocks, tables [n, w], -1 past each row;
    sequences up to `longest` tokens (default: what a row holds)."""
    lens = rng.integers(1, (longest or w * bs) + 1, n)
    blocks = rng.permutation(BLOCKS - 1)[: n * w].reshape(n, w).astype(np.int32)
    last = (lens - 1) // bs
    table = np.where(np.arange(w)[None, :] <= last[:, None], blocks, -1).astype(np.int32)
    slots = blocks[np.arange(n), last].astype(np.int64) * bs + (lens - 1) % bs
    return lens, table, slots


def _attn(lens: np.ndarray, table: np.ndarray, slots: np.ndarray, int32: bool) -> AttentionInputs:
    sl = torch.tensor(lens, dtype=torch.int32 if int32 else torch.int64)
    return AttentionInputs([1] * len(lens), sl, torch.from_numpy(table), torch.from_numpy(slots))


FAULTS = ("none", "seq_len", "block", "slot", "duplicate", "short width")


def _faulty(
    rng: np.random.Generator, n: int, w: int, fault: str, width: int, longest: int
) -> tuple:
    """A decode step (`_valid`) with one fault planted."""
    lens, table, slots = _valid(rng, n, w, longest=longest)
    i = int(rng.integers(n))
    if fault == "seq_len":
        lens[i] = rng.choice([0, -1, -(2**31), w * BS + 1, width * BS + 1, 2**31 - 1])
    elif fault == "block":
        j = int(rng.integers((lens[i] - 1) // BS + 1))  # a column the sequence reads
        table[i, j] = rng.choice([-1, -7, BLOCKS - 1, BLOCKS, 2**31 - 1])
    elif fault == "slot":
        slots[i] += int(rng.choice([-1, 1, BS, -(2**40)]))
    elif fault == "duplicate" and n > 1:
        k = (i + 1) % n
        table[k] = table[i]
        lens[k], slots[k] = lens[i], slots[i]
    elif fault == "short width" and w > 1:
        table = np.ascontiguousarray(table[:, : w - 1])  # rows too short for long sequences
    return lens, table, slots


def _same_outcome(fast: AttentionCheck, general: AttentionCheck, step: tuple, int32: bool) -> None:
    lens, table, slots = step
    attn = _attn(lens, table, slots, int32)
    assert fast.decode is not None
    seq_lens = attn.seq_lens.numpy()
    expect = _outcome(general, attn, len(lens))
    assert fast.decode.passes(seq_lens, table, slots) == (expect == "passed")
    assert _outcome(fast, attn, len(lens)) == expect


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.one_of(st.integers(1, FEW + 1), st.integers(1, 70)),  # both forms of `passes`
    w=st.integers(1, WIDTH),
    fault=st.sampled_from(FAULTS),
    int32=st.booleans(),
)
def test_fast_path_refuses_exactly_what_the_general_checks_refuse(seed, n, w, fault, int32):
    step = _faulty(np.random.default_rng(seed), n, w, fault, WIDTH, 0)
    _same_outcome(*_checks(), step, int32)


WIDE = 40  # FEW sequences of a table this wide: Python over the columns they read, or numpy


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, FEW + 1),
    w=st.integers(WIDE - 4, WIDE),
    longest=st.sampled_from([3 * BS, 0]),  # few columns read (Python), or up to all (numpy)
    fault=st.sampled_from(FAULTS),
    int32=st.booleans(),
)
def test_few_sequences_of_a_wide_table_are_refused_as_the_general_checks_refuse(
    seed, n, w, longest, fault, int32
):
    step = _faulty(np.random.default_rng(seed), n, w, fault, WIDE, longest)
    _same_outcome(*_checks(width=WIDE), step, int32)


def test_few_sequences_read_only_the_columns_they_use_or_go_to_numpy():
    fast, _ = _checks(width=WIDE)
    assert fast.decode is not None
    rng = np.random.default_rng(3)
    for longest, python in ((3 * BS, True), (WIDE * BS, False)):
        lens = np.array([longest, 1])
        table = rng.permutation(BLOCKS - 1)[: 2 * WIDE].reshape(2, WIDE).astype(np.int32)
        slots = table[[0, 1], (lens - 1) // BS].astype(np.int64) * BS + (lens - 1) % BS
        got = fast.decode._few(lens, table, slots)
        assert got is True if python else got is None
        assert fast.decode.passes(lens, table, slots)


def test_a_valid_step_passes_and_stays_as_given():
    fast, general = _checks()
    lens, table, slots = _valid(np.random.default_rng(0), 8, 5)
    a, b = (
        fast.check(_attn(lens, table, slots, True), 8),
        general.check(_attn(lens, table, slots, True), 8),
    )
    for x, y in ((a.seq_lens, b.seq_lens), (a.table, b.table), (a.slots, b.slots)):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (a.query_len, b.query_len) == (1, 1)


@pytest.mark.parametrize(
    "case, message",
    [
        ("short", "sequence 1 needs 6 blocks for seq_len 21 (block_size 4) but its row holds 5"),
        ("zero", "sequence 1 has query_len 1 and seq_len 0"),
        ("dummy", "sequence 1 uses block id 500 at column 0"),
        ("slot", "slot_mapping[1] is"),
        ("shared", "tokens 0 and 1 (sequences 0 and 1) both write cache slot"),
    ],
)
def test_a_bad_decode_step_is_named_as_before(case, message):
    fast, _ = _checks()
    lens, table, slots = _valid(np.random.default_rng(1), 3, 5)
    if case == "short":
        lens[1] = 21
    elif case == "zero":
        lens[1] = 0
    elif case == "dummy":
        table[1, 0] = BLOCKS - 1
    elif case == "slot":
        slots[1] += 1
    else:
        table[1], lens[1], slots[1] = table[0], lens[0], slots[0]
    with pytest.raises(InputError, match=re.escape(message)):
        fast.check(_attn(lens, table, slots, False), 3)


def test_the_fast_path_needs_the_dummy_last():
    fast, _ = _checks(dummy=0)  # a dummy first: the general checks' two compares
    assert fast.decode is None


@pytest.mark.parametrize("n", [0, 1, 2, SET_CHECK, SET_CHECK + 1, 300])
def test_distinct_finds_a_shared_slot_at_every_size(n):
    slots = np.arange(n, dtype=np.int64) * 3
    assert distinct(slots)
    if n >= 2:
        slots[n - 1] = slots[n // 3]
        assert not distinct(slots)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.integers(-2, 300), st.integers(-(2**63), 2**63 - 1)), max_size=2 * SMALL
    ),
    top=st.one_of(st.integers(0, 310), st.integers(0, 2**63 - 1)),
    strided=st.booleans(),
)
def test_bounds_through_min_and_max_equal_the_unsigned_compare(values, top, strided):
    a = np.array(values, dtype=np.int64)
    if strided:
        a = np.repeat(a, 2)[::2]  # a view with a stride, as a sliced tensor gives
    high = np.array(top, dtype=np.uint64)
    assert outside(a, (high, top)) == any_true(a.view(np.uint64) >= high)


def _arrays(check: AttentionCheck, attn: AttentionInputs, n: int) -> object:
    """What a check returns (each array's dtype and bytes), or its error."""
    try:
        h = check.check(attn, n)
    except InputError as exc:
        return f"InputError: {exc}"
    got = [(a.dtype.str, a.shape, a.tobytes()) for a in (h.query_lens, h.seq_lens, h.table)]
    return got, (h.slots.dtype.str, h.slots.tobytes()), h.query_len


SHAPES = ("as given", "rows", "seq_lens 2-d", "table 1-d", "slots 2-d", "too wide")


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 12),
    w=st.integers(1, WIDTH),
    fault=st.sampled_from(FAULTS),
    shape=st.sampled_from(SHAPES),
    dtypes=st.tuples(
        st.sampled_from([torch.int32, torch.int64, torch.int16]),
        st.sampled_from([torch.int32, torch.int64]),
        st.sampled_from([torch.int64, torch.int32]),
    ),
)
def test_host_tensors_viewed_at_once_equal_the_field_by_field_path(
    seed, n, w, fault, shape, dtypes
):
    """`host_fields` (the usual form in one call) returns what the field-by-field path
    returns, bitwise, and every other form falls through to that path's errors."""
    rng = np.random.default_rng(seed)
    lens, table, slots = _valid(rng, n, w)
    if fault == "seq_len":
        lens[0] = 0
    elif fault == "block":
        table[0, 0] = -1
    elif fault == "slot":
        slots[0] += 1
    sl, tb, sm = (
        torch.from_numpy(np.ascontiguousarray(a)).to(d)
        for a, d in zip((lens, table, slots), dtypes)
    )
    if shape == "rows":
        tb = tb[1:]
    elif shape == "seq_lens 2-d":
        sl = sl[:, None]
    elif shape == "table 1-d":
        tb = tb.reshape(-1)
    elif shape == "slots 2-d":
        sm = sm[:, None]
    elif shape == "too wide":
        tb = torch.cat([tb, tb.new_full((len(tb), WIDTH + 1 - w), -1)], 1)
    attn = AttentionInputs([1] * n, sl, tb, sm)
    fast, _ = _checks()
    viewed = host_fields(sl, tb, sm, WIDTH)
    usual = dtypes[1:] == (torch.int32, torch.int64) and dtypes[0] is not torch.int16
    assert (viewed is not None) == (usual and shape in ("as given", "rows"))
    expect = _arrays(fast, attn, n)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_attention, "host_fields", lambda *a: None)
        assert _arrays(fast, attn, n) == expect
