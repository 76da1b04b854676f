"""Where a capture session's host time goes: the reference model's decode and piecewise
graphs (as `xgraph bench startup` captures them) under cProfile, warm-ups done first.

    python -m xgraph.bench.capture_profile --backend cuda --top 40 [--decode 1,2,4,8]
    python -m xgraph.bench.capture_profile --backend cuda --compare 3

Prints the capture's seconds, then the functions with the most own time and the most
cumulative time. `--compare N`: no profiler; N rounds in one process, each a session with
the per-op guard on every graph and one as the backend runs it (on a backend that claims
`capture_refuses_host_reads`, full graphs without the guard), alternating, so a host whose
speed drifts between processes compares like with like.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from xgraph.bench import startup_run as sr
from xgraph.buckets import sglang_piecewise_sizes, vllm_capture_sizes
from xgraph.models import Qwen3Model
from xgraph.plugins import get_backend


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cuda")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--decode", default="")
    p.add_argument("--compare", type=int, default=0)
    args = p.parse_args()
    backend = get_backend(args.backend)
    decode = [int(s) for s in args.decode.split(",")] if args.decode else vllm_capture_sizes(512)
    pieces = sglang_piecewise_sizes(2048)
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16
    model = Qwen3Model.build(args.model, num_blocks=1, dtype=dtype, device=backend.device)
    sr._kv_cache(model, backend, decode, pieces)
    if args.compare:
        return compare(backend, model, decode, pieces, args.compare)
    full, pw = _warm_executors(backend, model, decode, pieces)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    sr._capture_all(full, pw)
    prof.disable()
    seconds = time.perf_counter() - t0
    graphs = full.stats()["captures"] + pw.stats()["captures"]
    print(f"captured {graphs} graphs in {seconds:.2f} s (under cProfile)")
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof).sort_stats(key).print_stats(args.top)
    sr._close([full, pw])


def _warm_executors(backend, model, decode: list[int], pieces: list[int]) -> list:  # type: ignore[no-untyped-def]
    full, pw = sr._reference_executors(model, backend, decode, pieces)
    full.warm_up()
    pw.warm_up(kind="piecewise")
    return [full, pw]


def compare(backend, model, decode: list[int], pieces: list[int], rounds: int) -> None:  # type: ignore[no-untyped-def]
    """Capture sessions guarded everywhere against the backend's own way, alternating."""
    claimed = type(backend).capture_refuses_host_reads
    times: dict[str, list[float]] = {"guarded": [], "as run": []}
    for _ in range(rounds):
        for name in times:
            backend.capture_refuses_host_reads = claimed and name == "as run"
            full, pw = _warm_executors(backend, model, decode, pieces)
            t0 = time.perf_counter()
            sr._capture_all(full, pw)
            times[name].append(time.perf_counter() - t0)
            graphs = full.stats()["captures"] + pw.stats()["captures"]
            sr._close([full, pw])
    backend.capture_refuses_host_reads = claimed
    print(f"{graphs} graphs a session; capture_refuses_host_reads={claimed}")
    for name, ts in times.items():
        print(f"{name:8s} " + " ".join(f"{t:.2f}" for t in ts) + f"  min {min(ts):.2f} s")


if __name__ == "__main__":
    main()
