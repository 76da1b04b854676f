"""The torch-style device layer: what every torch device adapter would otherwise write.

A device whose torch module has streams, graph objects and MemPools (torch.cuda, torch_npu)
is an adapter of four parts: its `TorchRuntime` (one-liners over the torch module), its
`CheckedVirtualMemory`, its probe, and what is really its own (kernels, error tables). The
layer writes the rest once: `StreamGraph` (side-stream capture, failed-capture undo),
`MemPoolCapturePool` (native or routed MemPools, keeper graph, parked pools) and
`TorchBackend` (capture stream, warm-up, pools, the threading rules). Not imported by
`import xgraph`; adapters reach it through `xgraph.adapter`.
"""

from .backend import TorchBackend
from .captures import CaptureBook, book, when_no_capture
from .graph import StreamGraph
from .pool import MemPoolCapturePool, keeper_graph, routing_allocator
from .runtime import PoolId, TorchRuntime

__all__ = [
    "CaptureBook",
    "MemPoolCapturePool",
    "PoolId",
    "StreamGraph",
    "TorchBackend",
    "TorchRuntime",
    "book",
    "keeper_graph",
    "routing_allocator",
    "when_no_capture",
]
