"""`bench decode`'s per-bucket probes (kernels per step and idle share from a device trace,
distance from a float32 reference) and issue 35's decode-limit record built from them."""

from __future__ import annotations

import json
import random

import pytest
import torch

import xgraph
from xgraph.bench import decode, limit
from xgraph.bench.fidelity import Fidelity, float32_twin
from xgraph.bench.kernel_trace import split_steps, step_stats
from xgraph.models import Workload


def test_steps_are_cut_at_the_widest_gaps_and_idle_time_is_what_no_kernel_covers() -> None:
    # two steps: kernels at 0-10, 12-20 (overlapping 15-18) | 100-110, 115-120
    spans = [(0.0, 10.0, "a"), (12.0, 20.0, "b"), (15.0, 18.0, "c"), (100.0, 110.0, "a")]
    spans.append((115.0, 120.0, "b"))
    steps = split_steps(spans, 2)
    assert [len(s) for s in steps] == [3, 2]
    first = step_stats(steps[0])
    assert first["kernels"] == 3 and first["busy_us"] == 18.0 and first["span_us"] == 20.0
    assert first["gap_share"] == pytest.approx(0.1)
    assert step_stats(steps[1])["gap_share"] == pytest.approx(0.25)
    assert split_steps([], 3) == []


def test_a_sample_depends_on_the_step_and_seed_only() -> None:
    """The cache is refilled before each sample, so what ran before cannot move it."""
    w = Workload.tiny()
    rng = random.Random(0)
    step, other = w.decode_step(rng, 2), w.decode_step(rng, 3)
    f = Fidelity(w)
    f.sample("a", 2, step, lambda: w.eager(step, forward=w.model.forward))
    w.eager(other, forward=w.model.forward)  # writes other slots in between
    f.sample("b", 2, step, lambda: w.eager(step, forward=w.model.forward))
    a, b = f.samples[2]["a"], f.samples[2]["b"]
    assert len(a) == f.states and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])  # the states differ: each is its own seed's cache
    found = f.finish()
    assert found[2]["a"] == found[2]["b"] < 1e-5  # float32 on the CPU: the reference itself


def test_the_float32_twin_holds_the_same_weights_and_its_own_cache() -> None:
    w = Workload.tiny(dtype=torch.bfloat16)
    twin = float32_twin(w.model)
    assert twin.kv_cache.dtype == torch.float32 and twin.kv_cache is not w.model.kv_cache
    a = twin.model.layers[0].self_attn.qkv_proj.weight
    b = w.model.model.layers[0].self_attn.qkv_proj.weight
    assert a.dtype == torch.float32 and torch.equal(a, b.float())
    assert twin.lm_head.weight is twin.model.embed_tokens.weight  # tied, as the original


def test_decode_rows_carry_fidelity_and_the_limit_record(tmp_path) -> None:  # type: ignore[no-untyped-def]
    backend = xgraph.get_backend("cpu")
    data = decode.run(backend, "tiny", [1, 2], iters=2, compile_batches=[])
    for r in data["rows"]:
        assert set(r["fidelity"]) == {"xgraph"} and r["fidelity"]["xgraph"] < 1e-5
        assert "profile" not in r  # the profiler traces no CPU kernels
    assert data["anchor_kernels"] == "torch"
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(data, default=str))
    out = tmp_path / "limit.json"
    assert limit.main(["--decode", str(path), "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["batch"] for r in record["rows"]] == [1, 2]
    assert record["rows"][0]["model"] == "tiny" and record["rows"][0]["xgraph_ms"] > 0


def _decode_row(**kw: float) -> dict:
    r = {"batch": 1, "best_xgraph": "xgraph", "best_xgraph_s": 0.4e-3}
    r.update(reduce_overhead_s=0.9e-3, roofline_s=0.2e-3)
    r["profile"] = {"xgraph": {"kernels": 145, "gap_share": 0.05}}
    r["fidelity_gate"] = {"xgraph_vs_fp32": 0.010, "reduce_overhead_vs_fp32": 0.010}
    r.update(kw)
    return r


def test_targets_are_checked_per_row() -> None:
    good = limit.rows({"model": "qwen3-0.6b", "rows": [_decode_row()]})[0]
    assert all(t["met"] for t in good["targets"].values()), good["targets"]
    names = {"ms", "speedup_over_reduce_overhead", "kernels_per_step", "fidelity_ratio"}
    assert set(good["targets"]) == names
    slow = _decode_row(best_xgraph_s=0.7e-3)
    slow["fidelity_gate"] = {"xgraph_vs_fp32": 0.02, "reduce_overhead_vs_fp32": 0.01}
    missed = limit.rows({"model": "qwen3-0.6b", "rows": [slow]})[0]["targets"]
    assert not missed["ms"]["met"] and not missed["fidelity_ratio"]["met"]
    big = limit.rows({"model": "qwen3-8b", "rows": [_decode_row(roofline_s=0.3e-3)]})[0]
    assert big["targets"]["of_floor"]["value"] == pytest.approx(4 / 3)
    assert not big["targets"]["of_floor"]["met"]
