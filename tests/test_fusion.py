"""Fused projections (`xgraph.fusion`, `linear(x, w, fusion)`): the reference model written
over fusions computes bit for bit what its unfused form computed (float32, CPU), a fused
kernel answers what it serves and the reference ops run the rest, and compiled code reaches
the kernel through its custom op.

A test kernel is installed for the CPU device type and removed after each test.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from xgraph import linear as core_linear
from xgraph.backends.cpu.backend import CPUBackend
from xgraph.errors import IncompleteBackendError, InputError
from xgraph.fusion import Fusion, HeadNorm, apply_rotary, reference, rms_norm, silu_mul
from xgraph.interfaces import Kernels
from xgraph.models import Qwen3Model, Workload


def _folded_forward(model: Qwen3Model):  # type: ignore[no-untyped-def]
    """The forward as it was written before fusion: the residual add folded into the norms,
    a zero residual into the first layer, every projection plain."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = model.model.embed_tokens(input_ids)
        residual = torch.zeros_like(x)
        cos_sin = model.rotary(positions)
        for layer, kv in zip(model.model.layers, model.kv_cache.layers):
            x, residual = layer(x, residual, cos_sin, kv)
        return model.model.norm(x, residual)[0]

    return forward


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_stream_form_is_the_folded_form_bit_for_bit(kind: str) -> None:
    rng = random.Random(3)
    stream, folded = Workload.tiny(seed=1), Workload.tiny(seed=1)
    stream.randomize_cache(7)
    folded.randomize_cache(7)
    step = stream.decode_step(rng, 5) if kind == "decode" else stream.prefill_step(rng, [3, 6])
    a = stream.eager(step, forward=stream.model.forward)
    b = folded.eager(step, forward=_folded_forward(folded.model))
    assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(stream.cache.layers, folded.cache.layers):
        assert torch.equal(ka, kb) and torch.equal(va, vb)  # the same k/v stored


def _case(seed: int, rows: int = 3, k: int = 32, n: int = 48) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    return g, x, w


def test_each_prologue_and_epilogue_is_its_unfused_op() -> None:
    g, x, w = _case(0)
    norm = 1 + 0.1 * torch.randn(32, generator=g)
    res = torch.randn(3, 48, generator=g)
    f = Fusion(norm, 1e-5, residual=res)
    assert torch.equal(reference(x, w, f, F.linear), F.linear(rms_norm(x, norm, 1e-5), w) + res)
    x2 = torch.randn(3, 64, generator=g)
    got = reference(x2, w, Fusion(gated=True), F.linear)
    gate, up = x2[:, :32], x2[:, 32:]
    assert torch.equal(got, F.linear(F.silu(gate) * up, w))
    assert torch.equal(silu_mul(x2), F.silu(gate) * up)


def test_the_heads_epilogue_norms_and_rotates_q_and_k_heads_only() -> None:
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 3, 4, 2, 8
    x = torch.randn(t, 16, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, 16, generator=g)
    qw, kw = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    cos_sin = torch.randn(t, 2, d, generator=g)
    y = reference(x, w, Fusion(heads=HeadNorm(qw, kw, 1e-6, cos_sin, hq, hkv)), F.linear)
    raw = F.linear(x, w).view(t, -1, d)
    heads = y.view(t, -1, d)
    assert torch.equal(
        heads[:, :hq], apply_rotary(rms_norm(raw[:, :hq], qw.expand(hq, d), 1e-6), cos_sin)
    )
    k_ref = apply_rotary(rms_norm(raw[:, hq : hq + hkv], kw.expand(hkv, d), 1e-6), cos_sin)
    assert torch.equal(heads[:, hq : hq + hkv], k_ref)
    assert torch.equal(heads[:, hq + hkv :], raw[:, hq + hkv :])


def test_a_fusion_refuses_two_prologues_or_two_epilogues() -> None:
    with pytest.raises(InputError, match="norm and gated are both prologues"):
        Fusion(torch.ones(4), gated=True)
    head = HeadNorm(torch.ones(2), torch.ones(2), 1e-6, torch.ones(1, 2, 2), 1, 1)
    with pytest.raises(InputError, match="residual and heads are both epilogues"):
        Fusion(residual=torch.ones(1, 2), heads=head)


