"""The skinny linear kernel against F.linear, which calls it serves, and the backend duty.

Without a GPU the kernel runs in Triton's CPU interpreter (conftest.py); shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from xgraph_cuda import linear as cuda_linear
from xgraph_cuda.kernels import skinny

from xgraph.errors import XGraphError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 64, 128), (1, 4100, 96), (3, 50, 130), (4, 2048, 64), (2, 7, 1000), (8, 33, 40)],
)
def test_matches_f_linear_in_float32(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    torch.testing.assert_close(skinny.skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bfloat16_rows_of_a_strided_input_within_bf16_tolerance() -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(4, 3 * 256, generator=g).to(DEVICE, torch.bfloat16)
    x = big[:, 256:512]  # row stride 768: the kernel honours it
    w = torch.randn(96, 256, generator=g).to(DEVICE, torch.bfloat16)
    y = skinny.skinny_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 96)
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def _pair(m: int, n: int, k: int = 64, dtype: torch.dtype = torch.float32) -> tuple:
    return torch.zeros(m, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)


def test_serves_one_row_anywhere_and_a_few_rows_into_narrow_outputs() -> None:
    assert skinny.serves(*_pair(1, 151936))
    assert skinny.serves(*_pair(4, skinny.NARROW))
    assert not skinny.serves(*_pair(2, skinny.NARROW + 1))  # wide outputs: cuBLAS
    assert not skinny.serves(*_pair(skinny.MAX_ROWS + 1, 64))
    x, w = _pair(1, 64)
    assert not skinny.serves(x.t(), w.t())  # inner stride not 1
    assert not skinny.serves(x, w.double())  # mixed dtypes
    assert not skinny.serves(x.to(torch.int32), w.to(torch.int32))
    assert not skinny.serves(x[None], w)  # 3-d input
    assert skinny.linear(*_pair(16, 64)) is None  # declined: F.linear runs it


def test_the_kernel_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from xgraph_cuda import projection

    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "torch")
    assert cuda_linear.linear_kernel() is None
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "skinny")
    assert cuda_linear.linear_kernel() is skinny.linear
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "auto")
    assert cuda_linear.linear_kernel() is projection.plain  # the decode kernels
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "triton")
    assert cuda_linear.linear_kernel() is projection.plain
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "cublas")
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_LINEAR='cublas'; use one of"):
        cuda_linear.linear_kernel()


@needs_cuda
def test_the_reference_model_decodes_the_same_with_and_without_the_kernel(backend) -> None:  # type: ignore[no-untyped-def]
    """At batch 1 the model's projections go through the installed kernel (activating the
    backend installs it) and agree with cuBLAS's within bf16 rounding."""
    import random

    import xgraph.linear as core_linear
    from xgraph.models import Workload

    backend.activate()
    assert core_linear.installed("cuda") is cuda_linear.linear_kernel()  # XGRAPH_CUDA_LINEAR's
    w = Workload.tiny(device="cuda", dtype=torch.bfloat16, num_blocks=64, max_seqs=4)
    step = w.decode_step(random.Random(3), 1)
    calls: list[tuple[int, ...]] = []

    def counted(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor | None:
        calls.append(tuple(x.shape))
        return skinny.linear(x, wt)

    try:
        core_linear.install("cuda", counted, "test")
        fast = w.eager(step, forward=w.model.forward)
        core_linear.install("cuda", None, "test")
        slow = w.eager(step, forward=w.model.forward)
    finally:
        backend.activate()
    assert len(calls) == 4 * w.model.config.num_layers
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)
