"""SimRuntime: the runtime facade over the simulated libascendcl and torch_npu.

The core simulator (`xgraph.testing.sim.SimRuntime`) is the torch side: streams, graphs,
the caching allocator's pools and rules, synchronize refused while any stream captures
(107027, from any thread, without invalidating the capture). This runtime adds what is
ACL's and torch_npu's: libascendcl's calls over the memfd VMM (SimAcl), the memory-pool
eras, ACL error codes, graph task groups and updates, external events and the fused kernel.
What the adapter calls is the same NpuRuntime interface TorchNpuRuntime implements, so every
adapter module runs unchanged. Selected only explicitly: backend `ascend-sim`, or
`AscendSimBackend(SimRuntime(era=..., capacity=...))` in tests.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from xgraph.testing import sim

from ..errors import AclRuntimeError
from ..runtime import NpuRuntime, PoolEra
from . import kernels
from .caching import NpuCachingAllocator, SimContextMemPool
from .capture import STREAM_NOT_CAPTURED, TASK_GROUP_STATUS, Task, TaskGroupHandle, UpdateSession
from .capture import route_task as _route
from .events import SimExternalEvent
from .faults import Faults
from .libacl import GRAN, SimAcl
from .npugraph import SimNPUGraph
from .streams import SimStreams

DEFAULT_CAPACITY = 32 << 30  # the simulated device's memory (mem_get_info total)
SYNC_TIMEOUT = 507046  # ACL_ERROR_RT_STREAM_SYNC_TIMEOUT


class SimRuntime(sim.SimRuntime, NpuRuntime):
    """One simulated NPU; `faults`, `lib` (the ACL stand-in) and `books()` are for tests."""

    name = "simulated"
    STREAM_CAPTURED, OUT_OF_MEMORY = 107027, 207001
    error_type = AclRuntimeError
    streams_type = SimStreams
    graph_type = SimNPUGraph
    caching: NpuCachingAllocator

    def __init__(self, era: PoolEra | str = PoolEra.OWNER, capacity: int = DEFAULT_CAPACITY):
        self.era = PoolEra(era)
        faults = Faults()
        self.lib = SimAcl(0, capacity, faults)
        self.acl = self.lib.functions
        super().__init__(capacity, GRAN, faults=faults, memory=self.lib.hbm)
        self.caching = NpuCachingAllocator(self)
        self.lib.busy = lambda: self.queued > 0
        self.lib.end_capture = self._end_capture_of
        self.lib.abort_capture = self._abort_capture_of

    # -- device and streams ----------------------------------------------------------------

    def ensure_device(self) -> None:
        """The simulated device is current in every thread."""

    def stream_handle(self, stream: Any) -> int:
        return int(stream.npu_stream)

    def synchronize(self) -> None:
        self._refuse_while_capturing("synchronize")  # refused at entry (context.cc)
        self._timed_out(self.streams.all(), "aclrtSynchronizeDeviceWithTimeout")
        super().synchronize()

    def stream_synchronize(self, stream: Any) -> None:
        if stream.capture is None:
            self._timed_out([stream], "aclrtSynchronizeStreamWithTimeout")
        super().stream_synchronize(stream)

    def empty_cache(self) -> None:
        self._refuse_while_capturing("empty_cache")
        self._timed_out(self.streams.all(), "aclrtSynchronizeDevice (empty_cache)")
        super().empty_cache()

    def _timed_out(self, streams: list[Any], call: str) -> None:
        """A synchronize of a stream blocked on a wait nothing released: an NPU hangs (or
        times out, with a timeout set); the simulator fails now, naming the wait."""
        blocked = [s for s in streams if s.waiting is not None]
        if blocked:
            waits = ", ".join(f"ExternalEvent #{s.waiting.event.id}" for s in blocked)
            raise AclRuntimeError(
                SYNC_TIMEOUT,
                call,
                f"{len(blocked)} stream(s) wait on {waits}, which nothing recorded since its "
                "last reset: a replay ran without the graph task update before it. On an NPU "
                "this synchronize would block until its timeout (forever without one); "
                "replay through Graph.replay, which runs the updates first",
            )

    def _end_capture_of(self, handle: int) -> int:
        """aclmdlRICaptureEnd's work: end the capture recording on that stream."""
        stream = self.streams.by_handle(handle)
        if stream is None or stream.capture is None:
            return STREAM_NOT_CAPTURED
        return stream.capture.stop()

    def _abort_capture_of(self, handle: int) -> None:
        """A failed aclmdlRICaptureEnd: the stream leaves capture, its model is not made."""
        stream = self.streams.by_handle(handle)
        if stream is not None and stream.capture is not None:
            stream.capture.abandon()

    end_capture = NpuRuntime.end_capture  # through the simulated aclmdlRICaptureEnd

    # -- pools and memory ------------------------------------------------------------------

    def new_mempool(self, allocator: Any | None) -> Any:
        if self.era is PoolEra.CONTEXT:
            return self.context_mempool(SimContextMemPool(allocator))
        return super().new_mempool(allocator)

    def mempool_context(self, mempool: Any) -> contextlib.AbstractContextManager[None]:
        """torch_npu.npu.memory.MemPoolContext (CONTEXT era only)."""
        return self.caching.mempool_context(mempool)

    def device_malloc(self, nbytes: int) -> int:
        out = ctypes.c_void_p()
        rc = self.acl.aclrtMalloc(ctypes.byref(out), nbytes, 0)
        return 0 if rc else int(out.value or 0)

    def device_free(self, address: int) -> None:
        self.acl.aclrtFree(address)

    def mem_get_info(self) -> tuple[int, int]:
        return self.lib.capacity - self.lib.used_bytes(), self.lib.capacity

    # -- graph task update -----------------------------------------------------------------

    def task_group_begin(self, stream: Any) -> None:
        self.check_fault("aclmdlRICaptureTaskGrpBegin")
        cap = stream.capture
        if cap is None:
            raise AclRuntimeError(STREAM_NOT_CAPTURED, "aclmdlRICaptureTaskGrpBegin")
        if cap.group is not None:
            raise AclRuntimeError(TASK_GROUP_STATUS, "aclmdlRICaptureTaskGrpBegin", "nested")
        cap.group = []

    def task_group_end(self, stream: Any) -> TaskGroupHandle:
        self.check_fault("aclmdlRICaptureTaskGrpEnd")
        cap = stream.capture
        if cap is None or cap.group is None:
            raise AclRuntimeError(TASK_GROUP_STATUS, "aclmdlRICaptureTaskGrpEnd", "no open group")
        handle = TaskGroupHandle(cap, cap.group)
        cap.group = None
        return handle

    def task_update_begin(self, stream: Any, handle: Any) -> None:
        call = "aclmdlRICaptureTaskUpdateBegin"
        self.check_fault(call)
        if stream.capture is not None:
            raise AclRuntimeError(107027, call, "the update stream must not be capturing")
        if stream.update is not None:
            raise AclRuntimeError(TASK_GROUP_STATUS, call, "an update is already open")
        if not isinstance(handle, TaskGroupHandle) or handle.capture.state != "captured":
            raise AclRuntimeError(107000, call, "the task group's graph is not captured (reset?)")
        replayed = handle.capture.replayed
        if replayed is not None and not replayed.done():  # silent on an NPU: recorded here
            self.lib.violations.append(
                f"{call} while a replay of its graph may still be running and reading the "
                "parameters this update replaces (synchronize before updating)"
            )
        stream.update = UpdateSession(handle)

    def task_update_end(self, stream: Any) -> None:
        self.check_fault("aclmdlRICaptureTaskUpdateEnd")
        session = stream.update
        if session is None:
            raise AclRuntimeError(TASK_GROUP_STATUS, "aclmdlRICaptureTaskUpdateEnd", "no update")
        stream.update = None
        session.finish()

    def external_event(self) -> SimExternalEvent:
        return SimExternalEvent(self.streams)

    # -- kernels ---------------------------------------------------------------------------

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int],
        out: torch.Tensor,
        lse: torch.Tensor,
        workspace: torch.Tensor | None,
        *,
        scale: float,
    ) -> None:
        args = (
            query,
            key_cache,
            value_cache,
            block_table,
            [int(n) for n in seq_lens],
            out,
            lse,
            workspace,
            scale,
        )
        task = Task("FusedInferAttentionScore", kernels.fused_infer_attention, args)
        _route(self.streams, None, task, run_at_capture=True)

    def fused_attention_workspace(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        scale: float,
    ) -> torch.Tensor | None:
        return torch.empty(kernels.WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)

    # -- reporting -------------------------------------------------------------------------

    def device_name(self) -> str:
        return "simulated Ascend NPU (host memory)"

    def versions(self) -> dict[str, str]:
        return {"runtime": "simulated ACL", "pool era": self.era.value}

    def books(self) -> dict[str, int]:
        """The simulator's live objects: ACL books plus torch_npu routes."""
        out = self.lib.books()
        out["routes"] = self.caching.routes()
        return out
