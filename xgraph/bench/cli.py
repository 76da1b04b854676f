"""`xgraph bench ...` on the command line: the options, and one runner per benchmark."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ..buckets import sglang_piecewise_sizes, vllm_capture_sizes
from ..cli_types import PIECEWISE_MIN, piecewise_max, positive_float, positive_int, sizes
from ..interfaces import Backend
from . import (
    decode,
    distributed,
    host,
    memory,
    memory_plot,
    pipeline,
    prefill,
    sleep,
    soak,
    startup,
    startup_targets,
    target_families,
)
from .report import Checkpoint, write_json

BENCHMARKS = ("memory", "prefill", "decode")  # what `bench all` runs
EXTRA = ("soak", "host", "distributed", "pipeline", "sleep", "startup")  # run on their own
# the benchmarks each option is read by: given to another one, it is refused, not ignored
USED_BY = {
    "sizes": (
        "memory",
        "prefill",
        "decode",
        "host",
        "distributed",
        "pipeline",
        "sleep",
        "startup",
    ),
    "max_size": ("memory", "prefill"),
    "compile": ("prefill", "decode"),
    "table_check": ("decode",),
    "piecewise_max": ("memory", "sleep", "startup"),
    "iters": ("prefill", "decode", "host", "distributed", "pipeline", "sleep"),
    "kv_cache_gib": ("sleep",),
    "steps": ("soak",),
    "memory": ("soak",),
    "plot": ("memory",),
    "targets": ("startup",),
    "process": ("startup",),
    "t0": ("startup",),
    "pieces": ("startup",),
}


def _compile_sizes(text: str) -> list[int]:
    """--compile's sizes; "none" (or "off") turns the compiled rows off."""
    if text.strip().lower() in ("none", "off"):
        return []
    return sizes(text)


def _names(
    allowed: tuple[str, ...] | Callable[[], tuple[str, ...]],
) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of names from `allowed` (or from what it returns when the line
    is parsed: the families registered by then), as an argparse type."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        choices = allowed() if callable(allowed) else allowed
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return names

    return parse


def _add_decode_and_memory_options(p: argparse.ArgumentParser) -> None:
    """Options of `bench decode` (the width check, the compiled rows), then bench memory's."""
    p.add_argument(
        "--table-check",
        type=positive_int,
        default=None,
        metavar="BATCH",
        help="decode: also run BATCH sequences of 512 tokens with block tables 512 and 4096 "
        "tokens wide (the step-time ratio of the two)",
    )
    p.add_argument(
        "--compile-scope",
        default="layers",
        choices=["layers", "forward"],
        help="decode: what xgraph's compiled row compiles (layers: each decoder layer, one "
        "graph they share; forward: the whole forward as one graph, as reduce-overhead does)",
    )
    p.add_argument(
        "--compile-buckets",
        default="one",
        choices=list(decode.COMPILE_BUCKETS),
        help="decode: xgraph's compiled row compiles once for every batch size (one: the "
        "token count dynamic), once per batch size (per-size: static shapes), both rows, or "
        "none (only reduce-overhead is compiled)",
    )
    p.add_argument(
        "--anchor-kernels",
        default="torch",
        choices=list(decode.ANCHOR_KERNELS),
        help="decode: the reduce-overhead anchor's kernels (torch: torch's own, what "
        "torch.compile gives a model without xgraph; xgraph: the backend's kernels)",
    )
    _add_memory_options(p)


