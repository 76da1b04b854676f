"""Several decode steps per launch (xgraph.DecodeLoop): the same tokens as one step at a time
for K = 1, 2, 8, greedy and seeded; finished sequences leave the cache alone; a sequence that
runs out of blocks stops cleanly."""

from __future__ import annotations

import pytest
import torch

import xgraph
from xgraph.decode_loop import DecodeLoop
from xgraph.device_sampling import sample
from xgraph.loop_launch import Sampling
from xgraph.models import Qwen3Model
from xgraph.runners import PagedDecodeRunner

BS = 4  # block size
PROMPTS = [[3, 17, 42, 5, 9], [11, 2, 8], [60, 61, 62, 63, 64, 65, 66]]


def build_model():
    m = Qwen3Model.build("tiny", num_blocks=64, block_size=BS, seed=1)
    with torch.no_grad():  # larger weights: greedy tokens that change from step to step
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(10)
    return m


@pytest.fixture(scope="module")
def model():
    return build_model()


def _executor(model):
    return xgraph.GraphExecutor(
        model.forward_logits,
        backend="cpu",
        buckets=[1, 2, 4, 8, 16, 32],
        inputs=model.inputs(),
        attention=xgraph.PagedAttention.for_cache(model.kv_cache, max_seqs=8, max_blocks_per_seq=8),
    )


