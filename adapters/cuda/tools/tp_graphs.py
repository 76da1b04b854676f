"""Tensor-parallel graphs with the collectives inside, one process per device, under torchrun.

    OUT=out/dist bash scripts/device.sh dist     # every GPU of the machine, one process each
    torchrun --standalone --nproc-per-node 2 adapters/cuda/tools/tp_graphs.py --backend cuda
    torchrun --standalone --nproc-per-node 2 adapters/cuda/tools/tp_graphs.py --backend cpu \
      --quick                                      # a dry run on the CPU, gloo

Stages, each rank in step with the others (every stage is collective):

- tp: for the Qwen3-0.6B shape and an 8B-class shape (random weights; bf16 on GPUs), TP over
  every rank: decode through the executor at batch 1, 8, 64 with the all-reduces inside the
  graphs, and piecewise prefill. Each step's logits from the executor, eager, the TP forward
  captured by hand (torch.cuda.CUDAGraph; decode) and, over a group of one, the single-rank
  executor, each against a float32 copy of the same weights (relative norm of the
  difference). The criterion (xgraph.bench.distributed_fidelity, docs/distributed.md): in
  bf16 exec_vs_fp32 <= 1.25 * eager_vs_fp32 + 1e-3; in float32 the executor equals eager
  bit for bit; over a group of one the TP executor equals the single-rank executor bit for
  bit. Every number goes into the row; `equal` says whether the criterion holds. Step time
  per batch against TP=1 (the single-rank model on this device) and against the
  hand-captured graph; the agreement's host cost per step;
- memory: shared-physical graph memory per rank in ascending, random and largest-first
  order against the largest bucket alone (data memory; graph executables apart);
- desync: one rank's forward issues an all-reduce of another width: every rank must raise
  CollectiveMismatchError within the timeout (skipped with one rank);
- moe: data-parallel ranks with different token counts, one idle, through an
  expert-parallel MoE: agreed keys, outputs against eager.

Rank 0 writes $OUT/tp_graphs.json (every rank's results; written after each stage, so a
stage cut short keeps the earlier ones). The exit status is 0 only if every stage ran and
every row holds its criterion ("all stages ok" on every rank's last line). NVLink multicast
stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are
set here before NCCL starts (and by scripts/device.sh for every process it starts); nothing
here calls cuMulticastCreate.
With one process it runs as a world-size-1 group (NCCL on one GPU: the collectives are still
issued and captured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import xgraph
from xgraph.bench import distributed as bench
from xgraph.bench import distributed_checks as checks
from xgraph.bench import distributed_fidelity as fidelity
from xgraph.bench import hooks
from xgraph.buckets import vllm_capture_sizes

MOE_PLAN = [(3, 5), (0, 7), (6, 0), (4, 4), (1, 16)]  # tokens per rank; 0: idle
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def no_multicast() -> None:
    """NVLink multicast off before any communicator starts: forced, not defaulted, so a stray
    setting cannot turn it on (children inherit the environment)."""
    os.environ.update(NO_MULTICAST)


def stage(results: dict, name: str, fn: Any) -> None:
    """Run one stage into results[name]; a failure is recorded, never raised (the ranks
    stay in step only if every rank fails alike: the timeouts bound the rest)."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        traceback.print_exc()
    took = time.perf_counter() - t0
    print(f"[tp_graphs] rank {dist.get_rank()}: {name} done in {took:.1f} s", flush=True)


CRITERION = (
    f"bf16: exec_vs_fp32 <= {fidelity.RATIO} * eager_vs_fp32 + {fidelity.EPSILON} (relative "
    "norms of the logits' difference to a float32 copy of the same weights); float32: the "
    "executor equals eager bit for bit; world size 1: the TP executor equals the single-rank "
    "executor bit for bit"
)


