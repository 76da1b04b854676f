"""Which device check of device metadata the CUDA adapter gives the core, chosen by environment.

XGRAPH_CUDA_CHECK (`Kernels.metadata_check`, `xgraph.device_check`):
- `auto` (default): the one-launch kernel (kernels/check.py) where triton imports, else
  the core's torch ops;
- `triton`: the kernel, failing loudly where Triton is missing;
- `torch`: the core's torch ops (some thirty kernels in the check's graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .linear import _asked, _has_triton

CHECK_ENV = "XGRAPH_CUDA_CHECK"
CHOICES = ("auto", "triton", "torch")


def metadata_check() -> Callable[..., Any] | None:
    """The device check XGRAPH_CUDA_CHECK picks, or None (the core's torch ops)."""
    asked = _asked(CHECK_ENV, CHOICES, "auto: the kernel where triton imports")
    if asked == "torch" or not _has_triton(asked, CHECK_ENV):
        return None
    from .kernels.check import metadata_check as kernel

    return kernel
