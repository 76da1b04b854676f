"""`GraphExecutor(pdl=...)` (xgraph.pdl_option): off by default, XGRAPH_PDL read where the
argument is left out; accepted and a no-op where the backend has no PDL (cpu, ascend-sim)
or the device does not run it; on the simulator with a PDL that races (a kernel reading its
predecessor's output before waiting for it, planted), the executor's full graphs take it,
its piecewise pieces never, `stats()` counts the edges, and the race check over the two
executors' replays finds the race and names its first mismatch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from planted_pdl import PlantedPDL, state
from xgraph_dummy.backend import DummyBackend

from xgraph import GraphExecutor, Input, XGraphError
from xgraph.kernels import Kernels
from xgraph.models import Workload
from xgraph.pdl import race_check
from xgraph.pdl_option import ENV, requested
from xgraph.testing.sim import SimRuntime

WIDTH = 8
INPUTS = [Input("x", torch.float32, ("num_tokens", WIDTH))]


def test_off_by_default_and_xgraph_pdl_read_where_the_argument_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert requested(None) is False
    for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv(ENV, value)
        assert requested(None) is on
    monkeypatch.setenv(ENV, "1")
    assert requested(False) is False  # the argument wins
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(XGraphError, match=r"XGRAPH_PDL='maybe': set it to 1 \(on\) or 0"):
        requested(None)
    with pytest.raises(XGraphError, match=r"pdl='yes': pass True, False or None"):
        GraphExecutor(lambda x: x, inputs=INPUTS, backend="cpu", pdl="yes")  # type: ignore[arg-type]


UNSUPPORTED = {"enabled": True, "supported": False, "graphs": 0, "programmatic_edges": 0}


@pytest.mark.parametrize("name", ["cpu", "ascend-sim"])
def test_accepted_and_a_no_op_where_the_backend_has_no_pdl(name: str) -> None:
    """Decode (full graphs) and prefill (piecewise) steps with the option on match the same
    executor with it off bit for bit, and stats say PDL is unsupported, 0 edges."""
    outs: dict[bool, list[torch.Tensor]] = {}
    for pdl in (True, False):
        w = Workload.tiny(num_blocks=96, max_blocks=6, max_seqs=8)
        w.randomize_cache(3)
        ex = w.executor(backend=name, buckets=[1, 2, 4, 8, 16], pdl=pdl)
        rng, got = random.Random(1), []
        for batch in (3, 1, 8, 3):
            got.append(ex(**w.decode_step(rng, batch).kwargs(), clone=True))
        got.append(ex(**w.prefill_step(rng, [5, 3]).kwargs(), clone=True))
        stats = ex.stats()["pdl"]
        assert {k: stats[k] for k in UNSUPPORTED} == {**UNSUPPORTED, "enabled": pdl}
        assert stats["per_key"] == {}
        assert {k[0] for k in ex.stats()["keys"]} == {"full", "piecewise"}
        ex.close()
        outs[pdl] = got
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


# -- the simulator with a planted race -----------------------------------------------------


class PlantedBackend(DummyBackend):
    """The dummy adapter's simulated device, with the planted PDL as its `Kernels.pdl`."""

    def __init__(self, pdl: PlantedPDL) -> None:
        super().__init__(SimRuntime())
        self.pdl = pdl

    def kernels(self) -> Kernels:
        return Kernels(pdl=self.pdl)


def _forward(waits: bool) -> Any:
    """producer: buf = x + 1; consumer: out = 2 * buf. Under PDL a consumer that does not
    wait reads the producer's output as the previous run left it (`late`, written last)."""
    late: dict[tuple, torch.Tensor] = {}

    def forward(x: torch.Tensor) -> torch.Tensor:
        prev = late.setdefault(tuple(x.shape), torch.zeros_like(x))
        buf = x + 1
        early = getattr(state, "pdl", False) and not waits
        out = (prev if early else buf) * 2
        prev.copy_(buf)
        return out

    return forward


