"""The CPU reference backend: always available, runs every contract without an accelerator."""

from __future__ import annotations

import os
import platform

import torch

from ...errors import XGraphError
from ...interfaces import Availability, Backend, CapturePool, SegmentAllocator
from .graph import CPUGraph
from .pool import HostCachingPool
from .tape import host_tensor
from .vmm import HostVirtualMemory, proportional_resident_bytes


class CPUBackend(Backend):
    """Recorded-op graphs on the host; memfd-backed VMM, so pools behave as on a GPU."""

    name = "cpu"
    graph_class = CPUGraph
    virtual_memory_class = HostVirtualMemory if hasattr(os, "memfd_create") else None
    graph_executables = False  # a recording is Python objects: the memory plan counts 0

    def __init__(self) -> None:
        # replays since the last synchronize: CPU work is done when it returns, but the
        # backend keeps a GPU's queue discipline so CI catches teardown that would unmap
        # memory under queued kernels on a device (the VMM refuses to unmap while > 0)
        self.queued = 0

    @classmethod
    def availability(cls) -> Availability:
        vmm = "memfd VMM" if cls.virtual_memory_class else "no VMM (memfd_create missing)"
        return Availability(
            True,
            f"reference backend: recorded-op graphs, {vmm}",
            {"torch": torch.__version__, "python": platform.python_version()},
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        vm = self.virtual_memory()
        if vm is None:
            raise XGraphError("CPU capture pools need memfd_create (Linux); this OS has none.")
        return HostCachingPool(vm, segments)  # type: ignore[arg-type]  # ours: a HostVirtualMemory

    def synchronize(self) -> None:
        """CPU ops complete before they return; only the queue discipline is reset."""
        self.queued = 0

    def capture_space_bytes(self) -> int:
        """The host's physical memory: no capture can use more (its pages are memfd pages)."""
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):  # no such sysconf name here: the core's default
            return super().capture_space_bytes()

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return host_tensor(address, nbytes)

    def memory_in_use(self) -> int | None:
        return proportional_resident_bytes() or None

    def device_name(self) -> str:
        return f"{platform.processor() or platform.machine()} (CPU)"
