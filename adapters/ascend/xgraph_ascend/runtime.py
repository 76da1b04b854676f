"""The runtime facade: the only code of the adapter that touches torch_npu and libascendcl.

`NpuRuntime` lists everything the adapter asks of the NPU stack: the core's TorchRuntime
port (what xgraph's device layer drives) and what is Ascend's own. `TorchNpuRuntime` is the
real one (torch_npu + libascendcl through ctypes); `xgraph_ascend.sim.SimRuntime` is the
simulated one used by the `ascend-sim` backend. The rest of the adapter runs unchanged on
either: it never imports torch_npu, never loads a library, never patches sys.modules.

Nothing in TorchNpuRuntime has run on an NPU (no NPU is reachable where xgraph is
developed); docs/ascend.md lists what only hardware can prove and ships a check script.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib
import logging
import threading
import weakref
from abc import abstractmethod
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch

from xgraph.adapter import PoolId, TorchRuntime, when_no_capture

from . import dlpack
from .acl import AclFunctions

logger = logging.getLogger("xgraph")


class PoolEra(str, enum.Enum):
    """How torch_npu's MemPool uses a custom allocator (docs/ascend.md, 'memory-pool eras')."""

    OWNER = "owner"  # the pool owns its allocator: segments come from it and go back to it
    CONTEXT = "context"  # MemPoolContext era: allocation routed, frees via a bare aclrtFree


class NpuRuntime(TorchRuntime):
    """torch_npu and libascendcl as the adapter uses them; one object per device.

    The TorchRuntime part (streams, graphs, MemPools, memory) is what the core's device layer
    drives; below it, what is Ascend's own: the ACL function table, the memory-pool era,
    graph task updates and the fused attention kernel.
    """

    name: str
    era: PoolEra
    acl: AclFunctions
    device_index: int

    @abstractmethod
    def ensure_device(self) -> None:
        """Make the device current in this thread (aclrt calls need a context)."""

    @abstractmethod
    def stream_handle(self, stream: Any) -> int:
        """The aclrtStream of a stream (for direct ACL calls)."""

    def context_mempool(self, mempool: Any) -> Any:
        """`mempool`, a MemPoolContext-era MemPool, set to empty torch_npu's cache once it goes.

        That era's MemPool holds no use of its pool and its destructor does nothing, so the
        segments of a closed pool whose graphs were all reset would stay cached until some
        empty_cache. The device layer drops a closed pool's MemPool only when no capture
        runs; the cache is emptied then (skipped if a capture has begun since: it
        synchronizes the device; the next empty_cache gives them back)."""
        try:
            done = weakref.finalize(mempool, _empty_cache_when_quiet, weakref.ref(self))
        except TypeError:  # a MemPool without weak references: the next empty_cache
            return mempool
        done.atexit = False  # not at interpreter exit: the runtime may be gone
        return mempool

    def end_capture(self, stream: Any) -> bool:
        """End a capture torch_npu could not end through aclmdlRICaptureEnd (and destroy the
        model it returns); False where libascendcl lacks the calls or refuses."""
        if not self.acl.has("aclmdlRICaptureEnd", "aclmdlRIDestroy"):
            return False
        ri = ctypes.c_void_p()
        rc = self.acl.aclmdlRICaptureEnd(self.stream_handle(stream), ctypes.byref(ri))
        if ri.value:
            self.acl.aclmdlRIDestroy(ri.value)
        return rc == 0

    # -- graph task update -----------------------------------------------------------------

    @abstractmethod
    def task_group_begin(self, stream: Any) -> None: ...

    @abstractmethod
    def task_group_end(self, stream: Any) -> Any:
        """Close the task group; returns its handle."""

    @abstractmethod
    def task_update_begin(self, stream: Any, handle: Any) -> None: ...

    @abstractmethod
    def task_update_end(self, stream: Any) -> None: ...

    @abstractmethod
    def external_event(self) -> Any:
        """An ExternalEvent: wait(stream), reset(stream), record(stream); wait may precede
        record, and it must be reset before reuse."""

    # -- kernels ---------------------------------------------------------------------------

    @abstractmethod
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
        """npu_fused_infer_attention_score (.out) for decode over a paged cache:
        query/out [b, hq, d], caches [blocks, block_size, hkv, d], host seq_lens."""

    @abstractmethod
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
        """The largest workspace the op may need for these shapes (allocated once)."""

    # -- reporting -------------------------------------------------------------------------

    @abstractmethod
    def device_name(self) -> str: ...

    @abstractmethod
    def versions(self) -> dict[str, str]: ...

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        """Seconds the device spent on `fn`'s work, where the runtime can time it."""
        return None


