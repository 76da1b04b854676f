"""xgraph: one graph-mode runtime for LLM inference engines across accelerators.

Pick a backend (`get_backend`), wrap the model forward in a `GraphExecutor`, call it every
step. This namespace is what an engine needs; adapter authors import `xgraph.adapter`.
See README.md and docs/ for the model adaptation guide and the adapter contract.
"""

from __future__ import annotations

import logging

from .attention import attention
from .buckets import Buckets, Dim, Input
from .distributed import Parallel
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    BucketOverflowError,
    CaptureError,
    ConcurrentStepError,
    InputError,
    PoolClosedError,
    VirtualMemoryError,
    XGraphError,
    XGraphWarning,
)
from .executor import GraphExecutor
from .graphs import graph
from .memory import GraphMemory

# the graph memory every bucket needs, before the KV cache exists (docs/startup.md):
# engine-facing, outside the 25 names of __all__
from .memory_plan import predict_graph_memory as predict_graph_memory
from .metadata import AttentionInputs
from .options import Fallback, MemoryMode, Mode
from .paging import PagedAttention, PagedKVCache
from .plugins import get_backend

# the profile run before the KV cache exists, and the runners an executor picks
# (docs/engine-integration.md): engine-facing, outside the 25 names of __all__
from .profile_run import profile_step as profile_step
from .runners import runners_for as runners_for

# sleep mode (docs/sleep.md): engine-facing, but outside the 25 names of __all__; their
# module is xgraph.sleepmode
from .sleepmode import memory_region as memory_region
from .sleepmode import sleep as sleep
from .sleepmode import wake as wake

__version__ = "0.1.0"

logging.getLogger("xgraph").addHandler(logging.NullHandler())

__all__ = [
    "AttentionInputs",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "BucketOverflowError",
    "Buckets",
    "CaptureError",
    "ConcurrentStepError",
    "Dim",
    "Fallback",
    "GraphExecutor",
    "GraphMemory",
    "Input",
    "InputError",
    "MemoryMode",
    "Mode",
    "PagedAttention",
    "PagedKVCache",
    "Parallel",
    "PoolClosedError",
    "VirtualMemoryError",
    "XGraphError",
    "XGraphWarning",
    "attention",
    "get_backend",
    "graph",
]
