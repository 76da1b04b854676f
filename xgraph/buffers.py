"""Persistent buffers: one packed device tensor, written through a pinned host twin.

Every persistent input (token ids, positions, slot mapping, sequence lengths, block tables,
user-declared extras) is a view of one device tensor sized for the largest bucket; graphs
read slices of those views, so their addresses never change. A step writes its host values
into the twin views in pinned host memory and then one asynchronous copy moves the touched
prefix to the device, through a `HostCopier`: the backend's own where it has a cheaper one
(`Backend.host_copier`), else a torch copy and an event. The CPU backend keeps a twin as
well (its copy is a memcpy), so a step refused after staging has still written nothing a
graph reads. Values already on the device are written on the device after that copy.

Host writes go through numpy views of the twin: on the per-step path a numpy slice
assignment costs well under a microsecond where a torch op on a small CPU tensor costs
several. Device views of a given extent are made once and reused; `StagingPlan` holds one
bucket's views and its copy, worked out once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import IncompleteBackendError
from .interfaces import HostCopier

# the backend's `host_copier`: (device buffer, pinned host buffer) -> a copier, or None
CopierFactory = Callable[[torch.Tensor, torch.Tensor], HostCopier | None]

ALIGN = 64  # bytes: every view starts on a cache line / vector boundary

_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
}


def has_numpy_twin(dtype: Any) -> bool:
    """Whether values of `dtype` are staged through numpy views (bfloat16, say, is not)."""
    return dtype in _NUMPY


@dataclass(frozen=True)
class _Target:
    """One buffer's extent: its host (numpy or torch) and device views, and where it ends."""

    np: np.ndarray | None
    host: torch.Tensor
    device: torch.Tensor
    end: int  # bytes of the packed twin up to the extent's last element (0: empty extent)
    fill: float | int


@dataclass(frozen=True)
class BufferSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: float | int


def _nbytes(s: BufferSpec) -> int:
    return _numel(s.shape) * torch.empty((), dtype=s.dtype).element_size()


@dataclass(frozen=True)
class StagingPlan:
    """One bucket's staging, worked out once: numpy views of the host twin and device views
    of every buffer's extent, and the one copy (a prefix of the packed twin) that sends them."""

    host: dict[str, np.ndarray]
    device: dict[str, torch.Tensor]
    fills: dict[str, float | int]
    nbytes: int  # the prefix of the packed twin the copy moves


