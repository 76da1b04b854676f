"""The CUDA backend's programmatic dependent launch: on only inside a full graph's capture
where the GPU has it; on a Hopper GPU, a captured chain of the decode kernels has
programmatic edges, and replays with PDL match replays without bit for bit."""

from __future__ import annotations

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
