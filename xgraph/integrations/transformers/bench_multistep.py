"""Several decode steps per launch against one step at a time, through the engine loop.

    python -m xgraph.integrations.transformers.bench_multistep --backend cuda \
        --model qwen3-0.6b --batches 1,32 --k 1,8 --json multistep.json

For each batch size: decode tokens per second of GraphModel.generate with one step per
engine step (the host samples between steps) and with K steps per launch, the same prompts
and model, greedy; whether the tokens are equal; the per-token time against the device
time of one decode step (one graph replay of the single-step executor) and of one step
inside a launch (the launch's device time / K), and what is left of a launch's time per
token beyond its device time (`host_ms_per_launch`); and the kernels of one graph step
against those of one launch / K (`kernels`: from a device trace where the profiler traces
the device, else the backend's recording of each graph, xgraph.bench.step_kernels). The
JSON has one row per (batch, K): {batch, k, tokens_per_s, single_step_tokens_per_s,
speedup, tokens_equal, ..., kernels}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from typing import Any

import torch

from ...bench.kernel_trace import profile_steps
from ...bench.step_kernels import recorded
from ...bench.timing import Timer
from ...metadata import AttentionInputs
from .bench_runs import build_named, random_prompts
from .model import GraphModel


def _rate(gm: GraphModel, prompts: list[list[int]], new: int, k: int, iters: int) -> tuple:
    gm.generate(prompts, new, steps_per_launch=k)  # warm-up: every graph captured
    best, tokens = 0.0, None
    for _ in range(iters):
        r = gm.generate(prompts, new, steps_per_launch=k)
        best = max(best, r.decode_rate())
        tokens = r.tokens
    return best, tokens


def _decode_inputs(gm: GraphModel, batch: int, prompt_len: int) -> tuple:
    """A decode step of `batch` sequences at position prompt_len over cache blocks 0..."""
    bs = gm.limits.block_size
    per = -(-(prompt_len + 1) // bs)
    rows = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    slots = [r[prompt_len // bs] * bs + prompt_len % bs for r in rows]
    ids = torch.ones(batch, dtype=torch.int64)
    pos = torch.full((batch,), prompt_len, dtype=torch.int64)
    attn = AttentionInputs([1] * batch, [prompt_len + 1] * batch, rows, slots)
    return ids, pos, attn


def step_seconds(gm: GraphModel, batch: int, prompt_len: int, k: int) -> dict[str, float]:
    """Device seconds of one single-step decode graph, of the LM head and argmax after it
    (eager, as the engine runs them), and of one K-step launch."""
    timer = Timer(gm.backend)
    ids, pos, attn = _decode_inputs(gm, batch, prompt_len)
    out = gm.step(ids, pos, attn)  # captured already by the runs; a replay now
    one = min(timer.once(lambda: gm.step(ids, pos, attn)) for _ in range(10))
    # what every token costs besides the graph step, one step at a time or in a launch
    head = min(timer.once(lambda: gm.logits(out).argmax(-1)) for _ in range(10))
    loop = gm.decode_loop(k)
    kw = dict(budget=[k] * batch, stop_ids=None)
    loop(ids, pos, attn, **kw)
    launch = min(timer.once(lambda: loop(ids, pos, attn, **kw)) for _ in range(5))
    on = bool(timer.on_device)
    return {"graph_step_s": one, "head_s": head, "launch_s": launch, "on_device": on}


def kernel_counts(gm: GraphModel, batch: int, prompt_len: int, k: int) -> dict[str, Any]:
    """Kernels of one single-step decode graph and of one K-step launch (and per step): a
    device trace's where the profiler traces the device (with each one's busy time and
    the launch's longest kernels), else the recordings' launches (the CPU backend's ops)."""
    ids, pos, attn = _decode_inputs(gm, batch, prompt_len)
    loop = gm.decode_loop(k)
    kw: dict[str, Any] = dict(budget=[k] * batch, stop_ids=None)
    one = profile_steps(gm.backend, lambda: gm.step(ids, pos, attn))
    out: dict[str, Any]
    if one is not None:
        launch = profile_steps(gm.backend, lambda: loop(ids, pos, attn, **kw), steps=3)
        assert launch is not None
        out = {"source": "device trace", "graph_step": one["kernels"], "launch": launch["kernels"]}
        out["graph_step_busy_us"] = one["busy_us"]
        out["launch_busy_us_per_step"] = launch["busy_us"] / k
        out["launch_top_kernels_us"] = launch["top_kernels_us"]
    else:
        sampled, x = loop.prepare(ids, pos, attn, **kw)
        out = {
            "source": "recorded ops",
            "graph_step": recorded(gm.executor, attn, input_ids=ids, positions=pos),
            "launch": recorded(loop.executor(sampled), **x),
        }
    if out["launch"] is not None:
        out["launch_per_step"] = out["launch"] / k
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    model = build_named(args.model, dtype, torch.device(args.device))
    gm = GraphModel(
        model,
        backend=args.backend,
        compile=args.compile,
        max_seqs=max(args.batches),
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_tokens=max(args.batches) * args.prompt_len,
    )
    rows = []
    for batch in args.batches:
        prompts = random_prompts(gm.spec.vocab_size, [args.prompt_len] * batch, seed=2)
        single, want = _rate(gm, prompts, args.new_tokens, 1, args.iters)
        for k in args.k:
            rate, got = _rate(gm, prompts, args.new_tokens, k, args.iters)
            t = step_seconds(gm, batch, args.prompt_len, k)
            # one sequence's time between tokens: what a graph step (all rows at once) bounds
            per_token = batch / rate if rate else float("inf")
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    "tokens_per_s": rate,
                    "single_step_tokens_per_s": single,
                    "speedup": rate / single if single else None,
                    "tokens_equal": got == want,
                    "per_token_ms": per_token * 1e3,
                    "graph_step_ms": t["graph_step_s"] * 1e3,
                    "head_and_argmax_ms": t["head_s"] * 1e3,
                    "launch_step_ms": t["launch_s"] * 1e3 / k,
                    "per_token_over_graph_step": per_token / t["graph_step_s"],
                    # a step in a launch runs the head and the choice too; the graph step not
                    "per_token_over_step_and_head": per_token / (t["graph_step_s"] + t["head_s"]),
                    # what a launch costs beyond its device time: the host's part, not hidden
                    "host_ms_per_launch": (per_token - t["launch_s"] / k) * k * 1e3,
                    "device_timed": t["on_device"],
                    "kernels": kernel_counts(gm, batch, args.prompt_len, k),
                }
            )
            print(_line(rows[-1]), flush=True)
    gm.close()
    meta = {"model": args.model, "dtype": args.dtype, "compile": bool(args.compile)}
    return {**meta, "rows": rows, "commit": _commit()}


