"""cuMem virtual memory of one CUDA device, through cuda-python's driver bindings.

- reserve: cuMemAddressReserve (address space only);
- create:  cuMemCreate (a pinned physical allocation on the device);
- map:     cuMemMap of the whole handle + cuMemSetAccess (read/write for the device);
- unmap:   cuMemUnmap (the range goes back to being a plain reservation);
- free / release: cuMemRelease / cuMemAddressFree.
One handle mapped at two addresses aliases. The contract is checked in Python before any
driver call, with the same messages as the CPU reference VMM, so a misuse never reaches the
driver; a driver failure raises VirtualMemoryError carrying the driver's error name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from cuda.bindings import driver as cu

from xgraph.errors import VirtualMemoryError
from xgraph.interfaces import PhysicalChunk, VirtualMemory

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


@dataclass(eq=False)
class _Chunk:
    chunk: PhysicalChunk
    mapped_at: set[int] = field(default_factory=set)


class CUDAVirtualMemory(VirtualMemory):
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
        self._lock = threading.Lock()
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
        self.granularity = int(
            check(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )
        self._reservations: dict[int, int] = {}  # start -> size
        self._mappings: dict[int, _Chunk] = {}  # address -> chunk mapped there
        self._chunks: dict[int, _Chunk] = {}  # id(PhysicalChunk) -> live chunk

    # -- helpers ---------------------------------------------------------------------------

    def _ensure_context(self) -> None:
        """Driver calls need a current context; threads torch never used have none."""
        err, ctx = cu.cuCtxGetCurrent()
        if err == _SUCCESS and ctx is not None and int(ctx) != 0:
            return
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._primary))

    def _check_size(self, call: str, size: int) -> None:
        if size <= 0 or size % self.granularity:
            raise VirtualMemoryError(
                call,
                f"size {size} is not a positive multiple of the granularity {self.granularity}",
                "Round sizes up to VirtualMemory.granularity.",
            )

    def _reservation_of(self, address: int, size: int) -> int:
        for start, rsize in self._reservations.items():
            if start <= address and address + size <= start + rsize:
                return start
        raise VirtualMemoryError(
            "map",
            f"[{address:#x}, {address + size:#x}) is not inside a reservation",
            "Map only inside ranges returned by reserve().",
        )

    def _live(self, call: str, chunk: PhysicalChunk) -> _Chunk:
        state = self._chunks.get(id(chunk))
        if state is None or state.chunk is not chunk:
            raise VirtualMemoryError(call, "chunk was not created here or is already freed")
        return state

    # -- contract --------------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        size = int(size)
        self._check_size("reserve", size)
        with self._lock:
            self._ensure_context()
            address = int(check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0)))
            if address % self.granularity:
                # the default alignment was smaller than a chunk: ask for it explicitly
                check("cuMemAddressFree", cu.cuMemAddressFree(address, size))
                address = int(
                    check(
                        "cuMemAddressReserve",
                        cu.cuMemAddressReserve(size, self.granularity, 0, 0),
                    )
                )
            self._reservations[address] = size
        return address

    def release(self, address: int) -> None:
        address = int(address)
        with self._lock:
            size = self._reservations.get(address)
            if size is None:
                raise VirtualMemoryError("release", f"{address:#x} is not a reservation's start")
            inside = [a for a in self._mappings if address <= a < address + size]
            if inside:
                raise VirtualMemoryError(
                    "release",
                    f"{len(inside)} chunk(s) still mapped in the range",
                    "unmap() every mapping before release().",
                )
            self._ensure_context()
            check("cuMemAddressFree", cu.cuMemAddressFree(address, size))
            del self._reservations[address]

    def create(self, size: int) -> PhysicalChunk:
        size = int(size)
        self._check_size("create", size)
        with self._lock:
            self._ensure_context()
            handle = check("cuMemCreate", cu.cuMemCreate(size, self._prop, 0))
            chunk = PhysicalChunk(int(handle), size)
            self._chunks[id(chunk)] = _Chunk(chunk)
        return chunk

    def free(self, chunk: PhysicalChunk) -> None:
        with self._lock:
            state = self._live("free", chunk)
            if state.mapped_at:
                raise VirtualMemoryError(
                    "free",
                    f"chunk still mapped at {len(state.mapped_at)} address(es)",
                    "unmap() it everywhere first.",
                )
            self._ensure_context()
            check("cuMemRelease", cu.cuMemRelease(chunk.handle))
            del self._chunks[id(chunk)]

    def map(self, address: int, chunk: PhysicalChunk) -> None:
        address = int(address)
        with self._lock:
            state = self._live("map", chunk)
            if address % self.granularity:
                raise VirtualMemoryError(
                    "map", f"address {address:#x} is not aligned to {self.granularity}"
                )
            self._reservation_of(address, chunk.size)
            for a, other in self._mappings.items():
                if a < address + chunk.size and address < a + other.chunk.size:
                    raise VirtualMemoryError(
                        "map",
                        f"[{address:#x}, +{chunk.size}) overlaps the mapping at {a:#x}",
                        "unmap() it first.",
                    )
            self._ensure_context()
            check("cuMemMap", cu.cuMemMap(address, chunk.size, 0, chunk.handle, 0))
            try:
                check("cuMemSetAccess", cu.cuMemSetAccess(address, chunk.size, [self._access], 1))
            except VirtualMemoryError:
                cu.cuMemUnmap(address, chunk.size)  # leave no inaccessible mapping behind
                raise
            self._mappings[address] = state
            state.mapped_at.add(address)

    def unmap(self, address: int) -> None:
        address = int(address)
        with self._lock:
            state = self._mappings.get(address)
            if state is None:
                raise VirtualMemoryError("unmap", f"nothing is mapped at {address:#x}")
            self._ensure_context()
            check("cuMemUnmap", cu.cuMemUnmap(address, state.chunk.size))
            del self._mappings[address]
            state.mapped_at.discard(address)

    # -- reporting -------------------------------------------------------------------------

    def physical_bytes(self) -> int:
        """Bytes of physical memory held in live chunks (what aliases share)."""
        with self._lock:
            return sum(s.chunk.size for s in self._chunks.values())

    def live(self) -> dict[str, int]:
        """Counts of live reservations, mappings and chunks (leak checks)."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "mappings": len(self._mappings),
                "chunks": len(self._chunks),
            }