def _add_memory_options(p: argparse.ArgumentParser) -> None:
    """Options of `bench memory` (models, kinds, modes), some shared with sleep and startup."""
    p.add_argument(
        "--models",
        default=None,
        type=_names(target_families),
        help="memory: model families, comma-separated (default: every registered one; "
        "reference: the reference model; hf-llama, which the transformers integration "
        "registers: transformers' LlamaForCausalLM through it, skipped without transformers)",
    )
    p.add_argument(
        "--kinds",
        default="full,piecewise",
        type=_names(memory.KINDS),
        help="memory: graph kinds, comma-separated (full: decode graphs; piecewise: prefill)",
    )
    p.add_argument(
        "--piecewise-max",
        type=piecewise_max,
        default=None,
        help="memory: piecewise graphs at SGLang-style sizes (4 and up) up to this (default "
        "2048 for the reference and 1024 for hf-llama on accelerators, 128 on the CPU "
        "backend); sleep, startup: the piecewise executor's sizes (default 2048; on the CPU "
        "backend 64 for sleep, 32 for startup)",
    )
    p.add_argument(
        "--all-modes",
        action="store_true",
        help="memory: also capture into shared-pool and private memory (default: "
        "shared-physical only)",
    )


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: memory | prefill | decode | all | soak | host | distributed | "
        "pipeline | sleep | startup",
    )
    p.add_argument(
        "which",
        choices=[*BENCHMARKS, "all", *EXTRA],
        help="which benchmark to run (all: memory, prefill and decode)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="backend name (default: XGRAPH_BACKEND, else the best available one)",
    )
    p.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "qwen3-0.6b", "qwen3-8b"],
        help="reference model shape (random weights)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        type=sizes,
        help="comma-separated sizes (memory: capture sizes; prefill: step sizes; "
        "decode: batch sizes; sleep, startup: decode capture sizes); defaults depend on the "
        "backend",
    )
    p.add_argument(
        "--max-size",
        type=positive_int,
        default=None,
        help="memory: full graphs at vLLM's capture sizes up to this (default on "
        "accelerators 512 for the reference, 256 for hf-llama; 128 and 64 on the CPU "
        "backend); bench prefill: its piecewise-memory sizes up to this (default "
        "2048 on accelerators, 256 on the CPU backend)",
    )
    p.add_argument(
        "--compile",
        default=None,
        type=_compile_sizes,
        help="decode: batch sizes to also run compiled (torch.compile reduce-overhead, and "
        "xgraph over the compiled forward; default 1,8,64 on accelerators; none: off); "
        "prefill: any value adds the piecewise executor over the compiled forward",
    )
    _add_decode_and_memory_options(p)
    _add_run_options(p)
    p.set_defaults(func=main, check=option_problem)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help="prefill, decode, host: timed repetitions per measurement (default 10 prefill, "
        "50 decode; host: 2000, 300 for the model on accelerators); sleep: sleep/wake "
        "cycles (default 2)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="soak: random steps to run, each checked against eager (default 2000)",
    )
    p.add_argument(
        "--memory",
        default=None,
        choices=["shared-physical", "shared-pool", "private"],
        help="soak: the executor's memory mode (default: the backend's default)",
    )
    p.add_argument(
        "--forward",
        default="trivial",
        choices=["trivial", "model"],
        help="host: the forward replayed (trivial: two ops; model: the reference model)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=positive_float,
        default=None,
        help="sleep: the KV cache dropped at each sleep, GiB above 0 (default 16 on accelerators)",
    )
    p.add_argument(
        "--targets",
        default=None,
        type=_names(startup_targets),
        help="startup: the models started, comma-separated (reference: the reference model; "
        "hf: transformers' Qwen3 through GraphModel(compile=True), skipped without "
        "transformers; default both)",
    )
    # startup's own processes (xgraph.bench.startup_run): the target, the parent's clock at
    # the spawn and the piecewise sizes; not for the command line's users
    p.add_argument("--process", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pieces", type=sizes, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the results here (bench all: a folder)")
    p.add_argument("--plot", default=None, help="memory: write a PNG plot here")
    p.add_argument("--out", default=None, help="bench all: folder for JSON, PNG and tables")


def _json_path(args: argparse.Namespace, name: str) -> str | None:
    """Where `main` writes this benchmark's JSON (partial results go there first)."""
    return os.path.join(args.out, f"{name}.json") if args.out else args.json


# Each runner: (backend, args, sizes given for this benchmark or None) -> (JSON data, table).
# --sizes only applies when one benchmark runs: its meaning differs between them.
Result = tuple[dict[str, Any], str]
Runner = Callable[[Backend, argparse.Namespace, list[int] | None], Result]


