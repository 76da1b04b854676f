"""A libascendcl stand-in: the ACL prototypes bound to Python over host memory, with books.

The functions are built from the same ctypes prototypes the real binding uses
(`AclFunctions.from_python`), so the adapter calls C function pointers and the simulator
decodes `void**` out-parameters and `aclrtPhysicalMemProp*` exactly as C would receive them.
Memory is the CPU backend's memfd VMM (HostVirtualMemory) at a 2 MiB granularity: a physical
handle is a memfd region, a mapping is mmap(MAP_FIXED|MAP_SHARED), so one handle mapped at two
addresses really aliases. Every documented rule is enforced (docs/ascend.md, 'rules');
which code the real driver returns for each misuse is not documented, so the codes chosen
here are the simulator's (ACL_ERROR_INVALID_PARAM for acl-layer checks, 107008 for an
unaligned address, 107017 for an unknown handle, 207001 when the device is full).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

from xgraph.backends.cpu import HostVirtualMemory
from xgraph.interfaces import PhysicalChunk

from .. import acl
from ..errors import error_name
from .faults import Faults

logger = logging.getLogger("xgraph")

GRAN = acl.GRANULARITY_2M
INVALID_PARAM = 100000
RT_PARAM_INVALID = 107000
ADDR_UNALIGNED = 107008
INVALID_HANDLE = 107017
MEMORY_ALLOCATION = 207001
DRV_INTERNAL = 507899
MISALIGN = 64 << 10  # where a deliberately misaligned reservation starts past the boundary


class AclRuleError(Exception):
    """A call broke a rule: becomes the call's return code."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def _rule(ok: bool, code: int, why: str) -> None:
    if not ok:
        raise AclRuleError(code, why)


