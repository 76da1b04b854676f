"""Kernels a decode step issues: inside a multi-step launch against a graph step, and the
per-step choice + feedback of a launch eager against compiled (xgraph.loop_step).

    python -m xgraph.bench.step_kernels --compiler inductor --seqs 1,32 --vocab 151936

Three ways to count, one for each place a count can come from:

- `recorded(ex, attn, **inputs)`: the launches in the recording of one full-graph step
  (`Graph.launches()`: the CPU backend's taped ops, CUDA's graph nodes), nothing kept
  (xgraph.parameterization.record); None where the backend cannot read its graphs. The
  CPU backend records the eager ops (compiled code runs eagerly under its recorder).
- `count_ops(fn)`: what one call issues on the host's profiler (CPU): the top-level aten
  ops that do work (views, allocations and no-op conversions left out) and the kernels
  Inductor generated (visible when compiled with `cpp.enable_kernel_profile`).
- xgraph.bench.kernel_trace.profile_steps: the device's kernels per call, from a device
  trace (CUDA), which bench_multistep reports on a GPU.

`tail_kernels` counts the choice + feedback of one step over `seqs` sequences and a
vocabulary of `vocab`, eager and compiled, greedy and sampled, on synthetic launch state.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..feedback import Feedback, LoopBuffers
from ..interfaces import Launch
from ..metadata import AttentionInputs, AttentionMetadata
from ..options import Kind

if TYPE_CHECKING:
    from ..executor import GraphExecutor

# aten ops that launch nothing: views, allocations, host scalars
NOT_KERNELS = {
    "aten::" + op
    for op in (
        "as_strided alias view _unsafe_view _reshape_alias unsqueeze squeeze select slice "
        "expand t transpose permute detach empty empty_strided empty_like lift_fresh "
        "scalar_tensor resolve_conj resolve_neg split split_with_sizes unbind chunk "
        "view_as_real view_as_complex _local_scalar_dense"
    ).split()
}
# aten ops that launch a kernel only where they copy (a child op does the work)
MAYBE_KERNELS = {
    "aten::" + op for op in "to contiguous reshape flatten view_as expand_as type_as".split()
}


def _generated(name: str) -> bool:
    """An Inductor kernel's profiler event (`graph_<n>_cpp_fused_...` / `..._triton_...`)."""
    return name.startswith("graph_") and ("cpp_fused" in name or "triton" in name)


def _works(e: Any) -> bool:
    """Whether the op (or one of the ops it calls) does work."""
    if e.name in MAYBE_KERNELS:
        return any(_works(c) for c in e.cpu_children)
    return e.name not in NOT_KERNELS


def _top_level(e: Any) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") or _generated(p.name):
            return False
        p = p.cpu_parent
    return True


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    """The kernels one call of `fn` issues on the host, by name (module docstring)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    out: Counter[str] = Counter()
    for e in prof.events():
        if _generated(e.name):
            out["inductor:" + e.name.split("_", 2)[2].split("_fused_")[0]] += 1
        elif e.name.startswith("aten::") and _top_level(e) and _works(e):
            out[e.name] += 1
    return out


def recorded(ex: GraphExecutor, attn: AttentionInputs, **inputs: Any) -> int | None:
    """Kernels in the recording of this step as a full graph of `ex` (nothing is kept):
    its launches that do work (views and allocations left out); None where the backend's
    graphs cannot describe what they record."""
    from ..launches import root_module
    from ..parameterization import record, supported

    if not supported(ex.backend):
        return None
    with ex.hold("counting a step's kernels"):
        step = ex.planner.plan(inputs, attn, kind=Kind.FULL)
        if step.kind is not Kind.FULL:
            return None
        sites = record(ex, step, root_module(ex.forward))
    return sum(1 for s in sites if _launches_work(s.launch))


def _launches_work(la: Launch) -> bool:
    """A kernel or an op that does work (not a view, an allocation, a copy node)."""
    return la.kind in ("kernel", "op", "task") and la.name not in NOT_KERNELS


def launch_state(seqs: int, vocab: int, width: int = 8, block_size: int = 16) -> dict:
    """Synthetic state of a launch over `seqs` running sequences: logits, LoopBuffers, the
    paging layout (sequence i at position 2 * i + 1 over block i, block `seqs + i` free)."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(seqs, dtype=torch.int64) * 2 + 1
    table = torch.full((seqs, width), 2 * seqs, dtype=torch.int32)  # the dummy block
    table[:, 0] = torch.arange(seqs, dtype=torch.int32)
    md = AttentionMetadata.build(
        [1] * seqs, (pos + 1).tolist(), table, (table[:, 0] * block_size + pos).tolist()
    )
    md.block_tables = table
    buf = LoopBuffers(
        input_ids=torch.randint(0, vocab, (seqs,), generator=g),
        positions=pos,
        budget=torch.full((seqs,), 8, dtype=torch.int64),
        stop_ids=torch.full((seqs, 4), -1, dtype=torch.int64),
        free_blocks=torch.arange(seqs, 2 * seqs, dtype=torch.int64),
        free_count=torch.tensor([seqs], dtype=torch.int64),
        md=md,
    )
    layout = dict(block_size=block_size, dummy_block=2 * seqs, dummy_slot=2 * seqs * block_size)
    return {"logits": torch.randn(seqs, vocab, generator=g), "buf": buf, "layout": layout}


