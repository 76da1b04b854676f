"""Contracts: every duty of a backend adapter, one line each.

An adapter writes what is declared abstract here; the core implements the rest once:
`xgraph.graphs.CheckedGraph` gives a Graph its public methods (state machine, capture-safety
guard, pool checks) over four driver calls, and `xgraph.vmm.CheckedVirtualMemory` gives a
VirtualMemory its public methods (checks and books) over seven. `xgraph.contract` checks an
adapter's classes once, when it is chosen. The conformance suite in `xgraph.testing` is the
executable form of these contracts. Core never imports a device runtime.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from .kernels import FusedLinearKernel, Kernels, LinearKernel  # noqa: F401 (importable here)
from .metadata import AttentionMetadata, KVCache

OpCheck = Callable[[Any, tuple, dict], None]  # (aten op, args, kwargs); raises to refuse the op
FALLBACK_CAPTURE_SPACE_BYTES = 1 << 36  # per capture, where the device reports no total memory


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine; `reason` says why not (or what was found)."""

    available: bool
    reason: str = ""
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class PhysicalChunk:
    """One physical allocation of a VirtualMemory: an opaque runtime handle and its size."""

    handle: Any
    size: int


class SegmentAllocator(Protocol):
    """Where a capture pool gets its segments when xgraph owns the memory (SharedPhysicalPool)."""

    def alloc(self, nbytes: int) -> int:
        """Return the address of `nbytes` of device memory, or 0 when none is left."""
        ...

    def free(self, address: int, nbytes: int) -> None:
        """Take back a segment the pool no longer caches."""
        ...


@dataclass(frozen=True)
class Launch:
    """One kernel, op or task of a recording, as the parameterization check compares two.

    `kind` says what it is ("kernel", "memset", "op", "task", ...) and `name` which one (the
    kernel's function, the aten op, the task type). `config` holds what the launch fixes at
    capture, as (field, value) pairs with printable, comparable values: grid, block, shared
    memory, argument bytes with pointers left out; an op's tensor layouts and non-tensor
    arguments. `layer` names the model code that issued it, where the backend knows it.
    `updated`: the backend re-parameterises it before every replay (a graph task update),
    so its config may differ between captures.
    """

    kind: str
    name: str
    config: tuple[tuple[str, Any], ...] = ()
    layer: str = ""
    updated: bool = False


class VirtualMemory(ABC):
    """Address ranges and physical chunks of one device; one chunk may be mapped at many addresses.

    Public methods (implemented by CheckedVirtualMemory): `reserve(size) -> address`,
    `release(address)`, `create(size) -> PhysicalChunk`, `free(chunk)`, `map(address, chunk)`
    (a whole chunk, read/write), `unmap(address)`, `physical_bytes()`, `live()`. Sizes and
    addresses are multiples of `granularity`. Adapters subclass CheckedVirtualMemory, set up
    their runtime in `__init__(backend)`, call `super().__init__(backend)`, and write the
    driver calls below; the core has checked every argument before it calls them.
    """

    granularity: int

    def __init__(self, backend: Backend | None) -> None:
        self.backend = backend

    # -- public (CheckedVirtualMemory) -----------------------------------------------------

    @abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space (no memory behind it) and return its start."""

    @abstractmethod
    def release(self, address: int) -> None:
        """Give back a whole reservation; every mapping in it must have been unmapped."""

    @abstractmethod
    def create(self, size: int) -> PhysicalChunk:
        """Allocate `size` bytes of physical memory, not yet mapped anywhere."""

    @abstractmethod
    def free(self, chunk: PhysicalChunk) -> None:
        """Free a chunk that is no longer mapped anywhere."""

    @abstractmethod
    def map(self, address: int, chunk: PhysicalChunk) -> None:
        """Map the whole chunk at `address` (inside a reservation) with read/write access."""

    @abstractmethod
    def unmap(self, address: int) -> None:
        """Remove the chunk mapped at `address`; the reservation stays."""

    # -- adapter duties --------------------------------------------------------------------

    @abstractmethod
    def _granularity(self) -> int:
        """The runtime's mapping granularity in bytes (asked once, at construction)."""

    @abstractmethod
    def _reserve_range(self, size: int) -> int:
        """Reserve `size` bytes of address space aligned to the granularity; return its start."""

    @abstractmethod
    def _release_range(self, address: int, size: int) -> None:
        """Free the whole reservation at `address` (nothing is mapped in it any more)."""

    @abstractmethod
    def _create_chunk(self, size: int) -> Any:
        """Allocate `size` bytes of physical memory; return the runtime's handle."""

    @abstractmethod
    def _free_chunk(self, handle: Any, size: int) -> None:
        """Free a physical allocation that is mapped nowhere."""

    @abstractmethod
    def _map_chunk(self, address: int, handle: Any, size: int) -> None:
        """Map the whole allocation at `address`, readable and writable by the device."""

    @abstractmethod
    def _unmap_chunk(self, address: int, size: int) -> None:
        """Remove the mapping at `address`, keeping the reservation."""


