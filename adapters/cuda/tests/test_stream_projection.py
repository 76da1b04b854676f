"""The decode projection kernels over a float32 residual stream with 16-bit weights: a
norm prologue reads the float32 stream and rounds only its output to the weights' dtype; a
residual epilogue adds the product to the float32 stream and stores the sum unrounded; every
other pairing of dtypes is declined (the reference ops run it).

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py); shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sm90 import ptx_of
from xgraph_cuda import projection
from xgraph_cuda.kernels import arena, gemv, qkv
from xgraph_cuda.kernels.tuning import Config, stages_for

from xgraph.fusion import Fusion, HeadNorm, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF = torch.bfloat16
MMA = Config(True, 16, 16, 32, 1, 4, 2)


def _t(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("split", [1, 2])
def test_the_residual_epilogue_stores_the_float32_sum_unrounded(split: int) -> None:
    g = torch.Generator().manual_seed(split)
    x, w = _t(g, 3, 64).to(BF), _t(g, 40, 64, scale=0.1).to(BF)
    stream = _t(g, 3, 40)
    c = MMA._replace(split=split)
    got = gemv.launch(x, w, c, arena.counts(x.device), residual=stream)
    assert got.dtype == torch.float32
    exact = x.float() @ w.float().T + stream  # 16-bit operands are exact in float32
    # a sum rounded to bf16 would be ~1e-3 away; unrounded, only the order of the adds
    assert _rel(got, exact) < 1e-5
    assert _rel(got.to(BF), exact) > 1e-4  # (the bound above can tell the two apart)


def test_the_norm_prologue_reads_the_float32_stream() -> None:
    g = torch.Generator().manual_seed(3)
    stream, w = _t(g, 2, 64), _t(g, 48, 64, scale=0.1).to(BF)
    norm = (1 + _t(g, 64, scale=0.1)).to(BF)
    f = Fusion(norm, 1e-6)
    got = projection.fused(stream, w, f)
    assert got is not None and got.dtype == BF
    want = reference(stream, w.float(), Fusion(norm.float(), 1e-6), F.linear)
    assert _rel(got, want) < 1e-2  # the normed input rounded once to bf16, as the reference
    assert _rel(reference(stream, w, f, F.linear), want) < 1e-2


def test_the_qkv_projection_reads_the_float32_stream_into_its_heads() -> None:
    g = torch.Generator().manual_seed(4)
    t, hq, hkv, d, k = 2, 2, 1, 32, 64
    stream, w = _t(g, t, k), _t(g, (hq + 2 * hkv) * d, k, scale=0.1).to(BF)
    norm = (1 + _t(g, k, scale=0.1)).to(BF)
    qw, kw = (1 + _t(g, d, scale=0.1)).to(BF), (1 + _t(g, d, scale=0.1)).to(BF)
    h = HeadNorm(qw, kw, 1e-6, _t(g, t, 2, d), hq, hkv)
    spec = (h.q_weight, h.k_weight, h.eps, h.cos_sin, hq, hkv)
    got = qkv.launch(stream, w, MMA, arena.counts(stream.device), spec, norm=norm, eps=1e-6)
    assert got.dtype == BF
    want = reference(stream, w, Fusion(norm, 1e-6, heads=h), F.linear)
    assert want.dtype == BF and _rel(got, want) < 2e-2


def test_other_pairings_of_dtypes_are_declined() -> None:
    g = torch.Generator().manual_seed(5)
    x, w = _t(g, 2, 64), _t(g, 16, 64).to(BF)
    assert not projection.serves(x, w)  # a float32 input without a norm prologue
    assert not projection.serves(_t(g, 2, 128), w, Fusion(gated=True))  # float32 gate/up
    assert not projection.serves(x.to(torch.float16), w, Fusion(torch.ones(64, device=DEVICE)))
    res16 = _t(g, 2, 16).to(torch.float16)
    assert not projection.serves(x.to(BF), w, Fusion(residual=res16))  # fp16 over bf16
    assert projection.serves(x, w, Fusion(torch.ones(64, device=DEVICE).to(BF)))
    assert projection.serves(x.to(BF), w, Fusion(residual=_t(g, 2, 16)))


def _gemv(x: str, stages: int) -> tuple[dict, dict, dict]:
    const = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 1, "NORM": True}
    const.update(GATED=False, RESIDUAL=False, MMA=True, EVEN=True, UPCAST=False)
    const.update(PRECISION="tf32", PDL=True, PREFETCH=False, LINE=64, TRIGGER=0, PRELOAD=1)
    types = {n: "*bf16" for n in ("W", "Y", "R", "G")}
    types.update(X=x, Part="*fp32", Count="*i32", eps="fp32")
    return const, types, {"num_stages": stages, "num_warps": 4}


# what a launch passes as multiples of 16 at the decode shapes (the row count is not)
_DIVISIBLE = ("N", "K", "k_per", "s_xm", "s_wn", "s_ym", "s_rm")


def test_the_stream_launches_are_not_pipelined_as_measured() -> None:
    """Compiled as launched (pointers and strides multiples of 16), Triton pipelines a
    16-bit input's loop at the configurations' three stages (cp.async), and a float32
    input's too; the stream's launches ask one stage (the measured
    choice, docs/kernels.md) and are not pipelined."""
    one = stages_for(MMA, torch.float32, BF)
    assert one == 1 and stages_for(MMA, BF, BF) == MMA.stages
    ptx = ptx_of(
        "xgraph_cuda.kernels.gemv",
        "_gemv_kernel",
        {
            "bf16": _gemv("*bf16", 3),
            "stream": _gemv("*fp32", one),
            "stream-3": _gemv("*fp32", 3),
        },
        _DIVISIBLE,
    )
    assert "cp.async" not in ptx["stream"]
    assert all("cp.async" in ptx[k] for k in ("bf16", "stream-3"))
    assert all("wgmma.mma_async" in p for p in ptx.values())
