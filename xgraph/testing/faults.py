"""Fault injection for VirtualMemory drivers: make the n-th call of a driver call fail.

    with fail_driver_call(vm, "_map_chunk", error="CUDA_ERROR_OUT_OF_MEMORY", nth=3):
        ...  # the third map of this VM raises VirtualMemoryError("_map_chunk", ...)

It wraps the driver method of one VM instance (CheckedVirtualMemory calls it after its own
checks), so the failure surfaces exactly where a runtime failure would, on any backend.
`books(vm)` is what a leak check compares: live reservations, mappings and chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..errors import VirtualMemoryError
from ..interfaces import VirtualMemory

DRIVER_CALLS = (
    "_reserve_range",
    "_release_range",
    "_create_chunk",
    "_free_chunk",
    "_map_chunk",
    "_unmap_chunk",
)


class FaultCounter:
    """How often the wrapped call ran, and whether the fault fired."""

    def __init__(self) -> None:
        self.calls = 0
        self.fired = False


@contextlib.contextmanager
def fail_driver_call(
    vm: VirtualMemory, call: str, error: str = "out of memory (injected)", nth: int = 1
) -> Iterator[FaultCounter]:
    """Make the `nth` call of `vm.<call>` (a driver call) raise VirtualMemoryError(call, error)."""
    if call not in DRIVER_CALLS:
        raise ValueError(f"{call!r} is not a driver call; choose one of {DRIVER_CALLS}")
    original = getattr(vm, call)
    counter = FaultCounter()

    def failing(*args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        if counter.calls == nth:
            counter.fired = True
            raise VirtualMemoryError(call, error, "Injected by xgraph.testing.faults.")
        return original(*args, **kwargs)

    setattr(vm, call, failing)
    try:
        yield counter
    finally:
        del vm.__dict__[call]  # the class's method shows through again


def books(vm: VirtualMemory) -> dict[str, int]:
    """Live reservations, mappings and chunks of a CheckedVirtualMemory (leak checks)."""
    return vm.live()  # type: ignore[attr-defined, no-any-return]