def tp_stage(
    backend: Any, model: str, batches: list[int], prefill: list[int], iters: int, dtype: Any
) -> dict:
    group = dist.group.WORLD
    par = xgraph.Parallel(tp=group, timeout=120)
    accel = backend.device.type != "cpu"
    w, w1 = bench.workloads(backend, model, group, max(batches), 512 if accel else 64, dtype)
    try:
        out = {
            "dtype": str(w.cache.dtype).removeprefix("torch."),
            "criterion": CRITERION,
            "decode": bench.decode_rows(backend, w, w1, par, batches, iters),
            "prefill": bench.prefill_rows(backend, w, par, prefill, iters, w1),
        }
    finally:
        par.close()
    out["summary"] = fidelity.summary(out["decode"] + out["prefill"])
    del w, w1
    if accel:
        torch.cuda.empty_cache()
    return out


def write(path: str | None, results: dict) -> None:
    everyone = [results]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, results)
    if path and dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"ranks": everyone}, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=None)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--stages", default="tp,memory,desync,moe")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps (CPU dry run)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    args = p.parse_args(argv)
    no_multicast()
    out_dir = os.environ.get("OUT")
    path = os.path.join(out_dir, "tp_graphs.json") if out_dir else None
    backend = xgraph.get_backend(args.backend)
    rank, world, _ = bench.init_group(backend.device.type)
    backend = bench.rank_backend(backend)
    accel = backend.device.type != "cpu"
    models = ["tiny"] if args.quick else args.models.split(",")
    batches = [1, 4] if args.quick else [1, 8, 64]
    prefill = [16] if args.quick else [128, 512]
    iters = 3 if args.quick else args.iters
    stages = args.stages.split(",")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    results: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "device": hooks.device_name(backend),
    }
    results["env"] = {k: os.environ.get(k) for k in NO_MULTICAST}
    results["versions"] = {"torch": torch.__version__, "nccl": _nccl_version()}
    for m in models if "tp" in stages else []:
        stage(results, f"tp {m}", lambda m=m: tp_stage(backend, m, batches, prefill, iters, dtype))
        write(path, results)
    group = dist.group.WORLD
    small = "tiny" if args.quick else "qwen3-0.6b"
    if "memory" in stages:
        sizes = [1, 2, 4, 8] if args.quick else vllm_capture_sizes(64)
        par = xgraph.Parallel(tp=group, timeout=120)
        w, _ = bench.workloads(backend, small, group, max(sizes), 64 if args.quick else 512)
        stage(results, "memory", lambda: checks.memory_orders(backend, w, par, sizes))
        par.close()
        write(path, results)
    if "desync" in stages and world > 1:
        par = xgraph.Parallel(tp=group, timeout=30)
        w, _ = bench.workloads(backend, small, group, 8, 64)
        stage(results, "desync", lambda: checks.desync(backend, w, par))
        par.close()
        write(path, results)
    if "moe" in stages:
        dtype = torch.bfloat16 if accel else torch.float32
        stage(results, "moe", lambda: checks.moe(backend, group, MOE_PLAN, dtype))
        write(path, results)
    failed = _failures(results)
    verdict = "FAILED: " + ", ".join(failed) if failed else "all stages ok"
    print(f"[tp_graphs] rank {rank}: {verdict}", flush=True)
    dist.barrier()
    bench.release_group()  # every rank is past the barrier
    return 1 if failed else 0


def _nccl_version() -> str | None:
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:
        return None


def _failures(results: dict) -> list[str]:
    bad = []
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r and name != "desync":
            bad.append(name)
        rows = []
        if isinstance(r, dict):
            rows = r.get("decode", []) + r.get("prefill", [])
        elif isinstance(r, list):
            rows = r
        if any(isinstance(x, dict) and x.get("equal") is False for x in rows):
            what = "criterion" if name.startswith("tp ") else "outputs differ from eager"
            bad.append(f"{name} ({what} failed)")
    d = results.get("desync")
    if d is not None and d.get("error") != "CollectiveMismatchError":
        bad.append("desync (no CollectiveMismatchError)")
    return bad


if __name__ == "__main__":
    sys.exit(main())
