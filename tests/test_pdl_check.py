"""`xgraph check`'s PDL race check (`xgraph.pdl_check`): nothing to check without PDL, and a
clean report over the reference model's decode buckets where the backend offers it (the
CPU backend with a PDL option that changes nothing: the two captures agree bit for bit)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from xgraph.backends.cpu.backend import CPUBackend
from xgraph.check_cli import race
from xgraph.kernels import Kernels, ProgrammaticLaunch
from xgraph.pdl_check import check_decode


class NoOpPDL(ProgrammaticLaunch):
    def __init__(self) -> None:
        self.asked: list[tuple[str, bool]] = []

    def capture(self, kind: str, enabled: bool) -> AbstractContextManager[Any]:
        self.asked.append((kind, enabled))
        return nullcontext()

    def programmatic_edges(self, graph: Any) -> int | None:
        return None


class PDLBackend(CPUBackend):
    pdl = NoOpPDL()

    def kernels(self) -> Kernels:
        return replace(super().kernels(), pdl=self.pdl)


def test_no_pdl_nothing_to_check(capsys: Any) -> None:
    assert check_decode(CPUBackend(), "tiny", [1]) is None
    args = type("A", (), {"pdl_replays": 3, "kind": "both", "model": "tiny", "sizes": [1]})
    assert race(args, CPUBackend())
    assert "has no programmatic dependent launch" in capsys.readouterr().out


def test_clean_over_every_bucket() -> None:
    backend = PDLBackend()
    reports = check_decode(backend, "tiny", [1, 4], replays=3)
    assert reports is not None and [r.key for r in reports] == [1, 4]
    assert all(r.clean and r.replays == 3 for r in reports)
    assert ("full", True) in backend.pdl.asked  # the PDL capture was asked for


def test_skipped_when_asked_or_not_a_reference_model(capsys: Any) -> None:
    off = type("A", (), {"pdl_replays": 0, "kind": "both", "model": "tiny", "sizes": [1]})
    assert race(off, PDLBackend())
    folder = type("A", (), {"pdl_replays": 5, "kind": "full", "model": "/m", "sizes": [1]})
    assert race(folder, PDLBackend())
    assert "reference model shapes only" in capsys.readouterr().out
