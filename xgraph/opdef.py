"""xgraph's custom ops (`xgraph::linear`, `xgraph::fused_linear`, `xgraph::attention`),
defined on the dispatcher directly: one Python kernel for every device, a fake kernel for
the compiler.

Compiled forwards call these ops about 140 times a step (four projections and attention
per layer), and a process's start-up runs a few hundred such forwards eagerly (warm-ups,
the memory plan's captures, the captures). `torch.library.custom_op` answers each call
through three Python layers (autograd, version bumps of mutated inputs, the kernel
itself); on an H100 host a fused projection's op cost 22-34 us over its Python answer that
way, 13.5 us as defined here (`experiments/op_dispatch.py`). The ops need none of those
layers: they are forward-only (`refuse_grad`), and the caches `xgraph::attention` writes
are never saved for a backward. The kernel keeps Dynamo out of its frames, as custom_op's
does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import XGraphError

NAMESPACE = "xgraph"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(
    name: str,
    kernel: Callable[..., Any],
    fake: Callable[..., Any],
    mutates: tuple[str, ...] = (),
) -> Any:
    """Define `xgraph::name` with `kernel`'s signature (annotated) for every device and
    `fake` for the compiler; the op's default overload, to call."""
    schema = torch.library.infer_schema(kernel, mutates_args=mutates)
    _LIB.define(name + schema)
    _LIB.impl(name, torch._disable_dynamo(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def refuse_grad(op: str, *tensors: torch.Tensor | None) -> None:
    """An op called where a gradient is wanted: an error, not a result with no backward."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise XGraphError(
            f"xgraph::{op} has no backward: it was called on tensors that require grad. Run "
            "the forward under torch.inference_mode() or torch.no_grad()."
        )
