"""The step path (xgraph.steps.StepPlanner.plan) against a reference staging written here.

Every valid step, in every input form engines use (tensors, lists, arrays, ragged or padded
block tables, padding, forced padded sizes), leaves the persistent buffers exactly as a
plain reference staging of the same step would, bit for bit; every invalid step is refused
with an InputError naming the field, with nothing written to the buffers.
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
from xgraph.options import Kind

BUCKETS = [1, 2, 4, 8, 16]
MAX_Q = 4  # steps of one query length up to this run as full graphs


@pytest.fixture(scope="module")
def w():
    return Workload.tiny(num_blocks=128, max_blocks=6, max_seqs=16)  # block_size 4


@pytest.fixture(scope="module")
def planner(w):
    ex = w.executor(backend="cpu", buckets=BUCKETS, attention=w.attention(max_query_len=MAX_Q))
    yield ex.planner
    ex.close()


class Reference:
    """The persistent buffers as the step path's specification says a step leaves them:
    every input at its prefix and `fill` to the key's extent; slots then the dummy slot;
    seq_lens, then 1 for each padded sequence (a full graph pads the sequences to the
    bucket), each padded sequence as long as the step's query length (1 in decode); query
    starts accordingly; table rows then the dummy block, padded rows the dummy block
    throughout. Compared: the extents the step's graph reads (outside them, a buffer holds
    whatever an earlier step left there, through either bank of host twins)."""

    def __init__(self, planner) -> None:
        self.bufs = {name: v.clone() for name, v in planner.staged.items()}
        self.a = planner.attention
        self.extents: dict[str, int] = {}

    def stage(self, step: Step, padded_tokens: int, full: bool) -> None:
        a, t, tb = self.a, step.num_tokens, padded_tokens
        rows = [list(r) for r in _rows(step.attn.block_tables)]
        ql = [int(q) for q in step.attn.query_lens]
        sl = [int(s) for s in step.attn.seq_lens]
        n = len(ql)
        pad_q = ql[0] if full else 1
        b = tb // pad_q if full else n
        for name, value in (("input_ids", step.input_ids), ("positions", step.positions)):
            self.bufs[name][:tb] = 0
            self.bufs[name][:t] = value
        slots = torch.as_tensor(step.attn.slot_mapping).reshape(-1).tolist()
        self.bufs["slot_mapping"][:tb] = torch.tensor(slots + [a.dummy_slot] * (tb - t))
        self.bufs["seq_lens"][:b] = torch.tensor(sl + [pad_q] * (b - n))
        starts = [0]
        for q in ql + [pad_q] * (b - n):
            starts.append(starts[-1] + q)
        self.bufs["query_start_loc"][: b + 1] = torch.tensor(starts)
        width = a.max_blocks_per_seq
        table = [r + [a.dummy_block] * (width - len(r)) for r in rows]
        table += [[a.dummy_block] * width] * (b - n)
        self.bufs["block_tables"][:b] = torch.tensor(table, dtype=torch.int32)
        self.extents = {
            "input_ids": tb,
            "positions": tb,
            "slot_mapping": tb,
            "seq_lens": b,
            "query_start_loc": b + 1,
            "block_tables": b,
            "device_counts": 0,  # written by device-metadata steps only
        }

    def assert_equal(self, planner) -> None:
        for name, v in planner.staged.items():
            n = self.extents[name]
            assert torch.equal(v[:n], self.bufs[name][:n]), name


def _rows(tables) -> list[list[int]]:
    if isinstance(tables, (torch.Tensor, np.ndarray)):
        return [list(map(int, r)) for r in tables]
    return [list(r) for r in tables]


def form(w: Workload, step: Step, rng: random.Random) -> Step:
    """The step with each attention field in a random form engines use."""
    a = step.attn
    rows = a.block_tables
    if rng.random() < 0.5:  # a padded int32 tensor, as wide as the rows or wider
        width = rng.randint(max(map(len, rows)), w.max_blocks)
        fill = rng.choice([w.cache.dummy_block, 0, -1, 10**6])  # never read: past seq_len
        rows = a.table(fill, width)
        rows = rows.numpy() if rng.random() < 0.2 else rows
    to = rng.choice(
        [
            list,
            torch.tensor,
            lambda x: torch.tensor(x, dtype=torch.int32),
            np.array,
            lambda x: np.array(x, dtype=np.int32),
        ]
    )
    lens = to(list(a.seq_lens))
    ql = rng.choice([list, torch.tensor, tuple])(list(a.query_lens))
    slots = torch.as_tensor(a.slot_mapping)
    slots = slots if rng.random() < 0.7 else slots.tolist()
    return Step(step.input_ids, step.positions, AttentionInputs(ql, lens, rows, slots))


def random_step(w: Workload, rng: random.Random) -> Step:
    if rng.random() < 0.6:
        return w.decode_step(rng, rng.randint(1, 16))
    query = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
    while sum(query) > 16:
        query.pop()
    return w.prefill_step(rng, query, [rng.randint(0, 9) for _ in query])


def plan(planner, step: Step, **kw):
    return planner.plan({"input_ids": step.input_ids, "positions": step.positions}, step.attn, **kw)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20), steps=st.integers(1, 6))
def test_valid_steps_stage_what_the_reference_stages(w, planner, seed, steps):
    rng = random.Random(seed)
    ref = Reference(planner)
    for _ in range(steps):
        step = form(w, random_step(w, rng), rng)
        at_least = rng.choice([None, rng.randint(step.num_tokens, 16)])
        planned = plan(planner, step, pad_to=at_least and {"num_tokens": at_least})
        full, tb, key = expected_key(step, at_least or 0)
        assert planned.key == key
        md = planned.metadata
        n = len(step.attn.query_lens)
        q = int(step.attn.query_lens[0])
        assert (md.num_tokens, md.num_seqs) == ((tb, tb // q) if full else (step.num_tokens, n))
        assert list(md.seq_lens_host) == planned.metadata.seq_lens[: md.num_seqs].tolist()
        ref.stage(step, tb, full)
        ref.assert_equal(planner)


def expected_key(step: Step, at_least: int) -> tuple[bool, int, tuple]:
    """(full graph, padded tokens, key): one query length q for every sequence makes a full
    graph of the sequences padded to a bucket, q tokens each, where that fits the buckets."""
    b = xgraph.Buckets(BUCKETS)
    ql = [int(q) for q in step.attn.query_lens]
    q = ql[0]
    if ql.count(q) == len(ql) and q <= MAX_Q:
        sb = b.pad(max(len(ql), -(-at_least // q)))
        if sb is not None and sb * q <= b.max:
            return True, sb * q, ("full", sb * q) if q == 1 else ("full", sb * q, q)
    tb = b.pad(max(step.num_tokens, at_least))
    return False, tb, ("piecewise", tb)


def corrupt(w: Workload, step: Step, rng: random.Random, how: str) -> tuple[Step, str]:
    """One way to make a decode step invalid (as lists, so any row can be edited), and
    what the error names."""
    a = step.attn
    ql, sl = list(a.query_lens), list(a.seq_lens)
    rows = [list(r) for r in a.block_tables]
    slots = list(a.slot_mapping.tolist())
    ids = step.input_ids.clone()
    i = rng.randrange(len(sl))
    bs = w.block_size
    attn: object = None
    if how == "block id":
        rows[i][rng.randrange((sl[i] - 1) // bs + 1)] = rng.choice(
            [w.cache.dummy_block, w.cache.num_blocks + 3, -2]
        )
        needle = "block_tables: sequence"
    elif how == "slot":
        slots[i] += rng.choice([1, -1, bs])
        needle = f"slot_mapping[{i}]"
    elif how == "seq_len":
        sl[i] = rng.choice([0, -1, len(rows[i]) * bs + 1])
        needle = f"sequence {i}"
    elif how == "short row":
        rows[i] = rows[i][: (sl[i] - 1) // bs]
        needle = f"sequence {i} needs"
    elif how == "token id":
        ids[i] = rng.choice([w.vocab, -1])
        needle = f"'input_ids'[{i}]"
    elif how == "table dtype":
        attn = AttentionInputs(ql, sl, a.table(0).long(), slots)
        needle = "block_tables must be torch.int32"
    elif how == "slot dtype":
        attn = AttentionInputs(ql, sl, rows, torch.tensor(slots, dtype=torch.int16))
        needle = "slot_mapping must be torch.int64"
    elif how == "slot count":
        slots = [*slots, slots[-1]]
        needle = "slot_mapping must be"
    elif how == "float lengths":
        sl = [float(s) + 0.5 for s in sl]
        needle = "seq_lens must hold integers"
    elif how == "a dict with a field missing":
        attn = {"query_lens": ql, "seq_lens": sl, "block_tables": rows}
        needle = "missing ['slot_mapping']"
    elif how == "not attention inputs":
        attn = (ql, sl, rows, slots)
        needle = "attn= must be xgraph.AttentionInputs"
    if attn is None:
        attn = AttentionInputs(ql, sl, rows, slots)
    return Step(ids, step.positions, attn), needle  # type: ignore[arg-type]


HOW = [
    "block id",
    "slot",
    "seq_len",
    "short row",
    "token id",
    "table dtype",
    "slot dtype",
    "slot count",
    "float lengths",
    "a dict with a field missing",
    "not attention inputs",
]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20), batch=st.integers(1, 16), how=st.sampled_from(HOW))
def test_invalid_steps_are_refused_naming_the_field_with_nothing_written(
    w, planner, seed, batch, how
):
    rng = random.Random(seed)
    bad, needle = corrupt(w, w.decode_step(rng, batch), rng, how)
    device, host = planner.staged.packed.clone(), planner.staged.host_packed.clone()
    with pytest.raises(xgraph.InputError) as info:
        plan(planner, bad)
    assert needle in str(info.value), str(info.value)
    assert torch.equal(planner.staged.packed, device)
    assert torch.equal(planner.staged.host_packed, host)


def shared_slot_step(w: Workload, rng: random.Random, batch: int) -> Step:
    """A decode step where two sequences point their last position at one cache slot."""
    step = w.decode_step(rng, batch)
    a = step.attn
    rows, sl = [list(r) for r in a.block_tables], list(a.seq_lens)
    i, j = rng.sample(range(batch), 2)
    rows[j][(sl[j] - 1) // w.block_size] = rows[i][(sl[i] - 1) // w.block_size]
    sl[j] = (sl[j] - 1) // w.block_size * w.block_size + (sl[i] - 1) % w.block_size + 1
    slots = list(a.slot_mapping.tolist())
    slots[j] = slots[i]
    pos = step.positions.clone()
    pos[j] = sl[j] - 1
    return Step(step.input_ids, pos, AttentionInputs(list(a.query_lens), sl, rows, slots))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20), batch=st.integers(2, 16), form_seed=st.integers(0, 99))
def test_two_tokens_writing_one_slot_are_refused(w, planner, seed, batch, form_seed):
    step = form(w, shared_slot_step(w, random.Random(seed), batch), random.Random(form_seed))
    slots = [int(s) for s in torch.as_tensor(step.attn.slot_mapping).reshape(-1)]
    i, j = (t for t, s in enumerate(slots) if slots.count(s) > 1)
    device = planner.staged.packed.clone()
    with pytest.raises(xgraph.InputError) as info:
        plan(planner, step)
    assert f"tokens {i} and {j} (sequences {i} and {j}) both write cache slot {slots[i]}" in str(
        info.value
    )
    assert torch.equal(planner.staged.packed, device)


def test_a_shared_slot_in_a_prefill_step_names_both_tokens(w, planner):
    step = w.prefill_step(random.Random(1), [3, 2])
    a = step.attn
    rows = [list(r) for r in a.block_tables]
    rows[1] = rows[0][:1]  # sequence 1's block is sequence 0's: positions 0, 1 of it twice
    slots = a.slot_mapping.tolist()
    slots[3:] = slots[:2]
    bad = Step(step.input_ids, step.positions, AttentionInputs([3, 2], [3, 2], rows, slots))
    with pytest.raises(xgraph.InputError, match=r"tokens 0 and 3 \(sequences 0 and 1\)"):
        plan(planner, bad)


def test_the_executor_refuses_a_shared_slot_that_would_change_the_output():
    """Run alone, the sequence gives one result; sharing its slot with another sequence of
    the step would give another (the second write wins). The step is refused instead."""
    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
    w.randomize_cache(3)
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    before = [t.clone() for t in w.cache.tensors()]
    with pytest.raises(xgraph.InputError, match="both write cache slot"):
        ex(**shared_slot_step(w, random.Random(4), 4).kwargs())
    for a, b in zip(before, w.cache.tensors()):
        assert torch.equal(a, b)
    ex.close()


def test_attention_inputs_as_a_mapping_of_their_fields(w, planner):
    step = w.decode_step(random.Random(2), 3)
    a = step.attn
    as_dict = {f: getattr(a, f) for f in ("query_lens", "seq_lens", "block_tables", "slot_mapping")}
    ref = Reference(planner)
    plan(planner, Step(step.input_ids, step.positions, as_dict))  # type: ignore[arg-type]
    ref.stage(step, 4, full=True)
    ref.assert_equal(planner)
    with pytest.raises(xgraph.InputError, match=r"unknown \['block_table'\]"):
        bad = {**as_dict, "block_table": as_dict.pop("block_tables")}
        plan(planner, Step(step.input_ids, step.positions, bad))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("query_lens", "abc", "query_lens must hold integers"),
        ("query_lens", None, "query_lens must hold integers"),
        ("seq_lens", 5, "seq_lens must be one int per sequence"),
        ("seq_lens", [[1, 2]], "seq_lens must be one int per sequence"),
        ("block_tables", 7, "block_tables must be an int32 tensor"),
        ("block_tables", [[1.5]], "block_tables must hold integers"),
        ("block_tables", [[2**40]], "block_tables holds values outside int32"),
        ("block_tables", np.zeros((1, 1)), "block_tables must hold integers"),
        ("block_tables", np.array([[2**40]]), "block_tables holds values outside int32"),
        ("slot_mapping", torch.zeros(1), "slot_mapping must be torch.int64"),
        ("slot_mapping", [True], "slot_mapping must hold integers"),
    ],
)
def test_wrong_types_for_a_field_name_the_field(w, planner, field, value, needle):
    step = w.decode_step(random.Random(5), 1)
    fields = {f: getattr(step.attn, f) for f in ("query_lens", "seq_lens", "block_tables")}
    fields["slot_mapping"] = step.attn.slot_mapping
    fields[field] = value
    with pytest.raises(xgraph.InputError, match=needle):
        plan(planner, Step(step.input_ids, step.positions, AttentionInputs(**fields)))


def test_a_step_is_validated_once(w, planner, monkeypatch):
    """One pass over the token inputs and one over the attention inputs, whatever the step."""
    calls = []
    for cls, name in ((type(planner.tokens), "tokens"), (type(planner.attn_check), "attn")):
        original = cls.check

        def counted(self, *args, _original=original, _name=name, **kw):
            calls.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(cls, "check", counted)
    rng = random.Random(6)
    for step in (w.prefill_step(rng, [3, 1]), w.decode_step(rng, 3)):
        calls.clear()
        plan(planner, step)
        assert calls == ["tokens", "attn"]


def test_forced_kind_and_padded_sizes(w, planner):
    rng = random.Random(7)
    decode = w.decode_step(rng, 3)
    assert plan(planner, decode, pad_to={"num_tokens": 9}).key == ("full", 16)
    assert plan(planner, decode, pad_to={"num_tokens": 2}).key == ("full", 4)  # at least
    step = plan(planner, decode, kind=Kind.PIECEWISE, pad_to={"num_tokens": 5})
    assert step.key == ("piecewise", 8) and step.metadata.num_seqs == 3
    assert plan(planner, decode, kind=Kind.EAGER).reason == "forced"
    prefill = w.prefill_step(rng, [2, 3])
    with pytest.raises(xgraph.InputError, match="kind='full' was forced"):
        plan(planner, prefill, kind=Kind.FULL)
    with pytest.raises(xgraph.InputError, match="not key dims"):
        plan(planner, decode, pad_to={"num_seqs": 4})
    over = plan(planner, decode, pad_to={"num_tokens": 17})
    assert over.kind is Kind.EAGER and over.reason == "above largest bucket"


def test_ranks_padding_to_the_largest_token_count_replay_one_graph():
    """Data-parallel ranks agree on the largest token count and plan to it: one key, and
    each rank's outputs equal its own step run eagerly."""
    ranks = [Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16) for _ in range(3)]
    refs = [Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16) for _ in range(3)]
    for x in ranks + refs:
        x.randomize_cache(8)
    exs = [r.executor(backend="cpu", buckets=BUCKETS) for r in ranks]
    rng = random.Random(8)
    steps = [r.decode_step(rng, b) for r, b in zip(ranks, (1, 5, 3))]
    largest = max(s.num_tokens for s in steps)
    for ex, ref, step in zip(exs, refs, steps):
        planned = ex.planner.plan(
            {"input_ids": step.input_ids, "positions": step.positions},
            step.attn,
            pad_to={"num_tokens": largest},
        )
        assert planned.key == ("full", 8)
        out = ex._run(planned)
        expected = ref.eager(ref.padded(step, xgraph.Buckets([8]), full=True))
        assert torch.equal(out, expected[: step.num_tokens])
        ex.close()


