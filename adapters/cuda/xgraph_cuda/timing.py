"""Device time of queued work, without the host's time to queue it.

Events recorded around `fn()` on an idle device bracket the host's enqueue time as well:
the start event completes at once, then the device waits for every launch `fn` makes (an
executor step's planning, an eager forward's Python). A spin kernel queued first keeps the
device busy while the host queues the work, so the work runs back to back between the
events. The spin's length follows the slowest enqueue seen so far (a call whose enqueue
outlasted its spin runs once more with a longer one), up to MAX_LEAD_S: a step whose host
side takes longer than that (an eager forward of thousands of launches, which also fills
the launch queue) is timed with the device's waits for the host in it, as it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("xgraph")
MAX_LEAD_S = 0.005  # an enqueue slower than this is timed with the host's part in it


class LeadTimer:
    """Times `fn`'s device work on one device, behind a spin kernel that covers its enqueue."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lead_s = 1e-3
        self._cycles_per_s: float | None = None
        self._warned = False

    def cycles_per_s(self) -> float:
        """The spin kernel's clock, measured once (torch.cuda._sleep counts SM cycles)."""
        if self._cycles_per_s is None:
            cycles = 2_000_000
            self._time(lambda: torch.cuda._sleep(cycles), 0)  # load the kernel
            self._cycles_per_s = cycles / self._time(lambda: torch.cuda._sleep(cycles), 0)[0]
        return self._cycles_per_s

    def _time(self, fn: Callable[[], Any], lead_cycles: int) -> tuple[float, float]:
        """(device seconds between the events, host seconds `fn` took to return)."""
        with torch.cuda.device(self.device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if lead_cycles:
                torch.cuda._sleep(lead_cycles)
            start.record()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, host

    def __call__(self, fn: Callable[[], Any]) -> float:
        if not hasattr(torch.cuda, "_sleep"):  # a torch without the spin kernel: plain events
            if not self._warned:
                self._warned = True
                logger.warning(
                    "torch.cuda._sleep is missing: device times include the "
                    "host's time to queue the work"
                )
            return self._time(fn, 0)[0]
        rate = self.cycles_per_s()
        device, host = self._time(fn, int(self.lead_s * rate))
        if host < 0.8 * self.lead_s or self.lead_s >= MAX_LEAD_S:
            return device
        # the spin ended before the host had queued everything: longer, and once more
        self.lead_s = min(2 * host, MAX_LEAD_S)
        return self._time(fn, int(self.lead_s * rate))[0]