@pytest.fixture
def backend() -> Iterator[PlantedBackend]:
    b = PlantedBackend(PlantedPDL())
    yield b
    assert b.runtime.violations == []


def _pair(
    backend: PlantedBackend, waits: bool, kind: str = "full", **kw: Any
) -> tuple[GraphExecutor, ...]:
    """Two executors of the forward on the device, PDL on and off, each with key 8 captured."""
    pair = []
    for pdl in (True, False):
        ex = GraphExecutor(_forward(waits), inputs=INPUTS, backend=backend, pdl=pdl, **kw)
        ex.capture([8], kind=kind, progress=False)
        pair.append(ex)
    return tuple(pair)


def _race(on: GraphExecutor, off: GraphExecutor, replays: int) -> Any:
    x = torch.zeros(8, WIDTH)
    g = torch.Generator().manual_seed(0)
    step = lambda ex: lambda: [ex(x=x)]  # noqa: E731
    return race_check(
        step(on),
        step(off),
        lambda i: x.copy_(torch.randn(x.shape, generator=g)),
        replays,
        key=("full", 8),
    )


def test_the_planted_race_in_the_executors_full_graphs_is_found_and_named(
    backend: PlantedBackend,
) -> None:
    on, off = _pair(backend, waits=False, buckets=[8])
    report = _race(on, off, replays=20)
    # each replay's consumer reads the previous step's producer output: every replay differs
    assert report.mismatches == 20
    first = report.first
    assert first is not None and (first.replay, first.output, first.index) == (0, 0, 0)
    assert report.describe().startswith("('full', 8): 20 of 20 replays differ; first at replay 0")
    assert backend.pdl.asked == [("full", True)] * 2  # one capture: its warm-up, its record
    for ex in (on, off):
        ex.close()


def test_a_forward_that_waits_is_clean_and_stats_count_the_edges(
    backend: PlantedBackend,
) -> None:
    on, off = _pair(backend, waits=True, buckets=[4, 8])
    on.capture([4], progress=False)
    report = _race(on, off, replays=30)
    assert report.clean, report.describe()
    stats = on.stats()["pdl"]
    edges = {k: len(on.graph(k).graph.launches()) - 1 for k in (("full", 4), ("full", 8))}
    assert min(edges.values()) > 0
    assert stats == {
        "enabled": True,
        "supported": True,
        "graphs": 2,
        "programmatic_edges": sum(edges.values()),
        "per_key": edges,
    }
    assert off.stats()["pdl"]["graphs"] == 0 and off.stats()["pdl"]["programmatic_edges"] == 0
    for ex in (on, off):
        ex.close()


def test_piecewise_pieces_never_take_pdl(backend: PlantedBackend) -> None:
    """The racy forward as piecewise keys of the PDL executor: never asked, no race, no
    edges counted; its full key still takes PDL."""
    on, off = _pair(backend, waits=False, kind="piecewise", buckets=[4, 8], mode="piecewise")
    x = torch.randn(8, WIDTH)
    for _ in range(3):
        x += 1
        assert torch.equal(on(x=x), off(x=x)) and torch.equal(on(x=x), (x + 1) * 2)
    assert backend.pdl.asked == []
    assert on.stats()["pdl"]["graphs"] == 0 and on.stats()["keys"] == [("piecewise", 8)]
    on.capture([4], kind="full", progress=False)
    assert backend.pdl.asked == [("full", True)] * 2
    assert list(on.stats()["pdl"]["per_key"]) == [("full", 4)]
    for ex in (on, off):
        ex.close()


def test_a_device_that_does_not_run_it_is_left_alone() -> None:
    """A backend with PDL on a device without it (a GPU before Hopper): nothing asked."""
    backend = PlantedBackend(PlantedPDL(available=False))
    on, off = _pair(backend, waits=False, buckets=[8])
    assert _race(on, off, replays=5).clean
    assert backend.pdl.asked == []
    assert {k: on.stats()["pdl"][k] for k in UNSUPPORTED} == UNSUPPORTED
    for ex in (on, off):
        ex.close()