def _empty_cache_when_quiet(runtime: weakref.ref[NpuRuntime]) -> None:
    rt = runtime()
    if rt is None:
        return
    try:
        when_no_capture(rt, rt.empty_cache)
    except Exception:  # a capture xgraph does not know of: the next empty_cache, then
        logger.debug("empty_cache after a MemPool was dropped failed", exc_info=True)


# what the adapter calls; missing ones mean a torch_npu older than the 7.0.0 branches
REQUIRED_APIS = ("NPUGraph", "graph_task_group_begin", "graph_task_update_begin", "ExternalEvent")


def torch_npu_facts() -> dict[str, Any]:
    """Import torch_npu and report what availability depends on (for the probe).

    Raises whatever the import raises: not only ImportError (see probe.py).
    """
    torch_npu = importlib.import_module("torch_npu")
    try:
        version = metadata.version("torch_npu")
    except metadata.PackageNotFoundError:
        version = str(getattr(torch_npu, "__version__", "?"))
    npu = torch.npu  # type: ignore[attr-defined]
    facts: dict[str, Any] = {"version": version, "available": bool(npu.is_available())}
    if facts["available"]:
        facts["missing"] = [f"torch.npu.{n}" for n in REQUIRED_APIS if not hasattr(npu, n)]
        context = hasattr(torch_npu.npu.memory, "MemPoolContext")
        facts["era"] = (PoolEra.CONTEXT if context else PoolEra.OWNER).value
        facts["devices"] = f"{npu.device_count()} x {npu.get_device_name()}"
    return facts


def _paged_kwargs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> dict[str, Any]:
    """npu_fused_infer_attention_score keyword arguments for paged decode (BNSD query)."""
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    return {
        "num_heads": query.shape[1],
        "num_key_value_heads": hkv,
        "input_layout": "BNSD",
        "scale": scale,
        "block_table": block_table,
        "block_size": bs,
        "actual_seq_lengths_kv": [int(n) for n in seq_lens],
        "sparse_mode": 0,
    }


