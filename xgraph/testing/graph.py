"""Conformance of Graph: capture, replay, reset, host-read detection."""

from __future__ import annotations

import os

import pytest
import torch

from xgraph.errors import CaptureError
from xgraph.interfaces import Backend

from .base import BackendTests, capture, line_of, small_mlp, tiny_workload


class GraphTests(BackendTests):
    """Graph: capture records, replay follows new input values on the same addresses."""

    def test_replay_follows_new_inputs(self, backend: Backend) -> None:
        dev = backend.device
        mlp = small_mlp(dev)
        x = torch.randn(16, 32, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(graph, pool, mlp, x)
        address = y.data_ptr()
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            x.copy_(torch.randn(16, 32, generator=gen, device="cpu"))
            graph.replay()
            backend.synchronize()
            with torch.no_grad():
                self.assert_matches(backend, y, mlp(x))
        assert y.data_ptr() == address
        graph.reset()
        pool.close()

    def test_python_control_flow_is_frozen_at_capture(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.ones(8, device=dev)
        state = {"double": True}

        def fn(t: torch.Tensor) -> torch.Tensor:
            return t * 2 if state["double"] else t * 3

        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(graph, pool, fn, x)
        state["double"] = False
        x.fill_(5)
        graph.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 10.0))
        graph.reset()
        pool.close()

    def test_reset_then_capture_again(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.arange(8, dtype=torch.float32, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        capture(graph, pool, lambda t: t + 1, x)
        graph.reset()
        y = capture(graph, pool, lambda t: t * 10, x)
        x.fill_(2)
        graph.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 20.0))
        graph.reset()
        pool.close()

    def test_two_graphs_on_one_pool_in_order(self, backend: Backend) -> None:
        """Pieces of one forward: the second graph reads what the first wrote into the pool."""
        dev = backend.device
        x = torch.randn(64, device=dev)
        pool = backend.new_pool()
        g1, g2 = backend.new_graph(), backend.new_graph()
        with torch.no_grad():
            a = x.exp()  # warm-up of both pieces
            (a * 2).sum(0, keepdim=True)
            backend.synchronize()
            g1.capture_begin(pool)
            a = x.exp()
            g1.capture_end()
            g2.capture_begin(pool)
            b = (a * 2).sum(0, keepdim=True)
            g2.capture_end()
        for _ in range(5):
            x.copy_(torch.randn(64))
            g1.replay()
            g2.replay()
            backend.synchronize()
            self.assert_matches(backend, b, (x.exp() * 2).sum(0, keepdim=True))
        g1.reset()
        g2.reset()
        del a, b
        pool.close()

    @pytest.mark.parametrize("op", ["item", "tolist", "nonzero"])
    def test_host_read_raises_capture_error(self, backend: Backend, op: str) -> None:
        dev = backend.device
        x = torch.randn(8, device=dev)

        def forward(t: torch.Tensor) -> torch.Tensor:
            if op == "item":
                s = t.sum().item()  # host read: the line the error must name
            elif op == "tolist":
                s = t.tolist()[0]  # host read: the line the error must name
            else:
                s = t.nonzero().shape[0]  # host read: the line the error must name
            return t * s

        graph, pool = backend.new_graph(), backend.new_pool()
        with pytest.raises(CaptureError) as info:
            capture(graph, pool, forward, x)
        needle = {"item": "t.sum().item()", "tolist": "t.tolist()", "nonzero": "t.nonzero()"}[op]
        line = line_of(forward, needle)
        msg = str(info.value)
        assert f"{os.path.basename(__file__)}:{line}" in msg, msg
        assert {"item": "_local_scalar_dense", "tolist": "tolist", "nonzero": "nonzero"}[op] in msg
        assert not graph.capturing
        # the backend stays usable: a clean capture on a fresh graph works
        g2 = backend.new_graph()
        y = capture(g2, pool, lambda t: t + 1, x)
        x.fill_(1)
        g2.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        assert x.tolist() == [1.0] * 8  # host conversions work again outside capture
        g2.reset()
        pool.close()

    def test_pool_reports_and_closes(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.randn(256, 256, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        capture(graph, pool, lambda t: (t @ t).relu(), x)
        assert pool.reserved_bytes() >= 256 * 256 * 4
        graph.reset()
        pool.close()

    def test_host_reads_in_full_graphs_meet_the_guard_or_the_runtime(
        self, backend: Backend
    ) -> None:
        """`capture_refuses_host_reads`: the executor leaves the per-op guard out of full
        graphs on the runtime's word, so where it is claimed the runtime must fail such a
        capture itself; where it is not, the executor records full graphs under the guard."""
        if not backend.capture_refuses_host_reads:
            assert all(_guards_seen(backend))
            return
        for op in ("item", "nonzero"):
            _refused_by_the_runtime(backend, op)


def _guards_seen(backend: Backend) -> list[bool]:
    """For each full graph an executor records: whether the capture guard was on."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from xgraph.graphs import _CaptureGuard, capturing_graph

    w = tiny_workload(backend, max_blocks=2, max_seqs=4)
    seen: list[bool] = []

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if capturing_graph() is not None:
            stack = _get_current_dispatch_mode_stack()
            seen.append(any(isinstance(m, _CaptureGuard) for m in stack))
        return w.model.forward_logits(input_ids, positions)

    ex = w.executor(forward, backend=backend, buckets=[2, 4])
    ex.capture(progress=False)
    ex.close()
    assert len(seen) == 2
    return seen


def _refused_by_the_runtime(backend: Backend, op: str) -> None:
    x = torch.randn(8, device=backend.device)
    graph, pool = backend.new_graph(), backend.new_pool()
    with torch.no_grad():
        _ = x.sum().item(), x.nonzero()  # warm: kernels load outside the capture
        backend.synchronize()
        graph.capture_begin(pool, check_ops=False)
        with pytest.raises(Exception) as info:
            _ = x.sum().item() if op == "item" else x.nonzero()
            graph.capture_end()
        assert not isinstance(info.value, CaptureError), op  # the runtime's, not the guard's
        graph.abort()
    assert not graph.capturing
    pool = pool if not pool.poisoned else backend.new_pool()
    g2 = backend.new_graph()
    y = capture(g2, pool, lambda t: t * 2, x)  # the backend still captures and replays
    x.fill_(1)
    g2.replay()
    backend.synchronize()
    assert torch.equal(y.cpu(), torch.full((8,), 2.0))
    g2.reset()
    pool.close()
