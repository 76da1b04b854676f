"""Conformance of a backend's kernels for the core's ops (`Backend.linear_kernel`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from xgraph import linear as core_linear
from xgraph.interfaces import Backend

from .base import BackendTests, capture

# (rows, columns, k): one row, a few rows, many rows; narrow and wide; k not a power of two
SHAPES = [(1, 64, 96), (1, 4100, 64), (3, 50, 130), (4, 2048, 64), (16, 64, 128)]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


class KernelTests(BackendTests):
    """A linear kernel answers x @ w.T (or declines with None), is installed on selection,
    and is recorded in a graph like any other device work."""

    @pytest.fixture
    def kernel(self, backend: Backend) -> Any:
        k = backend.linear_kernel()
        if k is None:
            pytest.skip(f"backend {backend.name!r} has no linear kernel of its own")
        return k

    def test_the_kernel_is_installed_for_the_device(self, backend: Backend, kernel: Any) -> None:
        assert core_linear.installed(backend.device.type) is not None

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_answers_match_f_linear_or_decline(
        self, backend: Backend, kernel: Any, dtype: torch.dtype
    ) -> None:
        g = torch.Generator().manual_seed(5)
        for m, n, k in SHAPES:
            x = torch.randn(m, k, generator=g).to(backend.device, dtype)
            w = torch.randn(n, k, generator=g).to(backend.device, dtype)
            y = kernel(x, w)
            if y is None:  # declined: F.linear runs it
                continue
            assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
            assert y.data_ptr() not in (x.data_ptr(), w.data_ptr())  # a fresh output
            ref = F.linear(x.float(), w.float())
            rtol, atol = TOLERANCE[dtype]
            torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol * k**0.5)

    def test_a_captured_call_follows_new_inputs(self, backend: Backend, kernel: Any) -> None:
        dev = backend.device
        g = torch.Generator().manual_seed(6)
        x = torch.randn(1, 96, generator=g).to(dev)
        w = torch.randn(64, 96, generator=g).to(dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(graph, pool, core_linear.linear, x, w)
        for _ in range(3):
            x.copy_(torch.randn(1, 96, generator=g))
            graph.replay()
            backend.synchronize()
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-3)
        graph.reset()
        pool.close()
