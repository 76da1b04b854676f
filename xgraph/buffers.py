"""Persistent buffers: one packed device tensor, written through a pinned host twin.

Every persistent input (token ids, positions, slot mapping, sequence lengths, block tables,
user-declared extras) is a view of one device tensor sized for the largest bucket; graphs
read slices of those views, so their addresses never change. A step writes its host values
into the twin views in pinned host memory (one of two banks, taken in turn) and then one
asynchronous copy moves the touched prefix to the device, through a `HostCopier`: the
backend's own where it has a cheaper one (`Backend.host_copier`), else a torch copy and an
event. The CPU backend keeps twins as well (its copy is a memcpy). Values already on the
device are written on the device after that copy.

Host writes go through numpy views of the twin: on the per-step path a numpy slice
assignment costs well under a microsecond where a torch op on a small CPU tensor costs
several. The views of a given extent (`Target`) are made once and reused; what a step
writes where is `xgraph.staging`'s.
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
class Target:
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
    return _numel(s.shape) * s.dtype.itemsize


@dataclass
class Bank:
    """One host twin of the packed buffer, its numpy and torch views, and the copier that
    sends it."""

    packed: torch.Tensor
    views: dict[str, torch.Tensor]
    np_views: dict[str, np.ndarray]
    copier: HostCopier


class StagedBuffers:
    """Named views of one device tensor, staged through pinned host memory (see module doc).

    Two banks of host twins take the steps in turn: a step writes one bank while the copy
    of the step before may still be reading the other, and waits only for its own bank's
    last copy (two steps back), so the host prepares a step while the device runs the
    previous one. The device buffer is one: copies and replays follow each other on the
    stream, so a copy never overtakes the replay that reads what it overwrites.
    """

    BANKS = 2

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
        self.device_views = {s.name: self._view(self.packed, s) for s in specs}
        self.banks = [self._bank(copier) for _ in range(self.BANKS)]
        self.packed.copy_(self.banks[0].packed)
        self.bank = 0  # the bank the current step writes
        self._extents: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._targets: dict[tuple[int, str, tuple[int, ...]], Target] = {}

    def _bank(self, copier: CopierFactory | None) -> Bank:
        host = _host_twin(self.packed)
        views = {s.name: self._view(host, s) for s in self.specs.values()}
        for s in self.specs.values():
            views[s.name].fill_(s.fill)
        np_views = {n: v.numpy() for n, v in views.items() if v.dtype in _NUMPY}
        # on the host the copy is a memcpy: numpy does it without torch's dispatch
        made = (
            MemcpyCopier(self.packed, host)
            if self.device.type == "cpu"
            else _copier(copier, self.packed, host)
        )
        return Bank(host, views, np_views, made)

    @property
    def host_packed(self) -> torch.Tensor:
        """The host twin of the current step's bank."""
        return self.banks[self.bank].packed

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

    def begin(self) -> int:
        """Before writing a step: take the next bank, once its last copy has read it; the
        bank's index (what `target` and `send` of this step use)."""
        self.bank = bank = 1 - self.bank  # (BANKS == 2)
        self.banks[bank].copier.wait()
        return bank

    def target(self, name: str, extent: tuple[int, ...], bank: int | None = None) -> Target:
        """Where a write of `extent` goes in a bank (default: the current one): made once
        per (bank, buffer, extent), then looked up."""
        b = self.bank if bank is None else bank
        key = (b, name, extent)
        target = self._targets.get(key)
        if target is None:
            host = self.banks[b].views[name]
            np_view = self.banks[b].np_views.get(name)
            index = tuple(slice(0, e) for e in extent)
            last = sum((e - 1) * st for e, st in zip(extent, host.stride()))
            end = self.offsets[name] + (last + 1) * host.element_size() if all(extent) else 0
            target = Target(
                np_view[(*index, ...)] if np_view is not None else None,  # 0-d: a view too
                host[index],
                self.device_view(name, extent),
                end,
                self.specs[name].fill,
            )
            self._targets[key] = target
        return target

    def send(self, nbytes: int) -> None:
        """Copy the first `nbytes` of the current bank to the device: one copy, asynchronous
        on an accelerator (the bank's next `begin` waits for it)."""
        self.banks[self.bank].copier.send(nbytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_views[name]

    def close(self) -> None:
        """Drop every view of the device buffer and the host twins: the buffer's memory goes
        back with its last view, so xgraph's own views must not keep it (idempotent; the
        planner refuses every step from here on)."""
        self.banks.clear()
        self.device_views.clear()
        self._extents.clear()
        self._targets.clear()
        self.packed = torch.empty(0, dtype=torch.uint8, device=self.device)

    def items(self):  # type: ignore[no-untyped-def]
        return self.device_views.items()


class MemcpyCopier(HostCopier):
    """The CPU backend's: the copy is a numpy memcpy, done when `send` returns."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._dst, self._src = device.numpy(), host.numpy()
        self._prefixes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def send(self, nbytes: int) -> None:
        pair = self._prefixes.get(nbytes)
        if pair is None:  # slicing costs two numpy calls: once per size
            pair = self._prefixes[nbytes] = (self._dst[:nbytes], self._src[:nbytes])
        pair[0][...] = pair[1]

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


def write_prefix(view: Any, value: Any, fill: float | int) -> None:
    """Copy `value` into the prefix of `view` (numpy arrays, or torch tensors); the rest of
    `view` gets `fill`. Only the first dim shorter (a step's tokens): two slice writes."""
    vs, ws = value.shape, view.shape
    if vs == ws:
        view[...] = value
    elif vs[1:] == ws[1:]:
        n = vs[0]
        view[:n] = value
        view[n:] = fill
    else:
        view[...] = fill
        view[tuple(slice(0, n) for n in vs)] = value


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
