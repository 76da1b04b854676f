"""The residual stream in float32 over fused kernels (`xgraph.linear.stream_dtype`): a 16-bit
model keeps its stream in float32 where its device has a fused kernel, so it is never
rounded between layers, and returns its hidden states in its own dtype; without a fused
kernel nothing changes (the unfused model's rounding, bit for bit). The reference ops of a
fusion take the float32 stream (a norm prologue rounds into the weights' dtype, a residual
epilogue promotes), and compiled code sees the fused op's output in that dtype.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from xgraph import linear as core_linear
from xgraph.bench.fidelity import float32_twin
from xgraph.fusion import Fusion, reference, rms_norm
from xgraph.models import Qwen3Model, Workload

BF = torch.bfloat16


def _stream_kernel(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor:
    """A fused kernel that serves every fusion with the reference ops (float32 inside)."""
    return reference(x, w, f, F.linear)


@pytest.fixture
def fused() -> Iterator[None]:
    core_linear.install("cpu", None, "test", _stream_kernel)
    try:
        yield
    finally:
        core_linear.install("cpu", None, "test")


def test_the_stream_is_float32_only_for_16_bit_models_over_a_fused_kernel(fused: None) -> None:
    assert core_linear.stream_dtype(torch.ones(1, dtype=BF)) == torch.float32
    assert core_linear.stream_dtype(torch.ones(1, dtype=torch.float16)) == torch.float32
    assert core_linear.stream_dtype(torch.ones(1)) == torch.float32  # float32 stays itself
    with core_linear.kernels_off("cpu"):
        assert core_linear.stream_dtype(torch.ones(1, dtype=BF)) == BF


def test_the_reference_ops_take_the_float32_stream() -> None:
    g = torch.Generator().manual_seed(0)
    stream = torch.randn(3, 32, generator=g)
    w = (torch.randn(16, 32, generator=g) * 0.1).to(BF)
    norm = torch.ones(32, dtype=BF)
    y = reference(stream, w, Fusion(norm), F.linear)  # normed into bf16, then projected
    assert y.dtype == BF and torch.equal(y, F.linear(rms_norm(stream, norm, 1e-6, BF), w))
    x = torch.randn(3, 32, generator=g).to(BF)
    res = torch.randn(3, 16, generator=g)
    y = reference(x, w, Fusion(residual=res), F.linear)  # the sum stays float32
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x, w).float() + res)


def _model() -> Workload:
    model = Qwen3Model.build("tiny", num_blocks=64, block_size=4, dtype=BF, seed=2)
    return Workload(model, 8, 8)


def _run(w: Workload, step: object, seed: int) -> torch.Tensor:
    w.randomize_cache(seed)
    return w.eager(step, forward=w.model.forward)  # type: ignore[arg-type]


def test_a_bf16_model_keeps_a_float32_stream_and_returns_bf16(fused: None) -> None:
    w = _model()
    seen: list[torch.dtype] = []
    hooks = [
        layer.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
        for layer in w.model.model.layers
    ]
    out = _run(w, w.decode_step(random.Random(0), 4), 1)
    for h in hooks:
        h.remove()
    assert out.dtype == BF
    assert seen == [torch.float32] * w.model.config.num_layers


def test_without_a_fused_kernel_the_stream_is_the_models_own_bit_for_bit() -> None:
    w = _model()
    step = w.decode_step(random.Random(0), 4)
    seen: list[torch.dtype] = []
    hook = w.model.model.layers[0].register_forward_hook(
        lambda m, a, out: seen.append(out[0].dtype)
    )
    out = _run(w, step, 1)
    hook.remove()
    assert seen == [BF]
    assert torch.equal(out, _run(w, step, 1))


def test_the_float32_stream_is_closer_to_float32_than_the_bf16_stream() -> None:
    """Over prefill and decode steps of the tiny model: the distance of the hidden states
    from a float32 copy of the same weights and cache shrinks with the float32 stream."""
    w = _model()
    twin = Workload(float32_twin(w.model), 8, 8)
    rng = random.Random(5)
    steps = [w.decode_step(rng, 6), w.prefill_step(rng, [5, 7])]
    err = {"bf16": 0.0, "float32": 0.0}
    for i, step in enumerate(steps):
        want = _run(twin, step, 10 + i)
        err["bf16"] += float((_run(w, step, 10 + i).float() - want).norm() / want.norm())
        core_linear.install("cpu", None, "test", _stream_kernel)
        try:
            err["float32"] += float((_run(w, step, 10 + i).float() - want).norm() / want.norm())
        finally:
            core_linear.install("cpu", None, "test")
    assert err["float32"] < 0.9 * err["bf16"], err


def test_compiled_code_sees_the_fused_ops_float32_output(fused: None) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, generator=g).to(BF)
    w = (torch.randn(16, 32, generator=g) * 0.1).to(BF)
    res = torch.randn(2, 16, generator=g)
    dtypes: list[torch.dtype] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        for n in gm.graph.nodes:
            if n.op == "call_function" and "fused_linear" in str(n.target):
                dtypes.append(n.meta["example_value"].dtype)
        return gm.forward

    def fn(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return core_linear.linear(a, b, Fusion(residual=r))

    assert torch.compile(fn, backend=backend)(x, w, res).dtype == torch.float32
    assert dtypes == [torch.float32]
