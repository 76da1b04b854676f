"""cuMem virtual memory of one CUDA device, through cuda-python's driver bindings.

- reserve: cuMemAddressReserve (address space only);
- create:  cuMemCreate (a pinned physical allocation on the device);
- map:     cuMemMap of the whole handle + cuMemSetAccess (read/write for the device);
- unmap:   cuMemUnmap (the range goes back to being a plain reservation);
- free / release: cuMemRelease / cuMemAddressFree;
- the scratch chunk of a sleeping range (CheckedVirtualMemory.cover): one cuMemMap of the
  one-granule handle per granule (cuMemMap maps a whole handle), then one cuMemSetAccess
  over the whole range, as torch's expandable segments set access once for many handles.
One handle mapped at two addresses aliases. CheckedVirtualMemory checks the contract before
any driver call (the same messages on every backend), so a misuse never reaches the driver;
a driver failure raises VirtualMemoryError carrying the driver's error name.
"""

from __future__ import annotations

from typing import Any

import torch
from cuda.bindings import driver as cu

from xgraph.adapter import CheckedVirtualMemory, VirtualMemoryError

_SUCCESS = cu.CUresult.CUDA_SUCCESS

# what to do about a driver failure of each call (appended to the error's message)
_HINTS = {
    "cuMemAddressReserve": "Reserve less address space (SharedPhysicalPool(space_bytes=...)).",
    "cuMemCreate": (
        "The device could not supply another physical chunk: free device memory "
        "(torch.cuda.empty_cache(), fewer captured buckets) or use larger chunks."
    ),
    "cuMemMap": "The range must be reserved and free, and the handle live.",
    "cuMemSetAccess": "The mapping was undone; check that the device supports VMM access.",
}


def error_name(err: Any) -> str:
    """The driver's name for a CUresult, e.g. 'CUDA_ERROR_OUT_OF_MEMORY'."""
    try:
        status, name = cu.cuGetErrorName(err)
        if status == _SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # an unknown code: fall back to the enum's own name
        pass
    return str(getattr(err, "name", None) or f"CUresult {int(err)}")


def _error_text(err: Any) -> str:
    try:
        status, text = cu.cuGetErrorString(err)
        if status == _SUCCESS and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    return ""


def check(call: str, result: tuple, hint: str = "") -> Any:
    """Raise VirtualMemoryError for a failed driver call; else return its value(s), if any."""
    err = result[0]
    if err != _SUCCESS:
        text = _error_text(err)
        parts = (f"({text})" if text else "", hint or _HINTS.get(call, ""))
        extra = " ".join(p for p in parts if p)
        raise VirtualMemoryError(call, error_name(err), extra)
    rest = result[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class CUDAVirtualMemory(CheckedVirtualMemory):
    """cuMem VirtualMemory of the backend's device; granularity is the driver's minimum."""

    def __init__(self, backend: Any) -> None:
        index = backend.device.index
        self.device_index = torch.cuda.current_device() if index is None else int(index)
        torch.cuda.init()
        check("cuInit", cu.cuInit(0))
        dev = check("cuDeviceGet", cu.cuDeviceGet(self.device_index))
        # the primary context is the one the runtime (torch) uses; retaining it creates it if
        # torch has not touched the device yet. Kept for the process's life.
        self._primary = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
        self._ensure_context()

        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        super().__init__(backend)

    def _granularity(self) -> int:
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(
            check(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(self._prop, flag),
            )
        )

    def _ensure_context(self) -> None:
        """Driver calls need a current context; threads torch never used have none."""
        err, ctx = cu.cuCtxGetCurrent()
        if err == _SUCCESS and ctx is not None and int(ctx) != 0:
            return
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._primary))

    # -- driver calls (the contract is checked by CheckedVirtualMemory first) ---------------

    def _reserve_range(self, size: int) -> int:
        self._ensure_context()
        address = int(check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0)))
        if address % self.granularity:
            # the default alignment was smaller than a chunk: ask for it explicitly
            check("cuMemAddressFree", cu.cuMemAddressFree(address, size))
            address = int(
                check("cuMemAddressReserve", cu.cuMemAddressReserve(size, self.granularity, 0, 0))
            )
        return address

    def _release_range(self, address: int, size: int) -> None:
        self._ensure_context()
        check("cuMemAddressFree", cu.cuMemAddressFree(address, size))

    def _create_chunk(self, size: int) -> int:
        self._ensure_context()
        return int(check("cuMemCreate", cu.cuMemCreate(size, self._prop, 0)))

    def _free_chunk(self, handle: int, size: int) -> None:
        self._ensure_context()
        check("cuMemRelease", cu.cuMemRelease(handle))

    def _map_chunk(self, address: int, handle: int, size: int) -> None:
        self._ensure_context()
        check("cuMemMap", cu.cuMemMap(address, size, 0, handle, 0))
        try:
            check("cuMemSetAccess", cu.cuMemSetAccess(address, size, [self._access], 1))
        except VirtualMemoryError:
            cu.cuMemUnmap(address, size)  # leave no inaccessible mapping behind
            raise

    def _unmap_chunk(self, address: int, size: int) -> None:
        self._ensure_context()
        check("cuMemUnmap", cu.cuMemUnmap(address, size))

    def _map_scratch(self, address: int, size: int, handle: int) -> None:
        self._ensure_context()
        g, done = self.granularity, 0
        try:
            for a in range(address, address + size, g):
                check("cuMemMap", cu.cuMemMap(a, g, 0, handle, 0))
                done += g
            check("cuMemSetAccess", cu.cuMemSetAccess(address, size, [self._access], 1))
        except VirtualMemoryError:
            for a in range(address, address + done, g):  # leave no mapping of it behind
                cu.cuMemUnmap(a, g)
            raise