class Seqs:
    """The host's books of a few sequences: tokens, block rows, the blocks still free."""

    def __init__(self, prompts, first_block=0):
        self.tokens = [list(p) for p in prompts]
        self.rows = []
        nxt = first_block
        for p in prompts:
            need = -(-len(p) // BS)
            self.rows.append(list(range(nxt, nxt + need)))
            nxt += need
        self.free = list(range(nxt, 63))

    def slot(self, i, pos):
        return self.rows[i][pos // BS] * BS + pos % BS

    def decode_step(self):
        """input ids, positions and AttentionInputs of the next decode step (one token each),
        with new blocks for sequences that cross into a new block (host bookkeeping)."""
        ids, pos, lens, slots = [], [], [], []
        for i, t in enumerate(self.tokens):
            p = len(t) - 1
            if p // BS >= len(self.rows[i]):
                self.rows[i].append(self.free.pop(0))
            ids.append(t[-1])
            pos.append(p)
            lens.append(p + 1)
            slots.append(self.slot(i, p))
        return ids, pos, xgraph.AttentionInputs([1] * len(ids), lens, self.rows, slots)


def _prefill(ex, seqs):
    ids, pos, slots, lens = [], [], [], []
    for i, t in enumerate(seqs.tokens):
        ids += t
        pos += list(range(len(t)))
        slots += [seqs.slot(i, p) for p in range(len(t))]
        lens.append(len(t))
    logits = ex(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        attn=xgraph.AttentionInputs(lens, lens, seqs.rows, slots),
    )
    last = torch.tensor(lens).cumsum(0) - 1
    return logits[last]


def _choose(logits, positions, sampling):
    if sampling is None:
        return logits.argmax(-1)
    n = logits.shape[0]
    return sample(
        logits,
        torch.tensor(sampling.temperature[:n]).float(),
        torch.tensor(sampling.top_k[:n]),
        torch.tensor(sampling.top_p[:n]).float(),
        torch.tensor(sampling.seeds[:n]),
        torch.tensor(positions) + 1,
        torch.arange(logits.shape[1]),
    )


def start(model, sampling=None):
    """A cache holding the prompts, their first tokens chosen: (executor, books)."""
    for t in model.kv_cache.tensors():
        t.zero_()
    ex = _executor(model)
    seqs = Seqs(PROMPTS)
    first = _prefill(ex, seqs)
    last_pos = [len(t) - 1 for t in seqs.tokens]
    for i, tok in enumerate(_choose(first, last_pos, sampling).tolist()):
        seqs.tokens[i].append(tok)
    return ex, seqs


def one_step_at_a_time(model, new, sampling=None):
    """The reference: the executor's own steps, the choice made after each on the host side."""
    ex, seqs = start(model, sampling)
    for _ in range(new - 1):
        ids, pos, attn = seqs.decode_step()
        logits = ex(input_ids=torch.tensor(ids), positions=torch.tensor(pos), attn=attn)
        for i, tok in enumerate(_choose(logits, pos, sampling).tolist()):
            seqs.tokens[i].append(tok)
    ex.close()
    return [t[len(p) :] for t, p in zip(seqs.tokens, PROMPTS)]


def k_per_launch(model, new, k, sampling=None, free_per_launch=None, **loop_options):
    ex, seqs = start(model, sampling)
    a = xgraph.PagedAttention.for_cache(model.kv_cache, max_seqs=8, max_blocks_per_seq=8)
    loop = DecodeLoop(
        model.forward_logits,
        attention=a,
        steps=k,
        backend="cpu",
        buckets=[1, 2, 4, 8],
        inputs=model.inputs(),
        memory=ex.memory,
        **loop_options,
    )
    reasons = None
    while min(len(t) - len(p) for t, p in zip(seqs.tokens, PROMPTS)) < new:
        ids = [t[-1] for t in seqs.tokens]
        pos = [len(t) - 1 for t in seqs.tokens]
        slots = [seqs.slot(i, p) for i, p in enumerate(pos)]
        attn = xgraph.AttentionInputs([1] * len(ids), [p + 1 for p in pos], seqs.rows, slots)
        budget = [new - (len(t) - len(p)) for t, p in zip(seqs.tokens, PROMPTS)]
        give = seqs.free[: free_per_launch if free_per_launch is not None else 8]
        out = loop(ids, pos, attn, budget=budget, free_blocks=give, sampling=sampling)
        for i, toks in enumerate(out.tokens):
            seqs.tokens[i] += toks
            for b in out.given[i]:
                seqs.rows[i].append(b)
                seqs.free.remove(b)
        reasons = out.reasons
        if any(r == "blocks" for r in reasons):
            break
    loop.close()
    ex.close()
    return [t[len(p) :] for t, p in zip(seqs.tokens, PROMPTS)], reasons


@pytest.mark.parametrize("k", [1, 2, 8])
def test_multi_step_greedy_tokens_equal_one_step_at_a_time(model, k):
    want = one_step_at_a_time(model, 12)
    got, reasons = k_per_launch(model, 12, k)
    assert got == want
    assert reasons == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_multi_step_seeded_sampling_is_the_same_for_every_k(model, k):
    n = len(PROMPTS)
    s = Sampling(
        temperature=[1.0, 0.7, 0.0], top_k=[0, 20, 0], top_p=[1.0, 0.9, 1.0], seeds=[5, 6, 7]
    )
    want = one_step_at_a_time(model, 10, s)
    got, _ = k_per_launch(model, 10, k, s)
    assert got == want
    assert len({tuple(t) for t in got}) == n  # the draws differ between sequences


def test_multi_step_stops_cleanly_where_it_runs_out_of_blocks(model):
    """No free blocks: a sequence stops where it would cross into a block it was not given,
    with the tokens before that equal to one step at a time; given blocks later, it goes on."""
    want = one_step_at_a_time(model, 12)
    got, reasons = k_per_launch(model, 12, 8, free_per_launch=0)
    assert "blocks" in reasons
    for g, w, r in zip(got, want, reasons):
        assert g == w[: len(g)]
        if r == "blocks":
            assert len(g) < 12


class _SlotsSeen(PagedDecodeRunner):
    """The reference decode runner, keeping the slots each call stores to (eager calls)."""

    def __init__(self):
        super().__init__()
        self.slots = []

    def run(self, q, k, v, out, kv_cache, scale):
        self.slots.append(self.planned().slot_mapping[: q.shape[0]].clone())  # no host read
        super().run(q, k, v, out, kv_cache, scale)


def test_multi_step_finished_sequences_leave_the_cache_alone(model):
    """A sequence whose budget ends after its first token writes only that step's slot; the
    rest of the launch it writes the dummy block only."""
    for t in model.kv_cache.tensors():
        t.zero_()
    ex = _executor(model)
    seqs = Seqs(PROMPTS)
    first = _prefill(ex, seqs)
    for i, tok in enumerate(first.argmax(-1).tolist()):
        seqs.tokens[i].append(tok)
    seen = _SlotsSeen()
    a = xgraph.PagedAttention.for_cache(
        model.kv_cache, max_seqs=8, max_blocks_per_seq=8, decode_runner=seen
    )
    loop = DecodeLoop(
        model.forward_logits,
        attention=a,
        steps=8,
        backend="cpu",
        buckets=[4],
        inputs=model.inputs(),
        memory=ex.memory,
    )
    ids = [t[-1] for t in seqs.tokens]
    pos = [len(t) - 1 for t in seqs.tokens]
    slots = [seqs.slot(i, p) for i, p in enumerate(pos)]
    attn = xgraph.AttentionInputs([1] * 3, [p + 1 for p in pos], seqs.rows, slots)
    before = [t[: a.dummy_block].clone() for t in model.kv_cache.tensors()]
    out = loop(ids, pos, attn, budget=[1, 8, 8], free_blocks=seqs.free[:8])
    assert out.reasons == ["length", "length", "length"] and len(out.tokens[0]) == 1
    mine = {r * BS + j for r in seqs.rows[0] for j in range(BS)}
    others = {r * BS + j for rows in out.tables[1:] for r in rows for j in range(BS)}
    changed = set()
    for b, t in zip(before, model.kv_cache.tensors()):
        diff = (b != t[: a.dummy_block]).flatten(2).any(-1).flatten()  # per slot
        changed |= set(torch.nonzero(diff).flatten().tolist())
    assert changed & mine == {slots[0]}  # its first step's token only
    assert changed <= others | {slots[0]}  # nobody wrote outside their own blocks
    layers = model.config.num_layers
    first_launch = [s.tolist() for s in seen.slots[: 8 * layers]]  # the eager run: 8 steps
    assert [s[0] for s in first_launch[:layers]] == [slots[0]] * layers
    assert {s[0] for s in first_launch[layers:]} == {a.dummy_slot}  # finished: dummy only
    assert all(s[1] != a.dummy_slot for s in first_launch)  # the others kept writing
    loop.close()
    ex.close()


class _Counting:
    """A torch.compile backend (aot_eager underneath) counting the calls of what it compiled."""

    def __init__(self):
        self.graphs, self.calls = [], 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo import lookup_backend

        self.graphs.append(gm)
        inner = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return inner(*args)

        return run


@pytest.fixture(scope="module")
def compiled_tail(model):
    """One StepTail compiled through a counting backend, shared by the loops of every K
    (their free lists of one size: the same shapes, so one compile serves them all)."""
    from xgraph.loop_step import StepTail

    a = xgraph.PagedAttention.for_cache(model.kv_cache, max_seqs=8, max_blocks_per_seq=8)
    backend = _Counting()
    layout = dict(block_size=a.block_size, dummy_block=a.dummy_block, dummy_slot=a.dummy_slot)
    return StepTail(**layout, compiler=backend, max_seqs=8), backend


@pytest.mark.parametrize("k", [1, 2, 8])
def test_multi_step_compiled_choice_and_feedback_give_the_same_tokens(model, compiled_tail, k):
    """A compiled StepTail: the choice and the feedback run compiled after every step
    (mode="eager": no recording, every launch through the compiled code), greedy and
    seeded, with the tokens of one step at a time."""
    import warnings

    from xgraph.errors import XGraphWarning

    tail, backend = compiled_tail
    s = Sampling(
        temperature=[1.0, 0.7, 0.0], top_k=[0, 20, 0], top_p=[1.0, 0.9, 1.0], seeds=[5, 6, 7]
    )
    options = dict(tail=tail, mode="eager", max_free_blocks=16)
    for sampling, new in ((None, 12), (s, 10)):
        want = one_step_at_a_time(model, new, sampling)
        calls = backend.calls
        with warnings.catch_warnings():
            warnings.simplefilter("error", XGraphWarning)  # no fallback to the eager code
            got, reasons = k_per_launch(model, new, k, sampling, **options)
        assert got == want
        assert reasons == ["length"] * len(PROMPTS)
        launches = -(-(new - 1) // k)  # the first token came from the prefill
        parts = 1 if sampling is None else 2  # greedy: one function; sampled: draws, advance
        assert backend.calls - calls == parts * launches * k  # every step ran compiled code
    assert len(backend.graphs) == 3  # greedy, draws, advance: compiled once for every K
