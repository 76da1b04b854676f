"""The decode projection kernels (kernels/gemv.py, kernels/qkv.py) against the fusion's
reference ops: plain, with each prologue and epilogue, split K finished by the last program
(in split order: bitwise repeatable, counts back to zero), both product forms.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py); shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from xgraph_cuda import linear as cuda_linear
from xgraph_cuda import projection
from xgraph_cuda.kernels import arena, gemv, prefetch, qkv, tuning
from xgraph_cuda.kernels.tuning import Config, candidates, pick

from xgraph.errors import XGraphError
from xgraph.fusion import Fusion, HeadNorm, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MMA = Config(True, 16, 16, 32, 1, 4, 2)
FMA = Config(False, 4, 8, 32, 1, 4, 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _t(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


def _cfg(base: Config, m: int, split: int) -> Config:
    return base._replace(block_m=max(base.block_m, 1 << (m - 1).bit_length()), split=split)


@pytest.mark.parametrize("form", [MMA, FMA], ids=["mma", "fma"])
@pytest.mark.parametrize("m,n,k,split", [(1, 40, 64, 1), (3, 33, 96, 2), (4, 16, 200, 4)])
def test_plain_matches_f_linear(form: Config, m: int, n: int, k: int, split: int) -> None:
    g = _gen(m * 100 + k)
    x, w = _t(g, m, k), _t(g, n, k)
    c = _cfg(form, m, split)
    y = gemv.launch(x, w, c, arena.counts(x.device))
    _close(y, F.linear(x, w))


def test_sixty_four_rows_on_the_tensor_core_form() -> None:
    g = _gen(9)
    x, w = _t(g, 64, 48), _t(g, 24, 48)
    y = gemv.launch(x, w, Config(True, 64, 16, 16, 2, 4, 2), arena.counts(x.device))
    _close(y, F.linear(x, w))


@pytest.mark.parametrize("split", [1, 2])
def test_norm_prologue_and_residual_epilogue(split: int) -> None:
    g = _gen(split)
    x, w = _t(g, 3, 64), _t(g, 40, 64, scale=0.1)
    norm, res = 1 + _t(g, 64, scale=0.1), _t(g, 3, 40)
    c = _cfg(MMA, 3, split)
    counts = arena.counts(x.device)
    got = gemv.launch(x, w, c, counts, norm=norm, eps=1e-5)
    _close(got, reference(x, w, Fusion(norm, 1e-5), F.linear))
    got = gemv.launch(x, w, c, counts, residual=res)
    _close(got, reference(x, w, Fusion(residual=res), F.linear))


@pytest.mark.parametrize("split", [1, 4])
def test_gated_prologue_with_the_residual(split: int) -> None:
    g = _gen(10 + split)
    x, w, res = _t(g, 2, 128), _t(g, 24, 64, scale=0.1), _t(g, 2, 24)
    got = gemv.launch(x, w, _cfg(MMA, 2, split), arena.counts(x.device), gated=True, residual=res)
    _close(got, reference(x, w, Fusion(gated=True, residual=res), F.linear))


def _heads(g: torch.Generator, t: int, hq: int, hkv: int, d: int) -> HeadNorm:
    qw, kw = 1 + _t(g, d, scale=0.1), 1 + _t(g, d, scale=0.1)
    cs = _t(g, t, 2, d)
    return HeadNorm(qw, kw, 1e-6, cs, hq, hkv)


@pytest.mark.parametrize("split,k", [(1, 64), (2, 64), (3, 320)])
def test_qkv_with_its_norms_and_rotary(split: int, k: int) -> None:
    """Splits 1 and 2, and 3 over a K no split of whole tiles shares evenly."""
    g = _gen(20 + split)
    t, hq, hkv, d = 3, 4, 2, 32
    x, w = _t(g, t, k), _t(g, (hq + 2 * hkv) * d, k, scale=0.1)
    norm = 1 + _t(g, k, scale=0.1)
    h = _heads(g, t, hq, hkv, d)
    spec = (h.q_weight, h.k_weight, h.eps, h.cos_sin, hq, hkv)
    c = _cfg(MMA, t, split)
    got = qkv.launch(x, w, c, arena.counts(x.device), spec, norm=norm, eps=1e-6)
    _close(got, reference(x, w, Fusion(norm, 1e-6, heads=h), F.linear))


def test_bfloat16_fusions_within_bf16_rounding() -> None:
    g = _gen(30)
    bf = torch.bfloat16
    x, w = _t(g, 2, 64).to(bf), _t(g, 48, 64, scale=0.1).to(bf)
    res = _t(g, 2, 48).to(bf)
    f = Fusion(residual=res)
    got = projection.run(x, w, f, _cfg(MMA, 2, 2))
    want = reference(x.float(), w.float(), Fusion(residual=res.float()), F.linear)
    _close(got, want.to(bf), tol=1e-2)


def test_a_split_is_bitwise_repeatable_and_leaves_the_counts_at_zero() -> None:
    g = _gen(40)
    x, w = _t(g, 2, 256), _t(g, 32, 256)
    counts = arena.counts(x.device)
    c = _cfg(MMA, 2, 4)
    a = gemv.launch(x, w, c, counts)
    b = gemv.launch(x, w, c, counts)
    assert torch.equal(a, b)
    assert int(counts.abs().sum()) == 0


def test_the_fused_duty_serves_decode_rows_and_declines_the_rest() -> None:
    g = _gen(50)
    x, w = _t(g, 2, 64), _t(g, 16, 64)
    assert projection.serves(x, w)
    assert projection.serves(_t(g, 65, 64), w)  # prefill-sized: cuBLAS and the kernels around
    assert projection.plain(_t(g, 65, 64), w) is None  # cuBLAS alone: F.linear's
    assert not projection.serves(x.double(), w.double())
    assert not projection.serves(x, w.t().contiguous().t())  # weight inner stride not 1
    assert not projection.serves(x, w, Fusion(residual=_t(g, 2, 15)))  # residual shape
    assert not projection.serves(x, w, Fusion(torch.ones(63)))  # norm width
    y = projection.fused(x, w, Fusion(residual=torch.zeros(2, 16, device=DEVICE)))
    assert y is not None
    _close(y, F.linear(x, w))


def test_default_configurations_cover_the_grid() -> None:
    c = pick(1, 1024, 2048, 132)
    assert c.mma and c.block_m == 16 and c.split == 8  # 16 column tiles x 8 splits
    assert pick(1, 24576, 4096, 132).split == 1  # 384 tiles fill the GPU alone
    assert pick(1, 6144, 1024, 132).split == 4  # 96 tiles x 4: under three a multiprocessor
    assert pick(1, 4096, 4096, 132).split == 4  # 64 tiles x 8 would be nearly four
    assert pick(1, 6144, 4096, 132, head_dim=128).block_n == 128
    # the qkv kernel's split fills whole waves: 48 head tiles x 11 = 4 x 132 at Qwen3-8B's
    # shape; Qwen3-0.6B's 32 tiles x 4 = 128 of 132 (two K tiles a program at most 4)
    assert pick(1, 6144, 4096, 132, head_dim=128).split == 11
    assert pick(8, 4096, 1024, 132, head_dim=128).split == 4
    assert pick(64, 6144, 4096, 132, head_dim=128).split == 4  # past 16 rows: a power of two
    for k, split in [(4096, 11), (1000, 3), (256, 2), (200, 5)]:
        c = MMA._replace(split=split)
        assert gemv.k_share(k, c)[1] == tuning.splits_needed(k, split, c.block_k)
    assert pick(64, 1024, 1024, 132).block_m == 64
    for c in candidates(1, 1024, 2048, 132):
        assert c.split * c.block_k <= 2048
    assert any(not c.mma for c in candidates(1, 1024, 2048, 132))
    wide = [c.block_n for c in candidates(64, 1024, 3072, 132) if c.block_n > 64]
    assert wide and not any(c.block_n > 64 for c in candidates(8, 1024, 3072, 132))


def test_the_kernels_are_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from xgraph_cuda.kernels import skinny

    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "triton")
    monkeypatch.delenv(cuda_linear.FUSED_ENV, raising=False)
    assert cuda_linear.linear_kernel() is projection.plain
    assert cuda_linear.fused_kernel() is projection.fused
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "auto")  # the default: the decode kernels
    assert cuda_linear.linear_kernel() is projection.plain
    assert cuda_linear.fused_kernel() is projection.fused
    monkeypatch.delenv(cuda_linear.LINEAR_ENV)
    assert cuda_linear.linear_kernel() is projection.plain
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "skinny")
    assert cuda_linear.linear_kernel() is skinny.linear
    assert cuda_linear.fused_kernel() is None  # auto: fused only with the decode kernel
    monkeypatch.setenv(cuda_linear.FUSED_ENV, "on")
    assert cuda_linear.fused_kernel() is projection.fused
    monkeypatch.setenv(cuda_linear.FUSED_ENV, "off")
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "triton")
    assert cuda_linear.fused_kernel() is None
    monkeypatch.setenv(cuda_linear.FUSED_ENV, "maybe")
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_FUSED='maybe'; use one of"):
        cuda_linear.fused_kernel()


def test_the_reference_model_through_the_kernels_matches_the_reference_ops() -> None:
    """A small Qwen3 (head_dim 32) decodes the same through the installed kernels, with
    every fusion served (five launches a layer with attention), as through the reference
    ops: float32, to rounding."""
    import random

    import xgraph.linear as core_linear
    from xgraph.models import Qwen3Config, Qwen3Model, Workload

    c = Qwen3Config(256, 64, 128, 2, 4, 2, 32, max_position=256)
    model = Qwen3Model.build(c, num_blocks=64, block_size=4, device=DEVICE)
    w = Workload(model, max_blocks=8, max_seqs=4)
    w.randomize_cache(1)
    step = w.decode_step(random.Random(2), 3)
    served: list[bool] = []

    def spy(x, wt, f):  # type: ignore[no-untyped-def]
        y = projection.fused(x, wt, f)
        served.append(y is not None)
        return y

    want = w.eager(step, forward=model.forward)
    core_linear.install(DEVICE.type, projection.plain, "test", spy)
    try:
        got = w.eager(step, forward=model.forward)
    finally:
        core_linear.install(DEVICE.type, None, "test")
    assert served == [True] * 4 * c.num_layers
    _close(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_a_bf16_decode_step_through_the_kernels_in_a_graph(backend, batch: int) -> None:  # type: ignore[no-untyped-def]
    """The Qwen3-0.6B layer shape in bf16: a full-graph decode step through the fused
    kernels against the reference ops (torch's own kernels, the reference attention)."""
    import random

    import xgraph.linear as core_linear
    from xgraph.models import Qwen3Config, Qwen3Model, Workload
    from xgraph.runners import PagedDecodeRunner

    c = Qwen3Config(4096, 1024, 3072, 2, 16, 8, 128, max_position=1024)
    model = Qwen3Model.build(c, num_blocks=64 * 8, device="cuda", dtype=torch.bfloat16)
    w = Workload(model, max_blocks=8, max_seqs=64)
    w.randomize_cache(4)
    step = w.decode_step(random.Random(batch), batch, max_context=100)
    with core_linear.kernels_off("cuda"):
        want = w.eager(step, runner=PagedDecodeRunner(), forward=model.forward)
    ex = w.executor(model.forward, backend=backend, buckets=[1, 8, 64])
    try:
        got = ex(**step.kwargs())[:batch].clone()  # outputs are views of one buffer
        again = ex(**step.kwargs())[:batch].clone()
    finally:
        ex.close()
    assert torch.equal(got, again)  # the replay is bitwise repeatable
    _close(got, want, tol=2e-2)


@pytest.mark.parametrize("split,k", [(1, 128), (2, 128), (2, 100), (3, 136)])
def test_the_first_tile_before_the_wait_changes_no_bit(
    monkeypatch: pytest.MonkeyPatch, split: int, k: int
) -> None:
    """XGRAPH_CUDA_PRELOAD moves where the first weight tiles are loaded, not what is done
    with them: both kernels give the same bits with none or one to four ahead, K a multiple
    of the split's share or not (the last program's tiles then masked past K). Tiles are
    loaded ahead only where the PDL wait is compiled in, which the interpreter cannot run, so
    the test asks for them without the wait: the same kernel body, less the wait."""
    g = _gen(50 + split + k)
    t, hq, hkv, d = 3, 4, 2, 32
    x, w = _t(g, t, k), _t(g, (hq + 2 * hkv) * d, k, scale=0.1)
    norm, res = 1 + _t(g, k, scale=0.1), _t(g, t, (hq + 2 * hkv) * d)
    h = _heads(g, t, hq, hkv, d)
    spec = (h.q_weight, h.k_weight, h.eps, h.cos_sin, hq, hkv)
    c, counts = _cfg(MMA, t, split), arena.counts(x.device)
    options = prefetch.options
    monkeypatch.setattr(prefetch, "options", lambda w, per, bk, waits: options(w, per, bk, True))
    outs = {}
    for mode in ("on", "off", "2", "3", "4"):
        monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", mode)
        outs[mode] = (
            gemv.launch(x, w, c, counts, norm=norm, eps=1e-5, residual=res),
            qkv.launch(x, w, c, counts, spec, norm=norm, eps=1e-6),
        )
    for mode in ("on", "2", "3", "4"):
        for ahead, off in zip(outs[mode], outs["off"]):
            assert torch.equal(ahead, off), mode


def test_auto_keeps_the_skinny_kernel_before_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernels are the default where they were measured (compute capability 9.0
    and up); an older GPU keeps the earlier default, and naming them still picks them."""
    from xgraph_cuda.kernels import skinny

    monkeypatch.delenv(cuda_linear.LINEAR_ENV, raising=False)
    monkeypatch.delenv(cuda_linear.FUSED_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = torch.device("cuda", 0)
    for major, plain, fused in [(8, skinny.linear, None), (9, projection.plain, projection.fused)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert cuda_linear.linear_kernel(gpu) is plain
        assert cuda_linear.fused_kernel(gpu) is fused
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "triton")
    assert cuda_linear.linear_kernel(gpu) is projection.plain
    assert cuda_linear.fused_kernel(gpu) is projection.fused


def test_auto_without_triton_is_cublas_on_any_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delenv(cuda_linear.LINEAR_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find(name, *a)
    )
    for major in (8, 9):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert cuda_linear.linear_kernel(torch.device("cuda", 0)) is None
        assert cuda_linear.fused_kernel(torch.device("cuda", 0)) is None
    monkeypatch.setenv(cuda_linear.LINEAR_ENV, "skinny")
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_LINEAR=skinny but triton is not installed"):
        cuda_linear.linear_kernel(torch.device("cuda", 0))
