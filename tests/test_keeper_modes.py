"""The capture pools' keeper graph under the grad modes engines use.

Every new capture pool of a torch-style backend captures a one-op keeper graph over one
scratch tensor its runtime keeps (xgraph.device.pool). Made under `torch.inference_mode()`
the scratch was an inference tensor, and every later pool made outside inference mode
failed its keeper capture ("Inplace update to inference tensor outside InferenceMode"), so
each new key of every executor ran eagerly from then on.
"""

from __future__ import annotations

import torch
from xgraph_dummy.backend import DummyBackend

import xgraph
from xgraph.testing.sim import SimRuntime


def test_a_pool_made_under_inference_mode_does_not_break_later_pools():
    backend = DummyBackend(SimRuntime())  # a fresh runtime: its keeper scratch not made yet
    with torch.inference_mode():
        first = backend.new_pool()
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            pool, graph = backend.new_pool(), backend.new_graph()
            x = torch.ones(4)
            with xgraph.graph(graph, pool):
                y = x * 3
            x.fill_(2)
            graph.replay()
            backend.synchronize()
            assert torch.equal(y, torch.full((4,), 6.0))
            graph.reset()
            pool.close()
    first.close()
    assert backend.runtime.violations == []