def test_synthetic_steps_use_only_the_dummy_block(w, planner):
    for kind in (Kind.FULL, Kind.PIECEWISE):
        tensors, attn = planner.synthetic(5, kind, {})
        with pytest.raises(xgraph.InputError, match="reserved dummy block"):
            planner.plan(tensors, attn, kind=kind)
        step = planner.plan(tensors, attn, kind=kind, synthetic=True)
        assert step.key == (kind.value, 8)


def test_dims_padded_like_num_tokens():
    def forward(x, lens):
        return x[:, None].float() + lens.sum()

    ex = xgraph.GraphExecutor(
        forward,
        inputs=[
            xgraph.Input("x", torch.int64, ("num_tokens",)),
            xgraph.Input("lens", torch.int32, ("num_seqs",), fill=0),
        ],
        dims=[xgraph.Dim("num_seqs", max=8, pad_like="num_tokens")],
        backend="cpu",
        buckets=[2, 4, 8],
    )
    step = ex.planner.plan({"x": torch.arange(3), "lens": torch.ones(2, dtype=torch.int32)}, None)
    assert step.key == ("full", 4) and step.padded == {"num_tokens": 4, "num_seqs": 4}
    assert step.views["lens"].tolist() == [1, 1, 0, 0]
    with pytest.raises(xgraph.InputError, match="exceeds the num_tokens bucket 4"):
        ex.planner.plan({"x": torch.arange(3), "lens": torch.ones(5, dtype=torch.int32)}, None)
    ex.close()


