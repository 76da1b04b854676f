"""Planted bad device metadata against the captured check (xgraph.device_check), on the CPU.

Each plant makes one of the four problems the check knows (a seq_len its row cannot hold,
a block id outside the cache or the dummy block, a slot its row does not give, a slot two
tokens write). The step runs (device metadata is never refused up front) next to the same
step without the plant on a host-metadata executor. Then, compared bit for bit: the KV
cache outside the dummy block is the reference's, except that the redirected tokens' own
slots kept what they held before (a token plant with q > 1 leaves its sequence's other
tokens writing their own slots with values of a stale read: those are not compared); the
valid sequences' outputs are the reference's. The next synchronizing call (a step, or
`synchronize()`) raises the InputError naming the field, the index and the value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xgraph
from xgraph import AttentionInputs
from xgraph.models import Step, Workload

BUCKETS = [1, 2, 4, 8, 16]
MAX_SEQS = {1: 16, 2: 8, 3: 4}  # the most sequences of q tokens a full graph takes here

PLANTS = {  # how -> the problem code it makes
    "seq_len past its row": 1,
    "seq_len below its query length": 1,
    "block id past the cache": 2,
    "negative block id": 2,
    "the dummy block": 2,
    "slot in a free block": 3,
    "negative slot": 3,
    "copy of another sequence": 4,
}


def pair(seed: int):  # type: ignore[no-untyped-def]
    """Two executors over equal workloads: device metadata on one, host metadata on the other."""
    ws = [Workload.tiny(num_blocks=96, max_blocks=6, max_seqs=16) for _ in range(2)]
    for w in ws:
        w.randomize_cache(seed)
    att = {"max_query_len": 3}
    exs = [w.executor(backend="cpu", buckets=BUCKETS, attention=w.attention(**att)) for w in ws]
    exs[0].planner.attn_check.cpu_is_device = True
    return ws, exs


def tensors(step: Step, w: Workload, width: int, fill: int, int64: bool) -> AttentionInputs:
    """The step's metadata as an engine keeps it: tensors, a table `width` wide."""
    a = step.attn
    return AttentionInputs(
        list(a.query_lens),
        torch.tensor(list(a.seq_lens), dtype=torch.int64 if int64 else torch.int32),
        a.table(fill, width),
        torch.as_tensor(a.slot_mapping).clone(),
    )


@dataclass
class Plant:
    attn: AttentionInputs
    named: str  # what the error says: "field[index] = value"
    bad_seq: int  # the sequence whose outputs are not valid
    kept: set[int] = field(default_factory=set)  # slots that must keep their values
    loose: set[int] = field(default_factory=set)  # slots written with values not compared


