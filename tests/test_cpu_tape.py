"""The CPU tape under the grad modes engines run in: no_grad and inference_mode.

Under inference mode the dispatcher hands the tape composite ops undecomposed (`aten::to`,
`contiguous`, `reshape`, ...) whose schemas say the result may alias an input while the
kernel returns a fresh tensor. Each case here captures a function that makes such a result,
mutates it in place and mixes it with its input, then replays over new input values: the
output and the input (which a real view writes through) must equal eager's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import xgraph
from xgraph.testing import capture

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}

# ops whose schema allows aliasing (or returns `self` when nothing changes) and whose
# kernel may return a fresh tensor; some inputs make a copy, others a real view
OPS = {
    "to_copy": lambda x: x.to(torch.float32, copy=True),
    "float": lambda x: x.float(),
    "to_dtype": lambda x: x.to(torch.float32),
    "double": lambda x: x.double(),
    "to_device_dtype": lambda x: x.to("cpu", torch.float64),
    "to_other": lambda x: x.to(torch.ones(1, dtype=torch.float32)),
    "to_same": lambda x: x.to(x.dtype),
    "contiguous_t": lambda x: x.t().contiguous(),
    "contiguous": lambda x: x.contiguous(),
    "reshape_t": lambda x: x.t().reshape(-1),
    "reshape": lambda x: x.reshape(-1),
    "reshape_as_t": lambda x: x.t().reshape_as(x),
    "flatten_t": lambda x: x.t().flatten(),
    "ravel_t": lambda x: x.t().ravel(),
    "type_as_f32": lambda x: x.type_as(torch.ones(1)),
    "type_as_self": lambda x: x.type_as(x),
    "view_as_real": lambda x: torch.view_as_real(torch.complex(x.float(), -x.float())),
    "channels_last": lambda x: x.view(1, 2, 4, -1).contiguous(memory_format=torch.channels_last),
}


def mixing(op):
    """op's result mutated in place, then read together with the input it came from."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = op(x)
        h.mul_(3)
        h.add_(1)
        return h.sum() + x.float().sum(0)

    return fn


def check(cpu, fn, x, mode, steps=4, seed=0):
    """Capture fn(x) under `mode`, replay over new values of x: bitwise equal to eager."""
    g = torch.Generator().manual_seed(seed)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with mode():
        static = x.clone()
        fn(static.clone())  # warm-up on a copy: fn may write through to its input
        with xgraph.graph(graph, pool):
            y = fn(static)
        for _ in range(steps):
            new = torch.randn(x.shape, generator=g).to(x.dtype)
            static.copy_(new)
            graph.replay()
            eager_x = new.clone()
            expected = fn(eager_x)
            assert torch.equal(y, expected), (y - expected).abs().max()
            assert torch.equal(static, eager_x)  # a view writes through on both sides
    graph.reset()
    pool.close()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_possibly_aliasing_ops_replay_like_eager(cpu, name, dtype, mode):
    check(cpu, mixing(OPS[name]), torch.randn(16, 8).to(dtype), MODES[mode])


class RMSNorm(torch.nn.Module):
    """Upcasts (a real copy even for float32 input), normalizes, scales in place."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32, copy=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h.mul_(self.weight)
        return h.to(x.dtype)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_that_upcasts_then_mutates(cpu, dtype, mode):
    """The engine's case: a norm that upcasts, then in-place ops on its result."""
    norm, proj = RMSNorm(64).to(dtype), torch.nn.Linear(64, 64).to(dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = norm(x).float()
        h.mul_(2.0)
        return proj(h.to(dtype)) + x

    check(cpu, forward, torch.randn(8, 64).to(dtype), MODES[mode], steps=6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "none"])
def test_a_graph_captured_under_inference_mode_replays_in_any_mode(cpu, mode):
    """As a GPU graph does: the replay does not depend on the caller's grad mode."""
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with torch.inference_mode():
        x, w = torch.randn(8, 16), torch.randn(16)
        with xgraph.graph(graph, pool):
            y = (x * w).relu().float()
            y.add_(1)
        x.fill_(2)
    with MODES.get(mode, torch.enable_grad)():
        graph.replay()
    assert torch.equal(y, (2 * w).relu().expand(8, 16) + 1)
    graph.reset()
    pool.close()


class CountingMode(TorchFunctionMode):
    """A TorchFunctionMode, as `torch.set_default_device` installs one, that counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_replay_runs_outside_every_torch_function_mode(cpu):
    """A function mode made each replayed op a Python call (about 3x the replay's cost)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU()).eval()
    x = torch.randn(4, 16)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    y = capture(graph, pool, mlp, x)
    x.copy_(torch.randn(4, 16))
    mode = CountingMode()
    with mode:
        graph.replay()
    assert mode.calls == 0
    with torch.no_grad():
        assert torch.equal(y, mlp(x))
    torch.set_default_device("cpu")  # installs a mode for the rest of the test: restored
    try:
        x.copy_(torch.randn(4, 16))
        graph.replay()
        with torch.no_grad():
            assert torch.equal(y, mlp(x))
    finally:
        torch.set_default_device(None)
    graph.reset()
    pool.close()
