"""The CUDA adapter's kernel for `xgraph.linear`: the skinny Triton kernel for decode's
few-row projections (`kernels.skinny`), when Triton imports.

XGRAPH_CUDA_LINEAR=torch turns it off (F.linear, cuBLAS, for every call); `triton` insists
on it and fails loudly where Triton is missing; `auto` (the default) uses it if Triton
imports.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from xgraph.adapter import XGraphError

LINEAR_ENV = "XGRAPH_CUDA_LINEAR"
CHOICES = ("auto", "triton", "torch")


def linear_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
    """The skinny kernel's entry point, or None (XGRAPH_CUDA_LINEAR=torch, or no Triton)."""
    asked = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if asked not in CHOICES:
        raise XGraphError(
            f"{LINEAR_ENV}={asked!r}; use one of {', '.join(CHOICES)} (auto: the Triton "
            "skinny kernel for decode projections when triton imports, else cuBLAS)."
        )
    if asked == "torch":
        return None
    if importlib.util.find_spec("triton") is None:
        if asked == "triton":
            raise XGraphError(
                f"{LINEAR_ENV}=triton but triton is not installed. Install the CUDA build of "
                "torch (it brings triton) or `pip install xgraph-cuda[triton]`."
            )
        return None
    from .kernels.skinny import linear

    return linear