def sampling_params(seqs: int) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p, seeds of a sampled launch (every sequence sampling)."""
    return (
        torch.full((seqs,), 0.8),
        torch.full((seqs,), 40, dtype=torch.int64),
        torch.full((seqs,), 0.95),
        torch.arange(seqs, dtype=torch.int64) + 7,
    )


def tail_call(tail: Any, kind: str, seqs: int, vocab: int) -> Callable[[], Any]:
    """One step's choice + feedback on fresh launch state (the Feedback made beforehand:
    what it saves is the launch's, not the step's)."""
    s = launch_state(seqs, vocab)
    fb = Feedback(s["buf"], **s["layout"])
    logits = s["logits"]
    if kind == "greedy":
        return lambda: tail.choose_greedy(logits, fb)
    params, ids = sampling_params(seqs), torch.arange(vocab)
    return lambda: tail.choose_sampled(logits, fb, params, ids)


def tail_kernels(compiler: str | None, seqs: int, vocab: int) -> dict[str, Any]:
    """Kernels of one step's choice + feedback, eager and under `compiler`, greedy and
    sampled: {"greedy": {"eager": n, "compiled": n, "eager_ops": {...}, ...}, ...}."""
    from ..loop_step import StepTail

    out: dict[str, Any] = {"seqs": seqs, "vocab": vocab, "compiler": compiler}
    layout = launch_state(1, 2)["layout"]
    layout.update(dummy_block=2 * seqs, dummy_slot=2 * seqs * layout["block_size"])
    tails = {"eager": StepTail(**layout)}
    if compiler is not None:
        tails["compiled"] = StepTail(**layout, compiler=compiler)
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.enable_kernel_profile": True}):  # its kernels on the profiler
        for kind in ("greedy", "sampled"):
            row: dict[str, Any] = {}
            for label, tail in tails.items():
                tail_call(tail, kind, seqs, vocab)()  # compiles, outside the count
                ops = count_ops(tail_call(tail, kind, seqs, vocab))
                row[label], row[f"{label}_ops"] = sum(ops.values()), dict(sorted(ops.items()))
            out[kind] = row
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiler", default="inductor", help="a torch.compile backend, or none")
    p.add_argument("--seqs", type=_ints, default=[1, 32])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    compiler = None if args.compiler == "none" else args.compiler
    rows = [tail_kernels(compiler, n, args.vocab) for n in args.seqs]
    for r in rows:
        for kind in ("greedy", "sampled"):
            k = r[kind]
            print(
                f"{r['seqs']:>3} sequences, {kind:>7}: {k['eager']} kernels eager, "
                f"{k.get('compiled', '-')} compiled ({compiler})",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
