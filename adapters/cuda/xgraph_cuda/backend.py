"""The CUDA backend: CUDA graphs, cuMem virtual memory and torch.cuda.MemPool capture pools."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from xgraph.errors import BackendUnavailableError, XGraphError
from xgraph.interfaces import (
    AttentionRunner,
    Availability,
    Backend,
    CapturePool,
    HostCopier,
    SegmentAllocator,
)

from . import attention, linear, probe, staging
from .graph import CUDAGraph
from .pool import CUDACapturePool
from .timing import LeadTimer
from .vmm import CUDAVirtualMemory


class _DeviceMemory:
    """Device memory described by the CUDA array interface (v3), for torch.as_tensor."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
        }


class CUDABackend(Backend):
    """NVIDIA GPUs: torch.cuda.CUDAGraph, cuMem VMM, MemPools (native or xgraph-routed)."""

    name = "cuda"
    priority = 100
    graph_class = CUDAGraph
    virtual_memory_class = CUDAVirtualMemory

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "The cuda backend needs a visible CUDA device; torch.cuda.is_available() is "
                "False. Run `xgraph info` to see which backends can run here."
            )
        # fixed at construction: graphs, pools and VMM of one backend stay on one device
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream: torch.cuda.Stream | None = None
        self._stream_lock = threading.Lock()
        self._timer: LeadTimer | None = None

    @classmethod
    def availability(cls) -> Availability:
        return probe.availability()

    @property
    def device(self) -> torch.device:
        return self._device

    def capture_stream(self) -> torch.cuda.Stream:
        """The non-default stream every capture of this backend runs on (created once)."""
        with self._stream_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self._device)
            return self._stream

    @contextlib.contextmanager
    def warmup_context(self) -> Iterator[None]:
        """Run warm-up on the capture stream, outside every capture pool."""
        # per-stream lazy allocations (cuBLAS workspaces) then land in the default pool
        # instead of inside the first capture's pool
        origin = torch.cuda.current_stream(self._device)
        side = self.capture_stream()
        side.wait_stream(origin)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            origin.wait_stream(side)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        return CUDACapturePool(segments, self._device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceMemory(int(address), int(nbytes)), device=self._device)

    def memory_in_use(self) -> int | None:
        """Device memory in use as the driver sees it (cuMem chunks and other processes too)."""
        free, total = torch.cuda.mem_get_info(self._device)
        return int(total - free)

    def attention_runners(self) -> dict[str, AttentionRunner]:
        """Triton decode and prefill runners when triton imports, else SDPA prefill and the
        core's graph-safe reference decode (XGRAPH_CUDA_ATTENTION=triton|torch forces one)."""
        return attention.attention_runners()

    def linear_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
        """The skinny Triton kernel for decode's few-row projections (`xgraph_cuda.linear`;
        XGRAPH_CUDA_LINEAR=torch: cuBLAS for every call)."""
        return linear.linear_kernel()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self._device)

    def prepare_collectives(self, groups: Sequence[Any]) -> None:
        """NCCL groups only (a gloo group moves cuda tensors through the host: not
        capturable), each warmed by one all_reduce outside any capture; captures already run
        in thread-local mode on the capture stream, as NCCL requires (docs/distributed.md)."""
        import torch.distributed as dist

        for g in groups:
            if "nccl" not in str(dist.get_backend(g)):
                raise XGraphError(
                    f"group {g.group_name!r} has backend {dist.get_backend(g)!r}: collectives "
                    "inside CUDA graphs need NCCL; create the group with backend='nccl'."
                )
        super().prepare_collectives(groups)

    def host_copier(self, device: torch.Tensor, host: torch.Tensor) -> HostCopier | None:
        """cuMemcpyHtoDAsync and an event on the current stream, without torch's copy path
        (`staging`; XGRAPH_CUDA_STAGING=torch uses the core's torch copy)."""
        return staging.host_copier(device, host)

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        if self._timer is None:
            self._timer = LeadTimer(self._device)
        return self._timer(fn)

    def native_graph(self, fn: Callable[[], Any]) -> Callable[[], None] | None:
        """`fn` captured with torch.cuda.graph on a pool of its own (the raw-graph anchor)."""
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up, as torch's docs ask, on a side stream
                fn()
        torch.cuda.current_stream(self._device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            fn()
        return g.replay
