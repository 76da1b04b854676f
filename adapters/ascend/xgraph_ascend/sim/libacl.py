"""A libascendcl stand-in: the ACL prototypes bound to Python over host memory, with books.

The functions are built from the same ctypes prototypes the real binding uses
(`AclFunctions.from_python`), so the adapter calls C function pointers and the simulator
decodes `void**` out-parameters and `aclrtPhysicalMemProp*` exactly as C would receive them.
Memory is the CPU backend's memfd VMM (HostVirtualMemory) at a 2 MiB granularity: a physical
handle is a memfd region, a mapping is mmap(MAP_FIXED|MAP_SHARED), so one handle mapped at two
addresses really aliases. That an NPU's driver allows it is an assumption (`ASSUMPTIONS`,
switch `alias_handles`): no source settles it. The rules are those of the acl layer (hicann/runtime
src/acl/aclrt_impl/memory.cpp: NULL pointers, size 0, flags, the prop's handle and
allocation types, location and memAttr, all 100000) and of the documentation (offset 0, a
map covers a whole handle, sizes rounded up to the granularity, a freed handle that is still
mapped goes at its last unmap); nothing stricter. Which code the closed driver returns for a
misuse it catches is not documented, so those codes are the simulator's (107000 for a bad
range or offset, 107008 for an unaligned address, 107017 for an unknown handle, 207001 when
the device is full).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xgraph.adapter import PhysicalChunk
from xgraph.testing.sim import HostVirtualMemory

from .. import acl
from ..errors import error_name
from .faults import Faults

logger = logging.getLogger("xgraph")

GRAN = acl.GRANULARITY_2M
INVALID_PARAM = 100000
RT_PARAM_INVALID = 107000
INVALID_DEVICE = 107001
ADDR_UNALIGNED = 107008
INVALID_HANDLE = 107017
MEMORY_ALLOCATION = 207001
DRV_INTERNAL = 507899
# aclrtReserveMemAddress's flags: 0, or 1 "kept for the early API's compatibility"
# (memory.cpp:1052-1053); torch_npu passes 1, vllm-ascend and xgraph 0
RESERVE_FLAGS = (0, 1)
# What the simulator assumes where no source settles the driver's behaviour: each is a
# switch of SimAcl, True by default (the assumption holds), so a test can run the adapter
# under the other answer; docs/ascend.md lists them with the hardware check that proves each.
ASSUMPTIONS = {
    "alias_handles": "one physical handle maps at several addresses at once, every mapping "
    "seeing the same bytes (shared-physical graph memory and wake depend on it; the VMM "
    "documentation says nothing; hardware check vmm_aliasing)",
}
# calls that check their injected faults themselves (a failed capture end still ends it)
_OWN_FAULTS = frozenset({"aclmdlRICaptureEnd"})
MISALIGN = 64 << 10  # where a deliberately misaligned reservation starts past the boundary
# location types aclrtMallocPhysical takes (UNREGISTERED and MANAGED are refused)
_LOCATIONS = (
    acl.ACL_MEM_LOCATION_TYPE_HOST,
    acl.ACL_MEM_LOCATION_TYPE_DEVICE,
    acl.ACL_MEM_LOCATION_TYPE_HOST_NUMA,
)


def _round_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity


@dataclass
class _Handle:
    """A physical allocation: its memfd region (rounded up) and what the caller asked for."""

    chunk: PhysicalChunk
    size: int  # aclrtMallocPhysical's size: what aclrtMapMem must pass
    on_device: bool  # this device's HBM (counts against its capacity)
    freed: bool = False  # aclrtFreePhysical ran while mapped: freed at the last unmap


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
        self.device_count = device_index + 1  # valid location ids (other devices: none here)
        self.capacity = capacity
        self.faults = faults
        self.hbm = HostVirtualMemory(granularity=GRAN)
        self.misaligned_reserves = 0  # next reservations returned off a 2 MiB boundary
        self.alias_handles = True  # an assumption (ASSUMPTIONS): False maps a handle once
        self.busy: Callable[[], bool] = lambda: False  # queued device work (set by runtime)
        self.end_capture: Callable[[int], int] = lambda stream: 107029
        self.abort_capture: Callable[[int], None] = lambda stream: None
        self._lock = threading.RLock()
        self._reservations: dict[int, tuple[int, int]] = {}  # va -> (host base, size)
        self._handles: dict[int, _Handle] = {}
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
            code = self.faults.check(name) if name not in _OWN_FAULTS else 0
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
        _rule(size > 0, INVALID_PARAM, "size is 0")
        _rule(flags in RESERVE_FLAGS, INVALID_PARAM, f"flags {flags} not accepted")
        # alignment is documented as reserved (0) but the acl layer passes it on unchecked
        # (memory.cpp:1049-1056): taken, and ignored, like expectPtr, a hint the driver may
        # honour inside 16T-24T (experimental) and the simulator never does. The size is
        # rounded up to the granularity, not refused.
        size = _round_up(size, GRAN)
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
        _rule(bool(va), INVALID_PARAM, "virPtr is NULL")
        _rule(va in self._reservations, RT_PARAM_INVALID, f"{va:#x} is not a reservation")
        base, size = self._reservations[va]
        inside = [a for a in self._mapped if va <= a < va + size]
        _rule(not inside, RT_PARAM_INVALID, f"{len(inside)} mapping(s) still in the range")
        self.hbm.release(base)
        del self._reservations[va]
        return 0

    def _aclrtMallocPhysical(self, handle_out, size, prop_ptr, flags) -> int:
        _rule(bool(handle_out) and bool(prop_ptr), INVALID_PARAM, "handle or prop is NULL")
        _rule(size > 0, INVALID_PARAM, "size is 0")
        _rule(flags == 0, INVALID_PARAM, f"flags must be 0, got {flags}")
        gran, on_device = self._check_prop(prop_ptr.contents)
        rounded = _round_up(size, gran)  # the documented HUGE rule: rounded up, not refused
        if on_device:
            full = self.used_bytes() + rounded > self.capacity
            _rule(not full, MEMORY_ALLOCATION, "device memory full")
        h = self._new_id()
        self._handles[h] = _Handle(self.hbm.create(rounded), size, on_device)
        handle_out[0] = h
        return 0

    def _check_prop(self, prop: acl.aclrtPhysicalMemProp) -> tuple[int, bool]:
        """The acl layer's checks of a prop: (granularity, whether it is this device's HBM)."""
        _rule(prop.handleType == acl.ACL_MEM_HANDLE_TYPE_NONE, INVALID_PARAM, "handleType")
        _rule(
            prop.allocationType == acl.ACL_MEM_ALLOCATION_TYPE_PINNED,
            INVALID_PARAM,
            "allocationType must be PINNED",
        )
        where = prop.location.type
        _rule(where in _LOCATIONS, INVALID_PARAM, f"location type {where} is not supported")
        device = where == acl.ACL_MEM_LOCATION_TYPE_DEVICE
        attr = prop.memAttr
        ddr_on_device = device and attr in acl.DDR_ATTRS
        _rule(not ddr_on_device, INVALID_PARAM, f"memAttr {attr} is host (DDR) memory only")
        known = attr in acl.HBM_ATTRS | acl.DDR_ATTRS
        _rule(known, INVALID_PARAM, f"memAttr {attr} is not supported")
        if device:
            valid = prop.location.id < self.device_count
            _rule(valid, INVALID_DEVICE, f"location.id {prop.location.id} names no device")
        # prop.reserve goes to the driver unchecked
        gran = acl.HUGE_1G if attr in acl.HUGE1G_ATTRS else GRAN
        return gran, device and prop.location.id == self.device_index

    def _aclrtFreePhysical(self, h) -> int:
        _rule(bool(h), INVALID_PARAM, "handle is NULL")
        rec = self._handles.get(h)
        _rule(rec is not None and not rec.freed, INVALID_HANDLE, f"handle {h:#x} is not live")
        assert rec is not None
        if any(x == h for x in self._mapped.values()):
            rec.freed = True  # CANN 9: the memory goes when its last mapping is unmapped
        else:
            self._drop_handle(h)
        return 0

    def _drop_handle(self, h: int) -> None:
        self.hbm.free(self._handles.pop(h).chunk)

    def _aclrtMapMem(self, va, size, offset, h, flags) -> int:
        _rule(bool(va) and bool(h), INVALID_PARAM, "virPtr or handle is NULL")
        _rule(size > 0, INVALID_PARAM, "size is 0")
        _rule(flags == 0, INVALID_PARAM, f"flags must be 0, got {flags}")
        rec = self._handles.get(h)
        _rule(rec is not None and not rec.freed, INVALID_HANDLE, f"handle {h:#x} is not live")
        assert rec is not None
        # the driver's checks (their codes are not documented: 107000 is the simulator's)
        _rule(offset == 0, RT_PARAM_INVALID, f"offset must be 0, got {offset}")
        _rule(
            size == rec.size,
            RT_PARAM_INVALID,
            f"size {size} is not the handle's {rec.size}: a map covers a whole handle",
        )
        span = rec.chunk.size
        _rule(va % GRAN == 0, ADDR_UNALIGNED, f"{va:#x} is not 2 MiB aligned")
        inside = any(s <= va and va + span <= s + n for s, (_, n) in self._reservations.items())
        _rule(inside, RT_PARAM_INVALID, f"[{va:#x}, +{span}) is not inside a reservation")
        for a, other in self._mapped.items():
            n = self._handles[other].chunk.size
            _rule(not (a < va + span and va < a + n), RT_PARAM_INVALID, f"overlaps {a:#x}")
            aliased = other == h and not self.alias_handles
            _rule(
                not aliased,
                RT_PARAM_INVALID,
                f"handle {h:#x} is mapped at {a:#x} already "
                "(alias_handles=False: this simulated driver maps a handle at one address)",
            )
        self.hbm.map(va, rec.chunk)
        self._mapped[va] = h
        return 0

    def _aclrtUnmapMem(self, va) -> int:
        _rule(bool(va), INVALID_PARAM, "virPtr is NULL")
        _rule(va in self._mapped, RT_PARAM_INVALID, f"nothing is mapped at {va:#x}")
        if self.busy():
            self.violations.append(
                f"aclrtUnmapMem({va:#x}) while queued device work may still use it "
                "(synchronize before unmapping)"
            )
        self.hbm.unmap(va)
        h = self._mapped.pop(va)
        if self._handles[h].freed and h not in self._mapped.values():
            self._drop_handle(h)
        return 0

    def _aclrtMemGetAllocationGranularity(self, prop_ptr, option, out) -> int:
        _rule(bool(prop_ptr) and bool(out), INVALID_PARAM, "prop or granularity is NULL")
        _rule(option in (0, 1), INVALID_PARAM, f"option {option}")
        out[0] = self._check_prop(prop_ptr.contents)[0]
        return 0

    # -- plain device memory (what torch_npu's caching allocator uses) --------------------

    def _aclrtMalloc(self, ptr_out, size, policy) -> int:
        _rule(bool(ptr_out) and size > 0, INVALID_PARAM, "devPtr NULL or size 0")
        size = _round_up(size, GRAN)
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
        injected = self.faults.check("aclmdlRICaptureEnd")
        if injected:  # past the status checks, a failure ends the capture all the same
            self.abort_capture(stream or 0)
            return self._fail("aclmdlRICaptureEnd", injected, "injected failure")
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
            held = sum(h.chunk.size for h in self._handles.values() if h.on_device)
            return held + sum(c.size for c in self._mallocs.values())

    def reservation_sizes(self) -> list[int]:
        """The size of each live aclrtReserveMemAddress range (rounded up), in VA order."""
        with self._lock:
            return [size for _, (_, size) in sorted(self._reservations.items())]

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
