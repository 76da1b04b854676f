"""Shared fixtures and helpers of the conformance classes."""

from __future__ import annotations

import inspect
import os
from typing import Any, ClassVar

import pytest
import torch

import xgraph
from xgraph.errors import BackendUnavailableError, XGraphError
from xgraph.interfaces import Backend, CapturePool, Graph

from .capabilities import Capabilities, require, with_option


def line_of(fn: Any, needle: str) -> int:
    """The line number of the first line of `fn`'s source that contains `needle`."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if needle in line:
            return start + i
    raise AssertionError(f"{needle!r} not in {fn.__name__}")


def small_mlp(device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A 3-layer MLP with fixed random weights (32 -> 128 -> 32, LayerNorm)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32), torch.nn.LayerNorm(32)
    )
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * 0.2)
    return m.to(device).eval()


def capture(graph: Graph, pool: CapturePool | None, fn: Any, *args: Any) -> Any:
    """Warm up, then capture fn(*args) with `xgraph.graph`; returns fn's (pool-backed) output."""
    with torch.no_grad():
        fn(*args)
        with xgraph.graph(graph, pool):
            return fn(*args)


def tiny_workload(backend: Backend, **kw: Any) -> Any:
    """The tiny reference model on the backend's device (xgraph.models.Workload.tiny)."""
    from xgraph.models import Workload

    return Workload.tiny(device=backend.device, **kw)


class BackendTests:
    """Fixtures shared by every conformance class."""

    backend_name: ClassVar[str | None] = None
    #: tolerance for device backends (float32; the CPU backend is checked bit for bit)
    rtol: ClassVar[float] = 1e-5
    atol: ClassVar[float] = 1e-5
    bitwise: ClassVar[bool | None] = None  # None: bitwise on cpu, tolerance elsewhere

    @pytest.fixture
    def backend(self, request: pytest.FixtureRequest) -> Backend:
        name = (
            self.backend_name
            or request.config.getoption("xgraph_backend", default=None)
            or os.environ.get("XGRAPH_BACKEND")
            or None
        )
        try:
            return xgraph.get_backend(name)
        except BackendUnavailableError as exc:
            pytest.skip(str(exc))

    def assert_matches(
        self, backend: Backend, actual: torch.Tensor, expected: torch.Tensor
    ) -> None:
        bitwise = self.bitwise if self.bitwise is not None else backend.device.type == "cpu"
        if bitwise:
            assert actual.dtype == expected.dtype and actual.shape == expected.shape
            assert torch.equal(actual, expected), (actual - expected).abs().max()
        else:
            torch.testing.assert_close(actual, expected, rtol=self.rtol, atol=self.atol)

    # -- capabilities: declared (fsspec style), checked, never read off the backend --------

    #: what the backend has: the defaults claim what a torch-style device has; an adapter
    #: lowers what it lacks (xgraph.testing.capabilities); tests adapt instead of skipping
    capabilities: ClassVar[Capabilities] = Capabilities()

    @pytest.fixture
    def declared(self, request: pytest.FixtureRequest) -> Capabilities:
        """The class's `capabilities`, with the command line's `--xgraph-capabilities`."""
        option = request.config.getoption("xgraph_capabilities", default=None)
        return with_option(self.capabilities, option)

    @pytest.fixture
    def has_virtual_memory(self, backend: Backend, declared: Capabilities) -> bool:
        """Whether the backend has a VirtualMemory (declared `virtual_memory`)."""
        return require(backend, declared, "virtual_memory")

    @pytest.fixture
    def reports_memory(self, backend: Backend, declared: Capabilities) -> bool:
        """Whether `memory_in_use()` reads the device's memory (else books are checked)."""
        return require(backend, declared, "reports_memory")

    @pytest.fixture
    def routes_segments(self, backend: Backend, declared: Capabilities) -> bool:
        """Whether capture pools can take their segments from xgraph (shared-physical)."""
        return require(backend, declared, "routes_segments")

    @pytest.fixture
    def has_linear_kernel(self, backend: Backend, declared: Capabilities) -> bool:
        """Whether the backend has a linear kernel of its own (declared `linear_kernel`)."""
        return require(backend, declared, "linear_kernel")


class VirtualMemoryFixture(BackendTests):
    """Tests of the backend's VirtualMemory; without one they check the documented absence."""

    @pytest.fixture
    def vm(self, backend: Backend, has_virtual_memory: bool) -> Any:
        vm = backend.virtual_memory()
        assert (vm is not None) == has_virtual_memory
        if vm is None:
            with pytest.raises(XGraphError, match="has no virtual memory"):
                xgraph.GraphMemory(backend, "shared-physical")
        return vm
