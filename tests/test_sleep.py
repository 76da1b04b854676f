"""Sleep and wake on the CPU backend: the conformance class, plus what only the host shows."""

from __future__ import annotations

from xgraph.testing.sleep import SleepTests


class TestCPUSleep(SleepTests):
    backend_name = "cpu"
