"""Tensor parallelism through the executor: TP=2 and TP=4 on gloo, spawned processes.

Decode (full graphs) and chunked prefill (piecewise) through the executor equal the same
TP model run eagerly, bit for bit, on every rank, and the single-rank model within 1e-5 in
float32. Every multi-process test is bounded by run_ranks' deadline (processes killed).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.distributed as dist

import xgraph
from xgraph import Buckets
from xgraph.distributed.spawn import run_ranks
from xgraph.models import Workload
from xgraph.models.qwen3_tp import Qwen3TPModel

BUCKETS = [1, 2, 4, 8, 16]
DECODE = [3, 4, 1, 8, 5, 16]
PREFILL = [[5, 3], [2, 2, 4], [9], [1, 6]]
HAS_ASCEND = importlib.util.find_spec("xgraph_ascend") is not None


def tp_workloads(group, seed: int = 3):
    """The single-rank model and two TP shards of it (executor, eager reference), their
    caches holding the same random values (each shard its kv heads)."""
    single = Workload.tiny(num_blocks=64, block_size=4, max_blocks=6, max_seqs=16)
    single.randomize_cache(seed)
    shards = []
    for _ in range(2):
        m = Qwen3TPModel.build("tiny", group, num_blocks=64, block_size=4)
        s = m.shard
        for mine, full in zip(m.kv_cache.tensors(), single.cache.tensors()):
            mine.copy_(full[:, :, s.kv_first : s.kv_first + s.kv_heads])
        shards.append(Workload(m, 6, 16))
    return single, shards[0], shards[1]


def run_tp(backend: str, seed: int) -> dict:
    group = dist.group.WORLD
    single, ex_w, ref_w = tp_workloads(group, seed)
    par = xgraph.Parallel(tp=group, timeout=30)
    ex = ex_w.executor(backend=backend, buckets=BUCKETS, parallel=par)
    buckets = Buckets(BUCKETS)
    rng = random.Random(seed)  # the same on every rank: TP ranks run one batch
    rows = []
    for b in DECODE + PREFILL:
        full = isinstance(b, int)
        step = ex_w.decode_step(rng, b) if full else ex_w.prefill_step(rng, b)
        out = ex(**step.kwargs()).clone()
        ref = ref_w.eager(ref_w.padded(step, buckets, full=full))[: step.num_tokens]
        one = single.eager(step)
        rows.append((b, torch.equal(out, ref), float((out - one).abs().max())))
    st = ex.stats()
    ex.close()
    return {"rows": rows, "keys": st["keys"], "parallel": st["parallel"]}


def tp_worker(rank: int, world: int, backends: list[str]) -> dict:
    return {b: run_tp(b, seed=11) for b in backends}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_decode_and_piecewise_prefill_equal_eager_bitwise_and_single_rank(world):
    backends = ["cpu"] + (["ascend-sim"] if world == 2 and HAS_ASCEND else [])
    outcomes = run_ranks(tp_worker, world, args=(backends,), timeout=240)
    for o in outcomes:
        for backend, r in o.value.items():
            where = f"rank {o.rank}, {backend}"
            assert all(equal for _, equal, _ in r["rows"]), (where, r["rows"])
            assert max(d for _, _, d in r["rows"]) <= 1e-5, (where, r["rows"])
            kinds = {k[0] for k in r["keys"]}
            assert kinds == {"full", "piecewise"}, (where, r["keys"])
            p = r["parallel"]
            assert p["world_size"] == world and p["agreements"] == len(DECODE) + len(PREFILL)
            assert "replans" not in p  # nothing is staged before the ranks agree
            # every captured key's manifest: the all-reduces and the logits' all-gather
            for key, manifest in p["manifests"].items():
                assert manifest and manifest[-1].startswith("c10d::_allgather_base_"), key
                assert all(" on tp" in c for c in manifest), manifest
    same = [
        {b: (r["rows"], r["keys"], r["parallel"]["manifests"]) for b, r in o.value.items()}
        for o in outcomes
    ]
    assert all(s == same[0] for s in same)  # every rank: the same results, keys and manifests


def test_tp_shards_load_hugging_face_names():
    """The shards are slices of the full checkpoint tensors, under the merged names."""
    from xgraph.models.qwen3_config import Qwen3Config
    from xgraph.models.qwen3_tp import Shard, random_hf_state, shard_hf_state

    c = Qwen3Config.tiny()
    full = random_hf_state(c, 0)

    class _Rank(Shard):  # a rank's slices without a process group
        def __init__(self, rank: int, size: int) -> None:
            self.group, self.size, self.rank = None, size, rank
            self.heads, self.kv_heads = c.num_heads // size, max(1, c.num_kv_heads // size)
            self.kv_first = rank * c.num_kv_heads // size
            self.inter, self.vocab = c.intermediate_size // size, c.vocab_size // size

    parts = [shard_hf_state(full, c, _Rank(r, 2)) for r in range(2)]
    p = "model.layers.0."
    assert torch.equal(
        torch.cat([s[p + "mlp.down_proj.weight"] for s in parts], 1),
        full[p + "mlp.down_proj.weight"],
    )
    assert torch.equal(
        torch.cat([s["model.embed_tokens.weight"] for s in parts]),
        full["model.embed_tokens.weight"],
    )
    q = [s[p + "self_attn.qkv_proj.weight"][: 2 * c.head_dim] for s in parts]
    assert torch.equal(torch.cat(q), full[p + "self_attn.q_proj.weight"])
    four = [shard_hf_state(full, c, _Rank(r, 4)) for r in range(4)]  # 2 kv heads, 4 ranks
    k = [s[p + "self_attn.qkv_proj.weight"][c.head_dim : 2 * c.head_dim] for s in four]
    assert torch.equal(k[0], k[1]) and torch.equal(k[2], k[3]) and not torch.equal(k[1], k[2])
