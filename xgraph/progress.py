"""Progress of long loops (captures): a tqdm bar when installed and wanted, else log lines."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

logger = logging.getLogger("xgraph")


def progress(items: list[int], desc: str, enabled: bool) -> Iterable[int]:
    """tqdm when installed and wanted; otherwise a log line every tenth of the way."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(items, desc=desc, unit="graph", leave=False)
        except ImportError:
            pass

    def logged() -> Iterable[int]:
        step = max(1, math.ceil(len(items) / 10))
        for i, n in enumerate(items):
            if i % step == 0:
                logger.info("%s: %d/%d", desc, i, len(items))
            yield n

    return logged()
