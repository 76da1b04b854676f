"""Bad attention metadata is refused naming the field and sequence; valid metadata never is;
garbage in the dummy block or past seq_len never reaches a real row."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xgraph
from xgraph import AttentionInputs, Buckets
from xgraph.models import Workload

BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def w():
    return Workload.tiny(num_blocks=32, max_blocks=4, max_seqs=8)  # block_size 4


@pytest.fixture(scope="module")
def ex(w):
    e = w.executor(backend="cpu", buckets=BUCKETS)
    yield e
    e.close()


def decode(w, lens, rows, slots=None, ids=None):
    bs = w.block_size
    if slots is None:  # where the rows put each last position (0 where a row is too short)
        slots = [
            r[(n - 1) // bs] * bs + (n - 1) % bs if (n - 1) // bs < len(r) else 0
            for r, n in zip(rows, lens)
        ]
    n = len(lens)
    return dict(
        input_ids=torch.zeros(n, dtype=torch.int64) if ids is None else ids,
        positions=torch.tensor([x - 1 for x in lens]),
        attn=AttentionInputs([1] * n, lens, rows, slots),
    )


BAD = {
    # seq_len 9 needs 3 blocks of 4; the row has 2
    "row too short": (dict(lens=[9, 2], rows=[[0, 1], [2]]), "sequence 0 needs 3 blocks"),
    "empty row": (dict(lens=[3, 2], rows=[[0], []]), "sequence 1 needs 1 blocks"),
    "negative block id": (dict(lens=[2, 5], rows=[[0], [3, -2]]), "block id -2"),
    "block id past the cache": (dict(lens=[2], rows=[[99]]), "block id 99"),
    "the dummy block": (dict(lens=[2], rows=[[32]]), "reserved dummy block"),
    "slot outside the row": (dict(lens=[2], rows=[[5]], slots=[3]), "slot_mapping[0] is 3"),
    "negative slot": (dict(lens=[2], rows=[[5]], slots=[-1]), "slot_mapping[0] is -1"),
    "token id past the vocabulary": (
        dict(lens=[2], rows=[[5]], ids=torch.tensor([256])),
        "'input_ids'[0] is 256",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_metadata_is_refused_naming_the_field(w, ex, case):
    kwargs, needle = BAD[case]
    before = [t.clone() for t in w.cache.tensors()]
    with pytest.raises(xgraph.InputError) as info:
        ex(**decode(w, **kwargs))
    assert needle in str(info.value), str(info.value)
    for a, b in zip(before, w.cache.tensors()):
        assert torch.equal(a, b)  # nothing was written


def test_zero_tokens_and_bad_lengths_are_refused(w, ex):
    with pytest.raises(xgraph.InputError, match="at least one sequence and one token"):
        none = torch.zeros(0, dtype=torch.int64)
        ex(input_ids=none, positions=none, attn=AttentionInputs([], [], [], []))
    bad = decode(w, lens=[2, 0], rows=[[0], [1]], slots=[1, 4])
    bad["positions"] = torch.tensor([1, 0])
    with pytest.raises(xgraph.InputError, match="sequence 1 has query_len 1 and seq_len 0"):
        ex(**bad)
    assert ex.stats()["keys"] == [] or all(k[0] == "full" for k in ex.stats()["keys"])


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**20),
    query=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    extra=st.lists(st.integers(0, 9), min_size=5, max_size=5),
    tensor=st.booleans(),
)
def test_valid_metadata_is_never_refused(w, ex, seed, query, extra, tensor):
    step = w.prefill_step(random.Random(seed), query, extra[: len(query)])
    if tensor:
        step = step.with_tensor_tables(w.max_blocks, w.cache.dummy_block)
    plan = ex.planner.plan({"input_ids": step.input_ids, "positions": step.positions}, step.attn)
    assert plan.num_tokens == step.num_tokens


@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
def test_garbage_in_the_dummy_block_never_reaches_a_real_row(poison):
    ex_w, ref_w = (Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16) for _ in range(2))
    for x in (ex_w, ref_w):
        x.randomize_cache(5)
    for t in ex_w.cache.tensors():
        t[ex_w.cache.dummy_block].fill_(poison)  # torch.empty caches hold anything
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS)
    rng = random.Random(5)
    for b in [3, 1, 5, 8, 2]:
        step = ex_w.decode_step(rng, b)
        out = ex(**step.kwargs())
        ref = ref_w.eager(step)  # unpadded: never touches the dummy block
        assert out.isfinite().all()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ex.close()


def test_garbage_past_seq_len_in_a_real_block_is_ignored():
    ex_w, ref_w = (Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16) for _ in range(2))
    for x in (ex_w, ref_w):
        x.randomize_cache(6)
    step = ex_w.decode_step(random.Random(6), 4)
    bs = ex_w.block_size
    for r, n in zip(step.attn.block_tables, step.attn.seq_lens):  # slots past seq_len: NaN
        for t in ex_w.cache.tensors():
            flat = t.view(-1, *t.shape[2:])
            flat[r[-1] * bs + (n - 1) % bs + 1 : (r[-1] + 1) * bs] = float("nan")
    ex = ex_w.executor(backend="cpu", buckets=Buckets(BUCKETS))
    out = ex(**step.kwargs())
    torch.testing.assert_close(out, ref_w.eager(step), rtol=1e-5, atol=1e-5)
    ex.close()


def test_a_host_input_numpy_cannot_view_is_checked_and_staged_through_torch():
    """A bfloat16 host input (embeddings, say) has no numpy view: its checks and its staging
    go through torch, and a graph step equals the eager forward."""

    def forward(x, e):
        return x[:, None].float() + e.float()

    ex = xgraph.GraphExecutor(
        forward,
        inputs=[
            xgraph.Input("x", torch.int64, ("num_tokens",), bounds=(0, 100)),
            xgraph.Input("e", torch.bfloat16, ("num_tokens", 4), bounds=(-2, 2)),
        ],
        backend="cpu",
        buckets=[2, 4],
    )
    x, e = torch.arange(3), torch.linspace(-1, 1, 12, dtype=torch.bfloat16).view(3, 4)
    for _ in range(2):  # the capture, then a replay
        torch.testing.assert_close(ex(x=x, e=e, clone=True), forward(x, e))
    with pytest.raises(xgraph.InputError, match=r"input 'e'\[0, 0\] is 3.0, outside its bounds"):
        ex(x=x, e=e + 4 * (torch.arange(12).view(3, 4) == 0))
    with pytest.raises(xgraph.InputError, match="input 'e' dim 1 is 3, declared 4"):
        ex(x=x, e=e[:, :3])
    ex.close()
