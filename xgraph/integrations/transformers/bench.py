"""Benchmark: a transformers model through xgraph against transformers' own generate().

    python -m xgraph.integrations.transformers.bench --backend cuda --model qwen3-0.6b \\
        --batches 1,32 --json out/transformers.json

One run, one model (a local folder, or a config name with random weights: tiny,
qwen3-0.6b), the same weights on both sides:

1. the logits check: a multi-sequence chunked-prefill + decode run through xgraph against
   transformers' full-sequence forward (sdpa), every logit of every step;
2. decode tokens per second at each batch size: xgraph (decode as full graphs) and
   transformers' generate() with its static cache, compiled with torch.compile on a GPU
   (generate compiles a static-cache forward itself; --hf-compile off disables it).

On the CPU backend with the tiny config it is a quick check that everything runs
(`--backend cpu --model tiny --batches 1,2 --prompt-len 16 --new-tokens 8`); its numbers
say nothing about accelerators.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import XGraphError
from ...plugins import get_backend
from .bench_runs import NAMED, build_named, check_logits, transformers_decode, xgraph_decode
from .deps import require
from .loading import DTYPES, load_model


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m xgraph.integrations.transformers.bench", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--backend",
        default=None,
        help="backend name (default: XGRAPH_BACKEND, else the best available one)",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a local model folder, or a config name with random weights: {', '.join(NAMED)}",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="default: bfloat16 on accelerators, float32 on the CPU backend",
    )
    p.add_argument("--batches", default="1,32", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--iters", type=int, default=3, help="timed runs per measurement (best kept)")
    p.add_argument(
        "--hf-compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile transformers' generate (auto: on for CUDA only)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="float32: the largest |logit difference| from transformers (default "
        "1e-4); 16-bit: how many times transformers' own distance from float32 "
        "logits xgraph's may be (default 2)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def _batches(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise XGraphError(f"--batches {text!r}: give sizes such as 1,32") from None
    if not sizes or min(sizes) < 1:
        raise XGraphError(f"--batches {text!r}: sizes must be positive")
    return sizes


def _passed(check: dict[str, Any], dtype: torch.dtype, tolerance: float | None) -> bool:
    """float32: within `tolerance` (1e-4) of transformers. 16-bit: no farther from the
    float32 logits than `tolerance` (2) times transformers' own 16-bit distance to them."""
    if dtype == torch.float32:
        return check["max_abs_diff"] <= (tolerance or 1e-4)
    return check["xgraph_vs_float32"] <= (tolerance or 2.0) * check["transformers_vs_float32"]


def _load(args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.dtype]:
    dtype = (
        DTYPES[args.dtype]
        if args.dtype
        else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    )
    if args.model in NAMED:
        return build_named(args.model, dtype, device), dtype
    if os.path.isdir(args.model):
        return load_model(args.model, dtype=dtype, device=device), dtype
    raise XGraphError(f"--model {args.model!r} is neither a folder nor one of {list(NAMED)}.")


def run(args: argparse.Namespace) -> dict[str, Any]:
    transformers = require()
    backend = get_backend(args.backend)
    model, dtype = _load(args, backend.device)
    reference = copy.deepcopy(model)  # transformers' own attention, same weights
    reference.set_attn_implementation("sdpa")
    compile_hf = args.hf_compile == "on" or (
        args.hf_compile == "auto" and backend.device.type == "cuda"
    )
    check = check_logits(model, reference, backend, args.prompt_len)
    check["passed"] = _passed(check, dtype, args.tolerance)
    rows = []
    for b in _batches(args.batches):
        x = xgraph_decode(model, backend, b, args.prompt_len, args.new_tokens, args.iters)
        t = transformers_decode(
            reference, b, args.prompt_len, args.new_tokens, args.iters, compile_hf
        )
        ratio = (
            x["decode_tokens_per_second"] / t["decode_tokens_per_second"]
            if t["decode_tokens_per_second"]
            else None
        )
        rows.append({"batch": b, "xgraph": x, "transformers": t, "speedup": ratio})
    return {
        "model": args.model,
        "model_class": type(model).__name__,
        "dtype": str(dtype),
        "backend": backend.name,
        "device": str(backend.device),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "iters": args.iters,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "check": check,
        "decode": rows,
    }


def report(data: dict[str, Any]) -> str:
    c = data["check"]
    lines = [
        f"{data['model']} ({data['model_class']}, {data['dtype']}) on {data['backend']}",
        f"check: max |xgraph - transformers| = {c['max_abs_diff']:.3g} (largest logit "
        f"{c['max_abs_logit']:.3g}), argmax agreement {c['argmax_agreement']:.4f} over "
        f"{c['rows']} rows: {'pass' if c['passed'] else 'FAIL'}",
        *(
            [
                f"distance from float32 logits: xgraph {c['xgraph_vs_float32']:.3g}, transformers "
                f"{c['transformers_vs_float32']:.3g}"
            ]
            if "xgraph_vs_float32" in c
            else []
        ),
        f"{'batch':>5}  {'xgraph tok/s':>13}  {'transformers tok/s':>18}  {'ratio':>6}",
    ]
    for r in data["decode"]:
        ratio = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        lines.append(
            f"{r['batch']:>5}  {r['xgraph']['decode_tokens_per_second']:>13.1f}  "
            f"{r['transformers']['decode_tokens_per_second']:>18.1f}  {ratio:>6}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = run(args)
    except XGraphError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    print(report(data))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0 if data["check"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
