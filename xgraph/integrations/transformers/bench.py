"""Benchmark: a transformers model through xgraph against transformers' own generate(), and
against the reference model of the same shape.

    python -m xgraph.integrations.transformers.bench --backend cuda --model qwen3-0.6b \\
        --parts compile --json out/compile.json                  # about 5 minutes on an H200
    python -m xgraph.integrations.transformers.bench --backend cuda --model qwen3-0.6b \\
        --parts check,decode,ttft --json out/generate.json       # about 4 minutes
    python -m xgraph.integrations.transformers.bench --merge out/compile.json \\
        out/generate.json --json transformers.json               # no device

One model (a local folder, or a config name with random weights: tiny, qwen3-0.6b,
tiny-llama, llama-3.2-1b), the same weights on both sides. Parts (`--parts`, comma list,
default all; each checkpointed into --json as it ends):

- check: a multi-sequence chunked-prefill + decode run through xgraph against transformers'
  full-sequence forward (sdpa), every logit of every step;
- decode: decode tokens per second at each --batches size, xgraph (GraphModel, compiled
  with --compiler, decode as full graphs) against transformers' generate() with its static
  cache, compiled with torch.compile on a GPU (--hf-compile);
- ttft: time to first token of --ttft cases (N x L: N prompts of L tokens at once), the
  same two;
- compile: compile + capture of --capture-sizes decode sizes (vLLM's 51) with one compile,
  capture without compile, and per-size compiles at --compare sizes, for the transformers
  model and for the reference model; their decode steps at the --compare sizes
  (bench_compile.py).

check, decode and ttft share one GraphModel (one compile). On the CPU backend with the tiny
config it is a quick check that everything runs; its numbers say nothing about
accelerators.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...buckets import default_sizes, vllm_capture_sizes
from ...errors import XGraphError
from ...plugins import get_backend
from .bench_compile import run_compile
from .bench_report import report
from .bench_runs import NAMED, build_named, check_logits, transformers_decode, xgraph_decode
from .bench_ttft import parse_cases, ttft_rows, xgraph_ttft
from .deps import require
from .loading import DTYPES, load_model
from .model import GraphModel

PARTS = ("check", "decode", "ttft", "compile")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m xgraph.integrations.transformers.bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--backend", default=None, help="backend name (default: the best available)")
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a local model folder, or a config name with random weights: {', '.join(NAMED)}",
    )
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bf16 on GPUs")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument(
        "--compiler",
        default=None,
        help="torch.compile backend of xgraph's compiled forward: inductor (default on "
        "accelerators), aot_eager, eager, or none (not compiled; the default on the CPU)",
    )
    p.add_argument("--batches", default="1,32", help="decode: comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="decode: tokens generated")
    p.add_argument("--iters", type=int, default=3, help="timed runs per measurement (best kept)")
    p.add_argument(
        "--steps-per-launch",
        type=int,
        default=1,
        help="decode: also K steps per launch (GraphModel.generate(steps_per_launch=K))",
    )
    p.add_argument("--ttft", default="1x2048,16x128", help="ttft: cases, N x L each")
    p.add_argument(
        "--capture-sizes",
        default=None,
        help="compile: decode sizes to capture (default: vLLM's 51 up to 512; CPU: up to 32)",
    )
    p.add_argument("--compare", default=None, help="compile: sizes timed (default 1,8,64)")
    p.add_argument("--step-iters", type=int, default=30, help="compile: timed steps per size")
    p.add_argument(
        "--hf-compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile transformers' generate (auto: on for CUDA only)",
    )
    p.add_argument("--tolerance", type=float, default=None, help="check: see docs")
    p.add_argument("--json", default=None, help="write the results here (as each part ends)")
    p.add_argument("--merge", nargs="+", default=None, help="merge these JSON files into --json")
    p.add_argument(
        "--warm-caches",
        action="store_true",
        help="keep torch.compile's caches (default: fresh ones, so compile times are cold)",
    )
    return p.parse_args(argv)


def sizes(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise XGraphError(f"{what} {text!r}: give sizes such as 1,32") from None
    if not out or min(out) < 1:
        raise XGraphError(f"{what} {text!r}: sizes must be positive")
    return out


def _parts(text: str) -> list[str]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise XGraphError(f"--parts {text!r}: choose from {', '.join(PARTS)}")
    return parts


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


def _compiler(args: argparse.Namespace, device: torch.device) -> str | None:
    name = args.compiler or ("none" if device.type == "cpu" else "inductor")
    return None if name == "none" else name


def _serving_model(
    model: Any, backend: Any, args: argparse.Namespace, compiler: str | None
) -> GraphModel:
    """The GraphModel check, decode and ttft share: every decode batch, every ttft case."""
    batches = sizes(args.batches, "--batches")
    cases = parse_cases(args.ttft)
    seqs = max([*batches, *(n for n, _ in cases), 3])
    longest = max([args.prompt_len + args.new_tokens, *(n + 1 for _, n in cases)])
    budget = max(n * length for n, length in cases)
    blocks = max(
        max(batches) * -(-(args.prompt_len + args.new_tokens) // 16),
        max(n * -(-(length + 1) // 16) for n, length in cases),
        3 * -(-(args.prompt_len + 8) // 16),
    )
    buckets = sorted({*default_sizes(max(seqs, 8)), 128, 256, 512, 1024, 2048, budget})
    return GraphModel(
        model,
        backend=backend,
        buckets=[b for b in buckets if b <= budget],
        block_size=16,
        max_model_len=longest,
        max_seqs=seqs,
        num_blocks=blocks,
        max_num_tokens=budget,
        compile=compiler or False,
        name="bench",
    )


def _xgraph_decode(gm: GraphModel, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One step a launch, and with --steps-per-launch K > 1 also K a launch (`xgraph_k`,
    its tokens compared with the single steps')."""
    x = xgraph_decode(gm, batch, args.prompt_len, args.new_tokens, args.iters)
    one = x.pop("tokens")
    row: dict[str, Any] = {"xgraph": x}
    k = args.steps_per_launch
    if k > 1:
        xk = xgraph_decode(gm, batch, args.prompt_len, args.new_tokens, args.iters, k)
        xk.update(steps_per_launch=k, tokens_equal=xk.pop("tokens") == one)
        row["xgraph_k"] = xk
    return row


