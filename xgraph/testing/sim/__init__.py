"""A simulated torch runtime on the host, for the device layer's failure paths in CI.

`SimRuntime` implements `xgraph.device.TorchRuntime` over host memory and recorded-op
graphs, enforcing the rules real runtimes break on (synchronize during a capture, the
caching allocators' pool rules, routing left behind by a failed capture, MemPools dropped
during a capture) and injecting faults on request. A torch-style adapter's tests run the
layer over it; the dummy adapter (tests/dummy_adapter) is a complete backend over it, and the
Ascend simulator builds its ACL runtime on it. It needs no pytest.

An adapter's simulator imports the core from `xgraph.adapter` and from here only, which
also hands on the host pieces a simulator is built from: the CPU backend's `OpTape` (a
recording of host ops) and `HostVirtualMemory` (memfd VMM), and `describe` /
`current_layer`, which turn a recorded task into a `Launch` for the parameterization check.
"""

from xgraph.backends.cpu import HostVirtualMemory, OpTape
from xgraph.launches import current_layer, describe

from .caching import PrivatePool, SimCachingAllocator, SimMemPool, SimPluggableAllocator, mempool_id
from .faults import Faults
from .graph import SimGraph, SimRecorder, leave_recorder
from .runtime import SimDeviceMemory, SimError, SimRuntime
from .streams import Queued, SimStream, SimStreams

__all__ = [
    "Faults",
    "HostVirtualMemory",
    "OpTape",
    "PrivatePool",
    "Queued",
    "SimCachingAllocator",
    "SimDeviceMemory",
    "SimError",
    "SimGraph",
    "SimMemPool",
    "SimPluggableAllocator",
    "SimRecorder",
    "SimRuntime",
    "SimStream",
    "SimStreams",
    "current_layer",
    "describe",
    "leave_recorder",
    "mempool_id",
]
