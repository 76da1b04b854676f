"""The simulated ACL runtime: libascendcl and torch_npu stand-ins on the host.

Used by the `ascend-sim` backend (never chosen by priority) and the adapter's tests. It
enforces the documented rules of the calls the adapter makes and keeps books, so the
adapter's code paths, failure handling and teardown run in CI without an NPU. What it cannot
show (the real driver's behaviour, HBM aliasing, numerics) is listed in docs/ascend.md.
"""

from __future__ import annotations

import platform

import torch

from xgraph.adapter import Availability

from .runtime import SimRuntime

__all__ = ["SimRuntime", "availability"]


def availability() -> Availability:
    """Always available: the simulator needs only the host (memfd_create, Linux)."""
    import os

    if not hasattr(os, "memfd_create"):
        return Availability(False, "the simulated ACL runtime needs memfd_create (Linux)")
    return Availability(
        True,
        "simulated ACL runtime on the host (no NPU): libascendcl stand-in over memfd VMM, "
        "torch_npu stand-in over recorded-op graphs",
        {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "fused decode": "yes",  # the simulated op and its max-workspace query
        },
    )
