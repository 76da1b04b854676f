"""Which projection kernels the CUDA adapter gives `xgraph.linear`, chosen by environment.

XGRAPH_CUDA_LINEAR (the plain projection, `Kernels.linear`):
- `auto` (default): the decode projection kernels (`projection.plain`: Triton
  kernels/gemv.py up to XGRAPH_CUDA_CUBLAS_ROWS rows, cuBLAS from there) on GPUs of
  compute capability 9.0 and up, where they were measured (docs/kernels.md), the skinny
  kernel below that, cuBLAS without triton;
- `triton`: the decode projection kernels on any GPU, failing loudly where Triton is
  missing;
- `skinny`: the earlier skinny kernel (kernels/skinny.py: one row, or up to four into
  narrow outputs), the default before 2026-12-06;
- `torch`: F.linear (cuBLAS) for every call.

XGRAPH_CUDA_CUBLAS_ROWS (the decode kernels' rows, `rows.cublas_rows`): calls of this many
rows or more run their product on cuBLAS, the ops fused around it as kernels of their own.

XGRAPH_CUDA_FUSED (`Kernels.fused_linear`: RMSNorm / SiLU-mul prologues, residual and
per-head norm + rotary epilogues in the projection's kernel):
- `auto` (default): on when the plain kernel is the decode projection kernel;
- `on`: on wherever triton imports (with any plain choice);
- `off`: the fusion's reference ops around the plain projection.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from xgraph.adapter import XGraphError

from .rows import cublas_rows

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


MEASURED_MAJOR = 9  # compute capability where the decode kernels were measured (Hopper)


def _plain_choice(device: torch.device | None) -> tuple[str, bool]:
    """(XGRAPH_CUDA_LINEAR's choice for `device`, whether it was named). `auto` resolves to
    the decode kernels (`triton`) where they were measured, compute capability 9.0 and up
    (or no GPU named: Triton's interpreter), else to the earlier default, `skinny`."""
    asked = _asked(LINEAR_ENV, CHOICES, "auto: the decode kernels when triton imports")
    if asked != "auto":
        return asked, True
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return "triton", False
    major = torch.cuda.get_device_capability(device)[0]
    return ("triton" if major >= MEASURED_MAJOR else "skinny"), False


def _check_switches() -> None:
    """A bad XGRAPH_CUDA_CUBLAS_ROWS or XGRAPH_CUDA_PRELOAD fails here, when the decode
    kernels are chosen, not at a forward's first projection."""
    from .kernels import prefetch

    cublas_rows()
    prefetch.preload()


def linear_kernel(device: torch.device | None = None) -> Callable[..., Any] | None:
    """The plain projection kernel XGRAPH_CUDA_LINEAR picks for `device`, or None
    (cuBLAS)."""
    choice, named = _plain_choice(device)
    if choice == "torch" or not _has_triton(choice if named else "auto", LINEAR_ENV):
        return None
    if choice == "skinny":
        from .kernels.skinny import linear

        return linear
    _check_switches()
    from .projection import plain

    return plain


def fused_kernel(device: torch.device | None = None) -> Callable[..., Any] | None:
    """The fused projection kernel XGRAPH_CUDA_FUSED picks for `device`, or None (the
    reference ops)."""
    asked = _asked(FUSED_ENV, FUSED_CHOICES, "auto: on with the decode projection kernel")
    if asked == "off":
        return None
    if asked == "auto" and _plain_choice(device)[0] != "triton":
        return None
    if not _has_triton(asked, FUSED_ENV):
        return None
    _check_switches()
    from .projection import fused

    return fused
