"""The CUDA backend: its runtime (torch.cuda), cuMem virtual memory, kernels and staging.

Graphs, capture pools, capture streams and the failed-capture undo are the device layer's
(`xgraph.adapter.TorchBackend`); what is CUDA's own is here: the probe, the kernels (Triton
attention runners, the skinny linear kernel), the driver copier and the benchmark hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xgraph.adapter import (
    Availability,
    BackendUnavailableError,
    HostCopier,
    Kernels,
    TorchBackend,
    TorchRuntime,
)

from . import attention, checks, linear, pdl, probe, staging
from .runtime import CUDARuntime
from .timing import LeadTimer
from .vmm import CUDAVirtualMemory


class CUDABackend(TorchBackend):
    """NVIDIA GPUs: torch.cuda.CUDAGraph, cuMem VMM, MemPools (native or xgraph-routed)."""

    name = "cuda"
    runtime_class = CUDARuntime
    virtual_memory_class = CUDAVirtualMemory
    # a gloo group moves cuda tensors through the host: not capturable. Captures already run
    # in thread-local mode on the capture stream, as NCCL requires (docs/distributed.md)
    collective_backend = "nccl"
    # a synchronising call from the capturing thread fails (cudaErrorStreamCaptureUnsupported)
    # and invalidates the capture: full graphs record without the per-op guard
    capture_refuses_host_reads = True

    @classmethod
    def default_runtime(cls) -> TorchRuntime:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "The cuda backend needs a visible CUDA device; torch.cuda.is_available() is "
                "False. Run `xgraph info` to see which backends can run here."
            )
        return CUDARuntime()

    @classmethod
    def availability(cls) -> Availability:
        return probe.availability()

    def kernels(self) -> Kernels:
        """Triton decode and prefill runners when triton imports, else SDPA prefill and the
        core's graph-safe reference decode (XGRAPH_CUDA_ATTENTION=triton|torch forces one);
        the decode projection kernels on Hopper and later when triton imports (cuBLAS
        from XGRAPH_CUDA_CUBLAS_ROWS rows; the skinny kernel before Hopper), plain and fused
        with the ops around them
        (XGRAPH_CUDA_LINEAR, XGRAPH_CUDA_FUSED choose; `linear`); programmatic
        dependent launch in full graphs on Hopper and later (`pdl`); the device check of
        device metadata in one launch when triton imports (XGRAPH_CUDA_CHECK=torch keeps the
        core's torch ops; `metadata_check`)."""
        return Kernels(
            attention.attention_runners(),
            linear.linear_kernel(self.device),
            linear.fused_kernel(self.device),
            pdl.CUDAProgrammaticLaunch(self.device),
            checks.metadata_check(),
        )

    def host_copier(self, device: torch.Tensor, host: torch.Tensor) -> HostCopier | None:
        """cuMemcpyHtoDAsync and an event on the current stream, without torch's copy path
        (`staging`; XGRAPH_CUDA_STAGING=torch uses the core's torch copy)."""
        return staging.host_copier(device, host)

    # -- benchmark hooks (xgraph.interfaces.BenchmarkHooks) -----------------------------------

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        timer = getattr(self, "_timer", None)
        if timer is None:
            timer = self._timer = LeadTimer(self.device)
        return timer(fn)

    def native_graph(self, fn: Callable[[], Any]) -> Callable[[], None] | None:
        """`fn` captured with torch.cuda.graph on a pool of its own (the raw-graph anchor)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up, as torch's docs ask, on a side stream
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            fn()
        return g.replay