class CapturePool(ABC):
    """The native memory pool one or more captures allocate from.

    A pool made with `segments` (Backend.new_pool) must take every segment it holds from
    that SegmentAllocator and give each back through it: this is how the shared-physical
    pool puts each capture in its own address range. A pool is `poisoned` once a capture
    whose begin or end the runtime refused may have left the runtime routing its id where
    nothing can undo it: the core never captures on it again (a new pool serves instead).
    """

    def __init__(self, segments: SegmentAllocator | None = None) -> None:
        self.segments = segments
        self.closed = False
        self.poisoned = False

    @abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes of memory this pool holds now (segments, used or cached)."""

    @abstractmethod
    def _release(self) -> None:
        """Give back everything the pool holds (called once, by close)."""

    def capturing(self) -> AbstractContextManager[Any]:
        """Entered around each capture on this pool: route the runtime's segment requests to
        `segments` where the runtime does not say which pool asks. Default: nothing to route."""
        return nullcontext()

    def allocating(self) -> AbstractContextManager[Any] | None:
        """Optional: a context in which this thread's ordinary tensor allocations on the
        device (outside any capture) come from this pool, for `xgraph.memory_region`; None
        where the runtime cannot route them (regions are then refused, with the reason).
        Only a pool made with `segments` is asked. Default: None."""
        return None

    def close(self) -> None:
        """Give back what the pool holds; graphs captured on it must be reset first."""
        if self.closed:
            return
        self.closed = True
        self._release()


class Graph(ABC):
    """One recorded launch sequence, replayed later on the same addresses.

    Public methods (implemented by xgraph.graphs.CheckedGraph, which adapters subclass):
    `capture_begin(pool, op_check=None, check_ops=True)`, `capture_end()`, `replay()`,
    `reset()`, `abort()`, `capturing`, `captured`, and for the parameterization check
    `keep_launches()` / `launches()`. Work issued between capture_begin and
    capture_end is recorded; tensors it allocates come from the pool and stay valid for the
    graph's life (until reset). Several captures may follow each other on one pool
    (piecewise graphs). Graphs never replay concurrently. The core checks state and pool
    before each driver call below and runs the capture-safety guard itself.
    """

    pool_type: ClassVar[type[CapturePool]]  # the pool class this backend's new_pool returns

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    # -- public (CheckedGraph) -------------------------------------------------------------

    @abstractmethod
    def capture_begin(
        self, pool: CapturePool, op_check: OpCheck | None = None, check_ops: bool = True
    ) -> None:
        """Start recording the work issued from now on; allocations come from `pool`. Low
        level: engines capture through GraphExecutor or the `xgraph.graph()` context."""

    @abstractmethod
    def capture_end(self) -> None:
        """Stop recording; afterwards the graph can be replayed."""

    @abstractmethod
    def replay(self) -> None:
        """Re-issue the recorded work; it reads and writes the addresses seen at capture."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the recording and what it holds; the graph may then be captured again."""

    @abstractmethod
    def abort(self) -> None:
        """End a failed capture and drop whatever it recorded, whatever state it is in."""

    @property
    @abstractmethod
    def capturing(self) -> bool:
        """Whether a capture is in progress."""

    # -- adapter duties --------------------------------------------------------------------

    @abstractmethod
    def _begin(self, pool: CapturePool) -> None:
        """Start recording the work this thread issues; its allocations come from `pool`."""

    @abstractmethod
    def _end(self) -> None:
        """Stop recording; raise CaptureError if the runtime refused the capture."""

    @abstractmethod
    def _replay(self) -> None:
        """Re-issue the recorded work on the addresses seen at capture."""

    @abstractmethod
    def _reset(self) -> None:
        """Drop the recording and whatever a begun or failed capture left; works in any state."""

    def _record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Optional: see every op of a capture after it ran (a host recorder); returns `out`."""
        return out

    def _keep_launches(self) -> bool:
        """Optional, before capture_begin: keep the next capture readable by `_launches`;
        False (the default): this backend cannot read what its graphs record."""
        return False

    def _launches(self) -> list[Launch]:
        """Optional, after capture_end of a capture `_keep_launches` kept: what the recording
        launches, in order (implement both or neither: xgraph.contract checks)."""
        raise NotImplementedError


class AttentionRunner(ABC):
    """Attention over a paged KV cache, split into host planning and a device launch.

    A `graph_safe` runner keeps one launch shape per bucket and reads every per-step value
    from device buffers, so it may be recorded inside a full graph; any other runner runs
    eagerly between the pieces of a piecewise graph. `max_query_len` is the longest query
    length, the same for every sequence of a step, that a graph-safe runner's `run` serves
    with causal masking inside the step (1: decode only; more: speculative verification
    runs as full graphs too, keyed by that length).
    """

    graph_safe: ClassVar[bool] = False
    max_query_len: ClassVar[int] = 1

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Once per step, on the host: take this step's metadata and write any plan to device."""

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> None:
        """Store k, v at this step's slots, then write attention of q over the cache into out."""

    def forget(self) -> None:
        """Optional: drop what the last plan holds (its executor closed; views of its buffers
        would keep their address range until they go). The next `plan` comes first."""
        return None  # a runner that keeps nothing of a plan has nothing to drop