class FusedRecorder:
    """Serves fusions with a residual (the reference + 1, recognisable), declines the rest."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor | None:
        served = f.residual is not None
        self.calls.append("served" if served else "declined")
        return reference(x, w, f, F.linear) + 1 if served else None


@pytest.fixture
def fused() -> Iterator[FusedRecorder]:
    rec = FusedRecorder()
    core_linear.install("cpu", None, "test", rec)
    try:
        yield rec
    finally:
        core_linear.install("cpu", None, "test")


def test_without_a_fused_kernel_a_fusion_runs_the_reference() -> None:
    _, x, w = _case(2)
    res = torch.ones(3, 48)
    assert core_linear.installed_fused("cpu") is None
    assert torch.equal(core_linear.linear(x, w, Fusion(residual=res)), F.linear(x, w) + res)


def test_the_fused_kernel_answers_what_it_serves(fused: FusedRecorder) -> None:
    g, x, w = _case(3)
    res = torch.randn(3, 48, generator=g)
    norm = torch.ones(32)
    assert torch.equal(core_linear.linear(x, w, Fusion(residual=res)), F.linear(x, w) + res + 1)
    plain = core_linear.linear(x, w, Fusion(norm))  # declined: the reference
    assert torch.equal(plain, F.linear(rms_norm(x, norm, 1e-6), w))
    assert torch.equal(core_linear.linear(x, w, Fusion()), F.linear(x, w))  # empty: no call
    assert fused.calls == ["served", "declined"]


def test_inputs_that_need_gradients_run_the_reference(fused: FusedRecorder) -> None:
    _, x, w = _case(4)
    res = torch.zeros(3, 48, requires_grad=True)
    y = core_linear.linear(x, w, Fusion(residual=res))
    assert y.requires_grad and fused.calls == []


def test_compiled_code_reaches_the_fused_kernel_through_its_custom_op(
    fused: FusedRecorder,
) -> None:
    _, x, w = _case(5)
    res = torch.randn(3, 48)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return core_linear.linear(a, b, Fusion(residual=r)) * 2

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x, w, res), (F.linear(x, w) + res + 1) * 2)
    assert any("fused_linear" in s for s in seen), seen
    assert fused.calls == ["served"]  # called at run time, not traced away


def test_kernels_off_uninstalls_both_kernels_for_the_block(fused: FusedRecorder) -> None:
    with core_linear.kernels_off("cpu"):
        assert core_linear.installed_fused("cpu") is None
    assert core_linear.installed_fused("cpu") is fused


def test_activation_installs_the_fused_kernel_and_refuses_a_bad_one() -> None:
    rec = FusedRecorder()

    class WithFused(CPUBackend):
        def kernels(self) -> Kernels:
            return Kernels(fused_linear=rec)

    class BadFused(CPUBackend):
        def kernels(self) -> Kernels:
            return Kernels(fused_linear="no")  # type: ignore[arg-type]

    try:
        WithFused().activate()
        assert core_linear.installed_fused("cpu") is rec
        with pytest.raises(IncompleteBackendError, match=r"kernels\(\).fused_linear is 'no'"):
            BadFused().activate()
        CPUBackend().activate()
        assert core_linear.installed_fused("cpu") is None
    finally:
        core_linear.install("cpu", None, "test")


def test_the_reference_model_hands_every_fusion_to_the_kernel(fused: FusedRecorder) -> None:
    """Per layer: qkv (norm + heads), o_proj (residual), gate/up (norm), down (gated +
    residual); the recorder serves the two with a residual."""
    w = Workload.tiny()
    step = w.decode_step(random.Random(0), 2)
    w.eager(step, forward=w.model.forward)
    per_layer = ["declined", "served", "declined", "served"]
    assert fused.calls == per_layer * w.model.config.num_layers
