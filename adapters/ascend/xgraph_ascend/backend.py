"""The Ascend backends: the device layer over torch_npu, aclrt virtual memory, ACL errors.

`AscendBackend` ("ascend") runs on torch_npu + libascendcl (TorchNpuRuntime);
`AscendSimBackend` ("ascend-sim", hidden) is the same adapter over the simulated runtime.
Both take an explicit runtime too (tests: `AscendSimBackend(SimRuntime(era="context"))`).
Capture streams, pools and the threading rules are `xgraph.adapter.TorchBackend`'s; what is
Ascend's: the memory-pool era (routed pools only where the pool frees through its
allocator), a libascendcl without VMM, the update stream of graph task updates, and ACL
error names. Nothing here imports torch_npu.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from xgraph.adapter import (
    Availability,
    BackendUnavailableError,
    TorchBackend,
    TorchRuntime,
    VirtualMemory,
)

from . import probe
from .acl import VMM_CALLS
from .errors import CAPTURE_CODES, SYNC_TIMEOUT_CODES, acl_code, capture_error, runtime_error
from .graph import AscendGraph
from .runtime import NpuRuntime, PoolEra, TorchNpuRuntime
from .sim.runtime import SimRuntime
from .vmm import AscendVirtualMemory

_CONTEXT_ERA = (
    "this torch_npu's MemPool routes allocations to a custom allocator only under "
    "MemPoolContext and releases cached segments with a bare aclrtFree instead of the "
    "allocator's free (torch_npu <= 2.12), which would hand xgraph's virtual-memory segments "
    "to aclrtFree; use torch_npu >= 2.13 (pools that own their allocator) for shared-physical"
)


class AscendBackend(TorchBackend):
    """Ascend NPUs through torch_npu: NPUGraph, aclrt VMM, MemPools (native or routed)."""

    name = "ascend"
    runtime: NpuRuntime
    runtime_class = TorchNpuRuntime
    graph_class = AscendGraph
    virtual_memory_class = AscendVirtualMemory
    collective_backend = "hccl"  # HCCL sets its communicator up on first use: warmed first

    def __init__(self, runtime: NpuRuntime | None = None) -> None:
        super().__init__(runtime)
        self._update: Any = None
        self._lock = threading.Lock()
        # held across each graph's update sequence: ACL takes one update at a time on a
        # stream (107033 for a second begin) and the task-update guide rules out concurrent
        # updates from several threads or streams, so threads replaying at once take turns
        self.update_lock = threading.Lock()

    @classmethod
    def default_runtime(cls) -> TorchRuntime:
        avail = probe.availability()
        if not avail.available:
            raise BackendUnavailableError(
                f"The ascend backend cannot run here: {avail.reason}. Run `xgraph info`."
            )
        return TorchNpuRuntime()

    @classmethod
    def availability(cls) -> Availability:
        return probe.availability()

    def update_stream(self) -> Any:
        """The stream graph task updates are issued on (never a capturing one), by one
        thread at a time (`update_lock`)."""
        with self._lock:
            if self._update is None:
                self._update = self.runtime.new_stream()
            return self._update

    def segments_support(self) -> Availability:
        if self.runtime.era is PoolEra.CONTEXT:
            return Availability(False, _CONTEXT_ERA)
        return Availability(True)

    def virtual_memory(self) -> VirtualMemory | None:
        if not self.runtime.acl.has(*VMM_CALLS):
            return None  # a libascendcl without VMM: shared-pool memory only
        return super().virtual_memory()

    def synchronize(self) -> None:
        try:
            super().synchronize()
        except Exception as exc:
            code = acl_code(exc)
            if code in CAPTURE_CODES:  # a synchronize inside a capture
                raise capture_error(exc, "synchronize") from exc
            if code in SYNC_TIMEOUT_CODES:  # a stream blocked on a wait (a skipped update)
                raise runtime_error(exc, "synchronize") from exc
            raise

    # -- benchmark hooks (xgraph.interfaces.BenchmarkHooks) -----------------------------------

    def device_name(self) -> str:
        return self.runtime.device_name()

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        return self.runtime.time_on_device(fn)


class AscendSimBackend(AscendBackend):
    """The same adapter over the simulated ACL runtime (host memory, no NPU)."""

    name = "ascend-sim"
    runtime_class = SimRuntime
    collective_backend = None  # host tensors: gloo groups, their collectives recorded as ops

    @classmethod
    def default_runtime(cls) -> TorchRuntime:
        return SimRuntime(era=os.environ.get("XGRAPH_ASCEND_SIM_ERA", "owner"))

    @classmethod
    def availability(cls) -> Availability:
        from . import sim

        return sim.availability()
