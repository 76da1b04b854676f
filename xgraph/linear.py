"""`linear(x, w)`: y = x @ w.T through the backend's kernel for the calls it serves;
`linear(x, w, fusion)`: the same with the ops around it (`xgraph.fusion`) in one kernel.

A backend may offer a faster kernel for some projections (`Backend.kernels().linear`; the
CUDA adapter's serves decode's few-row calls, where cuBLAS leaves most of the GPU idle).
The core installs it when the backend is activated (`Backend.activate`, which calls
`install`); the reference model calls `linear` for every projection of its layers. A
kernel answers None for calls it does not serve, and F.linear runs those; devices without a
kernel run F.linear directly (the CPU reference stays bit for bit what it was).

A backend may also fuse a projection with its prologue and epilogue (`Kernels.fused_linear`:
the RMSNorm or SiLU-mul before it, the residual add or the per-head QK-norm and rotary after
it). It answers None for calls it does not serve; those run `fusion.reference`, the unfused
ops around `linear` (so the plain kernel still serves the projection itself).

Compiled code reaches the kernels through the custom ops `xgraph::linear` and
`xgraph::fused_linear` (`xgraph.opdef`), opaque to the compiler like an extern GEMM, so the
choice is made per call at run time (and recorded by a graph captured around it). Where no
fused kernel is installed, compiled code traces the reference ops instead (the compiler
fuses them itself). Under autograd with inputs that need gradients, F.linear and the
reference run: the kernels are forward-only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .errors import IncompleteBackendError
from .fusion import Fusion, HeadNorm, output_dtype, reference
from .opdef import define, refuse_grad

LinearKernel = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
FusedLinearKernel = Callable[[torch.Tensor, torch.Tensor, Fusion], "torch.Tensor | None"]

_kernels: dict[str, LinearKernel] = {}  # by torch device type
_fused: dict[str, FusedLinearKernel] = {}


def _check(backend: str, duty: str, kernel: object, signature: str) -> None:
    if kernel is not None and not callable(kernel):
        raise IncompleteBackendError(
            f"Backend {backend!r}: kernels().{duty} is {kernel!r}, which is not callable. "
            f"Return a function {signature} -> tensor or None, or None for no kernel."
        )


def install(
    device_type: str,
    kernel: LinearKernel | None,
    backend: str,
    fused: FusedLinearKernel | None = None,
) -> None:
    """Use `kernel` for `linear` and `fused` for fused projections on `device_type` from now
    on (None: F.linear, and the reference ops around `linear`)."""
    _check(backend, "linear", kernel, "(x, weight)")
    _check(backend, "fused_linear", fused, "(x, weight, fusion)")
    for table, k in ((_kernels, kernel), (_fused, fused)):
        if k is None:
            table.pop(device_type, None)
        else:
            table[device_type] = k  # type: ignore[assignment]


def installed(device_type: str) -> LinearKernel | None:
    """The kernel `linear` uses on `device_type`, if any."""
    return _kernels.get(device_type)


def installed_fused(device_type: str) -> FusedLinearKernel | None:
    """The fused kernel `linear(x, w, fusion)` uses on `device_type`, if any."""
    return _fused.get(device_type)


@contextmanager
def kernels_off(device_type: str) -> Iterator[None]:
    """Run the block with no kernel installed on `device_type` (F.linear and the reference
    ops: what torch alone runs, for anchors measured against xgraph's kernels)."""
    saved = _kernels.pop(device_type, None), _fused.pop(device_type, None)
    try:
        yield
    finally:
        for table, k in zip((_kernels, _fused), saved):
            if k is not None:
                table[device_type] = k  # type: ignore[assignment]


def stream_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a model keeps its residual stream in, x being its first value: float32 for
    a 16-bit x on a device with a fused kernel (its residual epilogue adds in float32 and
    stores the sum unrounded, its norm prologue reads it so: `xgraph.fusion`), else x's own
    (the unfused model's rounding, bit for bit)."""
    if x.dtype in (torch.float16, torch.bfloat16) and x.device.type in _fused:
        return torch.float32
    return x.dtype


def _answer(kernel: LinearKernel | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's answer, or F.linear where there is no kernel or it declines."""
    y = kernel(x, weight) if kernel is not None else None
    return F.linear(x, weight) if y is None else y


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`xgraph::linear`: the projection as compiled code sees it, one opaque op."""
    refuse_grad("linear", x, weight)
    return _answer(_kernels.get(x.device.type), x, weight)


def _linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear_op = define("linear", _linear_kernel, _linear_fake)


def _plain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias), by the installed kernel of x's device where it serves."""
    kernel = _kernels.get(x.device.type)
    if kernel is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return linear_op(x, weight)
    return _answer(kernel, x, weight)  # eager: no op dispatch on the host path


def _fused_answer(x: torch.Tensor, weight: torch.Tensor, f: Fusion) -> torch.Tensor:
    kernel = _fused.get(x.device.type)
    y = kernel(x, weight, f) if kernel is not None else None
    return reference(x, weight, f, _plain) if y is None else y


def _fusion(
    norm: torch.Tensor | None,
    eps: float,
    gated: bool,
    residual: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    head_eps: float,
    cos_sin: torch.Tensor | None,
    heads: int,
    kv_heads: int,
) -> Fusion:
    """The Fusion the custom op's flat arguments spell."""
    head = None
    if q_weight is not None and k_weight is not None and cos_sin is not None:
        head = HeadNorm(q_weight, k_weight, head_eps, cos_sin, heads, kv_heads)
    return Fusion(norm, eps, gated, residual, head)


def _fused_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    gated: bool,
    residual: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    head_eps: float,
    cos_sin: torch.Tensor | None,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """`xgraph::fused_linear`: a fused projection as compiled code sees it, one opaque op."""
    refuse_grad("fused_linear", x, weight, norm, residual, q_weight, k_weight)
    f = _fusion(norm, eps, gated, residual, q_weight, k_weight, head_eps, cos_sin, heads, kv_heads)
    return _fused_answer(x, weight, f)


def _fused_fake(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
    dtype = output_dtype(weight, _fusion(*args))  # type: ignore[arg-type]
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=dtype)


fused_linear_op = define("fused_linear", _fused_kernel, _fused_fake)


def _op_args(f: Fusion) -> tuple:
    h = f.heads
    if h is None:
        return (f.norm, f.eps, f.gated, f.residual, None, None, 0.0, None, 0, 0)
    head = (h.q_weight, h.k_weight, h.eps, h.cos_sin, h.heads, h.kv_heads)
    return (f.norm, f.eps, f.gated, f.residual, *head)


def _needs_grad(x: torch.Tensor, weight: torch.Tensor, f: Fusion) -> bool:
    if not torch.is_grad_enabled():
        return False
    extra = (f.norm, f.residual, *((f.heads.q_weight, f.heads.k_weight) if f.heads else ()))
    return any(t is not None and t.requires_grad for t in (x, weight, *extra))


def linear(x: torch.Tensor, weight: torch.Tensor, fusion: Fusion | None = None) -> torch.Tensor:
    """x @ weight.T (no bias), by the installed kernel of x's device where it serves; with
    `fusion` (x 2-d), its prologue and epilogue too, by the fused kernel where one serves."""
    if fusion is None or fusion.empty:
        return _plain(x, weight)
    kernel = _fused.get(x.device.type)
    if kernel is None or _needs_grad(x, weight, fusion):
        return reference(x, weight, fusion, _plain)
    if torch.compiler.is_compiling():
        return fused_linear_op(x, weight, *_op_args(fusion))
    return _fused_answer(x, weight, fusion)
