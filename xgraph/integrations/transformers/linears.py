"""The model's projections through `xgraph.linear`: the backend's kernel where it serves.

A backend may have a faster kernel than the vendor GEMM for some projections (the CUDA
adapter's skinny kernel for decode's few-row calls, where cuBLAS leaves most of the GPU
idle; `xgraph.linear`). transformers' layers call `nn.Linear` on [1, tokens, features].
`swap_linears` turns each `nn.Linear` of the model, except the LM head (which runs outside
the graphs on the rows that sample), into an `XLinear`: the same module object with the
same parameters, whose forward flattens the tokens into rows and calls
`xgraph.linear.linear`. Where the device has no kernel (the CPU backend) the forward is
`F.linear` itself, so the model computes bit for bit what it did. `restore_linears` undoes
the swap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...linear import installed, linear


class XLinear(nn.Linear):
    """nn.Linear through xgraph.linear (the backend's kernel for the rows it serves)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if installed(x.device.type) is None:
            return F.linear(x, self.weight, self.bias)  # exactly nn.Linear's
        y = linear(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def swap_linears(model: Any) -> list[nn.Module]:
    """Make every plain nn.Linear of `model` but its output embeddings an XLinear, in
    place; returns the modules swapped (those already swapped are left alone)."""
    try:
        head = model.get_output_embeddings()
    except Exception:
        head = None
    swapped = []
    for m in model.modules():
        if type(m) is nn.Linear and m is not head:
            m.__class__ = XLinear
            swapped.append(m)
    return swapped


def restore_linears(modules: list[nn.Module]) -> None:
    """Undo swap_linears for these modules."""
    for m in modules:
        if type(m) is XLinear:
            m.__class__ = nn.Linear
