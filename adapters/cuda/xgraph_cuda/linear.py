"""Which projection kernels the CUDA adapter gives `xgraph.linear`, chosen by environment.

XGRAPH_CUDA_LINEAR (the plain projection, `Kernels.linear`):
- `auto` (default): the decode projection kernels (`projection.plain`: Triton
  kernels/gemv.py up to XGRAPH_CUDA_CUBLAS_ROWS rows, cuBLAS from there) when triton
  imports, else cuBLAS. With the float32 residual stream they pass the fidelity gate, and
  with cuBLAS past 32 rows no measured batch is slower than reduce-overhead's
  (docs/kernels.md, "Rows for cuBLAS");
- `triton`: the same, failing loudly where Triton is missing;
- `skinny`: the earlier skinny kernel (kernels/skinny.py: one row, or up to four into
  narrow outputs), the default before 2026-12-06;
- `torch`: F.linear (cuBLAS) for every call.

XGRAPH_CUDA_CUBLAS_ROWS (the decode kernels' rows, `rows.cublas_rows`): calls of this many
rows or more run their product on cuBLAS, the ops fused around it as kernels of their own.

XGRAPH_CUDA_FUSED (`Kernels.fused_linear`: RMSNorm / SiLU-mul prologues, residual and
per-head norm + rotary epilogues in the projection's kernel):
- `auto` (default): on when the plain kernel is the decode projection kernel (`auto`,
  `triton`);
- `on`: on wherever triton imports (with any plain choice);
- `off`: the fusion's reference ops around the plain projection.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from xgraph.adapter import XGraphError

LINEAR_ENV = "XGRAPH_CUDA_LINEAR"
FUSED_ENV = "XGRAPH_CUDA_FUSED"
CHOICES = ("auto", "triton", "skinny", "torch")
FUSED_CHOICES = ("auto", "on", "off")


def _asked(env: str, choices: tuple[str, ...], what: str) -> str:
    asked = os.environ.get(env, "auto").strip().lower() or "auto"
    if asked not in choices:
        raise XGraphError(f"{env}={asked!r}; use one of {', '.join(choices)} ({what}).")
    return asked


def _has_triton(asked: str, env: str) -> bool:
    if importlib.util.find_spec("triton") is not None:
        return True
    if asked in ("triton", "skinny", "on"):
        raise XGraphError(
            f"{env}={asked} but triton is not installed. Install the CUDA build of torch (it "
            "brings triton) or `pip install xgraph-cuda[triton]`."
        )
    return False


def linear_kernel() -> Callable[..., Any] | None:
    """The plain projection kernel XGRAPH_CUDA_LINEAR picks, or None (cuBLAS)."""
    asked = _asked(LINEAR_ENV, CHOICES, "auto: the decode kernels when triton imports")
    if asked == "torch" or not _has_triton(asked, LINEAR_ENV):
        return None
    if asked == "skinny":
        from .kernels.skinny import linear

        return linear
    from .projection import plain

    return plain


def fused_kernel() -> Callable[..., Any] | None:
    """The fused projection kernel XGRAPH_CUDA_FUSED picks, or None (the reference ops)."""
    asked = _asked(FUSED_ENV, FUSED_CHOICES, "auto: on with the decode projection kernel")
    if asked == "off":
        return None
    if asked == "auto":
        plain = _asked(LINEAR_ENV, CHOICES, "")
        if plain not in ("auto", "triton"):
            return None
    if not _has_triton(asked, FUSED_ENV):
        return None
    from .projection import fused

    return fused
