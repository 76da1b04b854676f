"""Conformance of a backend's kernels for the core's ops (`Backend.kernels().linear`)."""

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
    """A linear kernel answers x @ w.T (or declines with None), is installed on activation,
    and is recorded in a graph like any other device work; without one, `xgraph.linear` is
    F.linear on the device."""

    @pytest.fixture
    def kernel(self, backend: Backend, has_linear_kernel: bool) -> Any:
        kernel = backend.activate().linear
        assert (kernel is not None) == has_linear_kernel
        assert core_linear.installed(backend.device.type) is kernel
        return kernel if kernel is not None else F.linear

    def test_activation_installs_the_kernel_for_the_device(
        self, backend: Backend, kernel: Any, has_linear_kernel: bool
    ) -> None:
        x = torch.randn(2, 8).to(backend.device)
        w = torch.randn(4, 8).to(backend.device)
        if not has_linear_kernel:  # nothing installed: F.linear itself, bit for bit
            assert torch.equal(core_linear.linear(x, w), F.linear(x, w))
        assert core_linear.installed(backend.device.type) is (
            None if not has_linear_kernel else kernel
        )

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_answers_match_f_linear_or_decline(
        self, backend: Backend, kernel: Any, dtype: torch.dtype
    ) -> None:
        g = torch.Generator().manual_seed(5)
        for m, n, k in SHAPES:
            x = torch.randn(m, k, generator=g, device="cpu").to(backend.device, dtype)
            w = torch.randn(n, k, generator=g, device="cpu").to(backend.device, dtype)
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
        x = torch.randn(1, 96, generator=g, device="cpu").to(dev)
        w = torch.randn(64, 96, generator=g, device="cpu").to(dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(graph, pool, core_linear.linear, x, w)
        for _ in range(3):
            x.copy_(torch.randn(1, 96, generator=g))
            graph.replay()
            backend.synchronize()
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-3)
        graph.reset()
        pool.close()
