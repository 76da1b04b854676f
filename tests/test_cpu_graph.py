"""The CPU recorded-op graph: bitwise replay, capture safety, pool reuse inside a capture."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import xgraph
from xgraph.testing import capture


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.SiLU(),
        torch.nn.Linear(256, 64),
    ).eval()


@pytest.fixture(scope="module")
def captured():
    cpu = xgraph.get_backend("cpu")
    mlp = make_mlp()
    x = torch.zeros(24, 64)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    y = capture(graph, pool, mlp, x)
    yield mlp, x, y, graph
    graph.reset()
    pool.close()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_replay_equals_eager_bit_for_bit(captured, seed, scale):
    mlp, x, y, graph = captured
    g = torch.Generator().manual_seed(seed)
    x.copy_(torch.randn(x.shape, generator=g) * scale)
    address = y.data_ptr()
    graph.replay()
    with torch.no_grad():
        expected = mlp(x)
    assert y.data_ptr() == address
    assert torch.equal(y, expected)


def bad_forward(mlp, x):
    h = mlp(x)
    top = h.abs().max().item()  # host read inside the forward
    return h / top


def test_item_raises_naming_op_and_line_and_leaves_backend_usable(cpu):
    mlp = make_mlp()
    x = torch.randn(4, 64)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with pytest.raises(xgraph.CaptureError) as info:
        capture(graph, pool, bad_forward, mlp, x)
    msg = str(info.value)
    assert "aten._local_scalar_dense" in msg and "item()" in msg
    assert "test_cpu_graph.py:" in msg and "top = h.abs().max().item()" in msg
    assert not graph.capturing
    assert x.tolist()  # host conversions are restored after the failed capture
    # the same graph object and pool capture a safe forward afterwards
    y = capture(graph, pool, mlp, x)
    x.normal_()
    graph.replay()
    with torch.no_grad():
        assert torch.equal(y, mlp(x))
    graph.reset()
    pool.close()


def test_intermediates_live_in_the_pool_and_freed_blocks_are_reused(cpu):
    pool = cpu.new_pool()
    graph = cpu.new_graph()
    x = torch.randn(128, 1024)  # 512 KiB per activation

    def chain(t):
        for _ in range(16):
            t = (t * 1.0001).tanh()  # each step frees the previous activation
        return t

    capture(graph, pool, chain, x)
    # 32 activations of 512 KiB were produced; reuse keeps the pool near a few of them
    assert pool.reserved_bytes() <= 4 * 512 * 1024, pool.reserved_bytes()
    graph.replay()
    graph.reset()
    pool.close()


def test_replay_after_pool_close_is_refused(cpu):
    pool = cpu.new_pool()
    graph = cpu.new_graph()
    capture(graph, pool, lambda t: t * 2, torch.ones(4))
    pool.close()
    with pytest.raises(xgraph.PoolClosedError):
        graph.replay()


@pytest.mark.parametrize(
    "fn, needle",
    [
        (lambda t: t[t > 0].sum(), "boolean mask"),
        (lambda t: t.masked_fill(t > 0, 0).index_put_((t > 1,), torch.tensor(0.0)), "boolean mask"),
        (lambda t: t.repeat_interleave(torch.tensor([1, 2, 1, 2, 1, 2, 1, 2])), "no output_size"),
        (lambda t: t.unique(), "torch.unique"),
        (lambda t: t * bool(t[0] > 0), "bool(t)"),
    ],
)
def test_data_dependent_sizes_and_host_reads_are_refused(cpu, fn, needle):
    graph, pool = cpu.new_graph(), cpu.new_pool()
    with pytest.raises(xgraph.CaptureError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        capture(graph, pool, fn, torch.randn(8))
    pool.close()


def test_fixed_size_alternatives_capture_fine(cpu):
    """What the model adaptation guide recommends instead: masks and where, fixed sizes."""
    x = torch.randn(8)
    graph, pool = cpu.new_graph(), cpu.new_pool()
    y = capture(graph, pool, lambda t: torch.where(t > 0, t, 0).sum(), x)
    x.copy_(torch.randn(8))
    graph.replay()
    assert torch.equal(y, torch.where(x > 0, x, 0).sum())
    pool.close()
