"""Programmatic dependent launch (PDL) for the adapter's Triton kernels, while a capture asks.

Inside `enabled_for(True)` (the backend enters it around the capture of a full decode graph
when the executor asks for PDL), the kernels are launched with the programmatic stream
serialization attribute and wait for their predecessor in the kernel (`gdc_wait`) before
they read or write anything, then let their successor launch (`gdc_launch_dependents`).
Stream capture turns each such launch after a kernel into a programmatic edge of the graph.
Anywhere else they launch as usual, with no wait compiled in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def enabled() -> bool:
    """Whether launches in this thread use PDL now."""
    return bool(getattr(_local, "on", False))


@contextmanager
def enabled_for(on: bool) -> Iterator[None]:
    """Launch the adapter's kernels in this thread with PDL (`on`) until the block ends."""
    before = enabled()
    _local.on = on
    try:
        yield
    finally:
        _local.on = before
