"""The per-step choice and feedback of a multi-step launch compiled (xgraph.loop_step):
bitwise the eager code's results over randomized step sequences (ties in the logits, blocks
running out, stop tokens, budgets; aot_eager, and Inductor with the seeded draws), in far
fewer kernels per step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgraph.feedback import BUDGET, RUNNING, Feedback, LoopBuffers
from xgraph.loop_step import StepTail
from xgraph.metadata import AttentionMetadata

BS, WIDTH, BLOCKS, VOCAB, FREE = 4, 4, 32, 64, 7  # FREE: no sequence count (1-6)
DUMMY = BLOCKS - 1
LAYOUT = dict(block_size=BS, dummy_block=DUMMY, dummy_slot=DUMMY * BS)


def _state(seed: int, n: int) -> tuple[LoopBuffers, torch.Tensor]:
    """A launch of n sequences at random positions over distinct blocks, rows padded with
    the dummy block or -1, a short free list, small budgets and stop tokens."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, WIDTH * BS - 1, (n,), generator=g)
    table = torch.where(torch.rand(n, WIDTH, generator=g) < 0.5, DUMMY, -1).to(torch.int32)
    ids = torch.randperm(DUMMY, generator=g)
    for i in range(n):
        used = int(pos[i]) // BS + 1
        table[i, :used] = ids[i * WIDTH : i * WIDTH + used].to(torch.int32)
    free = ids[n * WIDTH : n * WIDTH + FREE]
    slots = table[torch.arange(n), pos // BS].long() * BS + pos % BS
    md = AttentionMetadata.build([1] * n, (pos + 1).tolist(), table, slots)
    md.block_tables = table  # -1 kept (build pads ragged rows only)
    buf = LoopBuffers(
        input_ids=torch.randint(0, VOCAB, (n,), generator=g),
        positions=pos,
        budget=torch.randint(0, 5, (n,), generator=g),
        stop_ids=torch.where(
            torch.rand(n, 3, generator=g) < 0.3, -1, torch.randint(0, 8, (n, 3), generator=g)
        ),
        free_blocks=free,
        free_count=torch.randint(0, FREE + 1, (1,), generator=g),
        md=md,
    )
    # integer logits: ties between tokens are common, and must go to the lowest id
    logits = torch.randint(0, 4, (3, n, VOCAB), generator=g).float()
    return buf, logits


def _packed(buf: LoopBuffers, rows: int = 8) -> LoopBuffers:
    """The same launch in views of one byte buffer, each sized for `rows` sequences and cut
    to the launch's, as an executor's persistent buffers are (xgraph.buffers)."""
    md = buf.md
    parts = [buf.input_ids, buf.positions, buf.budget, buf.stop_ids, buf.free_blocks]
    parts += [buf.free_count, md.seq_lens, md.slot_mapping, md.block_tables]
    growable = {0, 1, 2, 3, 6, 7, 8}  # [n, ...]: sized for `rows`
    shapes = [(rows, *t.shape[1:]) if i in growable else t.shape for i, t in enumerate(parts)]
    sizes = [
        -(-torch.Size(sh).numel() * t.element_size() // 64) * 64 for sh, t in zip(shapes, parts)
    ]
    packed = torch.zeros(sum(sizes), dtype=torch.uint8)
    views, at = [], 0
    for t, sh, size in zip(parts, shapes, sizes):
        nbytes = torch.Size(sh).numel() * t.element_size()
        whole = packed[at : at + nbytes].view(t.dtype).view(sh)
        view = whole[: t.shape[0]]
        view.copy_(t)
        views.append(view)
        at += size
    md.seq_lens, md.slot_mapping, md.block_tables = views[6:]
    return LoopBuffers(*views[:6], md=md)


def _params(n: int) -> tuple[torch.Tensor, ...]:
    t = torch.tensor([0.0, 0.7, 1.3, 1.0, 0.5, 2.0])[:n]
    return t, torch.tensor([0, 5, 0, 2, 1, 0])[:n], torch.full((n,), 0.9), torch.arange(n) + 3


def _run(
    tail: StepTail, sampled: bool, seed: int, n: int, packed: bool = False
) -> list[torch.Tensor]:
    """Three steps of choice + feedback; everything they report and leave in the buffers."""
    buf, logits = _state(seed, n)
    if packed:
        buf = _packed(buf)
    fb = Feedback(buf, **LAYOUT)
    seen = []
    for step in logits:
        if sampled:
            out = tail.choose_sampled(step, fb, _params(n), torch.arange(VOCAB))
        else:
            out = tail.choose_greedy(step, fb)
        md = buf.md
        now = [out, fb.generated, fb.reasons, fb.used, buf.input_ids, buf.positions]
        now += [md.seq_lens, md.slot_mapping, md.block_tables]
        seen += [t.clone() for t in now]
    return seen


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)
    )


EAGER = StepTail(**LAYOUT)


@pytest.fixture(scope="module")
def compiled():
    """A StepTail compiled with aot_eager: the functionalized graph, in place updates and
    all (Inductor's kernels: the slow test below)."""
    return StepTail(**LAYOUT, compiler="aot_eager", max_seqs=8)


