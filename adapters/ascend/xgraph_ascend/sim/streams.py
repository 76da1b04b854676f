"""Simulated NPU streams: a default stream, side streams, a current stream per thread.

The simulated device runs every task when it is issued, so streams carry no queue; they
carry what the capture rules depend on: whether a stream is the default one, which capture
(if any) records it, and which graph task update (if any) it is issuing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

_handles = itertools.count(0x7E00_0000_1000, 0x100)


class SimStream:
    """One stream; `npu_stream` is its aclrtStream handle, as on torch_npu's Stream."""

    def __init__(self, owner: SimStreams, default: bool = False) -> None:
        self._owner = owner
        self.handle = next(_handles)
        self.is_default = default
        self.capture: Any = None  # the SimCapture recording this stream, if any
        self.update: Any = None  # the UpdateSession this stream issues, if any

    @property
    def npu_stream(self) -> int:
        return self.handle

    def wait_stream(self, other: SimStream) -> None:
        """Ordering between streams: the simulated device is in order already."""

    def synchronize(self) -> None:
        self._owner.synchronize()

    def __repr__(self) -> str:
        kind = "default" if self.is_default else "side"
        return f"<simulated {kind} stream {self.handle:#x}>"


class SimStreams:
    """The streams of one simulated device."""

    def __init__(self, synchronize: Any) -> None:
        self.synchronize = synchronize  # the device-wide synchronize (the runtime's)
        self.default = SimStream(self, default=True)
        self._by_handle = {self.default.handle: self.default}
        self._local = threading.local()
        self._lock = threading.Lock()

    def new(self) -> SimStream:
        s = SimStream(self)
        with self._lock:
            self._by_handle[s.handle] = s
        return s

    def current(self) -> SimStream:
        return getattr(self._local, "stream", None) or self.default

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        outer = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = outer

    def by_handle(self, handle: int) -> SimStream | None:
        with self._lock:
            return self._by_handle.get(handle)

    def capturing(self) -> list[SimStream]:
        with self._lock:
            return [s for s in self._by_handle.values() if s.capture is not None]
