"""The CUDA backend's programmatic dependent launch: on only inside a full graph's capture
where the GPU has it; on a Hopper GPU, a captured chain of the decode kernels has
programmatic edges, and replays with PDL match replays without bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from xgraph_cuda import pdl

from xgraph.pdl import capture_options

needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
    reason="needs a GPU of compute capability 9.0 or later",
)


def test_launch_options_follow_the_mode_and_stay_off_the_interpreter() -> None:
    assert pdl.launch_options(True) == {"PDL": False}
    with pdl.enabled_for(True):
        assert pdl.launch_options(True) == {"PDL": True, "launch_pdl": True}
        assert pdl.launch_options(False) == {"PDL": False}  # CPU tensors: the interpreter
    with pdl.enabled_for(False, waits_only=True):
        assert pdl.launch_options(True) == {"PDL": True}  # the wait compiled in, no attribute


def test_a_projection_past_the_size_limit_keeps_the_binary_but_not_the_attribute(
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    mib = 1 << 20
    monkeypatch.delenv("XGRAPH_CUDA_PDL_MAX_MIB", raising=False)
    assert pdl.max_bytes() == 64 * mib  # measured: see docs/kernels.md
    monkeypatch.setenv("XGRAPH_CUDA_PDL_MAX_MIB", "16")
    with pdl.enabled_for(True):
        assert pdl.launch_options(True, 16 * mib) == {"PDL": True, "launch_pdl": True}
        assert pdl.launch_options(True, 16 * mib + 1) == {"PDL": True}  # a full edge in
    assert pdl.launch_options(True, 64 * mib) == {"PDL": False}  # outside PDL: unchanged
    assert pdl.launch_options(True, attribute=False) == {"PDL": False}
    with pdl.enabled_for(True):
        assert pdl.launch_options(True, attribute=False) == {"PDL": True}
        assert pdl.launch_options(False, attribute=False) == {"PDL": False}
    monkeypatch.setenv("XGRAPH_CUDA_PDL_MAX_MIB", "none")
    with pdl.enabled_for(True):
        assert pdl.launch_options(True, 1 << 40) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("XGRAPH_CUDA_PDL_MAX_MIB", "lots")
    with pdl.enabled_for(True), pytest.raises(pdl.XGraphError, match="number of MiB"):
        pdl.launch_options(True, mib)


def test_pdl_is_on_only_in_a_full_graph_capture_where_the_gpu_has_it() -> None:
    on = pdl.CUDAProgrammaticLaunch(torch.device("cpu"), available=True)
    off = pdl.CUDAProgrammaticLaunch(torch.device("cpu"), available=False)
    assert not pdl.enabled()
    with on.capture("full", True):
        assert pdl.enabled()
        with on.capture("piecewise", True):  # prefill pieces never
            assert not pdl.enabled()
        assert pdl.enabled()
    assert not pdl.enabled()
    with off.capture("full", True):
        assert not pdl.enabled()
    with on.baseline("full"):
        assert not pdl.enabled() and pdl.waits()
    with on.baseline("piecewise"):
        assert not pdl.waits()
    assert not pdl.CUDAProgrammaticLaunch(torch.device("cpu")).available


class _KeptGraph:
    """A torch CUDAGraph's two calls `captured` makes: the kept cudaGraph_t, instantiate."""

    def __init__(self, raw: int | None) -> None:
        self.raw, self.instantiated = raw, 0

    def raw_cuda_graph(self) -> int:
        if self.raw is None:  # as torch answers for a graph not kept (keep_graph=False)
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless ...")
        return self.raw

    def instantiate(self) -> None:
        self.instantiated += 1


