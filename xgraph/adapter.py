"""xgraph for adapter authors: the contract, its checked templates and the torch-style layer.

An engine needs `import xgraph`; an adapter imports from here:

- the contract (`xgraph.interfaces`): `Backend`, `CapturePool`, `AttentionRunner`,
  `HostCopier`, `Kernels`, `BenchmarkHooks`, `SegmentAllocator`, `Availability`,
  `PhysicalChunk`, `Launch` (what a readable recording launches), and the raw `Graph` /
  `VirtualMemory` ABCs that document the templates;
- the templates that implement the public halves once: `CheckedGraph`,
  `CheckedVirtualMemory`;
- the torch-style device layer (`xgraph.device`): `TorchRuntime`, the port an adapter
  writes as one-liners over its torch module, and `TorchBackend`, `StreamGraph`,
  `MemPoolCapturePool` written over it;
- registration and checks: `BackendSpec`, `hookimpl`, `check_backend_class`,
  `IncompleteBackendError`;
- what runners see: `AttentionMetadata`, `KVCache`, `capturing_graph`.
docs/writing-an-adapter.md says which to write and how to prove it.
"""

from __future__ import annotations

from .contract import check_backend_class
from .device import MemPoolCapturePool, PoolId, StreamGraph, TorchBackend, TorchRuntime
from .errors import IncompleteBackendError
from .graphs import CheckedGraph, capturing_graph
from .hooks import BackendSpec, hookimpl
from .interfaces import (
    AttentionRunner,
    Availability,
    Backend,
    BenchmarkHooks,
    CapturePool,
    Graph,
    HostCopier,
    Kernels,
    Launch,
    PhysicalChunk,
    SegmentAllocator,
    VirtualMemory,
)
from .metadata import AttentionMetadata, KVCache
from .vmm import CheckedVirtualMemory

__all__ = [
    "AttentionMetadata",
    "AttentionRunner",
    "Availability",
    "Backend",
    "BackendSpec",
    "BenchmarkHooks",
    "CapturePool",
    "CheckedGraph",
    "CheckedVirtualMemory",
    "Graph",
    "HostCopier",
    "IncompleteBackendError",
    "KVCache",
    "Kernels",
    "Launch",
    "MemPoolCapturePool",
    "PhysicalChunk",
    "PoolId",
    "SegmentAllocator",
    "StreamGraph",
    "TorchBackend",
    "TorchRuntime",
    "VirtualMemory",
    "capturing_graph",
    "check_backend_class",
    "hookimpl",
]