def _line(r: dict[str, Any]) -> str:
    return (
        f"batch {r['batch']:>3} K {r['k']:>2}: {r['tokens_per_s']:9.1f} tok/s vs "
        f"{r['single_step_tokens_per_s']:9.1f} one step at a time ({r['speedup']:.2f}x), "
        f"tokens equal {r['tokens_equal']}, per token {r['per_token_ms']:.3f} ms, graph step "
        f"{r['graph_step_ms']:.3f} ms (+ head {r['head_and_argmax_ms']:.3f} ms: "
        f"{r['per_token_over_step_and_head']:.2f}x per token), "
        f"in a launch {r['launch_step_ms']:.3f} ms; kernels: "
        f"{r['kernels']['graph_step']} per graph step, "
        f"{r['kernels'].get('launch_per_step', '?')} per step in a launch"
    )


def _commit() -> str | None:
    """HEAD of the checkout, or $XGRAPH_COMMIT where the tree was copied without git."""
    if os.environ.get("XGRAPH_COMMIT"):
        return os.environ["XGRAPH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive ints, comma separated")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=None)
    p.add_argument("--device", default="cpu", help="where the model is built before the move")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compile", action="store_true", help="the decoder under torch.compile")
    p.add_argument("--batches", type=_ints, default=[1, 32])
    p.add_argument("--k", type=_ints, default=[8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
