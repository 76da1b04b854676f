"""Kernels per step and the idle share of a step's span, read off a device trace.

A few steps run under torch.profiler with the device's activity (CUPTI on CUDA, which sees
each kernel a graph replay launches), each step synchronized, so steps lie apart on the
device's timeline; the largest gaps between kernels split them. Per step: the kernels it
launched (copies and memsets not counted), the time at least one kernel ran (`busy`), the
span from the first kernel's start to the last one's end, and `gap_share` = 1 - busy / span:
the share of the step the device sat idle between kernels. Medians over the steps.
Backends whose device the profiler cannot trace give None.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ..interfaces import Backend

TRACED = {"cuda": "CUDA"}  # device type -> torch.profiler activity
NOT_KERNELS = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")


def _activity(backend: Backend) -> Any:
    name = TRACED.get(backend.device.type)
    return getattr(torch.profiler.ProfilerActivity, name) if name else None


def _kernel_spans(prof: Any) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every device kernel the profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(NOT_KERNELS):
            continue
        out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return sorted(out)


def split_steps(spans: list[tuple[float, float, str]], steps: int) -> list[list]:
    """The kernels of each step: cut at the steps - 1 widest gaps between kernels."""
    if steps <= 1 or len(spans) < steps:
        return [spans] if spans else []
    gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - spans[i - 1][1])
    cuts = sorted(gaps[-(steps - 1) :])
    bounds = [0, *cuts, len(spans)]
    return [spans[a:b] for a, b in itertools.pairwise(bounds)]


def step_stats(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """Kernels, busy and span (us) and the idle share of one step's kernels."""
    busy, end = 0.0, float("-inf")
    for s, e, _ in kernels:  # sorted by start: the union of the intervals
        if s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    return {
        "kernels": len(kernels),
        "busy_us": busy,
        "span_us": span,
        "gap_share": 1.0 - busy / span if span > 0 else 0.0,
    }


def profile_steps(backend: Backend, step: Callable[[], Any], steps: int = 5) -> dict | None:
    """Medians over `steps` synchronized steps, and the step's longest kernels by name
    (total us per step); None where the profiler cannot trace the device."""
    activity = _activity(backend)
    if activity is None:
        return None
    step()  # anything lazy happens outside the trace
    backend.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
            backend.synchronize()
    per = [step_stats(k) for k in split_steps(_kernel_spans(prof), steps) if k]
    if not per:
        return None
    out: dict[str, Any] = {k: statistics.median(p[k] for p in per) for k in per[0]}
    out["steps"] = len(per)
    out["top_kernels_us"] = _top(_kernel_spans(prof), len(per))
    return out


def _top(spans: list[tuple[float, float, str]], steps: int, n: int = 8) -> dict[str, float]:
    """The n kernel names with the most device time per step."""
    total: dict[str, float] = {}
    for s, e, name in spans:
        total[name] = total.get(name, 0.0) + (e - s) / steps
    top = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return {name[:80]: us for name, us in top}
