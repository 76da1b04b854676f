"""torch_npu's pluggable allocator over xgraph.routing's callbacks (one per runtime).

The two C callbacks are the core's, shared with the CUDA adapter: segment requests of a
routed capture pool reach the SegmentAllocator that `routing(target)` names, frees reach
the target that handed the address out. Only the wrapping differs per runtime
(`_npu_customAllocator(alloc_ptr, free_ptr)` on torch_npu).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from xgraph.routing import callback_pointers

from .runtime import NpuRuntime

_allocators: weakref.WeakKeyDictionary[NpuRuntime, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def get_allocator(runtime: NpuRuntime) -> Any:
    """The runtime's allocator object over xgraph.routing's callbacks (made on first use)."""
    with _lock:
        allocator = _allocators.get(runtime)
        if allocator is None:
            allocator = _allocators[runtime] = runtime.custom_allocator(*callback_pointers())
        return allocator
