"""A simulated torch runtime on the host, for the device layer's failure paths in CI.

`SimRuntime` implements `xgraph.device.TorchRuntime` over host memory and recorded-op
graphs, enforcing the rules real runtimes break on (synchronize during a capture, the
caching allocators' pool rules, routing left behind by a failed capture, MemPools dropped
during a capture) and injecting faults on request. A torch-style adapter's tests run the
layer over it; the dummy adapter (tests/dummy_adapter) is a complete backend over it, and the
Ascend simulator builds its ACL runtime on it. It needs no pytest.
"""

from .caching import SimCachingAllocator, SimMemPool, SimPluggableAllocator
from .faults import Faults
from .graph import SimGraph, SimRecorder
from .runtime import SimDeviceMemory, SimError, SimRuntime
from .streams import Queued, SimStream, SimStreams

__all__ = [
    "Faults",
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
]
