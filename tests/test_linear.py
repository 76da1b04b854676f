"""`xgraph.linear`: a backend's kernel for the calls it serves, F.linear for the rest.

A test kernel is installed for the CPU device type (what `Backend.kernels().linear` gives
the core on activation) and removed again after each test.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import xgraph
from xgraph import linear as core_linear
from xgraph.adapter import IncompleteBackendError, Kernels
from xgraph.backends.cpu.backend import CPUBackend
from xgraph.models import Workload
from xgraph.testing.kernels import KernelTests


class Recorder:
    """Answers one-row calls with F.linear + 1 (so its answers are recognisable), declines
    the rest; records the row count of every call."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        self.rows.append(x.shape[0])
        return F.linear(x, w) + 1 if x.shape[0] == 1 else None


@pytest.fixture
def kernel() -> Iterator[Recorder]:
    rec = Recorder()
    core_linear.install("cpu", rec, "test")
    try:
        yield rec
    finally:
        core_linear.install("cpu", None, "test")


def _xw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return torch.randn(m, 8, generator=g), torch.randn(5, 8, generator=g)


def test_without_a_kernel_it_is_f_linear_bit_for_bit() -> None:
    assert core_linear.installed("cpu") is None
    x, w = _xw(3)
    assert torch.equal(core_linear.linear(x, w), F.linear(x, w))


def test_the_kernel_answers_what_it_serves_and_f_linear_the_rest(kernel: Recorder) -> None:
    x1, w = _xw(1)
    x3, _ = _xw(3)
    assert torch.equal(core_linear.linear(x1, w), F.linear(x1, w) + 1)
    assert torch.equal(core_linear.linear(x3, w), F.linear(x3, w))  # declined
    assert kernel.rows == [1, 3]


def test_inputs_that_need_gradients_run_f_linear(kernel: Recorder) -> None:
    x, w = _xw(1)
    w.requires_grad_(True)
    y = core_linear.linear(x, w)
    assert y.requires_grad and kernel.rows == []
    with torch.no_grad():
        core_linear.linear(x, w)
    assert kernel.rows == [1]


def test_compiled_code_reaches_the_kernel_through_the_custom_op(kernel: Recorder) -> None:
    x, w = _xw(1)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda a, b: core_linear.linear(a, b) * 2, backend=backend, fullgraph=True)
    assert torch.equal(fn(x, w), (F.linear(x, w) + 1) * 2)
    assert "xgraph.linear.default" in seen or "xgraph::linear" in str(seen), seen
    assert kernel.rows  # called at run time, not traced away


def test_every_projection_of_the_reference_model_goes_through_it(kernel: Recorder) -> None:
    w = Workload.tiny()
    step = w.decode_step(random.Random(0), 1)
    w.eager(step, forward=w.model.forward)
    assert kernel.rows == [1] * (4 * w.model.config.num_layers)


def test_activating_a_backend_installs_its_kernel_and_a_bad_one_is_refused() -> None:
    rec = Recorder()

    class WithKernel(CPUBackend):
        def kernels(self):  # type: ignore[no-untyped-def]
            return Kernels(linear=rec)

    class BadKernel(CPUBackend):
        def kernels(self):  # type: ignore[no-untyped-def]
            return Kernels(linear="not a function")  # type: ignore[arg-type]

    try:
        with_kernel = xgraph.get_backend(WithKernel())
        assert core_linear.installed("cpu") is None  # getting a backend installs nothing
        with_kernel.activate()
        assert core_linear.installed("cpu") is rec
        with pytest.raises(IncompleteBackendError, match="is not callable"):
            BadKernel().activate()
        CPUBackend().activate()  # no kernel of its own: F.linear again
        assert core_linear.installed("cpu") is None
    finally:
        core_linear.install("cpu", None, "test")


def _answer_one_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    return F.linear(x, w) if x.shape[0] == 1 else None


class _CPUWithKernel(CPUBackend):
    def kernels(self):  # type: ignore[no-untyped-def]
        return Kernels(linear=_answer_one_row)


class TestKernelConformanceOnCPU(KernelTests):
    """The conformance class on the CPU backend given a (correct) kernel of its own."""

    @pytest.fixture
    def backend(self) -> Iterator[CPUBackend]:  # type: ignore[override]
        b = _CPUWithKernel()
        try:
            yield b
        finally:
            core_linear.install("cpu", None, "test")


def test_the_kernel_conformance_fails_a_wrong_kernel() -> None:
    wrong = lambda x, w: F.linear(x, w) + 1  # noqa: E731
    with pytest.raises(AssertionError):
        KernelTests().test_answers_match_f_linear_or_decline(CPUBackend(), wrong, torch.float32)
