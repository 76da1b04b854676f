"""Programmatic dependent launch (PDL) inside captured graphs: the capture option, and the
race check that must pass before a key captured with it is trusted.

With PDL a kernel may start while its predecessor is still finishing; a kernel that reads
its predecessor's output before waiting for it (a missing fence) reads stale data on some
replays and not others (the technique's best-known bug: FlashInfer, NaN in 373 of 400
iterations). A backend offers PDL through `Kernels.pdl` (`ProgrammaticLaunch`): a context
to record a graph in, which turns it on for full decode graphs only (it costs host time and
hurts prefill), and a count of a captured graph's programmatic edges. `capture_options` is
what an executor enters around the warm-up and the capture of a key; it is a no-op where
PDL is not asked for or the backend has none.

`race_check` replays a key captured with PDL and the same key captured without
(`capture_options(..., baseline=True)`: where the backend can, the same kernel binaries
launched without the PDL attribute, so the two graphs differ by that alone), N times,
new inputs before each pair, and compares every output bit for bit (the decode kernels are
deterministic: split reductions finish in a fixed order), naming the first mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from .kernels import Kernels

Outputs = Callable[[], Sequence[torch.Tensor]]


def capture_options(
    kernels: Kernels, kind: str, pdl: bool, baseline: bool = False
) -> AbstractContextManager[Any]:
    """The context to warm up and record a graph of `kind` ("full", "piecewise") in: the
    backend's PDL capture where `pdl` is asked and it has one, else nothing. `baseline`: the
    race check's other capture of the key (the same kernels launched without PDL)."""
    if kernels.pdl is None or not (pdl or baseline):
        return nullcontext()
    if baseline:
        return kernels.pdl.baseline(kind)
    return kernels.pdl.capture(kind, pdl)


@dataclass(frozen=True)
class Mismatch:
    """Where the replays first disagreed: replay, output, flat element index and values."""

    replay: int
    output: int
    index: int
    with_pdl: float
    without_pdl: float


@dataclass
class RaceReport:
    key: Any
    replays: int
    mismatches: int = 0  # replays in which any output differed
    first: Mismatch | None = None
    per_output: dict[int, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.mismatches == 0

    def describe(self) -> str:
        if self.clean:
            return f"{self.key}: clean over {self.replays} replays"
        f = self.first
        assert f is not None
        return (
            f"{self.key}: {self.mismatches} of {self.replays} replays differ; first at replay "
            f"{f.replay}, output {f.output}, element {f.index}: {f.with_pdl!r} with PDL, "
            f"{f.without_pdl!r} without"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The flat index of the first element whose bits differ (NaNs compare by bits), or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return 0
    if torch.equal(_bits(a), _bits(b)):
        return None
    differ = (_bits(a) != _bits(b)).nonzero()
    return int(differ[0]) // a.element_size()


def race_check(
    with_pdl: Outputs,
    without_pdl: Outputs,
    feed: Callable[[int], None],
    replays: int = 200,
    key: Any = None,
) -> RaceReport:
    """`replays` pairs of replays, `feed(i)` writing new inputs before pair i; each replay
    returns its outputs (copied before the next one runs)."""
    report = RaceReport(key, replays)
    for i in range(replays):
        feed(i)
        a = [t.clone() for t in with_pdl()]
        b = [t.clone() for t in without_pdl()]
        bad = False
        for j, (x, y) in enumerate(zip(a, b)):
            at = first_difference(x, y)
            if at is None:
                continue
            bad = True
            report.per_output[j] = report.per_output.get(j, 0) + 1
            if report.first is None:
                xs, ys = x.reshape(-1), y.reshape(-1)
                report.first = Mismatch(i, j, at, float(xs[at]), float(ys[at]))
        report.mismatches += bad
    return report
