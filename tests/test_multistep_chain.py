"""Chained multi-step launches (xgraph.loop_chain): a launch queued behind another from the
state it left on the device gives the tokens of one step at a time, greedy and seeded;
sequences that finished earlier in the chain stay finished and leave the cache alone; the
chain refuses blocks handed out before, positions past the model's bound, eager loops."""

from __future__ import annotations

import pytest
import torch
from test_multistep import BS, PROMPTS, build_model, one_step_at_a_time, start

import xgraph
from xgraph.decode_loop import DecodeLoop
from xgraph.errors import InputError, XGraphError
from xgraph.loop_launch import Sampling


@pytest.fixture(scope="module")
def model():
    return build_model()


def _loop(model, ex, k, **options):
    a = xgraph.PagedAttention.for_cache(model.kv_cache, max_seqs=8, max_blocks_per_seq=8)
    return DecodeLoop(
        model.forward_logits,
        attention=a,
        steps=k,
        backend="cpu",
        buckets=[1, 2, 4, 8],
        memory=ex.memory,
        **{"inputs": model.inputs(), **options},
    )


def _first_launch(loop, seqs, budget, free, sampling=None):
    ids = [t[-1] for t in seqs.tokens]
    pos = [len(t) - 1 for t in seqs.tokens]
    slots = [seqs.slot(i, p) for i, p in enumerate(pos)]
    attn = xgraph.AttentionInputs([1] * len(ids), [p + 1 for p in pos], seqs.rows, slots)
    return loop.launch(ids, pos, attn, budget=budget, free_blocks=free, sampling=sampling)


def _take(seqs, result):
    for i, toks in enumerate(result.tokens):
        seqs.tokens[i] += toks
        for b in result.given[i]:
            seqs.rows[i].append(b)
            seqs.free.remove(b)


def chained(model, new, k, sampling=None):
    """Every launch after the first queued behind the one before, each read back only after
    the next is queued (an engine's pipeline): the tokens and the last reasons."""
    ex, seqs = start(model, sampling)
    loop = _loop(model, ex, k)
    budget = [new - 1] * len(PROMPTS)  # the first token came from the prefill
    per = 3  # blocks handed to each launch, new to the chain every time
    pool = list(seqs.free)
    launch = _first_launch(loop, seqs, budget, pool[:per], sampling)
    launches, reasons = 1, None
    while True:
        more = launches * k < new - 1
        nxt = launch.then(pool[launches * per : (launches + 1) * per]) if more else None
        r = launch.result()
        _take(seqs, r)
        reasons = r.reasons
        if nxt is None:
            break
        launch, launches = nxt, launches + 1
    loop.close()
    ex.close()
    return [t[len(p) :] for t, p in zip(seqs.tokens, PROMPTS)], reasons, launches


@pytest.mark.parametrize("k", [1, 2, 4])
def test_multi_step_chained_launches_give_the_tokens_of_one_step_at_a_time(model, k):
    want = one_step_at_a_time(model, 12)
    got, reasons, launches = chained(model, 12, k)
    assert launches == -(-11 // k) and launches > 1
    assert got == want
    assert reasons == ["length"] * len(PROMPTS)


def test_multi_step_chained_seeded_sampling_is_unchanged(model):
    s = Sampling(
        temperature=[1.0, 0.7, 0.0], top_k=[0, 20, 0], top_p=[1.0, 0.9, 1.0], seeds=[5, 6, 7]
    )
    want = one_step_at_a_time(model, 10, s)
    got, _, launches = chained(model, 10, 2, s)
    assert launches == 5
    assert got == want


def test_multi_step_a_sequence_finished_earlier_in_the_chain_stays_finished(model):
    """Budget 2 with K = 2: the first sequence finishes in the first launch; the chained
    launch reports no token for it, the reason it finished with, and writes nothing of it
    into the cache (its own blocks unchanged), while the others go on."""
    ex, seqs = start(model)
    loop = _loop(model, ex, 2)
    first = _first_launch(loop, seqs, [2, 6, 6], seqs.free[:4])
    second = first.then(seqs.free[4:8])
    r1 = first.result()
    kv = [t.clone() for t in model.kv_cache.tensors()]  # the CPU backend ran both already
    assert r1.reasons == ["length", None, None] and len(r1.tokens[0]) == 2
    r2 = second.result()
    assert r2.tokens[0] == [] and r2.reasons[0] == "length"
    assert [len(t) for t in r2.tokens[1:]] == [2, 2]
    mine = [r * BS + j for r in r1.tables[0] if r != loop.attention.dummy_block for j in range(BS)]
    third = second.then()  # the first sequence through one more launch of the chain
    third.result()
    for before, t in zip(kv, model.kv_cache.tensors()):
        flat_b, flat_t = before.flatten(0, 1), t.flatten(0, 1)
        assert torch.equal(flat_b[mine], flat_t[mine])
    loop.close()
    ex.close()


def test_multi_step_chain_refuses_blocks_handed_out_before(model):
    ex, seqs = start(model)
    loop = _loop(model, ex, 2)
    first = _first_launch(loop, seqs, [6, 6, 6], seqs.free[:3])
    with pytest.raises(InputError, match="handed to an earlier launch of this chain"):
        first.then(seqs.free[2:5])
    first.then(seqs.free[3:5])
    with pytest.raises(XGraphError, match="followed already"):  # one state, one next launch
        first.then(seqs.free[5:7])
    first.result()
    loop.close()
    ex.close()


def test_multi_step_chain_refuses_positions_past_the_model_bound(model):
    """Positions bounded at 24: the first launch's 4 steps fit, and so do chained ones
    until a launch could feed a position past the bound; that one is refused."""
    ex, seqs = start(model)
    bound = xgraph.Input("positions", torch.int64, ("num_tokens",), bounds=(0, 24))
    loop = _loop(model, ex, 4, inputs=[bound])
    first = _first_launch(loop, seqs, [100] * 3, seqs.free[:12])
    launch, queued = first, 0
    with pytest.raises(InputError, match="chained launch could feed position 26"):
        while queued < 10:
            launch = launch.then()
            queued += 1
    # the last prompt's token at 7: a launch at depth d feeds up to 10 + 4 d
    assert queued == 3
    loop.close()
    ex.close()


def test_multi_step_chain_needs_full_graphs(model):
    ex, seqs = start(model)
    loop = _loop(model, ex, 2, mode="eager")
    first = _first_launch(loop, seqs, [4, 4, 4], seqs.free[:3])
    with pytest.raises(XGraphError, match="chained launches"):
        first.then()
    assert [len(t) for t in first.result().tokens] == [2, 2, 2]
    loop.close()
    ex.close()
