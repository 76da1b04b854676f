"""Which device check of device metadata the CUDA adapter gives the core, chosen by environment.

XGRAPH_CUDA_CHECK (`Kernels.metadata_check`, `xgraph.device_check`):
- `auto` (default): the one-launch kernel where triton imports, else the core's torch ops;
- `triton`: the one-launch kernel (kernels/check.py), failing loudly where Triton is
  missing. It equals the torch ops bit for bit (tests/test_check_kernel.py, on a GPU and in
  Triton's interpreter) and takes 120-190 us of device time off a checked step on an H100
  (docs/benchmarks.md, "Pipeline");
- `torch`: the core's torch ops (some thirty kernels in the check's graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .linear import _asked, _has_triton

CHECK_ENV = "XGRAPH_CUDA_CHECK"
CHOICES = ("auto", "torch", "triton")


def metadata_check() -> Callable[..., Any] | None:
    """The device check XGRAPH_CUDA_CHECK picks, or None (the core's torch ops)."""
    asked = _asked(CHECK_ENV, CHOICES, "auto: the one-launch kernel when triton imports")
    if asked == "torch" or not _has_triton(asked, CHECK_ENV):
        return None
    from .kernels.check import metadata_check as kernel

    return kernel
