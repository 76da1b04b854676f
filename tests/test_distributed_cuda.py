"""Collectives inside CUDA graphs through the executor: a world-size-1 NCCL group on one GPU
(two ranks on one GPU are refused by NCCL; the two-GPU run is `scripts/device.sh dist` on two GPUs).

The TP model over a group of one still issues its all-reduces and its all-gather, so NCCL
kernels are captured in the full graphs (decode) and the pieces (prefill), replayed, and
compared with the same model run eagerly. Skipped without a CUDA GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from xgraph.distributed.spawn import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def nccl_worker(rank: int, world: int, device: str = "cuda") -> dict:
    import torch.distributed as dist

    import xgraph
    from xgraph import Buckets
    from xgraph.models import Workload
    from xgraph.models.qwen3_tp import Qwen3TPModel
    from xgraph.runners import PagedPrefillRunner

    group = dist.group.WORLD
    backend = xgraph.get_backend(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = Qwen3TPModel.build("tiny", group, num_blocks=64, block_size=4, dtype=dtype, device=device)
    w = Workload(m, 6, 16)
    buckets = [1, 2, 4, 8, 16]
    rows = []
    for mode in ("auto", "piecewise"):
        ex = w.executor(
            backend=backend, buckets=buckets, parallel=xgraph.Parallel(tp=group), mode=mode
        )
        rng = random.Random(0)
        for b in (3, 8, [5, 3], [9]):
            full = isinstance(b, int) and mode == "auto"
            step = w.decode_step(rng, b) if isinstance(b, int) else w.prefill_step(rng, b)
            out = ex(**step.kwargs(), clone=True)
            for _ in range(3):  # replays: the captured NCCL kernels run again
                again = ex(**step.kwargs(), clone=True)
            padded = w.padded(step, Buckets(buckets), full=full)
            runner = None if full else PagedPrefillRunner()
            ref = w.eager(padded, runner, num_tokens=None if full else step.num_tokens)
            ref = ref[: step.num_tokens]
            rows.append(
                {
                    "mode": mode,
                    "step": b,
                    "diff": float((out.float() - ref.float()).abs().max()),
                    "scale": float(ref.float().abs().max()),
                    "stable": torch.equal(out, again),
                }
            )
        st = ex.stats()
        rows.append({"keys": st["keys"], "manifests": st["parallel"]["manifests"]})
        ex.close()
    return rows


def test_nccl_all_reduce_inside_full_and_piecewise_graphs_equals_eager():
    rows = run_ranks(nccl_worker, 1, backend="nccl", timeout=240)[0].value
    checks = [r for r in rows if "diff" in r]
    for r in checks:
        assert r["diff"] <= 2e-2 * max(1.0, r["scale"]) and r["stable"], r
    summaries = [r for r in rows if "keys" in r]
    kinds = {k[0] for s in summaries for k in s["keys"]}
    assert kinds == {"full", "piecewise"}
    for s in summaries:
        for key, manifest in s["manifests"].items():
            assert any("c10d::allreduce_(bfloat16" in c for c in manifest), (key, manifest)
