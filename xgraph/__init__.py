"""xgraph: one graph-mode runtime for LLM inference engines across accelerators.

Pick a backend (`get_backend`), wrap the model forward in a `GraphExecutor`, call it every
step. See README.md and docs/ for the model adaptation guide and the adapter contract.
"""

from __future__ import annotations

import logging

from .attention import AttentionMetadata, attention, eager_attention
from .buckets import Buckets, Dim, Input, default_sizes, vllm_capture_sizes
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
from .executor import AttentionInputs, GraphExecutor, PagedAttention, XGraphWarning
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
from .plugins import BackendInfo, BackendSpec, get_backend, hookimpl, list_backends
from .pool import SharedPhysicalPool

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
    "Dim",
    "Graph",
    "GraphExecutor",
    "GraphMemory",
    "IncompleteBackendError",
    "Input",
    "InputError",
    "PagedAttention",
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
    "default_sizes",
    "eager_attention",
    "get_backend",
    "hookimpl",
    "list_backends",
    "vllm_capture_sizes",
]