class SimAcl:
    """The simulated libascendcl of one device: VMM, aclrtMalloc, capture end, books."""

    def __init__(self, device_index: int, capacity: int, faults: Faults) -> None:
        self.device_index = device_index
        self.capacity = capacity
        self.faults = faults
        self.hbm = HostVirtualMemory(granularity=GRAN)
        self.reserve_flags = {0, 1}  # the flags aclrtReserveMemAddress accepts
        self.misaligned_reserves = 0  # next reservations returned off a 2 MiB boundary
        self.busy: Callable[[], bool] = lambda: False  # queued device work (set by runtime)
        self.end_capture: Callable[[int], int] = lambda stream: 107029
        self._lock = threading.RLock()
        self._reservations: dict[int, tuple[int, int]] = {}  # va -> (host base, size)
        self._handles: dict[int, PhysicalChunk] = {}
        self._mapped: dict[int, int] = {}  # va -> handle
        self._mallocs: dict[int, PhysicalChunk] = {}
        self._ris: set[int] = set()
        self._next = 0x100
        self.violations: list[str] = []
        self._msg = ctypes.create_string_buffer(1024)
        impls = {name: self._entry(name, getattr(self, "_" + name)) for name in acl.PROTOTYPES}
        self.functions = acl.AclFunctions.from_python(impls, "simulated libascendcl")

    # -- the C boundary --------------------------------------------------------------------

    def _entry(self, name: str, impl: Callable[..., int]) -> Callable[..., Any]:
        """The Python function behind one prototype: faults, rules, never an exception."""
        if name == "aclGetRecentErrMsg":
            return lambda: ctypes.addressof(self._msg)

        def call(*args: Any) -> int:
            code = self.faults.check(name)
            if code:
                return self._fail(name, code, "injected failure")
            try:
                with self._lock:
                    return impl(*args)
            except AclRuleError as exc:
                return self._fail(name, exc.code, str(exc))
            except BaseException as exc:  # never raise through C: ctypes would return 0
                logger.exception("simulated %s raised", name)
                return self._fail(name, DRV_INTERNAL, repr(exc))

        return call

    def _fail(self, name: str, code: int, why: str) -> int:
        self._msg.value = f"{name}: {why} ({error_name(code)})".encode()[:1000]
        return code

    def _new_id(self) -> int:
        self._next += 0x10
        return 0x5A00_0000_0000 + self._next

    # -- virtual memory --------------------------------------------------------------------

    def _aclrtReserveMemAddress(self, va_out, size, alignment, expect, flags) -> int:
        _rule(bool(va_out), INVALID_PARAM, "virPtr is NULL")
        _rule(size > 0 and size % GRAN == 0, INVALID_PARAM, f"size {size} not a 2 MiB multiple")
        _rule(alignment == 0, INVALID_PARAM, f"alignment must be 0 (reserved), got {alignment}")
        _rule(not expect, INVALID_PARAM, "expectPtr must be NULL")
        _rule(flags in self.reserve_flags, INVALID_PARAM, f"flags {flags} not accepted")
        if self.misaligned_reserves:
            self.misaligned_reserves -= 1
            base = self.hbm.reserve(size + GRAN)
            va = base + MISALIGN
        else:
            base = va = self.hbm.reserve(size)
        self._reservations[va] = (base, size)
        va_out[0] = va
        return 0

    def _aclrtReleaseMemAddress(self, va) -> int:
        _rule(va in self._reservations, RT_PARAM_INVALID, f"{va or 0:#x} is not a reservation")
        base, size = self._reservations[va]
        inside = [a for a in self._mapped if va <= a < va + size]
        _rule(not inside, RT_PARAM_INVALID, f"{len(inside)} mapping(s) still in the range")
        self.hbm.release(base)
        del self._reservations[va]
        return 0

    def _aclrtMallocPhysical(self, handle_out, size, prop_ptr, flags) -> int:
        _rule(bool(handle_out) and bool(prop_ptr), INVALID_PARAM, "handle or prop is NULL")
        gran = self._check_prop(prop_ptr.contents)
        _rule(flags == 0, INVALID_PARAM, f"flags must be 0, got {flags}")
        _rule(size > 0 and size % gran == 0, INVALID_PARAM, f"size {size} not a multiple of {gran}")
        _rule(self.used_bytes() + size <= self.capacity, MEMORY_ALLOCATION, "device memory full")
        h = self._new_id()
        self._handles[h] = self.hbm.create(size)
        handle_out[0] = h
        return 0

    def _check_prop(self, prop: acl.aclrtPhysicalMemProp) -> int:
        _rule(prop.handleType == acl.ACL_MEM_HANDLE_TYPE_NONE, INVALID_PARAM, "handleType")
        _rule(
            prop.allocationType == acl.ACL_MEM_ALLOCATION_TYPE_PINNED,
            INVALID_PARAM,
            "allocationType must be PINNED",
        )
        _rule(prop.memAttr in acl.HBM_ATTRS, INVALID_PARAM, f"memAttr {prop.memAttr} is not HBM")
        _rule(
            prop.location.type == acl.ACL_MEM_LOCATION_TYPE_DEVICE,
            INVALID_PARAM,
            f"location.type {prop.location.type} is not DEVICE",
        )
        _rule(
            prop.location.id == self.device_index,
            INVALID_PARAM,
            f"location.id {prop.location.id} is not device {self.device_index}",
        )
        _rule(prop.reserve == 0, INVALID_PARAM, "reserve must be 0")
        huge1g = prop.memAttr in (acl.ACL_HBM_MEM_HUGE1G, 11)
        return acl.HUGE_1G if huge1g else GRAN

    def _aclrtFreePhysical(self, h) -> int:
        _rule(h in self._handles, INVALID_HANDLE, f"handle {h or 0:#x} is not live")
        mapped = [a for a, x in self._mapped.items() if x == h]
        _rule(not mapped, RT_PARAM_INVALID, f"handle still mapped at {len(mapped)} address(es)")
        self.hbm.free(self._handles.pop(h))
        return 0

    def _aclrtMapMem(self, va, size, offset, h, flags) -> int:
        _rule(offset == 0 and flags == 0, INVALID_PARAM, "offset and flags must be 0")
        _rule(h in self._handles, INVALID_HANDLE, f"handle {h or 0:#x} is not live")
        chunk = self._handles[h]
        _rule(
            size == chunk.size,
            INVALID_PARAM,
            f"size {size} is not the handle's {chunk.size}: a map covers a whole handle",
        )
        va = va or 0
        _rule(va % GRAN == 0, ADDR_UNALIGNED, f"{va:#x} is not 2 MiB aligned")
        inside = any(s <= va and va + size <= s + n for s, (_, n) in self._reservations.items())
        _rule(inside, RT_PARAM_INVALID, f"[{va:#x}, +{size}) is not inside a reservation")
        for a, other in self._mapped.items():
            n = self._handles[other].size
            _rule(not (a < va + size and va < a + n), RT_PARAM_INVALID, f"overlaps {a:#x}")
        self.hbm.map(va, chunk)
        self._mapped[va] = h
        return 0

    def _aclrtUnmapMem(self, va) -> int:
        _rule(va in self._mapped, RT_PARAM_INVALID, f"nothing is mapped at {va or 0:#x}")
        if self.busy():
            self.violations.append(
                f"aclrtUnmapMem({va:#x}) while queued device work may still use it "
                "(synchronize before unmapping)"
            )
        self.hbm.unmap(va)
        del self._mapped[va]
        return 0

    def _aclrtMemGetAllocationGranularity(self, prop_ptr, option, out) -> int:
        _rule(bool(prop_ptr) and bool(out), INVALID_PARAM, "prop or granularity is NULL")
        _rule(option in (0, 1), INVALID_PARAM, f"option {option}")
        out[0] = self._check_prop(prop_ptr.contents)
        return 0

    # -- plain device memory (what torch_npu's caching allocator uses) --------------------

    def _aclrtMalloc(self, ptr_out, size, policy) -> int:
        _rule(bool(ptr_out) and size > 0, INVALID_PARAM, "devPtr NULL or size 0")
        size = -(-size // GRAN) * GRAN
        _rule(self.used_bytes() + size <= self.capacity, MEMORY_ALLOCATION, "device memory full")
        va = self.hbm.reserve(size)
        chunk = self.hbm.create(size)
        self.hbm.map(va, chunk)
        self._mallocs[va] = chunk
        ptr_out[0] = va
        return 0

    def _aclrtFree(self, ptr) -> int:
        ptr = ptr or 0
        if ptr not in self._mallocs:
            vmm = any(s <= ptr < s + n for s, (_, n) in self._reservations.items())
            if vmm:  # the old torch_npu era's bare aclrtFree of a routed segment
                self.violations.append(f"aclrtFree({ptr:#x}) of an address in a VMM reservation")
            raise AclRuleError(RT_PARAM_INVALID, f"{ptr:#x} was not allocated by aclrtMalloc")
        chunk = self._mallocs.pop(ptr)
        self.hbm.unmap(ptr)
        self.hbm.free(chunk)
        self.hbm.release(ptr)
        return 0

    # -- model run instances ---------------------------------------------------------------

    def _aclmdlRICaptureEnd(self, stream, ri_out) -> int:
        _rule(bool(ri_out), INVALID_PARAM, "modelRI is NULL")
        code = self.end_capture(stream or 0)
        if code:
            return self._fail("aclmdlRICaptureEnd", code, "the stream could not end capture")
        ri_out[0] = self.new_ri()
        return 0

    def _aclmdlRIDestroy(self, ri) -> int:
        _rule(ri in self._ris, RT_PARAM_INVALID, f"model RI {ri or 0:#x} is not live")
        self._ris.discard(ri)
        return 0

    def _aclGetRecentErrMsg(self) -> int:
        return ctypes.addressof(self._msg)

    def new_ri(self) -> int:
        with self._lock:
            ri = self._new_id()
            self._ris.add(ri)
            return ri

    # -- books -----------------------------------------------------------------------------

    def used_bytes(self) -> int:
        with self._lock:
            return sum(c.size for c in self._handles.values()) + sum(
                c.size for c in self._mallocs.values()
            )

    def books(self) -> dict[str, int]:
        """Live objects of each kind (a leak shows as a count that does not go back)."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "handles": len(self._handles),
                "mappings": len(self._mapped),
                "mallocs": len(self._mallocs),
                "model_ris": len(self._ris),
                "violations": len(self.violations),
            }
