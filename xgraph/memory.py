"""Memory modes: which native pool each capture allocates from.

- "private": a new native pool per capture (sum of shapes: the naive baseline);
- "shared-pool": one native pool for every capture (the vLLM / SGLang way; good only when
  the largest shape is captured first);
- "shared-physical": a fresh native pool per capture whose segments come from a fresh VA
  space of one SharedPhysicalPool (max of shapes in any order). Default where the backend
  has virtual memory.

One GraphMemory may serve several executors or phases (decode full graphs, prefill pieces,
a draft model): pass the same object as `memory=` to each. Their steps take the memory's
StepLock (the physical pool's, when there is one), so graphs over shared memory never
replay concurrently, whichever threads call them. The memory knows the executors that use
it and refuses to close under an open one (MemoryInUseError): close the executors first.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from .errors import MemoryInUseError, PoolClosedError, XGraphError, XGraphWarning
from .interfaces import Backend, CapturePool
from .options import MemoryMode
from .pool import AddressSpace, SharedPhysicalPool
from .steplock import StepLock

logger = logging.getLogger("xgraph")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, XGraphWarning, stacklevel=4)
        logger.warning(msg)


@dataclass(eq=False)
class Lease:
    """The pool (and VA space, in shared-physical mode) one capture allocates from."""

    pool: CapturePool
    space: AddressSpace | None = None
    owned: bool = True  # the lease's pool is this capture's own (private, shared-physical)


class GraphMemory:
    """Hands each capture a pool according to the mode; accounts graph memory."""

    def __init__(
        self,
        backend: Backend,
        mode: MemoryMode | str | None = None,
        physical: SharedPhysicalPool | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self.backend = backend
        vm = backend.virtual_memory()
        if mode is None:
            has_vmm = vm is not None or physical is not None
            mode = MemoryMode.SHARED_PHYSICAL if has_vmm else MemoryMode.SHARED_POOL
        mode = MemoryMode.parse(mode, "memory")
        support = backend.segments_support()
        if mode is MemoryMode.SHARED_PHYSICAL and not support.available:
            _warn_once(
                f"Backend {backend.name!r} cannot give captures shared physical memory here "
                f"({support.reason}); graph memory uses 'shared-pool' instead (max of shapes "
                "only when the largest is captured first)."
            )
            mode, physical = MemoryMode.SHARED_POOL, None
        if mode is MemoryMode.SHARED_PHYSICAL and vm is None and physical is None:
            raise XGraphError(
                f"Backend {backend.name!r} has no virtual memory, so 'shared-physical' is not "
                "possible; use memory='shared-pool' or 'private'."
            )
        self.mode = mode
        self._owns_physical = physical is None and mode is MemoryMode.SHARED_PHYSICAL
        self.physical = physical
        if self._owns_physical:
            self.physical = SharedPhysicalPool(
                vm,  # type: ignore[arg-type]  # not None: checked above
                chunk_size=chunk_size,
                space_bytes=backend.capture_space_bytes(),
            )
        self._shared: CapturePool | None = None
        self._pools: list[CapturePool] = []  # every native pool handed out, for close()
        self._users: dict[int, Any] = {}  # id -> the Holdings of each open executor
        self.closed = False
        if self.physical is not None:
            self.physical.attach(self)  # refused if the pool is closed
            self.steps = self.physical.steps  # graphs over one physical pool share memory
        else:
            self.steps = StepLock()

    @classmethod
    def of(
        cls, backend: Backend, memory: GraphMemory | SharedPhysicalPool | MemoryMode | str | None
    ) -> GraphMemory:
        if isinstance(memory, GraphMemory):
            if memory.backend is not backend:
                raise XGraphError("A GraphMemory is bound to the backend it was created with.")
            return memory
        if isinstance(memory, SharedPhysicalPool):
            return cls(backend, MemoryMode.SHARED_PHYSICAL, physical=memory)
        if memory is None or isinstance(memory, str):
            return cls(backend, memory)
        raise XGraphError(
            f"memory= takes a mode name {[m.value for m in MemoryMode]}, a GraphMemory or a "
            "SharedPhysicalPool; "
            f"got {type(memory).__name__}."
        )

    # -- users ---------------------------------------------------------------------------

    def attach(self, user: Any) -> None:
        """Count `user` (an executor's Holdings, with a `name`) among this memory's users."""
        if self.closed:
            raise PoolClosedError(
                f"{user.name}: its GraphMemory is closed; create a new one (or pass none)."
            )
        self._users[id(user)] = user

    def detach(self, user: Any) -> None:
        self._users.pop(id(user), None)

    def users(self) -> list[str]:
        """Names of the open executors that use this memory."""
        return [u.name for u in self._users.values()]

    def holdings(self) -> list[Any]:
        """The Holdings of the open executors that use this memory (xgraph.lifetime)."""
        return list(self._users.values())

    def begin(self) -> Lease:
        """The pool for the next capture (several pieces of one forward share one lease)."""
        if self.closed:
            raise PoolClosedError("GraphMemory is closed; create a new one.")
        if self.mode is MemoryMode.PRIVATE:
            lease = Lease(self.backend.new_pool())
        elif self.mode is MemoryMode.SHARED_POOL:
            if self._shared is None or self._shared.poisoned:  # a failed capture's pool: replaced
                self._shared = self.backend.new_pool()
                self._pools.append(self._shared)
            return Lease(self._shared, owned=False)
        else:
            assert self.physical is not None
            space = self.physical.new_space()
            lease = Lease(self.backend.new_pool(segments=space), space)
        self._pools.append(lease.pool)
        return lease

    def rollback(self, lease: Lease) -> None:
        """Undo a failed capture's lease: its own pool closed, its VA space and chunks gone."""
        self.backend.synchronize()  # warm-up work may still read the memory going away
        if lease.owned:
            lease.pool.close()
            self._pools.remove(lease.pool)
        if lease.space is not None and self.physical is not None:
            self.physical.discard(lease.space)

    def graph_bytes(self) -> int:
        """Memory held for graphs: physical bytes in shared-physical mode, else pool segments."""
        if self.mode is MemoryMode.SHARED_PHYSICAL:
            assert self.physical is not None
            return self.physical.physical_bytes
        return sum(p.reserved_bytes() for p in self._pools)

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode.value,
            "graph_bytes": self.graph_bytes(),
            "native_pools": len(self._pools),
        }
        if self.physical is not None:
            out["physical"] = self.physical.stats()
        return out

    def close(self) -> None:
        """Close every native pool, then the physical pool if it is this memory's own.

        Refused (MemoryInUseError) while an open executor uses the memory: its graphs would
        replay memory that is gone. Close the executors first. Idempotent; after a driver
        failure, calling again finishes.
        """
        if self._users:
            names = ", ".join(repr(n) for n in self.users())
            raise MemoryInUseError(
                f"GraphMemory.close(): the open executor(s) {names} still use this memory, "
                "and their graphs would replay memory that is gone. Close them first "
                "(executor.close()), then the memory."
            )
        self.closed = True
        self.backend.synchronize()  # queued replays may still use every pool's memory
        while self._pools:
            self._pools[-1].close()
            self._pools.pop()
        self._shared = None
        if self.physical is not None:
            self.physical.detach(self)
            if self._owns_physical:
                self.physical.close()


