"""A torch.compile'd forward through the executor: full graphs and piecewise, equal to eager.

The attention call site is a graph break (torch.compiler.disable): the compiled pieces
around it hold no in-place cache write, and the step context runs as it does eagerly. On
the CPU backend the op tape records through a dispatch mode, under which Dynamo runs the
eager ops: these tests check that a compiled forward is served correctly (warm-up compiled,
capture recording the same ops), and that `compiled=True` leaves the per-op guard out on a
backend that does not record ops (CUDA, where the compiled kernels are then captured).
"""

from __future__ import annotations

import random

import pytest
import torch

from xgraph import Buckets
from xgraph.models import Workload
from xgraph.runners import PagedPrefillRunner

BUCKETS = [1, 2, 4, 8, 16, 32]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["auto", "piecewise"])
def test_compiled_forward_captures_and_replays_like_eager(mode):
    ex_w, ref_w = Workload.tiny(), Workload.tiny()
    for w in (ex_w, ref_w):
        w.randomize_cache(3)
    compiled = torch.compile(ex_w.model.forward_logits, backend="aot_eager")
    ex = ex_w.executor(compiled, backend="cpu", buckets=BUCKETS, mode=mode, compiled=True)
    rng, buckets = random.Random(3), Buckets(BUCKETS)
    steps = [ex_w.decode_step(rng, b) for b in (3, 5, 8, 3)]
    steps += [ex_w.prefill_step(rng, [5, 7]), ex_w.prefill_step(rng, [2, 1, 9])]
    for step in steps:
        out = ex(**step.kwargs())
        full = mode == "auto" and step.attn.is_decode
        runner = None if full else PagedPrefillRunner()  # what a piecewise step runs
        ref = ref_w.eager(ref_w.padded(step, buckets, full=full), runner)[: step.num_tokens]
        assert torch.equal(out, ref)
    s = ex.stats()
    assert s["replays"] >= len(steps) and s["eager"] == {} and s["failed_keys"] == {}
    kinds = {k[0] for k in s["keys"]}
    assert kinds == ({"full", "piecewise"} if mode == "auto" else {"piecewise"})
    if mode == "piecewise":  # the split at attention survived compilation
        layers = ex_w.model.config.num_layers
        assert ex.graph(s["keys"][0]).describe() == ["piece", "runner"] * layers + ["piece"]
    ex.close()


def test_compiled_captures_leave_the_op_guard_out_unless_the_graph_records_ops(cpu):
    from xgraph import CheckedGraph
    from xgraph.backends.cpu import HostCachingPool

    class StreamGraph(CheckedGraph):  # records nothing per op, like a CUDA or NPU graph
        pool_type = HostCachingPool

        def _begin(self, pool):  # type: ignore[no-untyped-def]
            pass

        def _end(self) -> None:
            pass

        def _replay(self) -> None:
            pass

        def _reset(self) -> None:
            pass

    seen = {}
    for name, graph in (("stream", StreamGraph(cpu)), ("tape", cpu.new_graph())):
        for checks in (True, False):
            pool = cpu.new_pool()
            graph.capture_begin(pool, check_ops=checks)
            seen[name, checks] = torch._C._len_torch_dispatch_stack()
            graph.capture_end()
            graph.reset()
            pool.close()
    assert seen == {("stream", True): 1, ("stream", False): 0,
                    ("tape", True): 1, ("tape", False): 1}
