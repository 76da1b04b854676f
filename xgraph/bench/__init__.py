"""`xgraph bench`: memory modes and capture orders, prefill pieces, decode against anchors.

Every benchmark measures its anchors side by side in the same process and prints ratios;
times are GPU times (CUDA events) on accelerators, host wall times on the CPU backend
(which proves correctness, not speed).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import decode, memory, prefill
from .common import write_json

__all__ = ["add_parsers", "decode", "main", "memory", "prefill"]


def _sizes(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks: memory | prefill | decode | all")
    p.add_argument("which", choices=["memory", "prefill", "decode", "all"])
    p.add_argument("--backend", default=None)
    p.add_argument("--model", default="tiny", help="tiny | qwen3-0.6b")
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes (memory: capture sizes; prefill: step sizes; "
        "decode: batch sizes); defaults depend on the backend",
    )
    p.add_argument(
        "--max-size",
        type=int,
        default=None,
        help="memory: vLLM's capture sizes up to this (default 512 on GPUs, 128 on "
        "the CPU backend)",
    )
    p.add_argument(
        "--compile",
        default=None,
        help="decode: batch sizes to also run under torch.compile reduce-overhead",
    )
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here (bench all: a folder)")
    p.add_argument("--plot", default=None, help="memory: write a PNG plot here")
    p.add_argument("--out", default=None, help="bench all: folder for JSON, PNG and tables")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import xgraph

    from ..buckets import vllm_capture_sizes

    backend = xgraph.get_backend(args.backend)
    which = ["memory", "prefill", "decode"] if args.which == "all" else [args.which]
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
    report = []
    for name in which:
        if name == "memory":
            sizes = _sizes(args.sizes) if args.which == "memory" else None
            if sizes is None and args.max_size:
                sizes = vllm_capture_sizes(args.max_size)
            data = memory.run(backend, args.model, sizes)
            text = memory.summarize(data)
            plot_path = args.plot or (os.path.join(out, "memory.png") if out else None)
            if plot_path:
                memory.plot(data, plot_path)
        elif name == "prefill":
            data = prefill.run(
                backend,
                args.model,
                _sizes(args.sizes) if args.which == "prefill" else None,
                iters=args.iters or 10,
            )
            text = prefill.summarize(data)
        else:
            data = decode.run(
                backend,
                args.model,
                _sizes(args.sizes) if args.which == "decode" else None,
                iters=args.iters or 50,
                compile_batches=_sizes(args.compile),
            )
            text = decode.summarize(data)
        print(f"\n## bench {name}\n\n{text}\n", flush=True)
        report.append(f"## bench {name}\n\n{text}\n")
        write_json(os.path.join(out, f"{name}.json") if out else args.json, data)
    if out:
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write("\n".join(report))
    return 0
