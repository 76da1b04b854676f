"""What a generation run reports: latencies per request, and a progress display."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger("xgraph")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear between the two nearest ranks); 0 for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def latency_summary(ttft: Sequence[float], per_token: Sequence[float]) -> dict[str, float]:
    """Time to first token and per-token latency (between a request's tokens), p50 / p99."""
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "per_token_p50_s": percentile(per_token, 50),
        "per_token_p99_s": percentile(per_token, 99),
    }


class TokenProgress:
    """Generated tokens against the tokens asked for: a tqdm bar when installed, else a log
    line every tenth of the way. The total grows as requests join."""

    def __init__(self, enabled: bool, desc: str = "generating") -> None:
        self.enabled, self.desc = enabled, desc
        self.total = self.done = 0
        self._bar: Any = None
        self._logged = 0
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=0, desc=desc, unit="tok", leave=False)
            except ImportError:
                pass

    def grow(self, n: int) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled or not n:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        tenth = max(1, math.ceil(self.total / 10))
        if self.done // tenth > self._logged:
            self._logged = self.done // tenth
            logger.info("%s: %d/%d tokens", self.desc, self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
