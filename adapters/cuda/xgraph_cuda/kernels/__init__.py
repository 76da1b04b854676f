"""Triton kernels of the CUDA adapter, one idea per module.

Attention: `store` writes a step's k/v rows into the paged caches, `decode` attends one
query token per sequence (graph-safe), `prefill` attends variable-length query tiles
planned by `tiles`. Projections: `gemv` (decode's few-row products with the ops around them
fused), `qkv` (the merged qkv projection with its per-head norm and rotary), over `operand`,
`fixup` (split reductions finished by the last program, counts in `arena`) and `tuning`;
`around` runs the fused ops as kernels of their own around cuBLAS for the rows past them;
`skinny` is the earlier few-row kernel.
Importing this package loads no Triton; the kernel modules do, so only code that has checked
for Triton imports them. Under TRITON_INTERPRET=1 the kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

_TRUE = ("1", "true", "on", "yes")


_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device (a small fixed number in the interpreter)."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints: `triton.cdiv` is a constexpr function whose call costs
    microseconds of wrapping at every launch that sizes a grid with it."""
    return -(-a // b)


def launcher(kernel: Any, grid: tuple[int, ...], compile_only: bool = False) -> Any:
    """`kernel` over `grid`, called as a launch; or (`compile_only`) compiled for the same
    arguments and not run (Triton's `warmup`: no launch, nothing read or written)."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]


def pdl_options(launch: bool = False, waits: bool = False) -> dict:
    """A launch's PDL constexpr and launch option: the predecessor wait compiled in with the
    launch attribute (`launch`), or compiled in alone (`waits`: the same binary launched
    without PDL, to compare launches that differ by the attribute only)."""
    opts: dict = {"PDL": launch or waits}
    if launch:
        opts["launch_pdl"] = True
    return opts


@functools.cache
def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set). Read once:
    Triton fixes the choice when it decorates the kernels, and a decode forward asks about
    500 times (an environment read each, 7% of its host time on an H100 host)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def dot_upcast() -> bool:
    """Whether dot operands go to float32 first: the interpreter's bfloat16 dot is wrong, and
    float32 there costs nothing that matters."""
    return interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """Input precision of tl.dot: IEEE for float32 operands (Triton would round them through
    TF32, torch's matmuls do not by default); 16-bit operands ignore it."""
    return "ieee" if dtype == torch.float32 or dot_upcast() else "tf32"
