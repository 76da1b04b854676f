"""`linear(x, w)`: y = x @ w.T through the backend's kernel for the calls it serves.

A backend may offer a faster kernel for some projections (`Backend.kernels().linear`; the
CUDA adapter's serves decode's few-row calls, where cuBLAS leaves most of the GPU idle).
The core installs it when the backend is activated (`Backend.activate`, which calls
`install`); the reference model calls `linear` for every projection of its layers. A
kernel answers None for calls it does not serve, and F.linear runs those; devices without a
kernel run F.linear directly (the CPU reference stays bit for bit what it was).

Compiled code reaches the kernel through the custom op `xgraph::linear`, opaque to the
compiler like an extern GEMM, so the choice is made per call at run time (and recorded by a
graph captured around it). Under autograd with inputs that need gradients, F.linear runs:
the kernels are forward-only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .errors import IncompleteBackendError

LinearKernel = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]

_kernels: dict[str, LinearKernel] = {}  # by torch device type


def install(device_type: str, kernel: LinearKernel | None, backend: str) -> None:
    """Use `kernel` for `linear` on `device_type` from now on (None: F.linear)."""
    if kernel is None:
        _kernels.pop(device_type, None)
        return
    if not callable(kernel):
        raise IncompleteBackendError(
            f"Backend {backend!r}: kernels().linear is {kernel!r}, which is not "
            "callable. Return a function (x, weight) -> tensor or None, or None for no kernel."
        )
    _kernels[device_type] = kernel


def installed(device_type: str) -> LinearKernel | None:
    """The kernel `linear` uses on `device_type`, if any."""
    return _kernels.get(device_type)


def _answer(kernel: LinearKernel | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's answer, or F.linear where there is no kernel or it declines."""
    y = kernel(x, weight) if kernel is not None else None
    return F.linear(x, weight) if y is None else y


@torch.library.custom_op("xgraph::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`xgraph::linear`: the projection as compiled code sees it, one opaque op."""
    return _answer(_kernels.get(x.device.type), x, weight)


@linear_op.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias), by the installed kernel of x's device where it serves."""
    kernel = _kernels.get(x.device.type)
    if kernel is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return linear_op(x, weight)
    return _answer(kernel, x, weight)  # eager: no op dispatch on the host path
