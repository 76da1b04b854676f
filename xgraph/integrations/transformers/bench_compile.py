"""Compile and capture of many decode sizes, and the decode step, for the transformers model
and for the reference model (xgraph/models/qwen3.py) of the same shape, in one process.

For each model, three executors over the same decode sizes (`sizes`: by default vLLM's 51):

- `one`: the forward compiled once for every size (xgraph.compiled.TokenCompiled: the
  token count dynamic; one graph for 2..max tokens, one for a single token), every size
  captured as a full graph, largest first: `compile_capture_s` is the wall time of it all,
  from nothing compiled to every graph captured;
- `eager`: the same captures over the uncompiled forward (capture time without compile);
- `per_size`: compiled once per size (static shapes), only at the `compare` sizes: the
  step times one compile must stay within.

Then each executor's decode step at the `compare` sizes, device time (median, the
decode benchmark's timer), on the same random decode steps for both models (512-token
block tables, contexts up to 256 tokens). The reference model loads the transformers
model's weights when it is a Qwen3; its executor returns hidden states, as the
transformers model's does (the LM head runs after the step on the rows that sample).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from typing import Any

from ...bench.anchors import compiled_twin
from ...bench.report import attempt, note
from ...bench.timing import Timer
from ...executor import GraphExecutor
from ...interfaces import Backend
from ...models import Qwen3Config, Qwen3Model, Step, Workload
from .model import GraphModel

BLOCK = 16
CONTEXT = 256  # decode steps' longest context
TABLE = 512  # block-table width in tokens, as the decode benchmark's


def reference_config(config: Any) -> Qwen3Config:
    """The reference model's shape from a transformers Qwen3-style config."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 1_000_000.0))
    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        max_position=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
    )


