"""Projections on cuBLAS with the fused ops as kernels of their own (kernels/around.py):
the rows from `rows.cublas_rows` on, and every row past the decode kernels' 64, against
the fusion's reference ops, against the decode kernels at the same rows, and the choice of
rows by the environment.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py); shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from xgraph_cuda import linear as cuda_linear
from xgraph_cuda import projection, rows
from xgraph_cuda.kernels import around

from xgraph.errors import XGraphError
from xgraph.fusion import Fusion, HeadNorm, epilogue, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, N, HQ, HKV, D = 64, 48, 4, 2, 32


def _t(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return float((got.float() - want.float()).norm() / want.float().norm())


def _heads(g: torch.Generator, m: int) -> HeadNorm:
    qw, kw = 1 + _t(g, D, scale=0.1), 1 + _t(g, D, scale=0.1)
    return HeadNorm(qw, kw, 1e-6, _t(g, m, 2, D), HQ, HKV)


def _call(kind: str, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, Fusion]:
    """x, w and the fusion of one projection of a decode layer, of `m` rows."""
    g = torch.Generator().manual_seed(seed)
    norm = 1 + _t(g, K, scale=0.1)
    if kind == "qkv":
        return (
            _t(g, m, K),
            _t(g, (HQ + 2 * HKV) * D, K, scale=0.1),
            Fusion(norm, heads=_heads(g, m)),
        )
    if kind == "gate_up":
        return _t(g, m, K), _t(g, 2 * N, K, scale=0.1), Fusion(norm, 1e-5)
    if kind == "down":
        return _t(g, m, 2 * K), _t(g, N, K, scale=0.1), Fusion(gated=True, residual=_t(g, m, N))
    return _t(g, m, K), _t(g, N, K, scale=0.1), Fusion(residual=_t(g, m, N))  # o


KINDS = ("qkv", "o", "gate_up", "down")


@pytest.mark.parametrize("m", [33, 70])
@pytest.mark.parametrize("kind", KINDS)
def test_the_fusions_on_cublas_match_the_reference_ops(kind: str, m: int) -> None:
    x, w, f = _call(kind, m, seed=m)
    assert projection.serves(x, w, f)
    assert _err(projection.fused(x, w, f), reference(x, w, f, F.linear)) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_cublas_and_the_decode_kernels_agree_at_the_same_rows(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w, f = _call(kind, 40, seed=7)
    on_cublas = projection.fused(x, w, f)
    monkeypatch.setenv(rows.CUBLAS_ROWS_ENV, "65")  # the decode kernels up to 64 rows
    assert _err(projection.fused(x, w, f), on_cublas) < 1e-5


def test_the_float32_stream_over_bf16_weights_keeps_its_dtypes() -> None:
    """The norm reads the float32 residual stream into bf16; the residual add stores the sum
    in float32, as the decode kernels do."""
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(3)
    x, w, norm = _t(g, 48, K), _t(g, N, K, scale=0.1).to(bf), 1 + _t(g, K, scale=0.1)
    f = Fusion(norm, 1e-6)
    got = projection.fused(x, w, f)
    assert got.dtype == bf and _err(got, reference(x, w, f, F.linear)) < 1e-2
    r = _t(g, 48, N)
    f = Fusion(residual=r)
    got = projection.fused(x.to(bf), w, f)
    assert got.dtype == torch.float32 and _err(got, reference(x.to(bf), w, f, F.linear)) < 1e-2


def test_the_heads_epilogue_runs_in_place_and_leaves_the_v_heads() -> None:
    g = torch.Generator().manual_seed(5)
    m, h = 20, _heads(g, 20)
    y = _t(g, m, (HQ + 2 * HKV) * D)
    want = epilogue(y.clone(), Fusion(heads=h))
    got = around.heads(y, h)
    assert got.data_ptr() == y.data_ptr()
    qk = (HQ + HKV) * D
    assert torch.equal(got[:, qk:], want[:, qk:])  # v: untouched
    assert _err(got, want) < 1e-5


def test_the_plain_projection_leaves_cublas_rows_to_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(9)
    x, w = _t(g, 33, K), _t(g, N, K)
    assert projection.plain(x, w) is None  # 33 rows: cuBLAS by default
    assert projection.plain(x[:32], w) is not None
    monkeypatch.setenv(rows.CUBLAS_ROWS_ENV, "65")
    assert rows.cublas_rows() == 65
    assert projection.plain(x, w) is not None
    assert projection.plain(_t(g, 65, K), w) is None  # past the decode kernels' rows


@pytest.mark.parametrize("raw", ["0", "66", "many", "-1", "\u00b2"])
def test_a_row_count_out_of_range_is_one_clear_error(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(rows.CUBLAS_ROWS_ENV, raw)
    with pytest.raises(
        XGraphError, match=r"XGRAPH_CUDA_CUBLAS_ROWS=.*give a row count from 1 to 65"
    ):
        rows.cublas_rows()
    monkeypatch.delenv(cuda_linear.LINEAR_ENV, raising=False)
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_CUBLAS_ROWS="):  # when the kernels
        cuda_linear.fused_kernel()  # are chosen, not at a forward's first projection


def test_strided_rows_uneven_widths_and_wider_heads_match_the_reference_ops() -> None:
    """What decode's calls never pass but a prefill piece may: an input with a row stride
    (a slice of a wider buffer), a K that is no power of two, a gate wider than one
    program's columns, heads of 64."""
    g = torch.Generator().manual_seed(11)
    m, k, d, hq, hkv = 37, 100, 64, 2, 1
    wide = _t(g, m, k + 28)
    x = wide[:, :k]  # row stride k + 28
    w, norm = _t(g, (hq + 2 * hkv) * d, k, scale=0.1), 1 + _t(g, k, scale=0.1)
    h = HeadNorm(1 + _t(g, d, scale=0.1), 1 + _t(g, d, scale=0.1), 1e-6, _t(g, m, 2, d), hq, hkv)
    f = Fusion(norm, heads=h)
    assert _err(projection.fused(x, w, f), reference(x, w, f, F.linear)) < 1e-5
    gate_k = around.GATE_BLOCK + 76  # two programs a row
    x = _t(g, m, 2 * gate_k)
    w, r = _t(g, N, gate_k, scale=0.1), _t(g, m, N)
    f = Fusion(gated=True, residual=r)
    assert _err(projection.fused(x, w, f), reference(x, w, f, F.linear)) < 1e-5


def test_bf16_heads_within_bf16_rounding_of_the_reference_ops() -> None:
    bf = torch.bfloat16
    x, w, f = _call("qkv", 40, seed=13)
    h = f.heads
    f = Fusion(
        f.norm.to(bf),
        heads=HeadNorm(h.q_weight.to(bf), h.k_weight.to(bf), h.eps, h.cos_sin, HQ, HKV),
    )
    got = projection.fused(x.to(bf), w.to(bf), f)
    assert got.dtype == bf and _err(got, reference(x.to(bf), w.to(bf), f, F.linear)) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles for a GPU only")
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernels_around_compile_ahead_without_running(kind: str) -> None:
    """What the family's pre-compile asks of them (projection._compile_one past the rows)."""
    x, w, f = _call(kind, 40, seed=17)
    y = around.run(x, w, f)  # warm: the binaries exist after a run
    around.compile_kernels(x, w, f)
    torch.cuda.synchronize()
    assert torch.equal(around.run(x, w, f), y)
