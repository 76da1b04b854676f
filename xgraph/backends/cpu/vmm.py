"""Host virtual memory over memfd_create + mmap: a real analogue of cuMem / aclrt VMM.

- reserve: an anonymous PROT_NONE mapping (address space, no memory behind it);
- create:  a region of one memfd (physical pages, allocated on first touch);
- map:     mmap(MAP_FIXED | MAP_SHARED) of that region at an address in a reservation;
- unmap:   the range goes back to PROT_NONE, the reservation stays;
- free:    the region's pages are punched out of the memfd.
Mapping one region at two addresses aliases: both see the same pages. The kernel's
proportional resident size (Pss) counts such pages once; VmRSS counts every mapping.

A sleeping range is covered by a scratch region of 2 MiB (or one granule, if larger)
mapped piece by piece: mmap maps part of a region, so a 64 KiB granularity needs 32x fewer
maps, and the process fewer of its `vm.max_map_count` mappings (65530 by default: a cover
of 64 KiB pieces would run out past 4 GiB). Its pages exist only where a slept tensor was
touched; one PROT_NONE mapping takes every piece away.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
from typing import Any

from ...errors import VirtualMemoryError, XGraphError
from ...vmm import CheckedVirtualMemory

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
SCRATCH_BYTES = 2 << 20  # the scratch region of sleeping ranges (see the module doc)


def _errno_name() -> str:
    e = ctypes.get_errno()
    return f"{os.strerror(e)} (errno {e})"


class HostVirtualMemory(CheckedVirtualMemory):
    """memfd-backed VirtualMemory of the host; granularity defaults to 64 KiB."""

    def __init__(self, backend: Any = None, granularity: int | None = None) -> None:
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
        self._gran = gran
        self._fd = os.memfd_create("xgraph-physical", getattr(os, "MFD_CLOEXEC", 1))
        self._file_end = 0  # chunks are regions of the memfd; offsets are never reused
        super().__init__(backend)

    def _granularity(self) -> int:
        return self._gran

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

    def _reserve_range(self, size: int) -> int:
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
        return start

    def _refuse_if_queued(self, call: str) -> None:
        """The simulated device queue (CPUBackend.queued): memory a queued replay may still
        use must not go away; on a GPU that is an illegal access, here a clear error."""
        if getattr(self.backend, "queued", 0):
            raise VirtualMemoryError(
                call,
                f"{self.backend.queued} replay(s) queued since the last synchronize may still "
                "use this memory",
                "Synchronize the backend first.",
            )

    def _release_range(self, address: int, size: int) -> None:
        self._refuse_if_queued("release")
        if _libc.munmap(address, size) != 0:
            raise VirtualMemoryError("release (munmap)", _errno_name())

    def _create_chunk(self, size: int) -> int:
        offset = self._file_end
        try:
            os.ftruncate(self._fd, offset + size)
        except OSError as exc:
            raise VirtualMemoryError("create (ftruncate)", str(exc)) from exc
        self._file_end = offset + size
        return offset

    def _free_chunk(self, handle: int, size: int) -> None:
        self._refuse_if_queued("free")
        rc = _libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, handle, size)
        if rc != 0:
            raise VirtualMemoryError("free (fallocate PUNCH_HOLE)", _errno_name())

    def _map_chunk(self, address: int, handle: int, size: int) -> None:
        r = _libc.mmap(
            address,
            size,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | _MAP_FIXED,
            self._fd,
            handle,
        )
        if r in (None, _MAP_FAILED):
            raise VirtualMemoryError("map (mmap MAP_FIXED)", _errno_name())

    def _unmap_chunk(self, address: int, size: int) -> None:
        self._refuse_if_queued("unmap")
        self._placeholder(address, size)

    # -- covers of sleeping ranges (CheckedVirtualMemory.cover) ---------------------------------

    @property
    def scratch_bytes(self) -> int:
        return max(self._gran, SCRATCH_BYTES)

    def _unmap_scratch(self, address: int, size: int) -> None:
        self._unmap_chunk(address, size)  # one PROT_NONE mapping replaces every piece

    def _zero_scratch(self, address: int, size: int) -> None:
        """A fresh region of the memfd reads zeros (offsets are never reused)."""

    def backed_bytes(self) -> int:
        """Bytes of the memfd actually backed by pages, as the kernel counts them."""
        return os.fstat(self._fd).st_blocks * 512


def proportional_resident_bytes() -> int:
    """The process's anonymous and shared-memory Pss from /proc/self/smaps_rollup (pages
    mapped at several addresses counted once). File-backed pages (the libraries' code) are
    left out: their Pss moves whenever another process maps or unmaps the same library, which
    a memory reading must not see. Kernels without the split give the whole Pss."""
    got: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Pss_Anon", "Pss_Shmem"):
                    got[key] = int(rest.split()[0]) * 1024
    except OSError:
        return 0
    if "Pss_Anon" in got and "Pss_Shmem" in got:
        return got["Pss_Anon"] + got["Pss_Shmem"]
    return got.get("Pss", 0)


def range_resident_bytes(start: int, end: int) -> tuple[int, int]:
    """(Rss, Pss) of this process's mappings inside [start, end), from /proc/self/smaps.

    Only those mappings count, so other processes and the rest of this one cannot move the
    reading (process-wide Pss changes whenever another process maps a shared library)."""
    rss = pss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = start <= lo and hi <= end
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
            elif inside and head == "Pss:":
                pss += int(line.split()[1]) * 1024
    return rss, pss


def resident_in(ranges: list[tuple[int, int]]) -> int:
    """Pss of this process's mappings inside any of the (start, size) ranges (/proc/self/smaps):
    the kernel's reading of the memory behind those reservations, aliases counted once."""
    spans = sorted((a, a + n) for a, n in ranges)
    starts = [a for a, _ in spans]
    pss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                i = bisect.bisect_right(starts, lo) - 1
                inside = i >= 0 and hi <= spans[i][1]
            elif inside and head == "Pss:":
                pss += int(line.split()[1]) * 1024
    return pss


def resident_bytes() -> int:
    """The process's VmRSS: every mapping of a shared page counted."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
