"""Host virtual memory over memfd_create + mmap: a real analogue of cuMem / aclrt VMM.

- reserve: an anonymous PROT_NONE mapping (address space, no memory behind it);
- create:  a region of one memfd (physical pages, allocated on first touch);
- map:     mmap(MAP_FIXED | MAP_SHARED) of that region at an address in a reservation;
- unmap:   the range goes back to PROT_NONE, the reservation stays;
- free:    the region's pages are punched out of the memfd.
Mapping one region at two addresses aliases: both see the same pages. The kernel's
proportional resident size (Pss) counts such pages once; VmRSS counts every mapping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from dataclasses import dataclass

from ...errors import VirtualMemoryError, XGraphError
from ...interfaces import PhysicalChunk, VirtualMemory

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

DEFAULT_GRANULARITY = 64 * 1024  # small enough that tiny models show sum vs max on CPU


def _errno_name() -> str:
    e = ctypes.get_errno()
    return f"{os.strerror(e)} (errno {e})"


@dataclass(eq=False)
class _Handle:
    offset: int
    mapped_at: set[int]


class HostVirtualMemory(VirtualMemory):
    """memfd-backed VirtualMemory of the host; granularity defaults to 64 KiB."""

    def __init__(self, backend: object = None, granularity: int | None = None) -> None:
        if not hasattr(os, "memfd_create"):
            raise XGraphError(
                "The CPU backend's virtual memory needs memfd_create (Linux). On this OS use "
                "memory='private' or 'shared-pool' executors, which need no VMM."
            )
        env = os.environ.get("XGRAPH_CPU_GRANULARITY")
        gran = granularity or (int(env) if env else DEFAULT_GRANULARITY)
        if gran % mmap.PAGESIZE:
            raise XGraphError(
                f"CPU VMM granularity {gran} is not a multiple of the page size {mmap.PAGESIZE}; "
                "choose a multiple (XGRAPH_CPU_GRANULARITY)."
            )
        self.granularity = gran
        self._fd = os.memfd_create("xgraph-physical", getattr(os, "MFD_CLOEXEC", 1))
        self._file_end = 0
        self._lock = threading.Lock()
        self._reservations: dict[int, int] = {}  # start -> size
        self._mappings: dict[int, PhysicalChunk] = {}  # address -> chunk
        self._chunks: set[int] = set()  # id() of live chunks

    # -- helpers ---------------------------------------------------------------------------

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

    def _placeholder(self, address: int, size: int) -> None:
        r = _libc.mmap(
            address,
            size,
            _PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED,
            -1,
            0,
        )
        if r in (None, _MAP_FAILED):
            raise VirtualMemoryError("mmap(PROT_NONE)", _errno_name())

    # -- contract --------------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._check_size("reserve", size)
        gran = self.granularity
        # over-reserve, then trim, so the start is aligned to the granularity
        raw = _libc.mmap(
            None,
            size + gran,
            _PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            -1,
            0,
        )
        if raw in (None, _MAP_FAILED):
            raise VirtualMemoryError("reserve (mmap)", _errno_name(), "Reserve less address space.")
        start = (raw + gran - 1) // gran * gran
        if start > raw:
            _libc.munmap(raw, start - raw)
        tail = raw + size + gran - (start + size)
        if tail:
            _libc.munmap(start + size, tail)
        with self._lock:
            self._reservations[start] = size
        return start

    def release(self, address: int) -> None:
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
            del self._reservations[address]
        if _libc.munmap(address, size) != 0:
            raise VirtualMemoryError("release (munmap)", _errno_name())

    def create(self, size: int) -> PhysicalChunk:
        self._check_size("create", size)
        with self._lock:
            offset = self._file_end
            self._file_end += size
            try:
                os.ftruncate(self._fd, self._file_end)
            except OSError as exc:
                self._file_end -= size
                raise VirtualMemoryError("create (ftruncate)", str(exc)) from exc
            chunk = PhysicalChunk(_Handle(offset, set()), size)
            self._chunks.add(id(chunk))
        return chunk

    def free(self, chunk: PhysicalChunk) -> None:
        with self._lock:
            if id(chunk) not in self._chunks:
                raise VirtualMemoryError("free", "chunk was not created here or is already freed")
            if chunk.handle.mapped_at:
                raise VirtualMemoryError(
                    "free",
                    f"chunk still mapped at {len(chunk.handle.mapped_at)} address(es)",
                    "unmap() it everywhere first.",
                )
            self._chunks.discard(id(chunk))
        rc = _libc.fallocate(
            self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, chunk.handle.offset, chunk.size
        )
        if rc != 0:
            raise VirtualMemoryError("free (fallocate PUNCH_HOLE)", _errno_name())

    def map(self, address: int, chunk: PhysicalChunk) -> None:
        with self._lock:
            if id(chunk) not in self._chunks:
                raise VirtualMemoryError("map", "chunk was not created here or is already freed")
            if address % self.granularity:
                raise VirtualMemoryError(
                    "map", f"address {address:#x} is not aligned to {self.granularity}"
                )
            self._reservation_of(address, chunk.size)
            for a, c in self._mappings.items():
                if a < address + chunk.size and address < a + c.size:
                    raise VirtualMemoryError(
                        "map",
                        f"[{address:#x}, +{chunk.size}) overlaps the mapping at {a:#x}",
                        "unmap() it first.",
                    )
            r = _libc.mmap(
                address,
                chunk.size,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | _MAP_FIXED,
                self._fd,
                chunk.handle.offset,
            )
            if r in (None, _MAP_FAILED):
                raise VirtualMemoryError("map (mmap MAP_FIXED)", _errno_name())
            self._mappings[address] = chunk
            chunk.handle.mapped_at.add(address)

    def unmap(self, address: int) -> None:
        with self._lock:
            chunk = self._mappings.pop(address, None)
            if chunk is None:
                raise VirtualMemoryError("unmap", f"nothing is mapped at {address:#x}")
            chunk.handle.mapped_at.discard(address)
            self._placeholder(address, chunk.size)

    # -- reporting -------------------------------------------------------------------------

    def physical_bytes(self) -> int:
        """Bytes of the memfd actually backed by pages (what aliases share)."""
        return os.fstat(self._fd).st_blocks * 512

    def live(self) -> dict[str, int]:
        """Counts of live reservations, mappings and chunks (leak checks)."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "mappings": len(self._mappings),
                "chunks": len(self._chunks),
            }


def proportional_resident_bytes() -> int:
    """The process's Pss from /proc/self/smaps_rollup: shared pages counted once per process."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """The process's VmRSS: every mapping of a shared page counted."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