def settled_reading(backend: Backend) -> int | None:
    """Wait for queued work, give cached free memory back to the device, then read the
    memory in use: a reading comparable across phases (sleep, benchmarks), at the cost of
    a device synchronize and an `empty_cache`."""
    backend.synchronize()
    backend.empty_cache()
    return backend.memory_in_use()


class OutsidePoolMeter:
    """Device memory that captures leave in use outside graph memory, by the backend's reading.

    Around each capture, the reading before and after, minus what graph memory grew by:
    the captures' own cost outside any pool (graph executables: the driver keeps each
    graph's nodes in device memory) plus anything else a capture left allocated. The
    readings bracket the capture alone, which allocates only from its graph pool, so the
    default allocator's cache is the same at both and cancels out: no synchronize and no
    `empty_cache` are needed. None where the backend reports no memory in use, or where its
    recordings cost the device nothing (`Backend.graph_executables` False: the CPU backend,
    whose reading is the whole process's resident size, 11 ms a read, two per capture).
    Other users of the device in the meantime count too.
    """

    def __init__(self, memory: GraphMemory) -> None:
        self.memory = memory
        self.bytes: int | None = None
        self._before: tuple[int | None, int] = (None, 0)
        self.reads = bool(memory.backend.graph_executables)

    def start(self) -> None:
        """Take the reading before a capture."""
        if self.reads:
            self._before = (self.memory.backend.memory_in_use(), self.memory.graph_bytes())

    def stop(self) -> None:
        if not self.reads:
            return
        after, (before, graph_before) = self.memory.backend.memory_in_use(), self._before
        if before is None or after is None:
            return
        grown = (after - before) - (self.memory.graph_bytes() - graph_before)
        self.bytes = (self.bytes or 0) + grown
