"""torch.compile'd forwards (CPU, Inductor): the attention call site is one opaque custom op.

`xgraph.attention` becomes `xgraph::attention` under torch.compile, so a whole decoder layer
(or the whole forward) compiles without a graph break. The op declares its in-place writes
to k_cache and v_cache; the generated code must pass the cache tensors straight to it,
never copy them. The tests share one compile of a 3-layer tiny model (module fixture).

On the CPU backend the op tape records through a dispatch mode, under which Dynamo runs the
eager code; a graph that records nothing (`_LiveGraph`, as a CUDA graph captures compiled
kernels) lets the compiled code itself run inside the captures.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from xgraph import Buckets, XGraphError
from xgraph.adapter import CheckedGraph
from xgraph.attention import eager_attention
from xgraph.backends.cpu import CPUBackend, HostCachingPool
from xgraph.models import Qwen3Config, Qwen3Model, Workload
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

BUCKETS = [1, 2, 4, 8, 16, 32]
ATTENTION = importlib.import_module("xgraph.attention")  # the package exports the function
TOL = 1e-5  # compiled float32 kernels against eager ones
CACHE = "(38, 4, 2, 16)"  # 37 blocks + the dummy, 4 slots, 2 kv heads of 16: no other tensor


def workload(layers: int = 3) -> Workload:
    c = dataclasses.replace(Qwen3Config.tiny(), num_layers=layers)
    w = Workload(Qwen3Model.build(c, num_blocks=37, block_size=4, seed=1), 8, 32)
    w.randomize_cache(3)
    return w


def run(w: Workload, step, forward=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    runner = PagedDecodeRunner() if step.attn.is_decode else PagedPrefillRunner()
    with torch.no_grad(), eager_attention(runner, step.attn.metadata()):
        return (forward or w.model.forward)(step.input_ids, step.positions)


def attention_graphs(counter: CompileCounterWithBackend) -> int:
    """Dynamo graphs that hold the attention op (one per compiled layer graph)."""
    op = torch.ops.xgraph.attention.default
    return sum(
        any(n.target in (op, ATTENTION.attention_op) for n in g.graph.nodes) for g in counter.graphs
    )


@pytest.fixture(scope="module")
def compiled():
    """A model with compiled layers, the code its first step generated, and an eager twin."""
    torch._dynamo.reset()
    w, ref = workload(), workload()
    counter = CompileCounterWithBackend("inductor")
    w.model.compile_layers(backend=counter)
    step = w.prefill_step(random.Random(0), [7, 5])
    ptrs = [t.data_ptr() for t in w.cache.tensors()]
    out, code = run_and_get_code(run, w, step)
    yield SimpleNamespace(
        w=w,
        ref=ref,
        counter=counter,
        step=step,
        out=out,
        ptrs=ptrs,
        code=code,
        graphs=attention_graphs(counter),
    )
    torch._dynamo.reset()


def test_the_cache_goes_straight_into_the_op_and_is_written_in_place(compiled):
    layer = [c for c in compiled.code if "torch.ops.xgraph.attention.default(" in c]
    assert len(layer) == 1, "one generated module for every layer"
    body = layer[0].split("def call(self, args):")[1].split("\n\n")[0]
    assert "auto_functionalized" not in body  # the mutation was re-inplaced
    call = re.search(
        r"torch\.ops\.xgraph\.attention\.default\((.*), (\w+), (\w+), \S+\)$", body, re.M
    )
    assert call, body
    for cache in call.group(2, 3):  # graph inputs, not buffers: nothing copied into them
        assert re.fullmatch(r"arg\d+_1", cache), call.group(0)
        uses = [line for line in body.splitlines() if re.search(rf"\b{cache}\b", line)]
        allowed = ("= args", "assert_size_stride(", "del ", "attention.default(")
        assert all(any(a in line for a in allowed) for line in uses), uses
    for line in "\n".join(compiled.code).splitlines():  # no buffer of the cache's size
        assert CACHE not in line or "assert_size_stride" in line or "rand_strided" in line, line
    # at run time: the same storage, holding what the eager model writes
    assert [t.data_ptr() for t in compiled.w.cache.tensors()] == compiled.ptrs
    expected = run(compiled.ref, compiled.step)
    torch.testing.assert_close(compiled.out, expected, rtol=TOL, atol=TOL)
    for a, b in zip(compiled.w.cache.tensors(), compiled.ref.cache.tensors()):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_the_layers_share_one_compiled_graph(compiled):
    w, counter = compiled.w, compiled.counter
    assert compiled.graphs == 1  # three layers, one graph
    rng = random.Random(1)
    run(w, w.decode_step(rng, 1))  # one token is specialised: one graph more
    frames = counter.frame_count
    for step in (w.decode_step(rng, 5), w.prefill_step(rng, [20, 3]), w.decode_step(rng, 2)):
        run(w, step)
    assert attention_graphs(counter) == 2 and counter.frame_count == frames


@pytest.mark.parametrize("mode", ["auto", "piecewise"])
def test_executor_over_compiled_layers_equals_eager(compiled, mode):
    """Warm-ups run the compiled layers; the CPU tape records the eager ops they stand for."""
    ex_w, ref_w = compiled.w, compiled.ref
    for w in (ex_w, ref_w):  # earlier tests wrote one cache and not the other
        w.randomize_cache(5)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, mode=mode, compiled=True)
    rng, buckets = random.Random(3), Buckets(BUCKETS)
    steps = [ex_w.decode_step(rng, b) for b in (3, 1, 3)] + [ex_w.prefill_step(rng, [5, 7])]
    for step in steps:
        out = ex(**step.kwargs())
        full = mode == "auto" and step.attn.is_decode
        runner = None if full else PagedPrefillRunner()  # what a piecewise step runs
        ref = ref_w.eager(ref_w.padded(step, buckets, full=full), runner)[: step.num_tokens]
        assert torch.equal(out, ref)
    s = ex.stats()
    assert s["replays"] >= len(steps) and s["eager"] == {} and s["failed_keys"] == {}
    ex.close()


class _LiveGraph(CheckedGraph):
    """Records nothing: the captured code runs as it would under a CUDA graph capture."""

    pool_type = HostCachingPool

    def _begin(self, pool):  # type: ignore[no-untyped-def]
        pass

    def _end(self) -> None:
        pass

    def _replay(self) -> None:
        pass

    def _reset(self) -> None:
        pass


class _LiveBackend(CPUBackend):
    graph_class = _LiveGraph


def test_compiled_code_calls_the_op_and_piecewise_capture_cuts_there(compiled, monkeypatch):
    w, layers = compiled.w, compiled.w.model.config.num_layers
    for x in (w, compiled.ref):
        x.randomize_cache(6)
    rng = random.Random(4)
    decode, prefill = w.decode_step(rng, 3), w.prefill_step(rng, [6, 3])
    ref = compiled.ref.eager(compiled.ref.padded(decode, Buckets(BUCKETS), full=True))[:3]
    callers: list[str] = []
    attend = ATTENTION._attend

    def spy(*args):  # type: ignore[no-untyped-def]
        callers.append(sys._getframe(1).f_code.co_name)
        return attend(*args)

    monkeypatch.setattr(ATTENTION, "_attend", spy)
    ex = w.executor(
        backend=_LiveBackend(), buckets=BUCKETS, compiled=True, on_capture_error="raise"
    )
    out = ex(**decode.kwargs())  # a full graph: the capture's own output comes back
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    ex(**prefill.kwargs())
    # warm-up and capture of both steps: every call came through the op
    assert callers == ["_attention_kernel"] * 4 * layers  # the op's kernel
    assert ex.graph(("piecewise", 16)).describe() == ["piece", "runner"] * layers + ["piece"]
    assert ex.graph(("full", 4)).describe() == ["graph"]
    ex.close()


def test_whole_forward_compiles_without_a_graph_break():
    """fullgraph=True: one graph for the whole forward, attention inside it as the op; it
    still captures as a full graph and cuts into pieces at each attention call."""
    w, ref = workload(2), workload(2)
    forward = torch.compile(w.model.forward_logits, backend="aot_eager", fullgraph=True)
    ex = w.executor(
        forward, backend=_LiveBackend(), buckets=BUCKETS, compiled=True, on_capture_error="raise"
    )
    rng = random.Random(7)
    decode, prefill = w.decode_step(rng, 5), w.prefill_step(rng, [2, 1, 9])
    expected = ref.eager(ref.padded(decode, Buckets(BUCKETS), full=True))[:5]
    torch.testing.assert_close(ex(**decode.kwargs()), expected, rtol=TOL, atol=TOL)
    ex(**prefill.kwargs())
    assert ex.graph(("piecewise", 16)).describe() == ["piece", "runner"] * 2 + ["piece"]
    ex.close()


def test_compiled_captures_leave_the_op_guard_out_unless_the_graph_records_ops(cpu):
    seen = {}
    for name, graph in (("stream", _LiveGraph(cpu)), ("tape", cpu.new_graph())):
        for checks in (True, False):
            pool = cpu.new_pool()
            graph.capture_begin(pool, check_ops=checks)
            seen[name, checks] = torch._C._len_torch_dispatch_stack()
            graph.capture_end()
            graph.reset()
            pool.close()
    assert seen == {
        ("stream", True): 1,
        ("stream", False): 0,
        ("tape", True): 1,
        ("tape", False): 1,
    }


def test_compiled_attention_outside_a_step_says_how_to_call_it():
    def f(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return ATTENTION.attention(q * 2, q[:, :2], q[:, 2:], (k_cache, v_cache)) + 1

    q, cache = torch.randn(3, 4, 16), torch.zeros(5, 4, 2, 16)
    with pytest.raises(XGraphError, match="outside a step"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, cache, cache.clone())


@pytest.mark.parametrize("scope", ["layers", "forward"])
def test_the_benchs_compiled_twin_equals_eager_through_the_executor(scope):
    """bench decode's compiled row, either scope, static shapes: full decode graphs on the
    CPU backend equal the padded eager step bit for bit (the eager compiler backend)."""
    from xgraph.bench.anchors import compiled_twin

    torch._dynamo.reset()
    w, ref = workload(), workload()
    twin = Workload(compiled_twin(w.model, "eager", dynamic=False, scope=scope), 8, 32)
    ex = twin.executor(twin.model.forward, backend="cpu", buckets=BUCKETS, compiled=True)
    rng, buckets = random.Random(5), Buckets(BUCKETS)
    for b in (3, 1, 3):
        step = twin.decode_step(rng, b)
        out = ex(**step.kwargs())
        expected = ref.eager(ref.padded(step, buckets, full=True), forward=ref.model.forward)
        assert torch.equal(out, expected[:b])
    assert ex.stats()["eager"] == {}
    ex.close()
    torch._dynamo.reset()
