"""The model's projections through `xgraph.linear`: the backend's kernel where it serves.

A backend may have a faster kernel than the vendor GEMM for some projections (the CUDA
adapter's decode projection kernel for 1 to 64 rows, where cuBLAS leaves most of the GPU
idle; `xgraph.linear`). The fused prologues and epilogues of `linear(x, w, fusion)` are not
reached: a transformers layer's norms, rotary and residual adds are its own code.
transformers' layers call `nn.Linear` on [1, tokens, features].
`swap_linears` turns each `nn.Linear` of the model, except the LM head (which runs outside
the graphs on the rows that sample), into an `XLinear`: the same module object with the
same parameters, whose forward flattens the tokens into rows and calls
`xgraph.linear.linear`. Where the device has no kernel (the CPU backend) the forward is
`F.linear` itself, so the model computes bit for bit what it did. `restore_linears` undoes
the swap.

With `merge=True` (where a kernel serves: one launch for three narrow projections is
cheaper than three), sibling projections that read the same input, `q_proj`, `k_proj`,
`v_proj` and `gate_proj`, `up_proj`, share one merged weight (their own weights become
views of it, so nothing is copied twice): the first of them to see an input computes all
of their outputs in one call and each returns its columns. Which input is "the same" is
decided by identity, so a model that feeds them different inputs still gets every output
right (one merged call per distinct input); the merged output is dropped once each
sibling has taken its part, so nothing outlives the forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...linear import installed, linear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] as rows through xgraph.linear: [rows, out]."""
    y = linear(x.reshape(-1, x.shape[-1]), weight)
    return y if bias is None else y + bias


class _Group:
    """Sibling projections over one merged weight; `y` holds the merged output of the
    input `x` until every sibling has taken its columns."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.weight = torch.cat([p.weight.detach() for p in parts])
        biased = parts[0].bias is not None
        self.bias = torch.cat([p.bias.detach() for p in parts]) if biased else None
        self.size = len(parts)
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.taken = 0
        at = 0
        for p in parts:  # the siblings' weights become views of the merged one
            n = p.weight.shape[0]
            p.weight.data = self.weight[at : at + n]
            if biased:
                p.bias.data = self.bias[at : at + n]  # type: ignore[index, union-attr]
            p._xgraph_part = (self, at, at + n)  # type: ignore[assignment]
            at += n


class XLinear(nn.Linear):
    """nn.Linear through xgraph.linear (the backend's kernel for the rows it serves)."""

    _xgraph_part: tuple[_Group, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if installed(x.device.type) is None:
            return F.linear(x, self.weight, self.bias)  # exactly nn.Linear's
        part = self._xgraph_part
        if part is None:
            y = _rows(x, self.weight, self.bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        group, lo, hi = part
        if group.x is not x:  # the first sibling to see this input: all of them at once
            group.x, group.y, group.taken = x, _rows(x, group.weight, group.bias), 0
        assert group.y is not None
        y = group.y[:, lo:hi]
        group.taken += 1
        if group.taken == group.size:  # every sibling has its part: keep nothing
            group.x = group.y = None
        return y.view(*x.shape[:-1], hi - lo)


def _merge(model: Any) -> int:
    """Group the sibling projections of every module that has them; how many groups."""
    groups = 0
    for m in model.modules():
        for names in SIBLINGS:
            parts = [getattr(m, n, None) for n in names]
            if not all(type(p) is XLinear for p in parts):
                continue
            same = {(p.in_features, p.weight.dtype, p.weight.device, p.bias is None) for p in parts}
            if len(same) == 1 and all(p._xgraph_part is None for p in parts):
                _Group(parts)  # type: ignore[arg-type]
                groups += 1
    return groups


def swap_linears(model: Any, merge: bool = False) -> list[nn.Module]:
    """Make every plain nn.Linear of `model` but its output embeddings an XLinear, in
    place (`merge`: siblings over one merged weight); returns the modules swapped (those
    already swapped are left alone)."""
    try:
        head = model.get_output_embeddings()
    except Exception:
        head = None
    swapped = []
    for m in model.modules():
        if type(m) is nn.Linear and m is not head:
            m.__class__ = XLinear
            swapped.append(m)
    if merge:
        _merge(model)
    return swapped


def restore_linears(modules: list[nn.Module]) -> None:
    """Undo swap_linears for these modules."""
    for m in modules:
        if type(m) is XLinear:
            m.__dict__.pop("_xgraph_part", None)  # its weight stays a view: the same values
            m.__class__ = nn.Linear
