"""The benchmarks' anchors and compiled variants, each built once per run and reused.

- `native_anchor`: the forward captured with the runtime's own graph API on static buffers
  (`native_graph`, a benchmark hook), bypassing xgraph: the raw-graph anchor.
- Each anchor is timed two ways: replaying the same step's static device inputs (a replay,
  nothing sent), and as a step an engine would run without xgraph (`+ inputs`): the step's
  token inputs and attention metadata first copied from pinned host tensors into those
  static buffers, one non-blocking copy per tensor (how engines fill persistent buffers),
  since an executor step includes sending its inputs.
- `ReduceOverhead`: torch.compile(mode="reduce-overhead") of the same forward, one compiled
  function for every batch size (static shapes: a recompile per size, each recorded into
  torch's own CUDA graphs).
- `compiled_twin`: a second module tree over the same weights and KV cache whose forward
  (or each decoder layer) is torch.compile'd, for executors made with `compiled=True`:
  Inductor's kernels in xgraph's graphs. `bench decode` compiles it once for every batch
  size (the token count dynamic, `Qwen3Model.compile_forward`) and, with
  `--compile-buckets per-size` or `both`, once per batch size (static shapes, as
  reduce-overhead does); `bench prefill` once with num_tokens dynamic. The original model
  keeps its eager kernels for the other rows; nothing large is copied.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from ..attention import InlineRunner, step_context
from ..interfaces import AttentionRunner, Backend
from ..metadata import AttentionMetadata
from ..models import Qwen3Model, Step, Workload
from ..runners import reference_runners
from . import hooks
from .timing import Timer


def compile_options(compiler: str) -> dict[str, Any]:
    """torch.compile options for a compiler name ("inductor": the default, else a backend
    such as "eager" or "aot_eager", which the CPU tests use to keep compiles short)."""
    return {} if compiler == "inductor" else {"backend": compiler}


def _static_metadata(w: Workload, step: Step) -> AttentionMetadata:
    """The step's metadata with block tables as wide as the executor's (the same work)."""
    dev = w.cache.tensors()[0].device
    wide = step.with_tensor_tables(w.max_blocks, w.cache.dummy_block)
    return wide.attn.metadata(dev, fill_block=w.cache.dummy_block)


def _decode_runner(backend: Backend) -> AttentionRunner:
    """A fresh decode runner of the kind the executor picks, so the anchors run the same forward."""
    return {**reference_runners(), **backend.kernels().attention}["decode"]


def sender(backend: Backend, targets: list[torch.Tensor]) -> Callable[[], None]:
    """Copies of host twins (pinned on an accelerator) into `targets`, one per tensor."""
    pin = backend.device.type != "cpu"
    pairs = [(t, t.cpu().pin_memory() if pin else t.cpu().clone()) for t in targets]

    def send() -> None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    return send


def as_step(send: Callable[[], None], run: Callable[[], Any]) -> Callable[[], None]:
    """`run` as an engine step: the step sent into the static buffers first."""

    def step() -> None:
        send()
        run()

    return step


def static_inputs(
    backend: Backend, w: Workload, step: Step
) -> tuple[torch.Tensor, torch.Tensor, InlineRunner, Callable[[], None]]:
    """Device token inputs and a runner planned on the step: the anchors' static buffers;
    and a callable that sends the step into them from the host, as an engine would."""
    dev = w.cache.tensors()[0].device
    runner = _decode_runner(backend)
    md = _static_metadata(w, step)
    runner.plan(md)
    ids, pos = step.input_ids.to(dev), step.positions.to(dev)
    tables = [md.slot_mapping, md.seq_lens, md.query_start_loc, md.block_tables]
    return ids, pos, InlineRunner(runner), sender(backend, [ids, pos, *tables])


def native_anchor(
    backend: Backend, w: Workload, step: Step
) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """The forward captured with the runtime's own graph API (a replay callable, and the
    sending of the step into its static buffers), or None. The sending callable holds the
    static buffers the graph reads: keep it as long as the replay is used."""
    ids, pos, ctx, send = static_inputs(backend, w, step)

    def forward() -> None:
        with torch.no_grad(), step_context(ctx):
            w.model.forward(ids, pos)

    replay = hooks.native_graph(backend, forward)
    return None if replay is None else (replay, send)


def compiled_twin(
    model: Qwen3Model,
    compiler: str = "inductor",
    dynamic: bool = True,
    scope: str = "layers",
    max_tokens: int = 512,
) -> Qwen3Model:
    """A copy of the module tree sharing the parameters, buffers and KV cache, compiled
    (compile_layers compiles modules, so it needs modules of its own).

    `scope="forward"`: the whole forward as one graph (embedding, rotary, every layer, the
    final norm; the attention op inside it), as reduce-overhead compiles it, through
    `Qwen3Model.compile_forward`: `dynamic=True` is one compile for every token count up
    to `max_tokens` (and one for a single token), `dynamic=False` one compile per count.
    `scope="layers"`: each decoder layer (`compile_layers`; `dynamic=True`: one graph for
    every count of 2 tokens or more)."""
    shared: dict[int, Any] = {
        id(t): t for t in (*model.parameters(), *model.buffers(), *model.kv_cache.tensors())
    }
    shared[id(model.kv_cache)] = model.kv_cache
    twin = copy.deepcopy(model, shared)
    if scope == "forward":
        twin.forward = twin.compile_forward(  # type: ignore[method-assign]
            max_tokens, dynamic=dynamic, **compile_options(compiler)
        )
        return twin
    if scope != "layers":
        raise ValueError(f"compile scope {scope!r}: choose 'layers' or 'forward'")
    return twin.compile_layers(dynamic=dynamic, **compile_options(compiler))


def _cudagraph_skips() -> int:
    """How often Inductor has declined to record a CUDA graph so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class ReduceOverhead:
    """torch.compile(mode="reduce-overhead") of `model.forward`, shared by every batch size.

    The attention call inside is the `xgraph::attention` op, answered at run time by the
    step context the caller sets around each call, so the compiled function itself holds
    nothing per batch. The KV cache tensors are marked as static addresses: the op writes
    them in place, and torch records no CUDA graph for a function that mutates inputs it
    does not know to be static (`reduce_overhead_cudagraph_skips` counts any refusal).
    """

    def __init__(self, backend: Backend, model: Qwen3Model, compiler: str = "inductor") -> None:
        self.backend = backend
        for t in model.kv_cache.tensors():
            torch._dynamo.mark_static_address(t, guard=False)
        if compiler == "inductor":
            self.fn = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        else:
            self.fn = torch.compile(model.forward, backend=compiler, dynamic=False)

    def measure(self, w: Workload, step: Step, timer: Timer, iters: int) -> dict[str, Any]:
        ids, pos, ctx, send = static_inputs(self.backend, w, step)
        skips = _cudagraph_skips()

        def call() -> None:
            torch.compiler.cudagraph_mark_step_begin()  # earlier outputs may be overwritten
            with torch.no_grad(), step_context(ctx):
                self.fn(ids, pos)

        t0 = time.perf_counter()
        for _ in range(3):  # compile, warm-up run, graph recording
            call()
        self.backend.synchronize()
        first = time.perf_counter() - t0
        return {
            "reduce_overhead_s": timer(call, iters),
            "reduce_overhead_inputs_s": timer(as_step(send, call), iters),
            "reduce_overhead_first_calls_s": first,
            "reduce_overhead_cudagraph_skips": _cudagraph_skips() - skips,
        }


def first_step(backend: Backend, fn: Callable[[], Any]) -> float:
    """Wall seconds of one call until the device is done (a first step: compile + capture)."""
    backend.synchronize()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t0
