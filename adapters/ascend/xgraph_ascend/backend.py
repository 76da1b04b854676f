"""The Ascend backends: ACL graphs, aclrt virtual memory and torch_npu MemPool capture pools.

`AscendBackend` ("ascend") runs on torch_npu + libascendcl (TorchNpuRuntime);
`AscendSimBackend` ("ascend-sim", hidden) is the same adapter over the simulated runtime.
Both take an explicit runtime too (tests: `AscendSimBackend(SimRuntime(era="context"))`).
Every call below goes through the runtime facade; nothing here imports torch_npu.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from xgraph import safety
from xgraph.errors import BackendUnavailableError, XGraphError
from xgraph.interfaces import (
    AttentionRunner,
    Availability,
    Backend,
    CapturePool,
    SegmentAllocator,
    VirtualMemory,
)
from xgraph.runners import reference_runners

from . import probe
from .acl import VMM_CALLS
from .errors import CAPTURE_CODES, acl_code, capture_error
from .graph import AscendGraph
from .pool import AscendCapturePool
from .runtime import NpuRuntime, PoolEra
from .vmm import AscendVirtualMemory

_CONTEXT_ERA = (
    "this torch_npu's MemPool routes allocations to a custom allocator only under "
    "MemPoolContext and releases cached segments with a bare aclrtFree instead of the "
    "allocator's free (torch_npu <= 2.12), which would hand xgraph's virtual-memory segments "
    "to aclrtFree; use torch_npu >= 2.13 (pools that own their allocator) for shared-physical"
)


class AscendBackend(Backend):
    """Ascend NPUs through torch_npu: NPUGraph, aclrt VMM, MemPools (native or routed)."""

    name = "ascend"
    priority = 90
    graph_class = AscendGraph
    virtual_memory_class = AscendVirtualMemory

    def __init__(self, runtime: NpuRuntime | None = None) -> None:
        self.runtime = runtime if runtime is not None else self._default_runtime()
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()
        # the adapter's frames are library code: capture errors name the model's line
        safety.register_library_path(os.path.dirname(os.path.abspath(__file__)))

    @classmethod
    def _default_runtime(cls) -> NpuRuntime:
        avail = probe.availability()
        if not avail.available:
            raise BackendUnavailableError(
                f"The ascend backend cannot run here: {avail.reason}. Run `xgraph info`."
            )
        from .runtime import TorchNpuRuntime

        return TorchNpuRuntime()

    @classmethod
    def availability(cls) -> Availability:
        return probe.availability()

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def _stream(self, role: str) -> Any:
        with self._lock:
            if role not in self._streams:
                self._streams[role] = self.runtime.new_stream()
            return self._streams[role]

    def capture_stream(self) -> Any:
        """The non-default stream every capture of this backend runs on (created once)."""
        return self._stream("capture")

    def update_stream(self) -> Any:
        """The stream graph task updates are issued on (never a capturing one)."""
        return self._stream("update")

    @contextlib.contextmanager
    def warmup_context(self) -> Iterator[None]:
        """Warm up on the capture stream, so lazy per-stream workspaces land outside pools."""
        rt = self.runtime
        origin, side = rt.current_stream(), self.capture_stream()
        side.wait_stream(origin)
        try:
            with rt.use_stream(side):
                yield
        finally:
            origin.wait_stream(side)

    def segments_support(self) -> Availability:
        if self.runtime.era is PoolEra.CONTEXT:
            return Availability(False, _CONTEXT_ERA)
        return Availability(True)

    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        if segments is not None and self.runtime.era is PoolEra.CONTEXT:
            raise XGraphError(f"Routed capture pools are refused: {_CONTEXT_ERA}.")
        return AscendCapturePool(self.runtime, segments)

    def virtual_memory(self) -> VirtualMemory | None:
        if not self.runtime.acl.has(*VMM_CALLS):
            return None  # a libascendcl without VMM: shared-pool memory only
        return super().virtual_memory()

    def synchronize(self) -> None:
        try:
            self.runtime.synchronize()
        except Exception as exc:
            if acl_code(exc) in CAPTURE_CODES:  # a synchronize inside a capture
                raise capture_error(exc, "synchronize") from exc
            raise

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return self.runtime.as_tensor(int(address), int(nbytes))

    def empty_cache(self) -> None:
        self.runtime.empty_cache()

    def memory_in_use(self) -> int | None:
        free, total = self.runtime.mem_get_info()
        return int(total - free)

    def attention_runners(self) -> dict[str, AttentionRunner]:
        # decode: the graph-safe reference; FusedDecodeRunner is opt-in (attention.py)
        return reference_runners()

    def device_name(self) -> str:
        return self.runtime.device_name()

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        return self.runtime.time_on_device(fn)

    def prepare_collectives(self, groups: Sequence[Any]) -> None:
        """On an NPU, HCCL groups only, each warmed by one all_reduce outside any capture
        (HCCL sets its communicator up on first use); captures already run in thread-local
        mode on the capture stream. The simulated runtime (host tensors) takes gloo groups,
        whose collectives it records as ops (docs/distributed.md)."""
        import torch.distributed as dist

        if self.device.type == "npu":
            for g in groups:
                if "hccl" not in str(dist.get_backend(g)):
                    raise XGraphError(
                        f"group {g.group_name!r} has backend {dist.get_backend(g)!r}: "
                        "collectives inside ACL graphs need HCCL; create it with backend='hccl'."
                    )
        super().prepare_collectives(groups)


class AscendSimBackend(AscendBackend):
    """The same adapter over the simulated ACL runtime (host memory, no NPU)."""

    name = "ascend-sim"

    @classmethod
    def _default_runtime(cls) -> NpuRuntime:
        from .sim import SimRuntime

        return SimRuntime(era=os.environ.get("XGRAPH_ASCEND_SIM_ERA", "owner"))

    @classmethod
    def availability(cls) -> Availability:
        from . import sim

        return sim.availability()