def test_captured_counts_then_makes_the_executable_once(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from xgraph_cuda import edges

    from xgraph.adapter import XGraphError

    launch = pdl.CUDAProgrammaticLaunch(torch.device("cpu"), available=True)
    monkeypatch.setattr(edges, "count_programmatic", lambda raw: raw % 100)
    kept, gone = _KeptGraph(1234), _KeptGraph(None)
    assert launch.captured(kept) == 34 and kept.instantiated == 1
    assert launch.captured(gone) is None and gone.instantiated == 0  # torch made it already

    def refuse(raw: int) -> int:
        raise XGraphError("Counting a graph's programmatic edges needs cuda-python")

    monkeypatch.setattr(edges, "count_programmatic", refuse)
    unread = _KeptGraph(99)
    with caplog.at_level(logging.WARNING, logger="xgraph"):
        assert launch.captured(unread) is None and unread.instantiated == 1  # it runs all the same
    assert "programmatic edges not counted: Counting" in caplog.text


def test_the_backend_offers_it(backend) -> None:  # type: ignore[no-untyped-def]
    kernels = backend.kernels()
    assert isinstance(kernels.pdl, pdl.CUDAProgrammaticLaunch)
    with capture_options(kernels, "full", False):
        assert not pdl.enabled()


def _chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    from xgraph_cuda import projection

    from xgraph.fusion import Fusion

    h = x
    for w in weights:  # each projection adds its input back: a dependent chain
        h = projection.fused(h, w, Fusion(residual=h))
        assert h is not None
    return h


@needs_hopper
def test_a_captured_chain_has_programmatic_edges_and_no_race(backend) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from xgraph.pdl import race_check

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 1024, device="cuda", generator=g).bfloat16()
    weights = [torch.randn(1024, 1024, device="cuda", generator=g).bfloat16() * 0.02]
    weights *= 8
    kernels = backend.kernels()
    replays, edges = [], []
    for on in (True, False):
        # the baseline runs the same binaries without the launch attribute
        with capture_options(kernels, "full", on, baseline=not on):
            _chain(x, weights)  # warm-up: compiles the variant the capture launches
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                out = _chain(x, weights)
        edges.append(kernels.pdl.programmatic_edges(graph))
        replays.append((graph, out))
    assert edges[0] >= len(weights) - 1 and edges[1] == 0

    def run(i: int):  # type: ignore[no-untyped-def]
        graph, out = replays[i]
        return lambda: (graph.replay(), torch.cuda.synchronize(), [out])[2]

    feed = lambda i: x.copy_(torch.randn(x.shape, device="cuda", generator=g))  # noqa: E731
    report = race_check(run(0), run(1), feed, replays=50)
    assert report.clean, report.describe()


def _steps(w, rng, n: int):  # type: ignore[no-untyped-def]
    """n decode steps over the executor's buckets, then a prefill (piecewise) step."""
    steps = [w.decode_step(rng, rng.choice([1, 3, 8, 16])) for _ in range(n)]
    return [*steps, w.prefill_step(rng, [5, 7])]


@needs_hopper
def test_an_executor_with_pdl_has_programmatic_edges_in_decode_graphs_only(backend) -> None:  # type: ignore[no-untyped-def]
    """GraphExecutor(pdl=True) over the reference model in bf16 with the decode projection
    kernels: every full (decode) graph has programmatic edges, every step equals pdl=False's
    bit for bit over the replays, and its piecewise (prefill) pieces have none (every graph
    kept readable here, to count them)."""
    pytest.importorskip("triton")
    import random

    from xgraph_cuda.edges import edge_types

    from xgraph.models import Workload

    with pytest.MonkeyPatch.context() as m:
        m.setenv("XGRAPH_CUDA_LINEAR", "triton")  # PDL-capable kernels in the pieces too
        m.setattr(backend.runtime, "new_graph", backend.runtime.readable_graph)
        w = Workload.tiny(device="cuda", dtype=torch.bfloat16, num_blocks=256, max_seqs=16)
        w.randomize_cache(2)
        on, off = (w.executor(backend=backend, buckets=[1, 4, 8, 16], pdl=p) for p in (True, False))
        try:
            for i, step in enumerate(_steps(w, random.Random(0), 60)):
                a = on(**step.kwargs(), clone=True)
                b = off(**step.kwargs(), clone=True)
                assert torch.equal(a, b), f"step {i}: PDL changed the logits"
            pdl, keys = on.stats()["pdl"], on.stats()["keys"]
            full = [k for k in keys if k[0] == "full"]
            assert pdl["enabled"] and pdl["supported"] and pdl["graphs"] == len(full) == 4
            assert set(pdl["per_key"]) == set(full) and min(pdl["per_key"].values()) > 0
            assert pdl["programmatic_edges"] == sum(pdl["per_key"].values())
            assert off.stats()["pdl"]["programmatic_edges"] == 0
            items = [g for k in keys if k[0] == "piecewise" for g in on.graph(k).items]
            pieces = [g for g in items if hasattr(g, "runtime_graph")]  # not the runner calls
            raw = [g.runtime_graph.raw_cuda_graph() for g in pieces]
            assert pieces and sum(len(edge_types(r)) for r in raw) > 0  # edges, none of them PDL
            counted = [backend.kernels().pdl.programmatic_edges(g) for g in pieces]
            assert counted == [0] * len(pieces)
        finally:
            on.close()
            off.close()
    backend.activate()  # the projection kernels of the default XGRAPH_CUDA_LINEAR again
