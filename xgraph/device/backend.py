"""TorchBackend: a Backend over a TorchRuntime, with every torch-style duty written once.

An adapter subclasses it and names what is its own: `name`, `runtime_class` (its
TorchRuntime; `default_runtime()` may build it with arguments), `virtual_memory_class`,
`availability()`, and any kernels, staging or benchmark hooks. The layer gives it the
capture stream (one per thread, replaced after a capture that could not be ended), warm-up
on that stream, MemPool capture pools (native or routed), and the threading rules: while
another thread captures on the device, `synchronize` waits for this thread's stream only (a
device-wide synchronize fails then on some runtimes) and `empty_cache` is skipped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..errors import XGraphError
from ..interfaces import Backend, CapturePool, Graph, SegmentAllocator
from .captures import book
from .graph import StreamGraph
from .pool import MemPoolCapturePool
from .runtime import TorchRuntime


class TorchBackend(Backend):
    """A torch device through its runtime: StreamGraphs on MemPoolCapturePools."""

    graph_class: ClassVar[type[Graph]] = StreamGraph
    runtime_class: ClassVar[type[TorchRuntime] | None] = None  # a duty (xgraph.contract)

    def __init__(self, runtime: TorchRuntime | None = None) -> None:
        self.runtime = runtime if runtime is not None else self.default_runtime()
        self._local = threading.local()  # this thread's capture stream

    @classmethod
    def default_runtime(cls) -> TorchRuntime:
        """The runtime a backend constructed without one drives (the registry's case)."""
        if cls.runtime_class is None:
            raise XGraphError(f"{cls.__name__} names no runtime_class (a TorchRuntime).")
        return cls.runtime_class()

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    # -- streams ---------------------------------------------------------------------------

    def capture_stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self.runtime.new_stream()
        return stream

    def stream_capturing(self) -> bool:
        return bool(self.runtime.is_capturing(self.runtime.current_stream()))

    def retire_capture_stream(self, stream: Any) -> None:
        """Give up `stream` (a capture on it could not be ended): this thread gets a new one."""
        if getattr(self._local, "stream", None) is stream:
            self._local.stream = None
        if self.runtime.is_capturing(stream):
            book(self.runtime).stuck(stream)

    @contextlib.contextmanager
    def warmup_context(self) -> Iterator[None]:
        rt = self.runtime
        origin, side = rt.current_stream(), self.capture_stream()
        side.wait_stream(origin)
        try:
            with rt.use_stream(side):
                yield
        finally:
            origin.wait_stream(side)

    def synchronize(self) -> None:
        # a device-wide synchronize fails while any stream captures (ACL 107027): the book
        # decides, and no capture begins until the device synchronize it chose has returned
        rt = self.runtime
        book(rt).synchronize(rt.synchronize, lambda: rt.current_stream().synchronize())

    # -- pools and memory ------------------------------------------------------------------

    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        if segments is not None:
            support = self.segments_support()
            if not support.available:
                raise XGraphError(f"Routed capture pools are refused: {support.reason}.")
        return MemPoolCapturePool(self.runtime, segments)

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return self.runtime.as_tensor(int(address), int(nbytes))

    def empty_cache(self) -> None:
        book(self.runtime).when_quiet(self.runtime.empty_cache)

    def capture_space_bytes(self) -> int:
        """The device's memory, as its runtime reports it: as much as one capture can use."""
        return int(self.runtime.mem_get_info()[1])

    def memory_in_use(self) -> int | None:
        free, total = self.runtime.mem_get_info()
        return int(total - free)
