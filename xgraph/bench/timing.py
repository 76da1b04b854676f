"""How the benchmarks time things: device time where the backend can measure it, else host time.

`Timer` asks `backend.time_on_device(fn)` (CUDA: events around the work `fn` queues, behind a
spin kernel that keeps the device busy while the host queues it, so only device time counts) and,
where the backend answers None, falls back to host wall time around a synchronized call.
`host_time` is the host cost of issuing a call, measured with an idle device; `wall_time` the
host's wait for a call to finish, queueing included (what an eager step costs end to end).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..interfaces import Backend
from . import hooks


class Timer:
    """Median time of a callable on the device where the backend can time it, else on the host."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # decided by the first measurement: a backend without a device timer answers None,
        # and asking again every iteration would only add noise
        self.on_device: bool | None = None

    def once(self, fn: Callable[[], Any]) -> float:
        """Seconds one call of `fn` took (device time, or synchronized host wall time)."""
        if self.on_device is not False:
            t = hooks.time_on_device(self.backend, fn)
            if t is not None:
                self.on_device = True
                return t
            self.on_device = False
        # synchronized on both sides so an accelerator's queued work is inside the window
        # (a no-op on the CPU backend, whose ops complete before they return)
        self.backend.synchronize()
        t0 = time.perf_counter()
        fn()
        self.backend.synchronize()
        return time.perf_counter() - t0

    def __call__(self, fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        self.backend.synchronize()
        return statistics.median(self.once(fn) for _ in range(iters))

    @property
    def unit(self) -> str:
        """What the times are, for the reports' "timing" field."""
        if self.on_device:
            return f"device time ({hooks.device_name(self.backend)})"
        if self.backend.device.type == "cpu":
            return "host wall time (CPU backend)"
        return f"host wall time, synchronized ({self.backend.name} has no device timer)"


def host_time(
    backend: Backend, fn: Callable[[], Any], iters: int, until_done: bool = False
) -> float:
    """Median host wall time of issuing `fn` with an idle device (synchronized before each call),
    so the call never waits on earlier work: the host cost alone, not the device's.
    `until_done`: up to the end of `fn`'s device work instead (see `wall_time`)."""
    return host_times(backend, {"fn": fn}, iters, until_done)["fn"]


def host_times(
    backend: Backend, fns: dict[str, Callable[[], Any]], iters: int, until_done: bool = False
) -> dict[str, float]:
    """`host_time` of several calls, taken in turn within each iteration (a host whose speed
    drifts, or compile workers still running from an earlier measurement, then weigh on
    every call alike): {name: median seconds}."""
    ts: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            backend.synchronize()
            t0 = time.perf_counter()
            fn()
            if until_done:
                backend.synchronize()
            ts[name].append(time.perf_counter() - t0)
    backend.synchronize()
    return {name: statistics.median(v) for name, v in ts.items()}


def wall_time(backend: Backend, fn: Callable[[], Any], iters: int) -> float:
    """Median host wall time from an idle device until `fn`'s work is done: queueing and
    device time together, the end-to-end cost of a step that is not a graph."""
    return host_time(backend, fn, iters, until_done=True)