def _memory(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    if sizes is None and args.max_size is not None:
        sizes = vllm_capture_sizes(args.max_size)
    pw = None if args.piecewise_max is None else sglang_piecewise_sizes(args.piecewise_max)
    data = memory.run(
        backend,
        args.model,
        sizes,
        pw,
        families=args.models,
        kinds=args.kinds,
        all_modes=args.all_modes,
        checkpoint=Checkpoint(_json_path(args, "memory")),
    )
    plot_path = args.plot or (os.path.join(args.out, "memory.png") if args.out else None)
    if plot_path:
        memory_plot.plot(data, plot_path)
    return data, memory.summarize(data)


def _prefill(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    # bench all keeps prefill's default memory sizes: --max-size there sizes the memory run
    memory_max = args.max_size if args.which == "prefill" else None
    data = prefill.run(
        backend,
        args.model,
        sizes,
        memory_max=memory_max,
        iters=10 if args.iters is None else args.iters,
        compiler="inductor" if args.compile is not None else None,
        checkpoint=Checkpoint(_json_path(args, "prefill")),
    )
    return data, prefill.summarize(data)


def _decode(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    data = decode.run(
        backend,
        args.model,
        sizes,
        iters=50 if args.iters is None else args.iters,
        compile_batches=args.compile,
        table_check_batch=args.table_check,
        checkpoint=Checkpoint(_json_path(args, "decode")),
        compile_scope=args.compile_scope,
        compile_buckets=args.compile_buckets,
        anchor_kernels=args.anchor_kernels,
    )
    return data, decode.summarize(data)


def _soak(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    steps = 2000 if args.steps is None else args.steps
    data = soak.run(backend, steps=steps, memory=args.memory, sample_every=max(1, steps // 20))
    return data, soak.summarize(data)


def _host(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    data = host.run(backend, args.model, sizes, iters=args.iters, forward=args.forward)
    return data, host.summarize(data)


def _distributed(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    # under torchrun every rank runs this; rank 0 alone writes the JSON (all ranks' rows)
    data = distributed.run(backend, args.model, sizes, iters=args.iters or 30, prefill=None)
    if distributed.dist.get_rank() != 0:
        args.json = None
    distributed.release_group()  # every rank has its results: the gather above met them
    return data, distributed.summarize(data)


def _pipeline(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    data = pipeline.run(backend, args.model, sizes, iters=args.iters)
    return data, pipeline.summarize(data)


def _sleep(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    pw = None if args.piecewise_max is None else sglang_piecewise_sizes(args.piecewise_max)
    data = sleep.run(
        backend,
        args.model,
        sizes,
        pw,
        kv_cache_gib=args.kv_cache_gib,
        cycles=2 if args.iters is None else args.iters,
        checkpoint=Checkpoint(_json_path(args, "sleep")),
    )
    return data, sleep.summarize(data)


def _startup(backend: Backend, args: argparse.Namespace, sizes: list[int] | None) -> Result:
    pw = None if args.piecewise_max is None else sglang_piecewise_sizes(args.piecewise_max)
    if args.process is not None:  # one process of the benchmark, spawned by it
        assert sizes is not None and args.pieces is not None and args.t0 is not None
        from .startup_run import one_process

        one_process(args.process, backend, args.model, sizes, args.pieces, args.t0)
        return {}, "one start-up process"
    data = startup.run(
        backend,
        args.model,
        sizes,
        pw,
        targets=args.targets,
        checkpoint=Checkpoint(_json_path(args, "startup")),
    )
    return data, startup.summarize(data)


RUNNERS: dict[str, Runner] = {
    "memory": _memory,
    "prefill": _prefill,
    "decode": _decode,
    "soak": _soak,
    "host": _host,
    "distributed": _distributed,
    "pipeline": _pipeline,
    "sleep": _sleep,
    "startup": _startup,
}


def misplaced_option(args: argparse.Namespace) -> str | None:
    """The mistake of an option given to a benchmark that does not read it, or None."""
    if args.which == "all" and args.sizes is not None:
        return (
            "--sizes does not apply to bench all (each benchmark reads it its own way); "
            "give it to one benchmark"
        )
    which = list(BENCHMARKS) if args.which == "all" else [args.which]
    for dest, users in USED_BY.items():
        if getattr(args, dest) is not None and not set(users) & set(which):
            option = "--" + dest.replace("_", "-")
            return (
                f"{option} does not apply to bench {args.which} (it is read by bench "
                f"{', '.join(users)}); leave it out"
            )
    return None


def option_problem(args: argparse.Namespace) -> str | None:
    """The mistake in the options together (refused before anything runs), or None."""
    misplaced = misplaced_option(args)
    if misplaced:
        return misplaced
    if args.which == "prefill" and args.max_size is not None and args.max_size < PIECEWISE_MIN:
        return (
            f"--max-size {args.max_size}: bench prefill measures piecewise memory at sizes "
            f"from {PIECEWISE_MIN} up to it; give at least {PIECEWISE_MIN}"
        )
    return None


def main(args: argparse.Namespace) -> int:
    import xgraph

    backend = xgraph.get_backend(args.backend)
    backend.activate()  # eager anchors run the backend's kernels too, as its executors do
    which = list(BENCHMARKS) if args.which == "all" else [args.which]
    failed = False
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
    report = []
    for name in which:
        own = args.sizes if args.which == name else None
        data, text = RUNNERS[name](backend, args, own)
        print(f"\n## bench {name}\n\n{text}\n", flush=True)
        report.append(f"## bench {name}\n\n{text}\n")
        write_json(os.path.join(out, f"{name}.json") if out else args.json, data)
        failed |= bool(data.get("mismatches"))
    if out:
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write("\n".join(report))
    return 1 if failed else 0