def plant(w: Workload, step: Step, how: str, rng: random.Random) -> Plant:
    a = step.attn
    q, n, bs, width = a.query_lens[0], len(a.query_lens), w.block_size, w.max_blocks
    orig = [int(s) for s in a.slot_mapping]
    i = rng.randrange(n - 1 if how == "copy of another sequence" else n)
    narrow = max(len(r) for r in a.block_tables) if how == "seq_len past its row" else width
    attn = tensors(step, w, narrow, w.cache.dummy_block, rng.random() < 0.5)
    sl, table, slots = attn.seq_lens, attn.block_tables, attn.slot_mapping

    def of(s: int) -> set[int]:
        return set(orig[s * q : (s + 1) * q])

    if how.startswith("seq_len"):
        v = narrow * bs + 1 + rng.randrange(5) if "past" in how else rng.randrange(q)
        sl[i] = v
        return Plant(attn, f"seq_lens[{i}] = {v}", i, of(i))
    if "block" in how:
        v = {"block id past the cache": w.cache.num_blocks + 7, "negative block id": -1}
        v = v.get(how, w.cache.dummy_block)
        table[i, rng.randrange((a.seq_lens[i] - 1) // bs + 1)] = v  # a column it reads
        return Plant(attn, f"block_tables[{i}] = {v}", i, of(i))
    if how == "copy of another sequence":  # a later sequence given the same blocks and slots
        j = rng.randrange(i + 1, n)
        sl[j], table[j] = sl[i], table[i]
        slots[j * q : (j + 1) * q] = slots[i * q : (i + 1) * q]
        return Plant(attn, f"slot_mapping[{j * q}] = {orig[i * q]}", j, of(j))
    t = i * q + rng.randrange(q)
    used = {b for r in a.block_tables for b in r}
    free = next(b for b in range(w.cache.num_blocks) if b not in used)
    v = free * bs + rng.randrange(bs) if how == "slot in a free block" else -1 - rng.randrange(9)
    slots[t] = v
    return Plant(attn, f"slot_mapping[{t}] = {v}", i, {orig[t]}, of(i) - {orig[t]})


def by_slot(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A cache tensor outside the dummy block, one row per slot."""
    return t[:num_blocks].reshape(-1, *t.shape[2:])


def run_plant(seed: int, how: str, q: int, n: int, by: str, warm: bool) -> None:
    (dw, hw), (dex, hex_) = pair(seed)
    rng = random.Random(seed)
    step = dw.step(rng, [q] * n, [rng.randint(q, 16) for _ in range(n)])
    if warm:  # the key's check captured already: the plant meets a replay
        warmup = dw.step(rng, [q] * n, [rng.randint(q, 16) for _ in range(n)])
        dex(
            input_ids=warmup.input_ids,
            positions=warmup.positions,
            attn=tensors(warmup, dw, 6, 0, False),
        )
        hex_(**warmup.kwargs())
    p = plant(dw, step, how, rng)
    nb = dw.cache.num_blocks
    before = [by_slot(t, nb).clone() for t in dw.cache.tensors()]
    kw = {"input_ids": step.input_ids, "positions": step.positions}
    out = dex(attn=p.attn, clone=True, **kw)  # queued, not refused
    ref = hex_(attn=step.attn, clone=True, **kw)
    kept, loose = sorted(p.kept), sorted(p.loose)
    for b, d, r in zip(before, dw.cache.tensors(), hw.cache.tensors()):
        expected = by_slot(r, nb).clone()
        expected[kept] = b[kept]
        expected[loose] = by_slot(d, nb)[loose]
        assert torch.equal(by_slot(d, nb), expected), how
    valid = [t for t in range(n * q) if t // q != p.bad_seq]
    assert torch.equal(out[valid], ref[valid])
    with pytest.raises(xgraph.InputError) as info:
        if by == "synchronize":
            dex.synchronize()
        else:
            nxt = dw.step(rng, [1] * 2, [rng.randint(1, 16) for _ in range(2)])
            dex(**nxt.kwargs())
    assert p.named in str(info.value), (p.named, str(info.value))
    assert "dummy block" in str(info.value)
    dex.synchronize()  # raised once; later steps give what host metadata gives
    for d, r in zip(dw.cache.tensors(), hw.cache.tensors()):
        r.copy_(d)  # the redirected slots differ from the reference's
    again = dw.step(rng, [q] * n, [rng.randint(q, 16) for _ in range(n)])
    kw = {"input_ids": again.input_ids, "positions": again.positions}
    assert torch.equal(dex(attn=tensors(again, dw, 6, 0, False), **kw), hex_(attn=again.attn, **kw))
    dex.synchronize()
    for ex in (dex, hex_):
        ex.close()


@pytest.mark.parametrize("q", [1, 2])
@pytest.mark.parametrize("how", list(PLANTS))
def test_each_planted_problem_is_redirected_and_named(how, q):
    code = PLANTS[how]
    run_plant(100 * code + q, how, q, 5, "synchronize" if q == 1 else "next step", q == 2)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**20),
    how=st.sampled_from(list(PLANTS)),
    q=st.sampled_from([1, 2, 3]),
    n=st.integers(2, 16),
    by=st.sampled_from(["synchronize", "next step"]),
    warm=st.booleans(),
)
def test_random_plants_in_random_steps_are_redirected_and_named(seed, how, q, n, by, warm):
    run_plant(seed, how, q, min(n, MAX_SEQS[q]), by, warm)


def test_sequences_are_named_before_tokens_and_the_next_step_runs_nothing_of_its_own():
    """A step with a bad slot at token 1 and a bad seq_len at sequence 4: the error names
    the sequence; the next step raises it before anything of its own is written."""
    (dw, _), (dex, hex_) = pair(21)
    hex_.close()
    rng = random.Random(21)
    one = dw.decode_step(rng, 6)
    a = tensors(one, dw, 6, 0, False)
    a.slot_mapping[1] = -2
    a.seq_lens[4] = 0
    dex(input_ids=one.input_ids, positions=one.positions, attn=a)
    staged = dex.planner.staged.packed.clone()
    two = dw.decode_step(rng, 3)
    with pytest.raises(xgraph.InputError, match=r"seq_lens\[4\] = 0"):
        dex(input_ids=two.input_ids, positions=two.positions, attn=tensors(two, dw, 6, 0, False))
    assert torch.equal(dex.planner.staged.packed, staged)
    dex.synchronize()
    dex.close()
