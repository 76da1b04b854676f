"""libascendcl as ctypes sees it: structs, enum values and the C prototypes xgraph calls.

Declarations only: nothing here loads a library. The runtime facade binds these prototypes
to the symbols of libascendcl (`AclFunctions.from_library`), the simulator binds the very
same prototypes to Python functions (`AclFunctions.from_python`), so in both cases the
adapter calls a real C function pointer: argument conversion, the `void**` out-parameters
and the 32-byte `aclrtPhysicalMemProp` are marshalled the same way.

Source: CANN `acl_rt.h` of the open-source CANN runtime (hicann/runtime,
include/external/acl/acl_rt.h), which declares every function below, the model-RI calls
(aclmdlRICaptureEnd, aclmdlRIDestroy) included; its `acl_mdl.h` is a stub. The memAttr rules
are the acl layer's (src/acl/aclrt_impl/memory.cpp, aclrtMallocPhysicalImpl).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

# -- types and enum values (acl_rt.h) -------------------------------------------------------

ACL_SUCCESS = 0
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_HBM_MEM_HUGE = 4
ACL_HBM_MEM_HUGE1G = 10
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2
ACL_MEM_LOCATION_TYPE_MANAGED = 3
ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
ACL_MEM_MALLOC_HUGE_FIRST = 0  # aclrtMemMallocPolicy of aclrtMalloc

GRANULARITY_2M = 2 << 20  # "currently fixed at 2M" (CANN docs); used when the query is missing
HUGE_1G = 1 << 30

# aclrtMemAttr values aclrtMallocPhysical takes for device memory: ACL_HBM_MEM_HUGE (4),
# ACL_HBM_MEM_NORMAL (5, allocated as HUGE), ACL_HBM_MEM_HUGE1G (10) and the generic
# ACL_MEM_* (12-17). ACL_DDR_MEM (0), ACL_HBM_MEM (1) and the HBM P2P values (8, 9, 11) have
# no handler and are refused (100000); the DDR values (2, 3, 6, 7) are host-only.
HBM_ATTRS = {4, 5, 10, 12, 13, 14, 15, 16, 17}
DDR_ATTRS = {2, 3, 6, 7}
HUGE1G_ATTRS = {10, 14, 17}  # 1 GiB pages: ACL_HBM_MEM_HUGE1G, ACL_MEM_HUGE1G, ..._P2P_HUGE1G


class aclrtMemLocation(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_uint32)]


class aclrtPhysicalMemProp(ctypes.Structure):
    _fields_ = [
        ("handleType", ctypes.c_uint32),
        ("allocationType", ctypes.c_uint32),
        ("memAttr", ctypes.c_uint32),
        ("location", aclrtMemLocation),
        ("reserve", ctypes.c_uint64),
    ]


# the layout every caller of libascendcl relies on (LP64): a wrong field would shift reserve
assert ctypes.sizeof(aclrtPhysicalMemProp) == 32
assert aclrtPhysicalMemProp.location.offset == 12 and aclrtPhysicalMemProp.reserve.offset == 24


def device_memory_prop(device_index: int, attr: int = ACL_HBM_MEM_HUGE) -> aclrtPhysicalMemProp:
    """The physical-memory properties torch_npu, xLLM and vllm-ascend all pass: pinned HBM."""
    prop = aclrtPhysicalMemProp()
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED
    prop.memAttr = attr
    prop.location.id = device_index
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE
    prop.reserve = 0
    return prop


# -- prototypes ------------------------------------------------------------------------------

_ERR = ctypes.c_int  # aclError
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_SIZE = ctypes.c_size_t
_U64 = ctypes.c_uint64

PROTOTYPES: dict[str, Any] = {
    # aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment,
    #                                 void *expectPtr, uint64_t flags)
    "aclrtReserveMemAddress": ctypes.CFUNCTYPE(_ERR, _PP, _SIZE, _SIZE, _P, _U64),
    "aclrtReleaseMemAddress": ctypes.CFUNCTYPE(_ERR, _P),
    # aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
    #                              const aclrtPhysicalMemProp *prop, uint64_t flags)
    "aclrtMallocPhysical": ctypes.CFUNCTYPE(
        _ERR, _PP, _SIZE, ctypes.POINTER(aclrtPhysicalMemProp), _U64
    ),
    "aclrtFreePhysical": ctypes.CFUNCTYPE(_ERR, _P),
    # aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle h,
    #                      uint64_t flags)
    "aclrtMapMem": ctypes.CFUNCTYPE(_ERR, _P, _SIZE, _SIZE, _P, _U64),
    "aclrtUnmapMem": ctypes.CFUNCTYPE(_ERR, _P),
    # aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
    #                                           aclrtMemGranularityOptions option, size_t *g)
    "aclrtMemGetAllocationGranularity": ctypes.CFUNCTYPE(
        _ERR, ctypes.POINTER(aclrtPhysicalMemProp), ctypes.c_int, ctypes.POINTER(_SIZE)
    ),
    # aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
    "aclrtMalloc": ctypes.CFUNCTYPE(_ERR, _PP, _SIZE, ctypes.c_int),
    "aclrtFree": ctypes.CFUNCTYPE(_ERR, _P),
    # aclError aclmdlRICaptureEnd(aclrtStream stream, aclmdlRI *modelRI)
    "aclmdlRICaptureEnd": ctypes.CFUNCTYPE(_ERR, _P, _PP),
    "aclmdlRIDestroy": ctypes.CFUNCTYPE(_ERR, _P),
    # const char *aclGetRecentErrMsg(void): declared as void* so no Python bytes object has
    # to own the C string (read with ctypes.string_at)
    "aclGetRecentErrMsg": ctypes.CFUNCTYPE(_P),
}

# absent from older libascendcl builds (the 7.0.0-era header has no granularity query)
OPTIONAL = {"aclrtMemGetAllocationGranularity", "aclGetRecentErrMsg"}
# without these the backend has no virtual memory (graph memory falls back to shared-pool)
VMM_CALLS = (
    "aclrtReserveMemAddress",
    "aclrtReleaseMemAddress",
    "aclrtMallocPhysical",
    "aclrtFreePhysical",
    "aclrtMapMem",
    "aclrtUnmapMem",
)

# torch_npu's pluggable allocator, C side (NPUPluggableAllocator.h):
# void* alloc(size_t size, int device, aclrtStream stream);
# void free(void* ptr, size_t size, int device, aclrtStream stream);
PLUGGABLE_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
PLUGGABLE_FREE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)


class AclFunctions:
    """libascendcl's functions as typed C function pointers, by name."""

    def __init__(self, table: Mapping[str, Any], origin: str) -> None:
        self._table = dict(table)
        self.origin = origin  # "libascendcl.so" or "simulated libascendcl"

    @classmethod
    def from_library(cls, lib: ctypes.CDLL) -> AclFunctions:
        """Bind every prototype the library exports; callers check `has()` for the rest."""
        table = {}
        for name, proto in PROTOTYPES.items():
            try:
                table[name] = proto((name, lib))
            except AttributeError:  # an older CANN: the feature using it is switched off
                pass
        return cls(table, getattr(lib, "_name", "libascendcl.so"))

    @classmethod
    def from_python(cls, impls: Mapping[str, Callable[..., Any]], origin: str) -> AclFunctions:
        """Bind every prototype to a Python implementation (the simulator)."""
        missing = set(PROTOTYPES) - set(impls) - OPTIONAL
        if missing:
            raise TypeError(f"simulated libascendcl lacks {sorted(missing)}")
        return cls({n: PROTOTYPES[n](f) for n, f in impls.items() if n in PROTOTYPES}, origin)

    def has(self, *names: str) -> bool:
        return all(n in self._table for n in names)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_table"][name]
        except KeyError:
            raise AttributeError(f"{self.origin} has no {name}") from None

    def recent_error(self) -> str:
        """aclGetRecentErrMsg(), or '' where the library has none."""
        fn = self._table.get("aclGetRecentErrMsg")
        if fn is None:
            return ""
        ptr = fn()
        return ctypes.string_at(ptr).decode(errors="replace").strip() if ptr else ""
