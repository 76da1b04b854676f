"""Programmatic dependent launch as a capture option (`xgraph.pdl`): a no-op where it is not
asked for or the backend has none, and the race check, run on the simulated runtime against
a planted race (a kernel that reads its predecessor's output without waiting for it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from planted_pdl import PlantedPDL, state
from xgraph_dummy.backend import DummyBackend

import xgraph
from xgraph.backends.cpu.backend import CPUBackend
from xgraph.kernels import Kernels
from xgraph.pdl import capture_options, first_difference, race_check
from xgraph.testing.sim import SimRuntime


def _step(x: torch.Tensor, bufs: dict[str, torch.Tensor], waits: bool) -> None:
    """producer: buf = x + 1; consumer: out = 2 * buf. Under PDL a consumer that does not
    wait reads the producer's output as it was before this replay (`late`, written last)."""
    bufs["buf"].copy_(x + 1)
    early = getattr(state, "pdl", False) and not waits
    bufs["out"].copy_((bufs["late"] if early else bufs["buf"]) * 2)
    bufs["late"].copy_(bufs["buf"])


def _captured(backend: DummyBackend, x: torch.Tensor, pdl: PlantedPDL, on: bool, waits: bool):  # type: ignore[no-untyped-def]
    bufs = {k: torch.zeros_like(x) for k in ("buf", "out", "late")}
    graph, pool = backend.new_graph(), backend.new_pool()
    kernels = Kernels(pdl=pdl)
    with capture_options(kernels, "full", on):
        _step(x, bufs, waits)  # the warm-up, under the same option
        with torch.no_grad(), xgraph.graph(graph, pool):
            _step(x, bufs, waits)

    def replay() -> list[torch.Tensor]:
        graph.replay()
        backend.synchronize()
        return [bufs["out"]]

    return replay


@pytest.fixture
def backend() -> Iterator[DummyBackend]:
    b = DummyBackend(SimRuntime())
    yield b
    assert b.runtime.violations == []


def _feed(x: torch.Tensor) -> Any:
    g = torch.Generator().manual_seed(0)
    return lambda i: x.copy_(torch.randn(x.shape, generator=g))


def test_the_planted_race_is_found_and_its_first_mismatch_named(backend: DummyBackend) -> None:
    x = torch.randn(8)
    pdl = PlantedPDL()
    racy = _captured(backend, x, pdl, on=True, waits=False)
    plain = _captured(backend, x, pdl, on=False, waits=False)
    report = race_check(racy, plain, _feed(x), replays=20, key=("full", 8))
    assert not report.clean and report.mismatches == 20
    first = report.first
    assert first is not None and (first.replay, first.output, first.index) == (0, 0, 0)
    assert "20 of 20 replays differ; first at replay 0, output 0, element 0" in report.describe()
    assert pdl.asked == [("full", True)]  # no PDL asked: the option never reached it


def test_a_kernel_that_waits_is_clean_under_pdl(backend: DummyBackend) -> None:
    x = torch.randn(8)
    pdl = PlantedPDL()
    fenced = _captured(backend, x, pdl, on=True, waits=True)
    plain = _captured(backend, x, pdl, on=False, waits=True)
    report = race_check(fenced, plain, _feed(x), replays=50, key="k")
    assert report.clean and report.first is None
    assert report.describe() == "k: clean over 50 replays"


def test_pdl_is_a_no_op_where_not_asked_or_not_there() -> None:
    pdl = PlantedPDL()
    with capture_options(Kernels(pdl=pdl), "full", False):
        assert not getattr(state, "pdl", False)
    with capture_options(CPUBackend().kernels(), "full", True):  # the CPU backend has none
        assert not getattr(state, "pdl", False)
    with capture_options(Kernels(pdl=pdl), "piecewise", True):  # full graphs only
        assert not getattr(state, "pdl", False)
    assert pdl.asked == [("piecewise", True)]
    with capture_options(Kernels(pdl=pdl), "full", False, baseline=True):  # default: plain
        assert not getattr(state, "pdl", False)


def test_differences_are_found_by_bits() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert first_difference(a, a.clone()) is None  # NaN equals its own bits
    b = a.clone()
    b[2] = 3.0000002
    assert first_difference(a, b) == 2
    assert first_difference(a, a[:2]) == 0  # another shape differs at once
