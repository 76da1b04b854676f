"""The CUDA runtime of xgraph's device layer: torch.cuda, one call per line.

Plus what torch does not offer: ending, through the driver (cuStreamEndCapture), a capture
torch could not end, raw device memory as a tensor (the CUDA array interface), and a
captured graph's kernel nodes read through the driver (`nodes.py`, for the
parameterization check). The
graphs, capture pools and threading rules over it are the core's (`xgraph.adapter`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from xgraph.adapter import Launch, PoolId, TorchRuntime


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


class CUDARuntime(TorchRuntime):
    """One CUDA device through torch.cuda (the current one by default)."""

    def __init__(self, device: torch.device | None = None) -> None:
        # fixed at construction: graphs, pools and VMM of one backend stay on one device
        self.device = device or torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # switches to the stream's device too

    def is_capturing(self, stream: Any) -> bool:
        with torch.cuda.stream(stream):
            return torch.cuda.is_current_stream_capturing()

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def readable_graph(self) -> torch.cuda.CUDAGraph | None:
        try:  # keep_graph: the raw cudaGraph_t outlives capture_end (torch >= 2.6)
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            return None

    def graph_launches(self, graph: Any) -> list[Launch]:
        from .nodes import read_launches  # cuda-python, only when a check reads a graph

        return read_launches(graph.raw_cuda_graph())

    def new_mempool(self, allocator: Any | None) -> Any:
        with torch.cuda.device(self.device):  # a MemPool belongs to the device current then
            return torch.cuda.MemPool(allocator) if allocator is not None else torch.cuda.MemPool()

    def custom_allocator(self, alloc_fn: int, free_fn: int) -> Any:
        return torch._C._cuda_customAllocator(alloc_fn, free_fn)

    def use_mem_pool(self, mempool: Any) -> AbstractContextManager[Any] | None:
        return torch.cuda.use_mem_pool(mempool, self.device)  # as vLLM's sleep allocator does

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        end = (
            getattr(torch._C, "_cuda_endAllocateToPool", None)
            or torch._C._cuda_endAllocateCurrentStreamToPool
        )
        end(self.device.index, pool_id)

    def release_pool(self, pool_id: PoolId) -> None:
        torch._C._cuda_releasePool(self.device.index, pool_id)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return torch.cuda.memory_snapshot()

    def end_capture(self, stream: Any) -> bool:
        from cuda.bindings import driver as cu

        err, graph = cu.cuStreamEndCapture(stream.cuda_stream)
        if graph is not None and int(graph):
            cu.cuGraphDestroy(graph)
        return bool(err == cu.CUresult.CUDA_SUCCESS)

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceMemory(address, nbytes), device=self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
