"""xgraph: one graph-mode runtime for LLM inference engines across accelerators.

Pick a backend (`get_backend`), wrap the model forward in a `GraphExecutor`, call it every
step. See README.md and docs/ for the model adaptation guide and the adapter contract.
"""

from __future__ import annotations

import logging

from .attention import attention, eager_attention
from .buckets import Buckets, Dim, Input, default_sizes, vllm_capture_sizes
from .contract import check_backend_class
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    BucketOverflowError,
    CaptureError,
    ConcurrentStepError,
    IncompleteBackendError,
    InputError,
    PoolClosedError,
    VirtualMemoryError,
    XGraphError,
    XGraphWarning,
)
from .executor import GraphExecutor
from .graphs import CheckedGraph, graph
from .hooks import BackendSpec, hookimpl
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
from .memory import GraphMemory
from .metadata import AttentionInputs, AttentionMetadata
from .options import Fallback, Kind, MemoryMode, Mode
from .paging import PagedAttention, PagedKVCache
from .plugins import BackendInfo, get_backend, list_backends
from .pool import SharedPhysicalPool

# sleep mode (docs/sleep.md): public names outside __all__; their module is xgraph.sleepmode
from .sleepmode import memory_region as memory_region
from .sleepmode import sleep as sleep
from .sleepmode import wake as wake
from .vmm import CheckedVirtualMemory

__version__ = "0.1.0"

logging.getLogger("xgraph").addHandler(logging.NullHandler())

__all__ = [
    "AttentionInputs",
    "AttentionMetadata",
    "AttentionRunner",
    "Availability",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "BucketOverflowError",
    "Buckets",
    "CaptureError",
    "CapturePool",
    "CheckedGraph",
    "CheckedVirtualMemory",
    "ConcurrentStepError",
    "Dim",
    "Fallback",
    "Graph",
    "GraphExecutor",
    "GraphMemory",
    "IncompleteBackendError",
    "Input",
    "InputError",
    "Kind",
    "MemoryMode",
    "Mode",
    "PagedAttention",
    "PagedKVCache",
    "PhysicalChunk",
    "PoolClosedError",
    "SegmentAllocator",
    "SharedPhysicalPool",
    "VirtualMemory",
    "VirtualMemoryError",
    "XGraphError",
    "XGraphWarning",
    "__version__",
    "attention",
    "check_backend_class",
    "default_sizes",
    "eager_attention",
    "get_backend",
    "graph",
    "hookimpl",
    "list_backends",
    "vllm_capture_sizes",
]
