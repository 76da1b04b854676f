"""Which device check of device metadata the CUDA adapter gives the core, chosen by environment.

XGRAPH_CUDA_CHECK (`Kernels.metadata_check`, `xgraph.device_check`):
- `torch` (default): the core's torch ops (some thirty kernels in the check's graph);
- `triton`: the one-launch kernel (kernels/check.py), failing loudly where Triton is
  missing. Opt-in: it equals the torch ops bit for bit in Triton's interpreter
  (tests/test_check_kernel.py) but has not run on a GPU yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from xgraph.adapter import XGraphError

from .linear import _has_triton

CHECK_ENV = "XGRAPH_CUDA_CHECK"
CHOICES = ("torch", "triton")


def metadata_check() -> Callable[..., Any] | None:
    """The device check XGRAPH_CUDA_CHECK picks, or None (the core's torch ops)."""
    asked = os.environ.get(CHECK_ENV, "torch").strip().lower() or "torch"
    if asked not in CHOICES:
        raise XGraphError(f"{CHECK_ENV}={asked!r}; use one of {', '.join(CHOICES)}.")
    if asked == "torch" or not _has_triton(asked, CHECK_ENV):
        return None
    from .kernels.check import metadata_check as kernel

    return kernel
