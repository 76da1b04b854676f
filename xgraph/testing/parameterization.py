"""Conformance of the parameterization check (GraphExecutor.check_parameterization).

A backend whose graphs describe what they record (`Graph.keep_launches` True) must pass
the reference model for both graph kinds, flag a planted leak (a graph-safe decode runner
whose op sizes follow a Python int of the longest sequence: on CUDA the grid and the
element count of its kernels, on a host recorder the op's shape) under changed sequence
lengths alone, and keep nothing: the executor's stats and the books of its virtual memory
are unchanged. A backend that cannot read its recordings refuses the check with the
documented error (`reads_launches`, declared in `capabilities`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from xgraph.errors import XGraphError
from xgraph.interfaces import Backend
from xgraph.runners import PagedDecodeRunner

from .base import BackendTests, tiny_workload
from .capabilities import Capabilities, require

BUCKETS = [1, 2, 4, 8]


class LongestSequenceLeak(PagedDecodeRunner):
    """Graph-safe by its claim, but the size of two ops follows the longest sequence."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        longest = max(int(n) for n in self.planned().seq_lens_host)
        # the planted leak: element count (and grid) from a Python int of the longest sequence
        out.add_(torch.zeros(longest * 1024, device=q.device).sum())


class PerCallLeak(PagedDecodeRunner):
    """Graph-safe by its claim, but the size of two ops follows how often it ran."""

    graph_safe = True
    calls = 0

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        self.calls += 1
        out.add_(torch.zeros(self.calls * 1024, device=q.device).sum())  # the planted leak


def _books(backend: Backend) -> Any:
    vm = backend.virtual_memory()
    return vm.live() if vm is not None else None


class ParameterizationTests(BackendTests):
    """The check on this backend: the reference model passes, a planted leak is flagged."""

    @pytest.fixture
    def reads_launches(self, backend: Backend, declared: Capabilities) -> bool:
        """Whether the backend's graphs describe what they record (declared)."""
        return require(backend, declared, "reads_launches")

    def test_the_reference_model_passes_and_nothing_is_kept(
        self, backend: Backend, reads_launches: bool
    ) -> None:
        w = tiny_workload(backend)
        ex = w.executor(backend=backend, buckets=BUCKETS)
        try:
            if not reads_launches:
                with pytest.raises(XGraphError, match="cannot read what its graphs record"):
                    ex.check_parameterization()
                return
            ex.capture([2], kind="full", progress=False)  # a graph held before the check
            stats, books = ex.stats(), _books(backend)
            report = ex.check_parameterization()
            assert report.ok, str(report)
            assert [k.key for k in report.keys] == [("full", 4), ("piecewise", 4)]
            assert all(k.launches > 0 and k.recordings == 5 for k in report.keys)
            backend.synchronize()
            assert ex.stats() == stats and _books(backend) == books
        finally:
            ex.close()

    def test_a_launch_that_follows_the_longest_sequence_is_flagged(
        self, backend: Backend, reads_launches: bool
    ) -> None:
        if not reads_launches:
            pytest.skip("the backend cannot read its recordings (checked by the test above)")
        w = tiny_workload(backend)
        runner = LongestSequenceLeak()
        ex = w.executor(
            backend=backend, buckets=BUCKETS, attention=w.attention(decode_runner=runner)
        )
        try:
            report = ex.check_parameterization(kind="full")
        finally:
            ex.close()
        assert not report.ok
        assert {v for d in report.differences for v in d.varied} == {"sequence lengths"}
        text = str(report)
        assert "(sequence lengths changed)" in text and "What to do (full graphs)" in text
        named = [d.site.launch.layer for d in report.differences if d.site.launch.layer]
        assert all("self_attn" in layer for layer in named)  # where the backend names layers

    def test_a_launch_that_follows_a_count_of_calls_is_a_per_call_leak(
        self, backend: Backend, reads_launches: bool
    ) -> None:
        if not reads_launches:
            pytest.skip("the backend cannot read its recordings (checked by the first test)")
        w = tiny_workload(backend)
        ex = w.executor(
            backend=backend, buckets=BUCKETS, attention=w.attention(decode_runner=PerCallLeak())
        )
        try:
            report = ex.check_parameterization(kind="full")
        finally:
            ex.close()
        assert report.differences and report.unstable == report.differences, str(report)
        assert "per call: two captures of the same step differ" in str(report)