@pytest.mark.parametrize("bs", [4, 3])  # a block size that is not a power of two too
def test_a_dummy_block_that_is_not_the_last_one(bs):
    """Block 0 reserved: ids are checked with two compares instead of one."""
    layout = xgraph.PagedAttention(
        max_seqs=8, max_blocks_per_seq=4, dummy_slot=0, dummy_block=0, block_size=bs, num_blocks=40
    )
    ex = xgraph.GraphExecutor(
        lambda x: x[:, None].float(),
        inputs=[xgraph.Input("x", torch.int64, ("num_tokens",))],
        backend="cpu",
        buckets=[1, 2, 4, 8],
        attention=layout,
    )
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
        attn = AttentionInputs([1] * n, sl, rows, slots)
        if bad:
            with pytest.raises(xgraph.InputError, match="reserved dummy block"):
                ex.planner.plan({"x": torch.arange(n)}, attn)
        else:
            step = ex.planner.plan({"x": torch.arange(n)}, attn)
            tb = step.padded["num_tokens"]
            table = step.metadata.block_tables
            assert table[:n, 0].tolist() == [r[0] for r in rows]
            assert (table[n:tb] == 0).all() and step.metadata.slot_mapping.tolist() == slots + [
                0
            ] * (tb - n)
    ex.close()