class StagedBuffers:
    """Named views of one device tensor, staged through pinned host memory (see module doc)."""

    def __init__(
        self,
        specs: Sequence[BufferSpec],
        device: torch.device,
        copier: CopierFactory | None = None,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`allocate(nbytes)`: where the packed device buffer lives (a uint8 tensor), e.g. an
        executor's xgraph.arena.Arena, whose memory sleep gives back; default torch's."""
        self.device = device
        self.specs = {s.name: s for s in specs}
        self.offsets: dict[str, int] = {}
        total = 0
        for s in specs:
            self.offsets[s.name] = total
            total += -(-_nbytes(s) // ALIGN) * ALIGN
        self.nbytes = total
        # zeros: alignment gaps hold no stale bytes (buffers compare equal byte for byte)
        n = max(total, ALIGN)
        self.packed = (
            torch.zeros(n, dtype=torch.uint8, device=device)
            if allocate is None
            else allocate(n).zero_()
        )
        self.host_packed = _host_twin(self.packed)
        self.device_views = {s.name: self._view(self.packed, s) for s in specs}
        self.host_views = {s.name: self._view(self.host_packed, s) for s in specs}
        self.np_views = {
            s.name: self.host_views[s.name].numpy() for s in specs if s.dtype in _NUMPY
        }
        for s in specs:
            self.host_views[s.name].fill_(s.fill)
        self.packed.copy_(self.host_packed)
        # on the host the copy is a memcpy: numpy does it without torch's dispatch
        host = device.type == "cpu"
        self._np_packed = (self.packed.numpy(), self.host_packed.numpy()) if host else None
        self._copier = (
            MemcpyCopier(self.packed, self.host_packed)
            if host
            else _copier(copier, self.packed, self.host_packed)
        )
        self._dirty = 0  # bytes of the host twin written since the last flush
        self._device_writes: list[tuple[torch.Tensor, torch.Tensor, float | int]] = []
        self._extents: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._targets: dict[tuple[str, tuple[int, ...]], _Target] = {}

    def _view(self, packed: torch.Tensor, s: BufferSpec) -> torch.Tensor:
        off = self.offsets[s.name]
        return packed[off : off + _nbytes(s)].view(s.dtype).view(s.shape)

    def device_view(self, name: str, extent: tuple[int, ...]) -> torch.Tensor:
        """buffer[:extent[0], :extent[1], ...] on the device (made once per extent)."""
        view = self._extents.get((name, extent))
        if view is None:
            view = self.device_views[name][tuple(slice(0, e) for e in extent)]
            self._extents[(name, extent)] = view
        return view

    def begin(self) -> None:
        """Before writing a step: the previous step's copy must have read the host twin."""
        self._copier.wait()

    def _target(self, name: str, extent: tuple[int, ...]) -> _Target:
        """Where a write of `extent` goes: made once per (buffer, extent), then looked up."""
        key = (name, extent)
        target = self._targets.get(key)
        if target is None:
            host = self.host_views[name]
            np_view = self.np_views.get(name)
            index = tuple(slice(0, e) for e in extent)
            last = sum((e - 1) * st for e, st in zip(extent, host.stride()))
            end = self.offsets[name] + (last + 1) * host.element_size() if all(extent) else 0
            target = _Target(
                np_view[(*index, ...)] if np_view is not None else None,  # 0-d: a view too
                host[index],
                self.device_view(name, extent),
                end,
                self.specs[name].fill,
            )
            self._targets[key] = target
        return target

    def plan(self, extents: dict[str, tuple[int, ...]]) -> StagingPlan | None:
        """The staging of one bucket (buffer -> extent), or None where a buffer's dtype has
        no numpy twin (such executors stage through `write`)."""
        targets = {name: self._target(name, e) for name, e in extents.items()}
        if any(t.np is None for t in targets.values()):
            return None
        return StagingPlan(
            host={n: t.np for n, t in targets.items()},  # type: ignore[misc]  # checked above
            device={n: t.device for n, t in targets.items()},
            fills={n: t.fill for n, t in targets.items()},
            nbytes=max(t.end for t in targets.values()),
        )

    def write(self, name: str, value: Any, extent: Sequence[int]) -> torch.Tensor:
        """Stage `value` (a tensor, numpy array or list) into the prefix of buffer[extent],
        `fill` elsewhere in the extent; returns the device view buffer[extent] (valid once
        `flush` has run)."""
        t = self._target(name, extent if type(extent) is tuple else tuple(extent))
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            self._device_writes.append((t.device, value, t.fill))
            return t.device
        if t.np is not None:
            _write_np(t.np, value, t.fill)
        else:
            _write(t.host, torch.as_tensor(value), t.fill)
        if t.end > self._dirty:
            self._dirty = t.end
        return t.device

    def flush(self) -> None:
        """Send what was staged to the device (one asynchronous copy), then device writes."""
        if self._dirty:
            self.send(self._dirty)
            self._dirty = 0
        for view, value, fill in self._device_writes:
            _write(view, value, fill)
        self._device_writes.clear()

    def send(self, nbytes: int) -> None:
        """Copy the first `nbytes` of the host twin to the device: one copy, asynchronous on
        an accelerator (the next `begin` waits for it before the twin is written again)."""
        self._copier.send(nbytes)

    def discard(self, nbytes: int) -> None:
        """Undo writes to the first `nbytes` of the host twin that will not be sent (a step
        refused after staging): the twin again holds what the device holds, so a later
        copy sends no byte of the refused step."""
        if self._np_packed is not None:
            dst, src = self._np_packed
            src[:nbytes] = dst[:nbytes]
        else:  # the error path: a blocking copy back is fine
            self.host_packed[:nbytes].copy_(self.packed[:nbytes])

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_views[name]

    def items(self):  # type: ignore[no-untyped-def]
        return self.device_views.items()


class MemcpyCopier(HostCopier):
    """The CPU backend's: the copy is a numpy memcpy, done when `send` returns."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._dst, self._src = device.numpy(), host.numpy()

    def send(self, nbytes: int) -> None:
        self._dst[:nbytes] = self._src[:nbytes]

    def wait(self) -> None:
        return None


class TorchCopier(HostCopier):
    """Any accelerator: a non-blocking torch copy of the prefix, then an event that the next
    `wait` synchronizes on (only while a copy may still be reading the host buffer). An
    adapter with a cheaper copy overrides `_copy` and keeps the event bookkeeping."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._device, self._host = device, host
        self._event = torch.Event(device=device.device)
        self._pending = False
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _copy(self, nbytes: int) -> None:
        """Queue the copy of the first `nbytes` on the current stream."""
        pair = self._copies.get(nbytes)
        if pair is None:  # slicing costs a microsecond: once per size
            pair = self._copies[nbytes] = (self._device[:nbytes], self._host[:nbytes])
        pair[0].copy_(pair[1], non_blocking=True)

    def send(self, nbytes: int) -> None:
        self._copy(nbytes)
        self._event.record()  # on the current stream, after the copy
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False


def _copier(factory: CopierFactory | None, device: torch.Tensor, host: torch.Tensor) -> HostCopier:
    """The backend's copier where it offers one (checked once, here), else a TorchCopier."""
    made = factory(device, host) if factory is not None else None
    if made is None:
        return TorchCopier(device, host)
    if not isinstance(made, HostCopier):
        raise IncompleteBackendError(
            f"host_copier returned {type(made).__name__}, not an xgraph.interfaces.HostCopier. "
            "Return a HostCopier subclass, or None to use the core's copy."
        )
    return made


def _write(view: torch.Tensor, value: torch.Tensor, fill: float | int) -> None:
    """Copy `value` into the prefix of `view`; the rest of `view` gets `fill`."""
    if tuple(value.shape) != tuple(view.shape):
        view.fill_(fill)
        view = view[tuple(slice(0, n) for n in value.shape)]
    view.copy_(value)


def _write_np(view: np.ndarray, value: Any, fill: float | int) -> None:
    """The numpy twin of `_write`."""
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    elif not isinstance(value, np.ndarray):
        value = np.asarray(value, dtype=view.dtype)
    if value.shape != view.shape:
        view.fill(fill)
        view = view[tuple(slice(0, n) for n in value.shape)]
    view[...] = value


def _host_twin(packed: torch.Tensor) -> torch.Tensor:
    """The host twin of the packed buffer: pinned where the platform has pinned memory (an
    asynchronous copy needs it); a plain second buffer on the CPU backend."""
    if packed.device.type != "cpu":
        try:
            return torch.zeros_like(packed, device="cpu", pin_memory=True)
        except RuntimeError:  # no pinned memory on this platform: pageable still works
            pass
    return torch.zeros_like(packed, device="cpu")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