def reference_workload(model: Any, backend: Backend, max_seqs: int, blocks: int) -> Workload:
    """The reference model in the transformers model's shape (and weights, for a Qwen3)."""
    dtype = next(model.parameters()).dtype
    ref = Qwen3Model.build(
        reference_config(model.config),
        num_blocks=blocks,
        block_size=BLOCK,
        dtype=dtype,
        device=backend.device,
    )
    if model.config.model_type == "qwen3":
        ref.load_hf_state({k: v.to(dtype) for k, v in model.state_dict().items()}, "the model")
    return Workload(ref, max_blocks=TABLE // BLOCK, max_seqs=max_seqs)


def decode_steps(w: Workload, sizes: list[int], seed: int = 0) -> dict[int, Step]:
    rng = random.Random(seed)
    return {
        b: w.decode_step(rng, b, max_context=CONTEXT).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        for b in sizes
    }


def _capture_all(backend: Backend, ex: GraphExecutor, sizes: list[int]) -> float:
    backend.synchronize()
    t0 = time.perf_counter()
    ex.capture(sorted(sizes, reverse=True), kind="full", progress=False)
    backend.synchronize()
    return time.perf_counter() - t0


def _first_steps(backend: Backend, ex: GraphExecutor, steps: dict[int, Step]) -> dict:
    """Compile + capture of each size's first step (per-size compiles)."""
    out = {}
    for b, step in steps.items():
        backend.synchronize()
        t0 = time.perf_counter()
        ex(**step.kwargs())
        backend.synchronize()
        out[b] = time.perf_counter() - t0
    return out


def measure(
    backend: Backend,
    make: Callable[[list[int]], tuple[GraphExecutor, Any, Callable[[], None]]],
    sizes: list[int] | None,
    steps: dict[int, Step],
    iters: int,
) -> dict[str, Any]:
    """One executor: capture every size (or, with sizes None, the steps' sizes one by one,
    each its first step), then each step's device time."""
    t0 = time.perf_counter()
    ex, compiled, close = make(sizes or sorted(steps))
    row: dict[str, Any] = {"build_s": time.perf_counter() - t0}
    try:
        if sizes is not None:
            row["sizes"] = len(sizes)
            row["compile_capture_s"] = _capture_all(backend, ex, sizes)
        else:
            row["first_step_s"] = _first_steps(backend, ex, steps)
        row["capture_seconds"] = ex.stats()["capture_seconds"]
        if compiled is not None:
            row["compile"] = compiled.stats()
        timer = Timer(backend)
        row["step_s"] = {b: timer(lambda s=s: ex(**s.kwargs()), iters) for b, s in steps.items()}
        row["timing"] = timer.unit
    finally:
        close()
        gc.collect()
        backend.empty_cache()
    return row


def hf_maker(
    model: Any, backend: Backend, w: Workload, compiler: Any, dynamic: bool
) -> Callable[[list[int]], tuple[GraphExecutor, Any, Callable[[], None]]]:
    """A GraphModel over `model` whose cache and tables have the reference's layout, so
    both run the same steps."""

    def make(sizes: list[int]) -> tuple[GraphExecutor, Any, Callable[[], None]]:
        gm = GraphModel(
            model,
            backend=backend,
            buckets=sizes,
            block_size=BLOCK,
            max_model_len=w.max_blocks * BLOCK,
            max_seqs=max(sizes),
            num_blocks=w.cache.num_blocks,
            compile=compiler or False,
            compile_dynamic=dynamic,
            compile_scope="forward",  # compiled whole, fused layers too: what this part times
            on_capture_error="raise",
            name="bench-hf",
        )
        return gm.executor, gm.compiled, gm.close

    return make


def ref_maker(
    w: Workload, backend: Backend, compiler: str | None, dynamic: bool
) -> Callable[[list[int]], tuple[GraphExecutor, Any, Callable[[], None]]]:
    def make(sizes: list[int]) -> tuple[GraphExecutor, Any, Callable[[], None]]:
        model = w.model
        if compiler is not None:
            model = compiled_twin(model, compiler, dynamic, scope="forward", max_tokens=max(sizes))
        ex = Workload(model, w.max_blocks, max(sizes)).executor(
            model.forward,
            backend=backend,
            buckets=sizes,
            compiled=compiler is not None,
            on_capture_error="raise",
            name="bench-reference",
        )
        return ex, model.forward if compiler is not None else None, ex.close

    return make


def run_compile(
    model: Any,
    backend: Backend,
    sizes: list[int],
    compare: list[int],
    compiler: str,
    iters: int,
) -> dict[str, Any]:
    """Both models, three executors each (module docstring), and the ratios."""
    every = sorted(set(sizes) | set(compare))
    blocks = max(compare) * (CONTEXT // BLOCK) + 1
    w = reference_workload(model, backend, max(every), blocks)
    steps = decode_steps(w, compare)
    makers: dict[str, Callable[[Any, bool], Any]] = {
        "hf": lambda c, d: hf_maker(model, backend, w, c, d),
        "reference": lambda c, d: ref_maker(w, backend, c, d),
    }
    variants = {
        "one": (compiler, True, every),
        "eager": (None, True, every),
        "per_size": (compiler, False, None),
    }
    data: dict[str, Any] = {"sizes": every, "compare": compare, "compiler": compiler}
    for name, maker in makers.items():
        rows: dict[str, Any] = {}
        for variant, (c, d, s) in variants.items():
            note(f"compile: {name} {variant}")
            _variant(rows, variant, backend, maker(c, d), s, steps, iters)
        data[name] = rows
    data["ratios"] = ratios(data, compare)
    return data


def _variant(
    rows: dict[str, Any],
    variant: str,
    backend: Backend,
    make: Any,
    sizes: list[int] | None,
    steps: dict[int, Step],
    iters: int,
) -> None:
    attempt(rows, variant, lambda: {variant: measure(backend, make, sizes, steps, iters)})


def ratios(data: dict[str, Any], compare: list[int]) -> dict[str, Any]:
    """one / per-size compile at each compared size, per model; transformers / reference
    at each size, both compiled once."""

    def steps(name: str, variant: str) -> dict[int, float]:
        return data.get(name, {}).get(variant, {}).get("step_s", {})

    out: dict[str, Any] = {}
    for name in ("hf", "reference"):
        one, per = steps(name, "one"), steps(name, "per_size")
        out[f"{name}_one_vs_per_size"] = {
            b: one[b] / per[b] for b in compare if b in one and b in per
        }
    hf, ref = steps("hf", "one"), steps("reference", "one")
    out["hf_vs_reference"] = {b: hf[b] / ref[b] for b in compare if b in hf and b in ref}
    return out
