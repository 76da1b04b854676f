"""Simulated streams: a default stream, side streams, a current stream per thread.

The simulated device runs every op when it is issued, so a stream carries no queue of work;
it carries what the runtime's rules depend on: whether it is the default stream, which
capture (if any) records it, and how many replays were issued on it since it last
synchronized (memory those may still touch must not be unmapped).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

_handles = itertools.count(0x7E00_0000_1000, 0x100)


class SimStream:
    """One stream; `handle` stands for the runtime's stream pointer."""

    def __init__(self, owner: SimStreams, default: bool = False) -> None:
        self._owner = owner
        self.handle = next(_handles)
        self.is_default = default
        self.capture: Any = None  # the recording this stream captures into, if any
        self.queued = 0  # replays issued on it since it last synchronized
        self.syncs = 0  # how often it synchronized (work queued before that has run)

    def settle(self) -> None:
        """Its work has run (a synchronize of it, or of the device)."""
        self.queued = 0
        self.syncs += 1

    def wait_stream(self, other: SimStream) -> None:
        """Ordering between streams: the simulated device is in order already."""

    def synchronize(self) -> None:
        """Wait for this stream's work (refused while it captures)."""
        self._owner.stream_synchronize(self)

    def __repr__(self) -> str:
        kind = "default" if self.is_default else "side"
        return f"<simulated {kind} stream {self.handle:#x}>"


class Queued:
    """Work issued on a stream: it may still run until that stream next synchronizes."""

    def __init__(self, stream: SimStream) -> None:
        self.stream, self._syncs = stream, stream.syncs

    def done(self) -> bool:
        return self.stream.syncs != self._syncs


class SimStreams:
    """The streams of one simulated device."""

    stream_class: type[SimStream] = SimStream

    def __init__(self, stream_synchronize: Callable[[SimStream], None]) -> None:
        self.stream_synchronize = stream_synchronize  # the runtime's stream-level rule
        self.default = self.stream_class(self, default=True)
        self._by_handle = {self.default.handle: self.default}
        self._local = threading.local()
        self._lock = threading.Lock()

    def new(self) -> SimStream:
        s = self.stream_class(self)
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

    def all(self) -> list[SimStream]:
        with self._lock:
            return list(self._by_handle.values())

    def capturing(self) -> list[SimStream]:
        return [s for s in self.all() if s.capture is not None]

    def queued(self) -> int:
        """Replays issued and not yet synchronized, on every stream."""
        return sum(s.queued for s in self.all())
