"""The CPU reference backend: recorded-op graphs and memfd-backed virtual memory."""

from .backend import CPUBackend
from .graph import CPUGraph
from .placement import PlaceInPool
from .pool import HostCachingPool
from .tape import OpTape, host_tensor
from .vmm import HostVirtualMemory

__all__ = [
    "CPUBackend",
    "CPUGraph",
    "HostCachingPool",
    "HostVirtualMemory",
    "OpTape",
    "PlaceInPool",
    "host_tensor",
]
