"""xgraph for adapter authors: the whole contract an adapter is written against.

An engine needs `import xgraph`; an adapter imports the core from here, and its registration
module from `xgraph.hooks` only (a simulator of the device also from `xgraph.testing.sim`;
tests/test_architecture.py holds adapters to that):

- the contract (`xgraph.interfaces`): `Backend`, `CapturePool`, `AttentionRunner`,
  `HostCopier`, `Kernels`, `BenchmarkHooks`, `SegmentAllocator`, `Availability`,
  `PhysicalChunk`, `Launch` (what a readable recording launches; `Unchecked`, `ADDRESS` and
  `by_value` mark the fields a backend cannot compare), and the raw `Graph` /
  `VirtualMemory` ABCs that document the templates;
- the kernel duties' pieces: `Fusion` and `HeadNorm` (`xgraph.fusion`: what a fused
  projection asks of `Kernels.fused_linear`), `ProgrammaticLaunch` (`xgraph.kernels`: a
  backend's programmatic dependent launch, `Kernels.pdl`) and `CheckCall`
  (`xgraph.check_call`: what `Kernels.metadata_check` is handed);
- the templates that implement the public halves once: `CheckedGraph`,
  `CheckedVirtualMemory`, and `TorchCopier` (a host copier over a torch copy and an event,
  whose `_copy` an adapter with a cheaper copy overrides);
- the torch-style device layer (`xgraph.device`): `TorchRuntime`, the port an adapter
  writes as one-liners over its torch module, and `TorchBackend`, `StreamGraph`,
  `MemPoolCapturePool` written over it; `when_no_capture` runs a call that fails during any
  capture of the device (an empty_cache) only when none runs;
- registration and checks: `BackendSpec`, `hookimpl`, `check_backend_class`;
- what runners see and are built from: `AttentionMetadata`, `KVCache`, `capturing_graph`
  (the graph being captured, for update callbacks), and the reference runners' pieces
  (`xgraph.runners`): `PlannedRunner`, `store_kv`, `context_kv`, `SeqSpan`,
  `sequence_spans`;
- the errors an adapter raises (`xgraph.errors`): `XGraphError`, `XGraphWarning`,
  `BackendUnavailableError`, `CaptureError`, `InputError`, `VirtualMemoryError`,
  `IncompleteBackendError`.
docs/writing-an-adapter.md says which to write and how to prove it.
"""

from __future__ import annotations

from .buffers import TorchCopier
from .check_call import CheckCall
from .contract import check_backend_class
from .device import (
    MemPoolCapturePool,
    PoolId,
    StreamGraph,
    TorchBackend,
    TorchRuntime,
    when_no_capture,
)
from .errors import (
    BackendUnavailableError,
    CaptureError,
    IncompleteBackendError,
    InputError,
    VirtualMemoryError,
    XGraphError,
    XGraphWarning,
)
from .fusion import Fusion, HeadNorm
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
from .kernels import ProgrammaticLaunch
from .launches import ADDRESS, Unchecked, by_value
from .metadata import AttentionMetadata, KVCache
from .runners import PlannedRunner, SeqSpan, context_kv, sequence_spans, store_kv
from .vmm import CheckedVirtualMemory

__all__ = [
    "ADDRESS",
    "AttentionMetadata",
    "AttentionRunner",
    "Availability",
    "Backend",
    "BackendSpec",
    "BackendUnavailableError",
    "BenchmarkHooks",
    "CaptureError",
    "CapturePool",
    "CheckCall",
    "CheckedGraph",
    "CheckedVirtualMemory",
    "Fusion",
    "Graph",
    "HeadNorm",
    "HostCopier",
    "IncompleteBackendError",
    "InputError",
    "KVCache",
    "Kernels",
    "Launch",
    "MemPoolCapturePool",
    "PhysicalChunk",
    "PlannedRunner",
    "PoolId",
    "ProgrammaticLaunch",
    "SegmentAllocator",
    "SeqSpan",
    "StreamGraph",
    "TorchBackend",
    "TorchCopier",
    "TorchRuntime",
    "Unchecked",
    "VirtualMemory",
    "VirtualMemoryError",
    "XGraphError",
    "XGraphWarning",
    "by_value",
    "capturing_graph",
    "check_backend_class",
    "context_kv",
    "hookimpl",
    "sequence_spans",
    "store_kv",
    "when_no_capture",
]
