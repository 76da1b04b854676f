"""What a transformers Qwen3's compile costs with its layers over the fused projections
(`GraphModel(fuse_layers=True)`, xgraph/integrations/transformers/fusions.py) against its
own layers: seconds from the GraphModel built to the first tokens (the two compiles of the
token classes, warm-ups and captures), each way in a fresh process with empty Inductor
caches, and whether the tokens agree.

    OUT=out python experiments/hf_fused_compile.py --backend cpu --layers 28
    OUT=out XGRAPH_CUDA_LINEAR=triton python experiments/hf_fused_compile.py --backend cuda

A tiny-width Qwen3 (transformers' config, random weights) with the layer count asked. On the
CPU backend, which has no fused kernel, the process gives it one that computes each fusion's
reference ops, so the layers take the fused form and Inductor compiles around it (C++
kernels): the compile's size, not its speed on a GPU. Unlike the other probes this one runs
without a GPU. Writes `$OUT/hf-fused-compile.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(backend: str, layers: int, fuse: bool) -> dict:
    """In this process: build, compile and generate once; the seconds and the tokens."""
    import torch
    import torch.nn.functional as F
    import transformers

    import xgraph
    from xgraph.fusion import reference
    from xgraph.integrations.transformers import GraphModel
    from xgraph.integrations.transformers.bench_runs import NAMED
    from xgraph.kernels import Kernels

    b = xgraph.get_backend(backend)
    if backend == "cpu":  # a fused kernel for the CPU backend: the fusions' reference ops
        k = Kernels(
            linear=lambda x, w: F.linear(x, w),
            fused_linear=lambda x, w, f: reference(x, w, f, F.linear),
        )
        b.kernels = lambda: k  # type: ignore[method-assign]
    # the transformers bench's "tiny" Qwen3 with the layer count asked
    cls_name, fields = NAMED["tiny"]
    config = getattr(transformers, cls_name)(**{**fields, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    if backend != "cpu":
        model = model.to(b.device, torch.bfloat16)
    limits = dict(block_size=4, max_model_len=64, max_seqs=4, max_num_tokens=8)
    t0 = time.perf_counter()
    with GraphModel(
        model,
        backend=b,
        compile=True,
        fuse_layers=fuse,
        compile_cache=False,
        buckets=[1, 2, 4, 8],
        **limits,
    ) as gm:
        t1 = time.perf_counter()
        tokens = gm.generate([[1, 2, 3, 4, 5]], max_new_tokens=3).tokens
        t2 = time.perf_counter()
        fused, compiles = gm.fused, gm.stats()["compile"].get("compiles")
    return {
        "fused": fused,
        "build_s": t1 - t0,
        "first_tokens_s": t2 - t1,
        "compiles": compiles,
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cpu")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--child", choices=["0", "1"], default=None)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(one(a.backend, a.layers, a.child == "1")))
        return
    runs = {}
    for fuse in ("0", "1"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="xgraph-ind-"))
        cmd = [sys.executable, __file__, "--backend", a.backend, "--layers", str(a.layers)]
        out = subprocess.run([*cmd, "--child", fuse], env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        runs["fused" if fuse == "1" else "own"] = json.loads(out.stdout.strip().splitlines()[-1])
        print(fuse, runs, flush=True)
    runs["tokens_equal"] = runs["fused"]["tokens"] == runs["own"]["tokens"]
    path = os.path.join(os.environ.get("OUT", "out"), "hf-fused-compile.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"backend": a.backend, "layers": a.layers, **runs}, f, indent=1)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
