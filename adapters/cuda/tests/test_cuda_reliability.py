"""On the GPU: teardown without a synchronize, interrupts mid-capture, injected driver failures.

Each test ends by running fresh CUDA work and synchronizing: an illegal memory access would
poison the context and fail there (and in every later test).
"""

from __future__ import annotations

import pytest
import torch

import xgraph
from xgraph import GraphMemory, Input
from xgraph.testing.faults import books

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BUCKETS = [8, 16, 32, 64]


def heavy(dev: torch.device, depth: int = 24, width: int = 4096):  # type: ignore[no-untyped-def]
    """A forward whose replay keeps the GPU busy for milliseconds: queued work at close."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ws = [
        (torch.randn(width, width, generator=g) / width**0.5).to(dev, torch.bfloat16)
        for _ in range(depth)
    ]

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.repeat(1, width // x.shape[1])
        for w in ws:
            h = torch.tanh(h @ w)
        return h[:, : x.shape[1]].float()

    return forward


def context_is_healthy(dev: torch.device) -> None:
    torch.cuda.synchronize(dev)  # raises if a queued kernel hit unmapped memory
    x = torch.arange(1024, device=dev, dtype=torch.float32)
    assert float((x * 2).sum()) == 1023 * 1024


@pytest.mark.parametrize("memory", ["shared-physical", "shared-pool", "private"])
def test_close_right_after_queued_replays_needs_no_synchronize(backend, memory):
    dev = backend.device
    fwd = heavy(dev)
    ex = xgraph.GraphExecutor(
        fwd,
        backend=backend,
        buckets=BUCKETS,
        memory=memory,
        inputs=[Input("x", torch.bfloat16, ("num_tokens", 256))],
    )
    for n in BUCKETS:  # capture every bucket
        ex(x=torch.randn(n, 256, dtype=torch.bfloat16))
    torch.cuda.synchronize(dev)
    for _ in range(10):  # queue replays, read nothing
        for n in BUCKETS:
            ex(x=torch.randn(n, 256, dtype=torch.bfloat16))
    ex.close()  # no synchronize before: close must wait
    context_is_healthy(dev)


def test_close_after_a_failed_capture_and_an_interrupt(backend):
    dev = backend.device
    fwd = heavy(dev)
    calls = {"n": 0}

    def flaky(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if x.shape[0] == 16 and calls["n"] % 2 == 0:
            raise KeyboardInterrupt  # in the capture (the warm-up is the odd call)
        if x.shape[0] == 32:
            x = x * (x.sum().item() != 0)  # a host read: this key fails to capture
        return fwd(x)

    ex = xgraph.GraphExecutor(
        flaky,
        backend=backend,
        buckets=BUCKETS,
        inputs=[Input("x", torch.bfloat16, ("num_tokens", 256))],
    )
    before = books(backend.virtual_memory())
    ex(x=torch.randn(8, 256, dtype=torch.bfloat16))
    with pytest.raises(KeyboardInterrupt):
        ex(x=torch.randn(16, 256, dtype=torch.bfloat16))
    with pytest.warns(xgraph.XGraphWarning):
        ex(x=torch.randn(32, 256, dtype=torch.bfloat16))
    assert torch.Tensor.tolist(torch.ones(1)) == [1.0]
    for _ in range(5):
        ex(x=torch.randn(8, 256, dtype=torch.bfloat16))
    ex.close()
    context_is_healthy(dev)
    assert books(backend.virtual_memory()) == before


@pytest.mark.parametrize(
    "call,nth",
    [
        ("cuMemCreate", 1),
        ("cuMemCreate", 3),
        ("cuMemMap", 2),
        ("cuMemSetAccess", 2),
        ("cuMemAddressReserve", 1),
    ],
)
def test_injected_driver_failure_rolls_back_with_balanced_books(backend, monkeypatch, call, nth):
    """The first capture (2 MiB activations: 20 MiB segments of ten 2 MiB chunks) fails at
    the n-th driver call."""
    from cuda.bindings import driver as cu

    dev = backend.device
    vm = backend.virtual_memory()
    start = books(vm)
    fwd = heavy(dev, depth=4, width=16384)
    mem = GraphMemory(backend, "shared-physical")
    ex = xgraph.GraphExecutor(
        fwd,
        backend=backend,
        buckets=BUCKETS,
        memory=mem,
        on_capture_error="raise",
        inputs=[Input("x", torch.bfloat16, ("num_tokens", 256))],
    )
    real, seen = getattr(cu, call), {"n": 0}

    def failing(*args):  # type: ignore[no-untyped-def]
        seen["n"] += 1
        if seen["n"] == nth:
            oom = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
            return (oom,) if call in ("cuMemMap", "cuMemSetAccess") else (oom, None)
        return real(*args)

    monkeypatch.setattr(cu, call, failing)
    try:
        with pytest.raises(
            xgraph.VirtualMemoryError, match=f"{call} failed: CUDA_ERROR_OUT_OF_MEMORY"
        ):
            ex(x=torch.randn(64, 256, dtype=torch.bfloat16))
    finally:
        monkeypatch.undo()
    assert books(vm) == start and mem.physical.stats()["chunks"] == 0
    for n in (64, 8, 40):  # the failed key captures now, and others too
        x = torch.randn(n, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(ex(x=x), fwd(x.to(dev)), rtol=2e-2, atol=2e-2)
    ex.close()
    mem.close()
    context_is_healthy(dev)
    assert books(vm) == start
