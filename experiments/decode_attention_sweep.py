"""The CUDA adapter's one-launch decode attention (store, attention, merge) over launch
configurations: K/V splits, key tile, warps and pipeline stages, per model shape and batch,
as a decode step calls it (one query token per sequence, the step's k/v stored by the
kernel, contexts of 1 to `--context` tokens drawn as the reference workload draws them, in
tables `--width` tokens wide on shuffled 16-token blocks).

    OUT=out python experiments/decode_attention_sweep.py --models qwen3-0.6b --batches 1,8,64

Per configuration: device us per call, replayed from a CUDA graph of one call per layer
(`--layers` caches, so each call reads its keys from memory, not L2); the K/V bytes the
calls read against the copy bandwidth; the relative error against the core's reference
runner and whether two calls give the same bits. Launches without PDL: a configuration's
worth inside the step under PDL is a `decode_variants.py` question. Writes
`$OUT/decode-attention-sweep.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
from typing import Any

import torch
from xgraph_cuda.kernels import arena, pdl_options, sm_count
from xgraph_cuda.kernels.decode import paged_decode
from xgraph_cuda.triton_runners import auto_splits, decode_tiles

from xgraph.metadata import AttentionInputs
from xgraph.models import Qwen3Config
from xgraph.runners import PagedDecodeRunner

# the kernel sweep's graph timing and copy bandwidth, reused
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "cuda", "tools"))
import bench_kernels

PAGE = 16


def inputs(model: str, batch: int, context: int, width: int, layers: int, seed: int) -> dict:
    """A decode step's metadata, `layers` random bf16 caches and the step's q, k, v."""
    c = Qwen3Config.named(model)
    rng = random.Random(seed)
    lens = [rng.randint(1, context) for _ in range(batch)]
    per = width // PAGE
    blocks = list(range(batch * per))
    rng.shuffle(blocks)
    dummy = batch * per
    tables = [blocks[i * per : i * per + -(-n // PAGE)] for i, n in enumerate(lens)]
    slots = [t[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for t, n in zip(tables, lens)]
    padded = [t + [dummy] * (per - len(t)) for t in tables]
    dev = torch.device("cuda")
    md = AttentionInputs([1] * batch, lens, padded, slots).metadata(dev, fill_block=dummy)
    shape = (dummy + 1, PAGE, c.num_kv_heads, c.head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=dev).bfloat16()

    return {
        "md": md,
        "caches": [(rand(*shape), rand(*shape)) for _ in range(layers)],
        "q": rand(batch, c.num_heads, c.head_dim),
        "k": rand(batch, c.num_kv_heads, c.head_dim),
        "v": rand(batch, c.num_kv_heads, c.head_dim),
        "kv_bytes": sum(lens) * c.num_kv_heads * c.head_dim * 2 * 2,
    }


def call(x: dict, cache: Any, out: torch.Tensor, cfg: dict) -> None:
    """One fused decode-attention launch under `cfg` (splits, block_n, warps, stages)."""
    md, q = x["md"], x["q"]
    splits = cfg["splits"]
    paged_decode(
        q,
        cache,
        md.seq_lens,
        md.block_tables,
        out,
        q.shape[-1] ** -0.5,
        splits,
        cfg["block_n"],
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
        store=(x["k"], x["v"], md.slot_mapping),
        counts=arena.counts(q.device) if splits > 1 else None,
        pdl=pdl_options(),
    )


def median_us(fn: Any, calls: int) -> float:
    """Device us per call of `fn` (`calls` calls) replayed from a CUDA graph (the kernel
    sweep's timing), the median of five captures."""
    return statistics.median(bench_kernels.graph_us(fn, calls) for _ in range(5))


def reference(x: dict) -> torch.Tensor:
    """The core's reference runner on the first cache (it stores the same k, v)."""
    runner = PagedDecodeRunner()
    runner.plan(x["md"])
    ref = torch.empty_like(x["q"])
    runner.run(x["q"], x["k"], x["v"], ref, x["caches"][0], x["q"].shape[-1] ** -0.5)
    return ref.float()


def measure(x: dict, cfg: dict, ref: torch.Tensor, bw: float) -> dict:
    """One configuration's row: us per call, bandwidth share, error, repeatability."""
    row: dict[str, Any] = dict(cfg)
    try:
        out = torch.empty_like(x["q"])
        call(x, x["caches"][0], out, cfg)
        first = out.clone()
        call(x, x["caches"][0], out, cfg)
        row["repeat"] = bool(torch.equal(first, out))
        row["err"] = float((first.float() - ref).norm() / ref.norm())
        row["us"] = median_us(lambda: [call(x, c, out, cfg) for c in x["caches"]], len(x["caches"]))
        row["of_copy"] = x["kv_bytes"] / (row["us"] * 1e-6) / bw
    except Exception as exc:  # a configuration that does not compile or fit is a row too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def grid(args: argparse.Namespace, batch: int, hkv: int, sms: int) -> list[dict]:
    """The configurations of one batch: the runner's own launch first."""
    splits = auto_splits(batch * hkv, args.width, sms, 64)
    block_n, stages = decode_tiles(batch * hkv, splits, args.width, sms)
    default = {"splits": splits, "block_n": block_n, "warps": 4, "stages": stages}
    default["default"] = True
    out = [default]
    for s, n, w, st in itertools.product(
        [int(v) for v in args.splits.split(",")],
        [int(v) for v in args.block_n.split(",")],
        [int(v) for v in args.warps.split(",")],
        [int(v) for v in args.stages.split(",")],
    ):
        cfg = {"splits": s, "block_n": n, "warps": w, "stages": st}
        if any(all(d[k] == cfg[k] for k in cfg) for d in out):
            continue
        out.append(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=256, help="longest context drawn")
    p.add_argument("--width", type=int, default=512, help="table width in tokens")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", default="1,2,3")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    sms, bw = sm_count(dev), bench_kernels.copy_bandwidth()
    data: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bytes_s": bw}
    data["args"], data["rows"] = vars(a), []
    for model, batch in itertools.product(a.models.split(","), map(int, a.batches.split(","))):
        x = inputs(model, batch, a.context, a.width, a.layers, seed=batch)
        ref = reference(x)
        hkv = x["k"].shape[1]
        rows = [measure(x, cfg, ref, bw) for cfg in grid(a, batch, hkv, sms)]
        for r in rows:
            r |= {"model": model, "batch": batch}
        data["rows"] += rows
        done = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        base = next(r for r in rows if r.get("default"))
        print(f"{model} b={batch}: default {base.get('us', float('nan')):.2f} us", flush=True)
        for r in done[:6]:
            print(f"   {r['us']:7.2f} us {r['of_copy']:.2f} err {r['err']:.1e} {r}", flush=True)
        del x
        save(data)  # after each batch: a run cut short keeps what it measured
    return 0


def save(data: dict) -> None:
    path = os.path.join(os.environ.get("OUT", "."), "decode-attention-sweep.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
