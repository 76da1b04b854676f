"""Arena: an executor's persistent buffers in memory that sleep gives back and wake restores
at the same addresses.

Each buffer (the packed input buffer, each output buffer) is a segment of its own
(`RestorableSegments` over the backend's VirtualMemory) seen as a device tensor through
`Backend.as_tensor`, so graphs that read or write it keep their addresses across a sleep.
Input buffers are kept across a sleep (copied to host memory and back: they hold the staged
inputs, a few KB to MB); output buffers are dropped (the last step's outputs are not kept;
they come back zeroed).

A buffer's segment goes when its tensor does (a finalizer on the storage), so output views a
caller still holds stay valid after close(), as they are with torch's own allocator. A
finalizer may fire anywhere, inside a VirtualMemory call or a capture of this thread (cyclic
garbage collection), where giving memory back is not safe: the segment then goes at the
arena's next operation or the next arena made.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from .graphs import capturing_graph
from .interfaces import Backend, VirtualMemory
from .restorable import RestorableSegments

logger = logging.getLogger("xgraph")

_pending: weakref.WeakSet[Arena] = weakref.WeakSet()  # arenas with deferred releases


class Arena:
    """Persistent buffers of one executor (see the module docstring)."""

    def __init__(self, backend: Backend, vm: VirtualMemory, name: str) -> None:
        self.backend, self.vm = backend, vm
        self.segments = RestorableSegments(backend, vm, f"{name}: persistent buffers")
        self._keep: dict[int, bool] = {}  # segment address -> contents kept across a sleep
        self._dead: list[int] = []
        self._lock = threading.Lock()
        for other in list(_pending):
            other.drain()

    @classmethod
    def of(cls, backend: Backend, name: str) -> Arena | None:
        """An arena over the backend's VirtualMemory, or None without one."""
        vm = backend.virtual_memory()
        return None if vm is None else cls(backend, vm, name)

    def empty(self, nbytes: int, keep: bool) -> torch.Tensor:
        """A uint8 device tensor of `nbytes` in a segment of its own; `keep`: its contents
        survive a sleep (copied to host memory and back)."""
        self.drain()
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8, device=self.backend.device)
        seg = self.segments.add(nbytes)
        self._keep[seg.address] = keep
        t = self.backend.as_tensor(seg.address, seg.size)
        done = weakref.finalize(t.untyped_storage(), self._died, seg.address)
        done.atexit = False  # at exit the memory outlives Python's objects
        return t[:nbytes]

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, keep: bool) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` in a segment of its own."""
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.empty(nbytes, keep).view(dtype).view(shape)

    def _died(self, address: int) -> None:
        with self._lock:
            self._dead.append(address)
        owned = getattr(getattr(self.vm, "_lock", None), "_is_owned", None)
        if capturing_graph() is not None or owned is None or owned():
            _pending.add(self)  # not safe here: the next operation gives it back
            return
        self.drain()

    def drain(self) -> None:
        """Give back the segments of buffers that are gone."""
        while True:
            with self._lock:
                if not self._dead:
                    _pending.discard(self)
                    return
                address = self._dead[-1]
            try:
                self.segments.remove(address)
            except Exception:  # from a finalizer: report, keep it for the next attempt
                logger.exception("releasing a persistent buffer's memory failed")
                _pending.add(self)
                return
            with self._lock:
                self._dead.remove(address)
                self._keep.pop(address, None)

    # -- sleep and wake --------------------------------------------------------------------

    def sleep(self) -> tuple[int, int]:
        """Give every buffer's memory back (input buffers copied to host memory first);
        returns (bytes given back, bytes copied)."""
        self.drain()
        return self.segments.release(lambda s: self._keep.get(s.address, False))

    def wake(self, commit: bool = True) -> int:
        self.drain()
        return self.segments.restore(commit)

    @property
    def asleep(self) -> bool:
        return self.segments.asleep