class TorchNpuRuntime(NpuRuntime):
    """torch_npu and libascendcl of the current NPU (import torch_npu before constructing)."""

    name = "torch_npu"

    def __init__(self) -> None:
        import torch_npu  # only this module imports it (torch_npu_facts above for the probe)

        self._tn = torch_npu
        self.device_index = int(torch.npu.current_device())  # type: ignore[attr-defined]
        self.device = torch.device("npu", self.device_index)
        memory = torch_npu.npu.memory
        self.era = PoolEra.CONTEXT if hasattr(memory, "MemPoolContext") else PoolEra.OWNER
        # after `import torch_npu` this resolves to the copy torch_npu already loaded
        self.acl = AclFunctions.from_library(ctypes.CDLL("libascendcl.so"))
        self._thread = threading.local()

    # -- device and streams ----------------------------------------------------------------

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def ensure_device(self) -> None:
        if not getattr(self._thread, "set", False):
            torch.npu.set_device(self.device_index)  # type: ignore[attr-defined]
            self._thread.set = True

    def new_stream(self) -> Any:
        return torch.npu.Stream(device=self.device)  # type: ignore[attr-defined]

    def current_stream(self) -> Any:
        return torch.npu.current_stream(self.device)  # type: ignore[attr-defined]

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.npu.stream(stream)  # type: ignore[attr-defined]

    def stream_handle(self, stream: Any) -> int:
        return int(stream.npu_stream)

    def is_capturing(self, stream: Any) -> bool:
        check = getattr(torch.npu, "is_current_stream_capturing", None)
        with torch.npu.stream(stream):  # type: ignore[attr-defined]
            if check is not None:
                return bool(check())
            return bool(self._tn._C._npu_isCurrentStreamCapturing())

    # -- graphs and pools ------------------------------------------------------------------

    def new_graph(self) -> Any:
        return torch.npu.NPUGraph()  # type: ignore[attr-defined]

    def new_mempool(self, allocator: Any | None) -> Any:
        pool_cls = self._tn.npu.memory.MemPool
        mempool = pool_cls(allocator) if allocator is not None else pool_cls()
        return self.context_mempool(mempool) if self.era is PoolEra.CONTEXT else mempool

    def custom_allocator(self, alloc_fn: int, free_fn: int) -> Any:
        return self._tn._C._npu_customAllocator(alloc_fn, free_fn)

    def use_mem_pool(self, mempool: Any) -> contextlib.AbstractContextManager[Any] | None:
        return self._tn.npu.memory.use_mem_pool(mempool)  # what vllm-ascend's sleep mode uses

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        c = self._tn._C
        end = getattr(c, "_npu_endAllocateToPool", None) or c._npu_endAllocateCurrentStreamToPool
        end(self.device_index, pool_id)

    def release_pool(self, pool_id: PoolId) -> None:
        self._tn._C._npu_releasePool(self.device_index, pool_id)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return list(self._tn.npu.memory_snapshot())

    # -- graph task update -----------------------------------------------------------------

    def task_group_begin(self, stream: Any) -> None:
        torch.npu.graph_task_group_begin(stream)  # type: ignore[attr-defined]

    def task_group_end(self, stream: Any) -> Any:
        return torch.npu.graph_task_group_end(stream)  # type: ignore[attr-defined]

    def task_update_begin(self, stream: Any, handle: Any) -> None:
        torch.npu.graph_task_update_begin(stream, handle)  # type: ignore[attr-defined]

    def task_update_end(self, stream: Any) -> None:
        torch.npu.graph_task_update_end(stream)  # type: ignore[attr-defined]

    def external_event(self) -> Any:
        return torch.npu.ExternalEvent()  # type: ignore[attr-defined]

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
        b, hq, d = query.shape
        blocks, bs = key_cache.shape[:2]
        self._tn.npu_fused_infer_attention_score.out(
            query.view(b, hq, 1, d),
            key_cache.view(blocks, bs, -1),
            value_cache.view(blocks, bs, -1),
            workspace=workspace,
            out=[out.view(b, hq, 1, d), lse],
            **_paged_kwargs(query, key_cache, block_table, seq_lens, scale),
        )

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
        fn = getattr(self._tn, "_npu_fused_infer_attention_score_get_max_workspace", None)
        if fn is None:
            return None  # the op then allocates its workspace itself
        b, hq, d = query.shape
        blocks, bs = key_cache.shape[:2]
        return fn(
            query.view(b, hq, 1, d),
            key_cache.view(blocks, bs, -1),
            value_cache.view(blocks, bs, -1),
            **_paged_kwargs(query, key_cache, block_table, seq_lens, scale),
        )

    # -- memory and reporting --------------------------------------------------------------

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        cap = dlpack.capsule(address, nbytes, dlpack.KDL_EXT_DEV, self.device_index)
        return self._tn._C._npu_from_dlpack(cap)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.npu.mem_get_info(self.device)  # type: ignore[attr-defined]
        return int(free), int(total)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()  # type: ignore[attr-defined]

    def device_name(self) -> str:
        return str(torch.npu.get_device_name(self.device_index))  # type: ignore[attr-defined]

    def versions(self) -> dict[str, str]:
        out = {"torch_npu": str(getattr(self._tn, "__version__", "?")), "pool era": self.era.value}
        get_cann = getattr(getattr(self._tn.npu, "utils", None), "get_cann_version", None)
        if get_cann is not None:
            with contextlib.suppress(Exception):
                out["CANN"] = str(get_cann())
        return out

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        event = torch.npu.Event  # type: ignore[attr-defined]
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3
