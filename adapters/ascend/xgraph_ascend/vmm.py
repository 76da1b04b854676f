"""aclrt virtual memory of one NPU: the seven driver calls through the ACL function table.

- reserve: aclrtReserveMemAddress(&va, size, 0, NULL, flags=0) (alignment is reserved and
  must be 0, expectPtr NULL lets the driver choose; the acl layer takes flags 0 or 1 alike
  and refuses neither, so a refusal is never retried with the other); the start must come
  back 2 MiB aligned, else the range is given back and the call fails;
- create:  aclrtMallocPhysical(&h, size, {NONE, PINNED, HBM_HUGE, {device, DEVICE}}, 0);
- map:     aclrtMapMem(va, size, 0, h, 0), always a whole handle (no aclrtMemSetAccess:
  torch_npu, xLLM and vllm-ascend map without it);
- unmap:   aclrtUnmapMem(va); unlike aclrtFree it does not wait for queued work that may
  still touch the range, and CheckedVirtualMemory synchronizes the backend before it;
- free / release: aclrtFreePhysical(h) / aclrtReleaseMemAddress(va);
- the scratch chunk of a sleeping range (CheckedVirtualMemory.cover): the default calls,
  one aclrtMapMem of the one-granule handle per granule and one aclrtUnmapMem each (the
  API has no batched form). It relies on one handle mapped at many addresses, as the
  shared-physical pool does: run only on the simulated runtime so far (docs/ascend.md).
CheckedVirtualMemory has checked every argument before a call; a failed call raises
VirtualMemoryError with the ACL error name, aclGetRecentErrMsg() and advice.
"""

from __future__ import annotations

import ctypes
from typing import Any

from xgraph.adapter import CheckedVirtualMemory, VirtualMemoryError

from . import acl
from .errors import vmm_error


class AscendVirtualMemory(CheckedVirtualMemory):
    """aclrt VMM of the backend's NPU; granularity from aclrtMemGetAllocationGranularity."""

    def __init__(self, backend: Any) -> None:
        self.runtime = backend.runtime
        self.acl: acl.AclFunctions = self.runtime.acl
        self._prop = acl.device_memory_prop(self.runtime.device_index)
        super().__init__(backend)

    def _check(self, call: str, rc: int, extra: str = "") -> None:
        if rc != acl.ACL_SUCCESS:
            raise vmm_error(call, rc, self.acl.recent_error(), extra)

    def _granularity(self) -> int:
        if not self.acl.has("aclrtMemGetAllocationGranularity"):
            return acl.GRANULARITY_2M  # older CANN: the docs fix it at 2 MiB
        self.runtime.ensure_device()
        out = ctypes.c_size_t()
        rc = self.acl.aclrtMemGetAllocationGranularity(
            ctypes.byref(self._prop), acl.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, ctypes.byref(out)
        )
        self._check("aclrtMemGetAllocationGranularity", rc)
        return int(out.value)

    # -- driver calls (the contract is checked by CheckedVirtualMemory first) ---------------

    def _reserve_range(self, size: int) -> int:
        self.runtime.ensure_device()
        va = ctypes.c_void_p()
        rc = self.acl.aclrtReserveMemAddress(ctypes.byref(va), size, 0, None, 0)
        self._check("aclrtReserveMemAddress", rc, "Reserve less address space.")
        address = int(va.value or 0)
        if address % self.granularity:
            # alignment must be 0 on this call, so an aligned retry is impossible: give it back
            self.acl.aclrtReleaseMemAddress(address)
            raise VirtualMemoryError(
                "aclrtReserveMemAddress",
                f"the range came back at {address:#x}, not aligned to {self.granularity}",
                "Chunks must map at multiples of the granularity; report the CANN version.",
            )
        return address

    def _release_range(self, address: int, size: int) -> None:
        self.runtime.ensure_device()
        self._check("aclrtReleaseMemAddress", self.acl.aclrtReleaseMemAddress(address))

    def _create_chunk(self, size: int) -> int:
        self.runtime.ensure_device()
        h = ctypes.c_void_p()
        rc = self.acl.aclrtMallocPhysical(ctypes.byref(h), size, ctypes.byref(self._prop), 0)
        self._check("aclrtMallocPhysical", rc)
        return int(h.value or 0)

    def _free_chunk(self, handle: int, size: int) -> None:
        self.runtime.ensure_device()
        self._check("aclrtFreePhysical", self.acl.aclrtFreePhysical(handle))

    def _map_chunk(self, address: int, handle: int, size: int) -> None:
        self.runtime.ensure_device()
        self._check("aclrtMapMem", self.acl.aclrtMapMem(address, size, 0, handle, 0))

    def _unmap_chunk(self, address: int, size: int) -> None:
        self.runtime.ensure_device()
        self._check("aclrtUnmapMem", self.acl.aclrtUnmapMem(address))
