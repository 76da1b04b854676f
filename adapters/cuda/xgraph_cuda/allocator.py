"""torch's pluggable CUDA allocator over xgraph's routing callbacks (one for the process)."""

from __future__ import annotations

import threading
from typing import Any

from xgraph.routing import callback_pointers

_allocator: Any = None
_allocator_lock = threading.Lock()


def get_allocator() -> Any:
    """The one torch CUDA allocator over xgraph.routing's callbacks (made on first use)."""
    global _allocator
    with _allocator_lock:
        if _allocator is None:
            import torch

            _allocator = torch._C._cuda_customAllocator(*callback_pointers())
        return _allocator