def _generate_parts(
    data: dict[str, Any], parts: list[str], gm: GraphModel, reference: Any, args: Any, save: Any
) -> None:
    compile_hf = data["transformers_compile"]
    if "check" in parts:
        check = check_logits(gm, reference, args.prompt_len)
        check["passed"] = _passed(check, gm.spec.dtype, args.tolerance)
        data["check"] = check
        save()
    # xgraph's runs (every batch, every ttft case) before transformers' compiled generate()
    # runs at all: captures and replays after transformers' reduce-overhead compile (torch's
    # CUDA graph trees) in the same process met an illegal memory access on an H200 (torch
    # 2.11; docs/transformers.md, limits), not yet explained
    batches = sizes(args.batches, "--batches") if "decode" in parts else []
    cases = parse_cases(args.ttft) if "ttft" in parts else []
    decode = [_xgraph_decode(gm, b, args) for b in batches]
    ttft = [xgraph_ttft(gm, n, length, args.iters) for n, length in cases]
    if "decode" in parts:
        data["decode"] = []
        for b, row in zip(batches, decode):
            t = transformers_decode(
                reference, b, args.prompt_len, args.new_tokens, args.iters, compile_hf
            )
            rate = t["decode_tokens_per_second"] or None
            row["speedup"] = rate and row["xgraph"]["decode_tokens_per_second"] / rate
            if "xgraph_k" in row:
                row["speedup_k"] = rate and row["xgraph_k"]["decode_tokens_per_second"] / rate
            data["decode"].append({"batch": b, **row, "transformers": t})
            save()
    if "ttft" in parts:
        data["ttft"] = ttft_rows(reference, cases, ttft, args.iters, compile_hf)
        save()
    data["graph_model"] = {k: v for k, v in gm.stats().items() if k in ("compile", "head")}


def run(args: argparse.Namespace, checkpoint: Any = None) -> dict[str, Any]:
    """Every part asked for; `checkpoint(data)` after each (a run cut short keeps them)."""
    transformers = require()
    parts = _parts(args.parts)
    backend = get_backend(args.backend)
    model, dtype = _load(args, backend.device)
    compiler = _compiler(args, backend.device)
    data: dict[str, Any] = {
        "model": args.model,
        "model_class": type(model).__name__,
        "dtype": str(dtype),
        "backend": backend.name,
        "device": backend.device_name(),
        "parts": parts,
        "compiler": compiler,
        "transformers_compile": args.hf_compile == "on"
        or (args.hf_compile == "auto" and backend.device.type == "cuda"),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "iters": args.iters,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "seconds": {},
    }

    def save() -> None:
        if checkpoint is not None:
            checkpoint(data)

    if "compile" in parts:  # first: the compile times are those of a cold process
        t0 = time.perf_counter()
        cap = args.capture_sizes
        every = sizes(cap, "--capture-sizes") if cap else _default_capture(backend)
        compare = sizes(args.compare or "1,8,64", "--compare")
        data["compile"] = run_compile(
            model, backend, every, compare, compiler or "inductor", args.step_iters
        )
        data["seconds"]["compile"] = time.perf_counter() - t0
        save()
    if any(p in parts for p in ("check", "decode", "ttft")):
        t0 = time.perf_counter()
        reference = copy.deepcopy(model)  # transformers' own attention, same weights
        reference.set_attn_implementation("sdpa")
        with _serving_model(model, backend, args, compiler) as gm:
            _generate_parts(data, parts, gm, reference, args, save)
        data["seconds"]["generate"] = time.perf_counter() - t0
    return data


def _default_capture(backend: Any) -> list[int]:
    return vllm_capture_sizes(512) if backend.device.type != "cpu" else vllm_capture_sizes(32)


def _fresh_caches() -> str:
    """torch.compile's on-disk caches in a fresh folder: the compiles measured are cold."""
    root = tempfile.mkdtemp(prefix="xgraph-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    return root


def _write(path: str | None, data: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)


def merge(paths: list[str]) -> dict[str, Any]:
    """One result of several runs' JSON (each part from the run that measured it)."""
    out: dict[str, Any] = {"merged_from": paths, "seconds": {}}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for k, v in d.items():
            if k == "seconds":
                out["seconds"].update(v)
            elif k == "parts":
                out["parts"] = [*out.get("parts", []), *v]
            else:
                out[k] = v
    out.pop("partial", None)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.merge:
            data = merge(args.merge)
        else:
            if not args.warm_caches:
                _fresh_caches()
            data = run(args, lambda d: _write(args.json, {**d, "partial": True}))
    except XGraphError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    print(report(data))
    _write(args.json, data)
    return 0 if data.get("check", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
