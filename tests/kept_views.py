"""An executor whose forward keeps views of its persistent input buffer, shared by the tests
of buffers that outlive close() (`from kept_views import executor_with_views`; pytest's
default rootdir import mode puts tests/ on the path). Not a test module."""

from __future__ import annotations

import torch

from xgraph import GraphExecutor, Input


def executor_with_views(backend):  # type: ignore[no-untyped-def]
    """An executor over `backend` whose forward keeps views of its persistent input buffer,
    after one step; and the list holding those views."""
    kept: list[torch.Tensor] = []
    ex = GraphExecutor(
        lambda x: kept.append(x) or x * 2,
        inputs=[Input("x", torch.float32, ("num_tokens", 4))],
        backend=backend,
        buckets=[16],
    )
    ex(x=torch.randn(3, 4))
    return ex, kept
