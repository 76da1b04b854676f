"""Persistent buffers: one packed device tensor, written through a pinned host twin.

Every persistent input (token ids, positions, slot mapping, sequence lengths, block tables,
user-declared extras) is a view of one device tensor sized for the largest bucket; graphs
read slices of those views, so their addresses never change. A step writes its host values
into the twin views in pinned host memory (cheap CPU work, no device launches) and then one
asynchronous copy moves the touched prefix to the device. On the CPU backend the twin is
the buffer itself. Values already on the device are written on the device after that copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every view starts on a cache line / vector boundary


@dataclass(frozen=True)
class BufferSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: float | int


class StagedBuffers:
    """Named views of one device tensor, staged through pinned host memory (see module doc)."""

    def __init__(self, specs: Sequence[BufferSpec], device: torch.device) -> None:
        self.device = device
        self.specs = {s.name: s for s in specs}
        self.offsets: dict[str, int] = {}
        total = 0
        for s in specs:
            self.offsets[s.name] = total
            nbytes = _numel(s.shape) * torch.empty((), dtype=s.dtype).element_size()
            total += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = total
        self.packed = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=device)
        self.staged = device.type != "cpu"
        self.host_packed = self.packed
        if self.staged:
            try:
                self.host_packed = torch.empty_like(self.packed, device="cpu", pin_memory=True)
            except RuntimeError:  # no pinned memory on this platform: pageable still works
                self.host_packed = torch.empty_like(self.packed, device="cpu")
        self.device_views = {s.name: self._view(self.packed, s) for s in specs}
        self.host_views = {s.name: self._view(self.host_packed, s) for s in specs}
        for s in specs:
            self.host_views[s.name].fill_(s.fill)
        if self.staged:
            self.packed.copy_(self.host_packed)
        self._event: torch.Event | None = None
        self._dirty = 0  # bytes of the host twin written since the last flush
        self._device_writes: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []

    def _view(self, packed: torch.Tensor, s: BufferSpec) -> torch.Tensor:
        off = self.offsets[s.name]
        n = _numel(s.shape) * torch.empty((), dtype=s.dtype).element_size()
        return packed[off : off + n].view(s.dtype).view(s.shape)

    def begin(self) -> None:
        """Before writing a step: the previous step's copy must have read the host twin."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def write(self, name: str, value: torch.Tensor, extent: Sequence[int]) -> torch.Tensor:
        """Stage `value` into the prefix of buffer[extent], `fill` elsewhere in the extent;
        returns the device view buffer[extent] (valid once `flush` has run)."""
        extent = tuple(int(e) for e in extent)
        index = tuple(slice(0, e) for e in extent)
        if self.staged and value.device.type != "cpu":
            self._device_writes.append((name, value, extent))
        else:
            host = self.host_views[name]
            _write(host[index], value, self.specs[name].fill)
            if self.staged and all(extent):
                last = sum((e - 1) * st for e, st in zip(extent, host.stride()))
                end = self.offsets[name] + (last + 1) * host.element_size()
                self._dirty = max(self._dirty, end)
        return self.device_views[name][index]

    def flush(self) -> None:
        """Send what was staged to the device (one asynchronous copy), then device writes."""
        if self._dirty:
            self.packed[: self._dirty].copy_(self.host_packed[: self._dirty], non_blocking=True)
            self._event = torch.Event(device=self.device)
            self._event.record()
            self._dirty = 0
        for name, value, extent in self._device_writes:
            view = self.device_views[name][tuple(slice(0, e) for e in extent)]
            _write(view, value, self.specs[name].fill)
        self._device_writes.clear()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_views[name]

    def items(self):  # type: ignore[no-untyped-def]
        return self.device_views.items()


def _write(view: torch.Tensor, value: torch.Tensor, fill: float | int) -> None:
    """Copy `value` into the prefix of `view`; the rest of `view` gets `fill`."""
    if tuple(value.shape) != tuple(view.shape):
        view.fill_(fill)
        view = view[tuple(slice(0, n) for n in value.shape)]
    view.copy_(value)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
