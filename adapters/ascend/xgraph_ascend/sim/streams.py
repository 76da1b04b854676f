"""Simulated NPU streams: the core simulator's streams, plus what ACL adds to a stream.

A stream also carries the graph task update (if any) it is issuing, the ExternalEvent wait
it is blocked on (if any), and its aclrtStream handle under torch_npu's name
(`npu_stream`).
"""

from __future__ import annotations

from typing import Any

from xgraph.testing import sim


class SimStream(sim.SimStream):
    """One stream; `npu_stream` is its aclrtStream handle, as on torch_npu's Stream."""

    update: Any = None  # the UpdateSession this stream issues, if any
    waiting: Any = None  # the wait it is blocked on and the work behind it (capture.Waiting)

    @property
    def npu_stream(self) -> int:
        return self.handle


class SimStreams(sim.SimStreams):
    """The streams of one simulated NPU."""

    stream_class = SimStream
