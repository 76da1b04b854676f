"""The profile run before the KV cache exists (`xgraph.profile_step`) and the runners an
executor picks (`xgraph.runners_for`), on the CPU backend and the Ascend simulator."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import xgraph
from xgraph import AttentionInputs, InputError, XGraphError
from xgraph.adapter import AttentionRunner
from xgraph.attention import eager_attention
from xgraph.models import Workload
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

BACKENDS = ["cpu", "ascend-sim"]
LENS = [5, 9, 1, 3]  # tokens of each sequence: prefills from position 0


def _prefill(w: Workload, lens: list[int], seed: int = 0):  # type: ignore[no-untyped-def]
    return w.prefill_step(random.Random(seed), lens)


@pytest.mark.parametrize("name", BACKENDS)
def test_runners_for_gives_what_an_executor_runs(name):
    backend = xgraph.get_backend(name)
    decode, prefill = xgraph.runners_for(backend)
    w = Workload.tiny()
    ex = w.executor(backend=backend, buckets=[1, 2, 4])
    assert type(ex.decode_runner) is type(decode) and type(ex.prefill_runner) is type(prefill)
    ex.close()
    again = xgraph.runners_for(name)  # by name too; fresh runners: no plan shared
    assert again[0] is not decode and again[1] is not prefill
    own_decode, own_prefill = PagedDecodeRunner(), PagedPrefillRunner()
    both = w.attention(decode_runner=own_decode, prefill_runner=own_prefill)
    assert xgraph.runners_for(backend, both) == (own_decode, own_prefill)
    one = w.attention(prefill_runner=own_prefill)
    got = xgraph.runners_for(backend, one)
    assert got[1] is own_prefill and type(got[0]) is type(decode)


@pytest.mark.parametrize("name", BACKENDS)
def test_profile_step_equals_an_eager_step_and_touches_no_cache(name):
    """The forward under a profile step gives bitwise what an executor's eager step (a step
    above its largest bucket) gives over the real cache, for the same tokens; the model's
    cache is neither read nor written."""
    w = Workload.tiny()
    w.randomize_cache(3)  # garbage a read of the cache would show
    before = [t.clone() for t in w.cache.tensors()]
    step = _prefill(w, LENS)
    with xgraph.profile_step(LENS, backend=name) as prof:
        got = w.model.forward_logits(step.input_ids, step.positions)
    for a, b in zip(w.cache.tensors(), before):
        assert torch.equal(a, b)
    ref = Workload.tiny()
    ex = ref.executor(backend=name, buckets=[1, 2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xgraph.XGraphWarning)  # above the largest bucket
        expected = ex(**step.kwargs())
    assert ex.stats()["eager"] and torch.equal(got, expected)
    assert torch.equal(got, ref.eager(step))
    ex.close()
    # the scratch: one layout (every layer alike) in the block size of the cache the model
    # passes (4), the step's blocks and one dummy
    c = w.model.config
    blocks = sum(-(-n // 4) for n in LENS) + 1
    assert prof.scratch_bytes == 2 * blocks * 4 * c.num_kv_heads * c.head_dim * 4
    assert len(prof.scratch) == 1 and prof.peak_bytes is None  # no allocator peaks on CPU


class TwoLayers(torch.nn.Module):
    """A model whose attention layers are given their caches at call time: None before the
    engine has allocated them."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        hidden = 32
        self.embed = torch.nn.Embedding(64, hidden)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(hidden, (heads + 2 * kv_heads) * dim) for _ in range(2)
        )
        self.o = torch.nn.ModuleList(torch.nn.Linear(heads * dim, hidden) for _ in range(2))

    def forward(self, ids: torch.Tensor, caches: list) -> torch.Tensor:  # type: ignore[type-arg]
        x = self.embed(ids)
        d, h, kh = self.dim, self.heads, self.kv_heads
        for qkv, o, kv in zip(self.qkv, self.o, caches):
            q, k, v = qkv(x).split([h * d, kh * d, kh * d], -1)
            q, k, v = (t.unflatten(1, (-1, d)) for t in (q, k, v))
            x = x + o(xgraph.attention(q, k, v, kv).flatten(1))
        return x


