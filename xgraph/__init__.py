"""xgraph: one graph-mode runtime for LLM inference engines across accelerators.

Pick a backend (`get_backend`), wrap the model forward in a `GraphExecutor`, call it every
step. See README.md and docs/ for the model adaptation guide and the adapter contract.
"""

from __future__ import annotations

import logging

from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    BucketOverflowError,
    CaptureError,
    IncompleteBackendError,
    InputError,
    PoolClosedError,
    VirtualMemoryError,
    XGraphError,
)
from .interfaces import (
    AttentionRunner,
    Availability,
    Backend,
    CapturePool,
    Graph,
    PhysicalChunk,
    SegmentAllocator,
    VirtualMemory,
)
from .plugins import BackendInfo, BackendSpec, get_backend, hookimpl, list_backends

__version__ = "0.1.0"

logging.getLogger("xgraph").addHandler(logging.NullHandler())

__all__ = [
    "AttentionRunner",
    "Availability",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "BucketOverflowError",
    "CaptureError",
    "CapturePool",
    "Graph",
    "IncompleteBackendError",
    "InputError",
    "PhysicalChunk",
    "PoolClosedError",
    "SegmentAllocator",
    "VirtualMemory",
    "VirtualMemoryError",
    "XGraphError",
    "__version__",
    "get_backend",
    "hookimpl",
    "list_backends",
]
