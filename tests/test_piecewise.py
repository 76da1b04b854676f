"""Piecewise graphs on the CPU backend: one graph per num_tokens serves every batch composition.

Prefill and mixed steps run as captured pieces with attention between them; decode steps
run as full graphs. Tolerance against the unpadded eager run: float32, rtol = atol = 1e-5.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xgraph
from xgraph import Buckets
from xgraph.attention import attention
from xgraph.buckets import default_sizes
from xgraph.models import Workload
from xgraph.runners import PagedPrefillRunner

RTOL = ATOL = 1e-5
BUCKETS = Buckets(default_sizes(128))


def workloads(seed: int, n: int = 3) -> list[Workload]:
    ws = [Workload.tiny(num_blocks=256, max_blocks=48, max_seqs=16) for _ in range(n)]
    for w in ws:
        w.randomize_cache(seed)
    return ws


def check_step(ex, ex_w: Workload, pad_w: Workload, raw_w: Workload, step, full: bool) -> None:
    out = ex(**step.kwargs())
    t = step.num_tokens
    ref_padded = pad_w.eager(pad_w.padded(step, BUCKETS, full=full))[:t]
    ref_raw = raw_w.eager(step)
    assert torch.equal(out, ref_padded), "piecewise replay differs from padded eager"
    torch.testing.assert_close(out, ref_raw, rtol=RTOL, atol=ATOL)
    for a, b in zip(ex_w.cache.tensors(), pad_w.cache.tensors()):
        assert torch.equal(a, b)
    for a, b in zip(ex_w.cache.real(), raw_w.cache.real()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("memory", ["shared-physical", "shared-pool"])
def test_one_graph_for_every_composition_of_128_tokens(memory):
    ex_w, pad_w, raw_w = workloads(0)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, memory=memory)
    rng = random.Random(0)
    compositions = [[64, 64], [32] * 4, [16] * 8, [128]]
    for _ in range(4):  # random mixes, with cached context of different lengths
        cut = sorted(rng.sample(range(1, 128), rng.randint(1, 6)))
        compositions.append([b - a for a, b in zip([0, *cut], [*cut, 128])])
    for comp in compositions:
        extra = [rng.choice([0, 0, rng.randint(1, 60)]) for _ in comp]
        step = ex_w.prefill_step(rng, comp, extra)
        check_step(ex, ex_w, pad_w, raw_w, step, full=False)
    s = ex.stats()
    assert s["keys"] == [("piecewise", 128)] and s["captures"] == 1
    assert s["hits"][("piecewise", 128)] == len(compositions) - 1
    pw = ex.graph(("piecewise", 128))
    layers = ex_w.model.config.num_layers
    assert pw.describe() == ["piece", "runner"] * layers + ["piece"]
    ex.close()


step_spec = st.one_of(
    st.tuples(st.just("decode"), st.integers(1, 12)),
    st.tuples(st.just("prefill"), st.lists(st.integers(1, 40), min_size=1, max_size=6)),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), steps=st.lists(step_spec, min_size=2, max_size=6))
def test_random_prefill_and_decode_sequence(seed, steps):
    ex_w, pad_w, raw_w = workloads(seed)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS)
    rng = random.Random(seed)
    for kind, arg in steps:
        if kind == "decode":
            step = ex_w.decode_step(rng, arg, max_context=64)
        else:
            step = ex_w.prefill_step(rng, arg, [rng.randint(0, 50) for _ in arg])
        full = all(q == 1 for q in step.attn.query_lens)
        check_step(ex, ex_w, pad_w, raw_w, step, full=full)
    kinds = {k[0] for k in ex.stats()["keys"]}
    if any(k == "decode" for k, _ in steps):
        assert "full" in kinds
    ex.close()


def test_mixed_batch_of_prefill_and_decode_runs_piecewise():
    ex_w, pad_w, raw_w = workloads(3)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS)
    rng = random.Random(3)
    step = ex_w.step(rng, [1, 1, 30, 1, 17], [40, 9, 30, 77, 50])
    check_step(ex, ex_w, pad_w, raw_w, step, full=False)
    assert ex.stats()["keys"] == [("piecewise", 64)]
    ex.close()


class BypassSDPA(torch.nn.Module):
    """Calls SDPA directly instead of the call site: its batch layout would be frozen."""

    def forward(self, input_ids, positions):
        x = (input_ids % 8).float()[:, None].expand(-1, 8).contiguous()
        q = x[None, None]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)[0, 0]


class BypassRunner(torch.nn.Module):
    """Runs a prefill runner on the KV cache itself, inside the captured forward."""

    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.w = w

    def forward(self, input_ids, positions):
        k_cache, _ = self.w.cache.layers[0]
        return k_cache.flatten(1)[positions % 4, :8] + input_ids[:, None].float()


@pytest.mark.parametrize("which", ["sdpa", "cache"])
def test_bypassed_attention_is_refused_at_capture(which):
    (w,) = workloads(4, n=1)
    model = BypassSDPA() if which == "sdpa" else BypassRunner(w)
    ex = w.executor(model.forward, backend="cpu", buckets=BUCKETS, on_capture_error="raise")
    step = w.prefill_step(random.Random(4), [5, 7])
    with pytest.raises(xgraph.CaptureError) as info:
        ex(**step.kwargs())
    msg = str(info.value)
    assert "xgraph.attention" in msg and "piecewise" in msg
    assert ("scaled_dot_product_attention" if which == "sdpa" else "KV cache tensor") in msg
    assert "test_piecewise.py" in msg
    assert ex.stats()["keys"] == [] and ex.stats()["graph_bytes"] == 0
    ex.close()


def test_runner_does_not_run_during_capture():
    """On a GPU nothing runs during capture; the CPU backend keeps the same rule."""
    (w,) = workloads(5, n=1)
    calls = []

    class Counting(PagedPrefillRunner):
        def run(self, *a, **k):
            calls.append(1)
            super().run(*a, **k)

    ex = w.executor(
        backend="cpu", buckets=BUCKETS, attention=w.attention(prefill_runner=Counting())
    )
    layers = w.model.config.num_layers
    ex(**w.prefill_step(random.Random(5), [9, 3]).kwargs())
    # warm-up (eager) + the capture step's replay; none during capture itself
    assert len(calls) == 2 * layers
    ex(**w.prefill_step(random.Random(6), [4, 4, 4]).kwargs())
    assert len(calls) == 3 * layers
    ex.close()


def test_attention_outside_a_step_says_how_to_call_it():
    q = torch.zeros(1, 4, 16)
    with pytest.raises(xgraph.XGraphError, match="outside a step"):
        attention(q, q[:, :2], q[:, :2], (q, q))


def test_precapture_of_piecewise_graphs_touches_only_the_dummy_block():
    (w,) = workloads(6, n=1)
    before = [t.clone() for t in w.cache.real()]
    ex = w.executor(backend="cpu", buckets=BUCKETS)
    ex.capture([128, 64, 8], kind="piecewise", progress=False)
    assert sorted(ex.stats()["keys"]) == [("piecewise", 8), ("piecewise", 64), ("piecewise", 128)]
    for a, b in zip(before, w.cache.real()):
        assert torch.equal(a, b)
    ex.close()
