"""Contracts every backend implements: Backend, Graph, VirtualMemory, CapturePool, AttentionRunner.

They are deliberately small. The conformance suite in `xgraph.testing` is the executable
form of these contracts; a docstring here states the one-line promise each method makes.
Core never imports a device runtime: adapters implement these classes in their own packages.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .errors import IncompleteBackendError

if TYPE_CHECKING:
    import torch

    from .attention import AttentionMetadata


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


class VirtualMemory(ABC):
    """Address ranges and physical chunks of one device; one chunk may be mapped at many addresses.

    Chunk sizes and addresses are multiples of `granularity`. `map` always maps a whole chunk
    (ACL cannot map part of a handle) and leaves it readable and writable by the device.
    `unmap` needs only the address (ACL unmaps by address); implementations that need the
    size keep it. A reservation is released whole, by its start address.
    """

    granularity: int

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


class CapturePool(ABC):
    """The memory one or more captures allocate from (a backend-native pool)."""

    @abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes of memory this pool holds now (segments, used or cached)."""

    @abstractmethod
    def close(self) -> None:
        """Give back what the pool holds; graphs captured on it must be reset first."""


class Graph(ABC):
    """One recorded launch sequence, replayed later on the same addresses.

    Work issued between `capture_begin` and `capture_end` is recorded; tensors it allocates
    come from the pool and stay valid for the graph's life (until `reset`). Several captures
    may follow each other on one pool (piecewise graphs). Graphs never replay concurrently.
    """

    @abstractmethod
    def capture_begin(self, pool: CapturePool) -> None:
        """Start recording the work issued from now on; allocations come from `pool`."""

    @abstractmethod
    def capture_end(self) -> None:
        """Stop recording; afterwards the graph can be replayed."""

    @abstractmethod
    def replay(self) -> None:
        """Re-issue the recorded work; it reads and writes the addresses seen at capture."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the recording and what it holds; the graph may then be captured again."""

    @property
    def capturing(self) -> bool:
        return bool(getattr(self, "_capturing", False))

    def abort(self) -> None:
        """End a failed capture and drop whatever it recorded, whatever state it is in."""
        if self.capturing:
            try:
                self.capture_end()
            except Exception:  # the capture already failed; its own error is the one to report
                pass
        self.reset()


class AttentionRunner(ABC):
    """Attention over a paged KV cache, split into host planning and a device launch.

    A `graph_safe` runner keeps one launch shape per bucket and reads every per-step value
    from device buffers, so it may be recorded inside a full graph; any other runner runs
    eagerly between the pieces of a piecewise graph.
    """

    graph_safe: ClassVar[bool] = False

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
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> None:
        """Store k, v at this step's slots, then write attention of q over the cache into out."""


class Backend(ABC):
    """One accelerator family: its graphs, its virtual memory and its native capture pools.

    Subclasses set `name`, `priority`, `graph_class` and, where the platform has VMM,
    `virtual_memory_class`; `check_complete` rejects a backend whose classes leave any
    abstract method unimplemented.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    graph_class: ClassVar[type[Graph]]
    virtual_memory_class: ClassVar[type[VirtualMemory] | None] = None

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
        """A fresh native capture pool; with `segments`, every segment it holds comes from there."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all work queued on the device has finished."""

    @abstractmethod
    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor over `nbytes` at `address` (memory the caller keeps alive)."""

    # Concrete helpers shared by every backend.

    def new_graph(self) -> Graph:
        return self.graph_class(self)  # type: ignore[call-arg]

    def virtual_memory(self) -> VirtualMemory | None:
        """This device's VirtualMemory (one per backend instance), or None without VMM."""
        if self.virtual_memory_class is None:
            return None
        vm = getattr(self, "_virtual_memory", None)
        if vm is None:
            vm = self.virtual_memory_class(self)  # type: ignore[call-arg]
            self._virtual_memory = vm
        return vm

    def warmup_context(self) -> AbstractContextManager[None]:
        """Where warm-up runs: on the capture stream, so per-stream lazy allocations (cuBLAS
        workspaces) happen outside every capture pool. Default: nothing to switch."""
        return nullcontext()

    def empty_cache(self) -> None:
        """Give cached, unused memory of the default allocator back to the driver."""
        return None  # the CPU backend's default allocator caches nothing of ours

    def memory_in_use(self) -> int | None:
        """Bytes of device memory the process holds, as the driver sees it; None if unknown."""
        return None

    def attention_runners(self) -> dict[str, AttentionRunner]:
        """Reference runners: 'decode' (graph-safe) and 'prefill' (planned on the host)."""
        from .attention import PagedDecodeRunner, PagedPrefillRunner

        return {"decode": PagedDecodeRunner(), "prefill": PagedPrefillRunner()}

    def __repr__(self) -> str:
        return f"<xgraph backend {self.name!r} on {self.device}>"

    @classmethod
    def check_complete(cls) -> None:
        """Raise IncompleteBackendError naming every abstract method the adapter left out."""
        missing: list[str] = []
        parts: list[tuple[str, Any]] = [(cls.__name__, cls)]
        graph_cls = getattr(cls, "graph_class", None)
        if graph_cls is None:
            missing.append(f"{cls.__name__}.graph_class")
        else:
            parts.append(("graph_class", graph_cls))
        if cls.virtual_memory_class is not None:
            parts.append(("virtual_memory_class", cls.virtual_memory_class))
        if not getattr(cls, "name", None):
            missing.append(f"{cls.__name__}.name")
        for _label, klass in parts:
            if inspect.isabstract(klass):
                missing += [f"{klass.__name__}.{m}" for m in sorted(klass.__abstractmethods__)]
        if missing:
            raise IncompleteBackendError(
                f"Backend class {cls.__module__}.{cls.__qualname__} is incomplete: it does not "
                f"implement {', '.join(missing)}. Implement them (see docs/writing-an-adapter.md) "
                "and run `xgraph conformance --backend NAME` to check the adapter."
            )