def _eager_over_a_cache(model: TwoLayers, ids: torch.Tensor, lens: list[int], bs: int):  # type: ignore[no-untyped-def]
    """The same forward eagerly, over a real cache of 32 blocks of `bs` (dummy last)."""
    shape = (33, bs, model.kv_heads, model.dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
    rows, slots, at = [], [], 0
    for n in lens:
        need = -(-n // bs)
        rows.append(list(range(at, at + need)))
        slots += [rows[-1][p // bs] * bs + p % bs for p in range(n)]
        at += need
    md = AttentionInputs(lens, lens, rows, slots).metadata(fill_block=32)
    with torch.no_grad(), eager_attention(PagedPrefillRunner(), md):
        return model(ids, caches)


@pytest.mark.parametrize(
    "caches, block_size, expected_bs",
    [
        (None, None, 16),  # nothing to go by: the default
        (None, 2, 2),
        ("meta", None, 8),  # placeholders on the meta device give the layout
        ("meta", 4, 4),  # an explicit block size wins
    ],
)
def test_profile_step_before_the_cache_exists(caches, block_size, expected_bs):
    torch.manual_seed(0)
    model = TwoLayers().requires_grad_(False)
    lens = [7, 2, 12]
    ids = torch.randint(0, 64, (sum(lens),))
    if caches == "meta":
        shape = (1000, 8, model.kv_heads, model.dim)  # the cache to come: nothing allocated
        given = [(torch.empty(shape, device="meta"),) * 2 for _ in range(2)]
    else:
        given = [None, None]
    with xgraph.profile_step(lens, backend="cpu", block_size=block_size) as prof:
        got = model(ids, given)
    assert torch.equal(got, _eager_over_a_cache(model, ids, lens, 4))
    ((k, v),) = prof.scratch.values()
    blocks = sum(-(-n // expected_bs) for n in lens) + 1
    assert k.shape == v.shape == (blocks, expected_bs, model.kv_heads, model.dim)
    assert prof.scratch_bytes == 2 * k.nbytes
    with pytest.raises(XGraphError, match="outside a step"):  # the step is over
        model(ids, given)


class Counting(AttentionRunner):
    """A runner that counts its plans and runs, over the reference prefill."""

    graph_safe = False

    def __init__(self) -> None:
        self.inner, self.plans, self.runs = PagedPrefillRunner(), 0, 0

    def plan(self, metadata):  # type: ignore[no-untyped-def]
        self.plans += 1
        self.inner.plan(metadata)

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        self.runs += 1
        self.inner.run(q, k, v, out, kv_cache, scale)


def test_profile_step_runs_the_given_runner_planned_once_per_step():
    w = Workload.tiny()
    step = _prefill(w, LENS)
    runner = Counting()
    with xgraph.profile_step(LENS, runner=runner, cache_dtype=torch.float32) as prof:
        got = w.model.forward_logits(step.input_ids, step.positions)
    assert runner.plans == 1 and runner.runs == w.model.config.num_layers
    assert prof.runner is runner and torch.equal(got, w.eager(step))


def test_profile_step_refuses_what_it_cannot_run():
    w = Workload.tiny()
    # decode tokens (and chunked prefill) need keys from a cache that does not exist yet
    with pytest.raises(
        InputError, match=r"sequence 1 adds 1 tokens to a seq_len of 9: its first 8"
    ):
        with xgraph.profile_step([4, 1], seq_lens=[4, 9]):
            pass
    for bad in ([], [3, 0]):
        with pytest.raises(InputError, match="at least one sequence"):
            with xgraph.profile_step(bad):
                pass
    with pytest.raises(InputError, match="must be integers"):
        with xgraph.profile_step(["a"]):
            pass
    with pytest.raises(InputError, match="2 query_lens but 1 seq_lens"):
        with xgraph.profile_step([2, 2], seq_lens=[2]):
            pass
    # the forward's tokens must be the step's, unpadded
    step = _prefill(w, [5, 3])
    with pytest.raises(InputError, match=r"q of 8 rows .* the step has 9 tokens"):
        with xgraph.profile_step([5, 4]):
            w.model.forward_logits(step.input_ids, step.positions)
    # a placeholder must be laid out as the cache will be
    with pytest.raises(XGraphError, match=r"laid out \(4, 16, 3, 8\)"):
        with xgraph.profile_step([2]):
            bad = torch.empty(4, 16, 3, 8, device="meta")
            xgraph.attention(
                torch.ones(2, 4, 8), torch.ones(2, 2, 8), torch.ones(2, 2, 8), (bad, bad)
            )
    # not inside another step
    md = step.attn.metadata()
    with eager_attention(PagedPrefillRunner(), md):
        with pytest.raises(XGraphError, match="inside another step"):
            with xgraph.profile_step([5, 3]):
                pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_step_measures_the_peak_on_cuda():
    """On a GPU: the backend's own prefill runner (Triton or SDPA), a peak that grows with the
    batch and includes the scratch, and outputs close to an executor's over the real cache."""
    w = Workload.tiny(device="cuda", num_blocks=256, max_blocks=32)  # rows of 64 tokens
    peaks = []
    for lens in ([16], [64, 64, 64, 64]):
        step = _prefill(w, lens)
        ids, pos = step.input_ids.cuda(), step.positions.cuda()
        with xgraph.profile_step(lens, backend="cuda") as prof:
            got = w.model.forward_logits(ids, pos)
        assert prof.peak_bytes is not None and prof.peak_bytes >= prof.scratch_bytes
        assert prof.peak_bytes >= got.nbytes
        peaks.append(prof.peak_bytes)
        ex = w.executor(backend="cuda", buckets=[1, 2, 4])  # above 4 tokens: eager steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", xgraph.XGraphWarning)
            expected = ex(**step.kwargs())
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        ex.close()
    assert peaks[1] > peaks[0]
