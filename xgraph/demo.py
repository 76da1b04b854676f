"""`xgraph demo`: capture a small MLP once, replay it with new inputs, check against eager."""

from __future__ import annotations

import time

import torch

import xgraph
from xgraph.testing.suite import _mlp, capture


def run_demo(backend_name: str | None = None, steps: int = 50) -> int:
    backend = xgraph.get_backend(backend_name)
    dev = backend.device
    mlp = _mlp(dev)
    x = torch.randn(16, 32, device=dev)
    graph, pool = backend.new_graph(), backend.new_pool()
    t0 = time.perf_counter()
    y = capture(backend, graph, pool, mlp, x)
    t_capture = time.perf_counter() - t0
    worst = 0.0
    for _ in range(steps):
        x.copy_(torch.randn(16, 32))
        graph.replay()
        backend.synchronize()
        with torch.no_grad():
            worst = max(worst, float((y - mlp(x)).abs().max()))
    print(
        f"backend {backend.name} on {dev}: captured a 3-layer MLP in {t_capture * 1e3:.1f} ms, "
        f"replayed {steps} times with new inputs; max |replay - eager| = {worst:.3g}; "
        f"pool holds {pool.reserved_bytes()} bytes"
    )
    graph.reset()
    pool.close()
    return 0 if worst <= (0.0 if dev.type == "cpu" else 1e-4) else 1