class HostCopier(ABC):
    """Sends prefixes of one pinned host buffer into one device buffer, asynchronously."""

    @abstractmethod
    def send(self, nbytes: int) -> None:
        """Queue a copy of the first `nbytes` on the current stream, and return."""

    @abstractmethod
    def wait(self) -> None:
        """Return once every copy queued so far has read the host buffer."""


class Backend(ABC):
    """One accelerator family: its graphs, its virtual memory and its native capture pools.

    Subclasses set `name` (the name its BackendSpec registers), `graph_class` (a
    CheckedGraph) and, where the platform has VMM, `virtual_memory_class` (a
    CheckedVirtualMemory); a backend is constructed with no arguments. Selection priority
    lives in the BackendSpec alone. Methods below the abstract ones have working defaults,
    grouped by what they serve: graphs and memory, kernels, staging. Benchmark hooks are
    apart (BenchmarkHooks). `xgraph.adapter.TorchBackend` implements the graph and memory
    duties once for torch-style devices.
    """

    name: ClassVar[str]
    graph_class: ClassVar[type[Graph]]
    virtual_memory_class: ClassVar[type[VirtualMemory] | None] = None
    #: whether a captured graph's executable lives in device memory outside every pool (CUDA,
    #: ACL: the memory plan measures it); False where recordings are host objects (the CPU)
    graph_executables: ClassVar[bool] = True
    #: whether the runtime fails a capture that reads device data on the host (CUDA: a
    #: synchronising call from the capturing thread invalidates its capture), so full graphs
    #: record without the per-op guard and a failed one is diagnosed after (xgraph.capture)
    capture_refuses_host_reads: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Say whether this backend can run here and, if not, why."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The torch device its graphs run on."""

    @abstractmethod
    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        """A fresh native capture pool (a `graph_class.pool_type`); with `segments`, every
        segment it holds comes from there."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until the work queued on the device has finished; while another thread
        captures, at least the calling thread's work (never a call that fails then)."""

    @abstractmethod
    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor over `nbytes` at `address` (memory the caller keeps alive)."""

    # -- graphs and memory, with defaults --------------------------------------------------

    def new_graph(self) -> Graph:
        """A fresh graph of this backend."""
        return self.graph_class(self)

    def virtual_memory(self) -> VirtualMemory | None:
        """This device's VirtualMemory (one per backend instance), or None without VMM."""
        if self.virtual_memory_class is None:
            return None
        vm = getattr(self, "_virtual_memory", None)
        if vm is None:
            vm = self._virtual_memory = self.virtual_memory_class(self)
        return vm

    def segments_support(self) -> Availability:
        """Whether `new_pool(segments)` can route every segment to `segments` here (needed by
        shared-physical memory, which otherwise falls back to shared-pool with a warning)."""
        return Availability(True)

    def capture_space_bytes(self) -> int:
        """Address space reserved per capture in shared-physical memory: as much as one
        capture can use, the device's total memory (its torch device module's
        `mem_get_info`), else FALLBACK_CAPTURE_SPACE_BYTES."""
        info = getattr(getattr(torch, self.device.type, None), "mem_get_info", None)
        if info is None:
            return FALLBACK_CAPTURE_SPACE_BYTES
        try:
            return int(info(self.device)[1])
        except Exception:  # a runtime that cannot say: the fallback, as on any other device
            return FALLBACK_CAPTURE_SPACE_BYTES

    def capture_stream(self) -> Any:
        """The stream this thread's captures run on (a non-default one, joined to the
        current stream before and after each capture); None where the runtime has no
        streams (host recorders)."""
        return None

    def stream_capturing(self) -> bool:
        """Whether this thread's current stream records a capture, anyone's (memory must not
        be given back there); False where the runtime has no streams."""
        return False

    def warmup_context(self) -> AbstractContextManager[Any]:
        """Where warm-up runs: on the capture stream, so per-stream lazy allocations (cuBLAS
        workspaces) happen outside every capture pool. Default: nothing to switch."""
        return nullcontext()

    def empty_cache(self) -> None:
        """Give cached, unused memory of the default allocator back to the driver."""
        return None

    def memory_in_use(self) -> int | None:
        """Bytes of device memory the process holds, as the driver sees it; None if unknown."""
        return None

    # -- kernels ---------------------------------------------------------------------------

    def kernels(self) -> Kernels:
        """This device's faster kernels (fresh runners on every call); none by default."""
        return Kernels()

    def activate(self) -> Kernels:
        """Make this backend's kernels the ones the core's ops use on its device
        (`xgraph.linear`) and return them. GraphExecutor calls it once, when it is built;
        code that runs the core's ops without an executor calls it itself."""
        from . import check_call, linear  # the kernel tables this fills

        kernels = self.kernels()
        linear.install(self.device.type, kernels.linear, self.name, kernels.fused_linear)
        check_call.install(self.device.type, kernels.metadata_check, self.name)
        return kernels

    # -- staging ---------------------------------------------------------------------------

    def host_copier(self, device: torch.Tensor, host: torch.Tensor) -> HostCopier | None:
        """A per-step copier from `host` (pinned) to `device` (uint8, one size) cheaper than
        the core's (a torch copy and an event), or None."""
        return None

    # -- collectives inside graphs (graphs across ranks; docs/distributed.md) ----------------

    #: the torch.distributed backend whose collectives this backend's graphs can hold
    #: ("nccl", "hccl"); None: any
    collective_backend: str | None = None

    def prepare_collectives(self, groups: Sequence[Any]) -> None:
        """Make collectives on `groups` (torch.distributed process groups) capturable here:
        called once per group, on every rank together, before any capture of a forward that
        issues them. Default: each group's backend checked against `collective_backend`,
        then one all_reduce of a one-element tensor on this device per group and a
        synchronize, so a communicator that sets up on first use (NCCL, HCCL) does so
        outside every capture. A runtime with further needs (a capture mode, a stream, an
        environment setting) checks or sets them here and raises, naming them, if it cannot."""
        import torch.distributed as dist  # only executors with `parallel` get here

        from .errors import XGraphError

        want = self.collective_backend
        for group in groups:
            got = str(dist.get_backend(group))
            if want is not None and want not in got:
                raise XGraphError(
                    f"group {group.group_name!r} has backend {got!r}: collectives inside "
                    f"{self.name!r} graphs need {want}; create the group with backend={want!r}."
                )
        for group in groups:
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        self.synchronize()

    def __repr__(self) -> str:
        return f"<xgraph backend {self.name!r} on {self.device}>"


class BenchmarkHooks(Protocol):
    """What `xgraph bench` asks of a backend where it has it (each method is optional; the
    bench looks each up and falls back: str(device), host wall time, no native anchor)."""

    def device_name(self) -> str:
        """A human-readable name of the device (benchmark reports)."""
        ...

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        """Seconds the device spent on the work `fn` queues (not the host's time to queue
        it: the device is kept busy until it is queued), or None if it cannot time it."""
        ...

    def native_graph(self, fn: Callable[[], Any]) -> Callable[[], None] | None:
        """`fn` captured with the runtime's own graph API, bypassing xgraph, as a replay
        callable: a benchmark anchor. None where the runtime has none of its own."""
        ...
