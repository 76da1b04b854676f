"""SimRuntime: the runtime facade over the simulated libascendcl and torch_npu.

The device is the host (torch.device("cpu")): tensors are CPU tensors, "HBM" is the CPU
backend's memfd VMM behind the simulated ACL calls, graphs are recorded-op programs. What
the adapter calls is the same NpuRuntime interface TorchNpuRuntime implements, so every
adapter module runs unchanged. Selected only explicitly: backend `ascend-sim`, or
`AscendSimBackend(SimRuntime(era=..., capacity=...))` in tests.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from xgraph.backends.cpu import host_tensor

from ..errors import AclRuntimeError
from ..runtime import NpuRuntime, PoolEra, PoolId
from . import kernels
from .caching import SimCachingAllocator, SimMemPool, SimPluggableAllocator
from .capture import STREAM_NOT_CAPTURED, TASK_GROUP_STATUS, Task, TaskGroupHandle, UpdateSession
from .capture import route_task as _route
from .events import SimExternalEvent
from .faults import Faults
from .libacl import SimAcl
from .npugraph import SimNPUGraph
from .streams import SimStream, SimStreams

DEFAULT_CAPACITY = 32 << 30  # the simulated device's memory (mem_get_info total)
CAPTURE_MODE_NOT_SUPPORT = 107030
MODEL_RUNNING = 107037
_private_ids = itertools.count(1)


class SimRuntime(NpuRuntime):
    """One simulated NPU; `faults`, `lib` (the ACL stand-in) and `books()` are for tests."""

    name = "simulated"

    def __init__(self, era: PoolEra | str = PoolEra.OWNER, capacity: int = DEFAULT_CAPACITY):
        self.era = PoolEra(era)
        self.device = torch.device("cpu")
        self.device_index = 0
        self.faults = Faults()
        self.lib = SimAcl(self.device_index, capacity, self.faults)
        self.acl = self.lib.functions
        self.streams = SimStreams(self.synchronize)
        self.caching = SimCachingAllocator(self.lib, self.streams, self.era)
        self._busy = False
        self._lock = threading.Lock()
        self.lib.busy = lambda: self._busy
        self.lib.end_capture = self._end_capture_of

    # -- device and streams ----------------------------------------------------------------

    def synchronize(self) -> None:
        me = threading.get_ident()
        for s in self.streams.capturing():
            cap = s.capture
            if (
                cap is not None
                and cap.mode != "relaxed"
                and (cap.mode == "global" or cap.thread == me)
            ):
                why = "synchronize while a stream is capturing"
                cap.invalidate(CAPTURE_MODE_NOT_SUPPORT, why)
                raise AclRuntimeError(CAPTURE_MODE_NOT_SUPPORT, "aclrtSynchronizeDevice", why)
        with self._lock:
            self._busy = False

    def mark_busy(self) -> None:
        with self._lock:
            self._busy = True

    def ensure_device(self) -> None:
        """The simulated device is current in every thread."""

    def new_stream(self) -> SimStream:
        return self.streams.new()

    def current_stream(self) -> SimStream:
        return self.streams.current()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.streams.use(stream)

    def stream_handle(self, stream: Any) -> int:
        return int(stream.npu_stream)

    def is_capturing(self, stream: Any) -> bool:
        return stream.capture is not None

    def _end_capture_of(self, handle: int) -> int:
        """aclmdlRICaptureEnd's work: end the capture recording on that stream."""
        stream = self.streams.by_handle(handle)
        if stream is None or stream.capture is None:
            return STREAM_NOT_CAPTURED
        return stream.capture.stop()

    # -- graphs and pools ------------------------------------------------------------------

    def new_graph(self) -> SimNPUGraph:
        return SimNPUGraph(self)

    def private_id(self) -> PoolId:
        return (next(_private_ids), 0)

    def new_mempool(self, allocator: Any | None) -> SimMemPool:
        return SimMemPool(self.caching, allocator)

    def custom_allocator(self, alloc_fn: int, free_fn: int) -> SimPluggableAllocator:
        return SimPluggableAllocator(alloc_fn, free_fn, self.device_index)

    def mempool_use_count(self, mempool: Any) -> int:
        return int(mempool.use_count())

    def use_mem_pool(self, mempool: Any) -> contextlib.AbstractContextManager[Any]:
        """torch_npu.npu.memory.use_mem_pool: the block's tensors land in the pool's blocks."""
        return self.caching.use_mem_pool(mempool.id)

    def end_allocate_to_pool(self, pool_id: PoolId) -> bool:
        try:
            self.caching.end_allocate_to_pool(pool_id)
            return True
        except RuntimeError:
            return False

    def release_pool(self, pool_id: PoolId) -> None:
        self.caching.release_pool(pool_id)

    def pool_bytes(self, pool_id: PoolId, mempool: Any) -> int:
        return self.caching.pool_bytes(pool_id)

    def mempool_context(self, mempool: Any) -> contextlib.AbstractContextManager[None]:
        """torch_npu.npu.memory.MemPoolContext (CONTEXT era only)."""
        return self.caching.mempool_context(mempool.id)

    # -- graph task update -----------------------------------------------------------------

    def _fault(self, call: str) -> None:
        code = self.faults.check(call)
        if code:
            raise AclRuntimeError(code, call, "injected failure")

    def task_group_begin(self, stream: Any) -> None:
        self._fault("aclmdlRICaptureTaskGrpBegin")
        cap = stream.capture
        if cap is None:
            raise AclRuntimeError(STREAM_NOT_CAPTURED, "aclmdlRICaptureTaskGrpBegin")
        if cap.group is not None:
            raise AclRuntimeError(TASK_GROUP_STATUS, "aclmdlRICaptureTaskGrpBegin", "nested")
        cap.group = []

    def task_group_end(self, stream: Any) -> TaskGroupHandle:
        self._fault("aclmdlRICaptureTaskGrpEnd")
        cap = stream.capture
        if cap is None or cap.group is None:
            raise AclRuntimeError(TASK_GROUP_STATUS, "aclmdlRICaptureTaskGrpEnd", "no open group")
        handle = TaskGroupHandle(cap, cap.group)
        cap.group = None
        return handle

    def task_update_begin(self, stream: Any, handle: Any) -> None:
        call = "aclmdlRICaptureTaskUpdateBegin"
        self._fault(call)
        if stream.capture is not None:
            raise AclRuntimeError(107027, call, "the update stream must not be capturing")
        if stream.update is not None:
            raise AclRuntimeError(TASK_GROUP_STATUS, call, "an update is already open")
        if not isinstance(handle, TaskGroupHandle) or handle.capture.state != "captured":
            raise AclRuntimeError(107000, call, "the task group's graph is not captured (reset?)")
        if self._busy:
            raise AclRuntimeError(
                MODEL_RUNNING,
                call,
                "a replay may still be running and reading the parameters this update "
                "replaces; synchronize before updating",
            )
        stream.update = UpdateSession(handle)

    def task_update_end(self, stream: Any) -> None:
        self._fault("aclmdlRICaptureTaskUpdateEnd")
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
        return torch.empty(kernels.WORKSPACE_BYTES, dtype=torch.uint8)

    # -- memory and reporting --------------------------------------------------------------

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return host_tensor(address, nbytes)

    def mem_get_info(self) -> tuple[int, int]:
        used = self.lib.used_bytes()
        return self.lib.capacity - used, self.lib.capacity

    def empty_cache(self) -> None:
        """Private pools give their segments back when their use count reaches zero."""

    def device_name(self) -> str:
        return "simulated Ascend NPU (host memory)"

    def versions(self) -> dict[str, str]:
        return {"runtime": "simulated ACL", "pool era": self.era.value}

    def books(self) -> dict[str, int]:
        """The simulator's live objects: ACL books plus torch_npu routes and pools."""
        out = self.lib.books()
        out["routes"] = self.caching.routes()
        return out