def test_multistep_random_states_cover_what_the_feedback_decides():
    """The states the comparison draws reach every reason a sequence stops for."""
    reasons = set()
    for seed in range(40):
        n = seed % 6 + 1
        buf, logits = _state(seed, n)
        fb = Feedback(buf, **LAYOUT)
        assert set(fb.reasons.tolist()) <= {RUNNING, BUDGET}
        for step in logits:
            EAGER.choose_greedy(step, fb)
        reasons |= set(fb.reasons.tolist())
    assert reasons == {0, 1, 2, 3}  # running, stop, budget, no block left


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), packed=st.booleans())
def test_multistep_compiled_tail_is_bitwise_the_eager_one(compiled, seed, n, packed):
    """Greedy, over three steps of random launches, the buffers fresh tensors or views of
    one byte buffer (an executor's; the sampled path compiled end to end: test_multistep)."""
    want = _run(EAGER, False, seed, n)
    assert _same(_run(EAGER, False, seed, n, packed), want)
    assert _same(_run(compiled, False, seed, n, packed), want)
    stats = compiled.stats()["greedy"]
    assert stats["fallback"] is None and stats["graph_breaks"] is None


def test_multistep_compiled_tail_over_a_long_vocabulary_splits_its_argmax(compiled):
    """Rows of 5,000 logits: the compiled tail takes its argmax in two stages
    (xgraph.row_argmax), with the eager tail's tokens and feedback."""
    g = torch.Generator().manual_seed(5)
    for seed in range(4):
        buf, _ = _state(seed, 3)
        logits = torch.randint(0, 3, (3, 5000), generator=g).float()  # ties across pieces
        got, want = Feedback(_packed(buf), **LAYOUT), Feedback(_state(seed, 3)[0], **LAYOUT)
        assert torch.equal(compiled.choose_greedy(logits, got), EAGER.choose_greedy(logits, want))
        assert torch.equal(got.generated, want.generated) and torch.equal(got.reasons, want.reasons)


@pytest.mark.slow
def test_multistep_inductor_tail_is_bitwise_the_eager_one_in_a_tenth_of_the_kernels():
    """Inductor on the CPU (one compile for 2 to 6 sequences, one of the draws): the greedy
    choice + feedback gives the eager code's bits over random launches, in a few kernels
    where the eager code issues dozens; the compiled draws are the eager draws' bits."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor

    from xgraph.bench.step_kernels import count_ops
    from xgraph.device_sampling import uniform

    tail = StepTail(**LAYOUT, compiler="inductor", max_seqs=8)
    # its kernels on the profiler; compiled here (a cached graph brings the guards of the
    # process that cached it, bounds of its own included)
    with (
        inductor.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}),
        functorch.patch(enable_autograd_cache=False),
    ):
        for seed in range(12):
            n = seed % 5 + 2
            want = _run(EAGER, False, seed, n)
            assert _same(_run(tail, False, seed, n, packed=seed % 2 == 1), want)
        counts = []
        for t in (EAGER, tail):  # a launch of the shapes compiled above
            buf, logits = _state(99, 4)
            fb = Feedback(buf, **LAYOUT)
            counts.append(count_ops(lambda t=t, fb=fb, x=logits[0]: t.choose_greedy(x, fb)))
        seeds, pos = torch.tensor([3, 2**31 + 5, 7]), torch.tensor([0, 9, 2**20])
        vocab = torch.arange(VOCAB)
        assert torch.equal(tail.draws(seeds, pos, vocab), uniform(seeds, pos, vocab))
    eager, compiled = (sum(c.values()) for c in counts)
    assert eager >= 10 * compiled > 0
    assert any(k.startswith("inductor:") for k in counts[1])  # its own kernels ran
    assert "aten::argmax" in counts[0] and "aten::argmax" not in counts[1]
    stats = tail.stats()
    assert stats["greedy"]["compiles"] == 1 and stats["draws"]["compiles"] == 1


def test_multistep_loop_refuses_a_tail_of_another_layout():
    import xgraph
    from xgraph.decode_loop import DecodeLoop
    from xgraph.errors import XGraphError
    from xgraph.models import Qwen3Model

    model = Qwen3Model.build("tiny", num_blocks=BLOCKS, block_size=BS)
    a = xgraph.PagedAttention.for_cache(model.kv_cache, max_seqs=4, max_blocks_per_seq=4)
    other = StepTail(block_size=BS * 2, dummy_block=a.dummy_block, dummy_slot=a.dummy_slot)
    with pytest.raises(XGraphError, match="tail= is a StepTail of the layout"):
        DecodeLoop(model.forward_logits, attention=a, steps=2, backend="cpu", tail=other)
    mine = StepTail(block_size=BS, dummy_block=a.dummy_block, dummy_slot=a.dummy_slot)
    loop = DecodeLoop(model.forward_logits, attention=a, steps=2, backend="cpu", tail=mine)
    assert loop.tail is mine and not loop.compiled
    loop.close()
