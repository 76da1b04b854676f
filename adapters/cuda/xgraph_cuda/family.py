"""A projection's binaries for every row count, compiled together on its first call.

Triton compiles a kernel per specialization of its arguments, and a row count is specialized
on being 1 or a multiple of 16 (that specialization is worth keeping: measured on an H100,
the decode step without it was 5.9% slower at batch 1 and 4.2% at 64), on top of the rows a
program holds (16, 32 or 64). So one projection of decode needs up to seven binaries, and a
process compiles them one at a time as its warm-ups meet each row count: 23 of the 39
kernels a cold transformers Qwen3 process compiled (18.4 s of its start-up, all on one
thread; docs/startup.md). On the first call of a projection of one kind (its weight's shape
and dtype, the input's dtype and strides, the ops fused around it, PDL on or off),
`compile_family` compiles the binaries of every row count up to `MAX_ROWS` at once, in a
pool of threads (Triton's `AsyncCompileMode`: its compiler releases the interpreter's lock
while it works), and returns when all are in Triton's cache: the first call waits for the
slowest binary instead of each count waiting for its own. Nothing runs on the device; the
inputs of the other row counts are small tensors made for the compile and dropped. On the
H100 the cold transformers process's eager warm-up of every size went from 10.0 to 2.8 s,
its load and warm-up together from 16.4 to 12.8 s.

Skipped (the calls compile as they meet each count, as before) where Triton has no
`AsyncCompileMode`, inside another one, in the interpreter, and while the stream is being
captured (nothing may be allocated for the compile there). A compile that fails here is
logged once per kind and left to the call that needs it, which compiles it as before.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from xgraph.adapter import Fusion

from . import pdl
from .kernels import interpreting
from .kernels.tuning import MAX_ROWS

logger = logging.getLogger("xgraph")

# one row count of each binary Triton makes up to MAX_ROWS: (count, rows a program holds)
# 1 (16: the count specialized as 1), 2 (16), 16 (16: a multiple of 16), 24 (32), 32 (32:
# a multiple), 40 (64), 48 (64: a multiple, as 64 is)
ROWS = (1, 2, 16, 24, 32, 40, 48)
WORKERS = 8

_lock = threading.Lock()
_done: set[tuple] = set()
_pool: ThreadPoolExecutor | None = None


def _async_mode() -> Any:
    """Triton's AsyncCompileMode where it has one and none is active here, else None."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return None
    return AsyncCompileMode if active_mode.get() is None else None


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:  # one pool, whichever thread asks first
        if _pool is None:
            workers = min(WORKERS, os.cpu_count() or 1)
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="xgraph-compile")
        return _pool


def kind(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> tuple:
    """What, besides the row count, sets the binaries a projection call compiles."""
    h, r = f.heads, f.residual
    heads = None if h is None else (h.head_dim, h.heads, h.kv_heads, h.cos_sin.dtype)
    return (
        pdl.enabled(),  # a capture under PDL compiles binaries with the wait in
        pdl.waits(),
        x.device,
        x.dtype,
        x.shape[1],
        x.stride(0),
        tuple(w.shape),
        w.stride(0),
        w.dtype,
        None if f.norm is None else f.norm.dtype,
        f.gated,
        None if r is None else (r.dtype, r.stride(0)),
        heads,
    )


def resized(x: torch.Tensor, f: Fusion, m: int) -> tuple[torch.Tensor, Fusion]:
    """An input of `m` rows with x's row stride, and `f` with its per-row tensors (the
    residual, the rotary's cos_sin) of m rows too: what a call of m rows passes."""
    xs = torch.empty_strided((m, x.shape[1]), (x.stride(0), 1), dtype=x.dtype, device=x.device)
    changes: dict[str, Any] = {}
    r = f.residual
    if r is not None:
        changes["residual"] = torch.empty_strided(
            (m, r.shape[1]), (r.stride(0), 1), dtype=r.dtype, device=r.device
        )
    h = f.heads
    if h is not None:
        cs = h.cos_sin
        changes["heads"] = dataclasses.replace(h, cos_sin=cs.new_empty((m, *cs.shape[1:])))
    return xs, dataclasses.replace(f, **changes)


def compile_family(
    x: torch.Tensor,
    w: torch.Tensor,
    f: Fusion,
    compile_one: Callable[[torch.Tensor, torch.Tensor, Fusion], None],
    key: tuple | None = None,
) -> None:
    """On the first call of this projection's kind, every row count's binary compiled at
    once (see the module doc); `compile_one(x, w, f)` compiles the call of x's rows
    without running it; `key`: the call's `kind`, where the caller has it. Later calls of
    the kind return at once."""
    key = key or kind(x, w, f)
    # a capture's call leaves the kind to the next call outside one
    if key in _done or _capturing(x):  # (a set lookup needs no lock)
        return
    with _lock:
        if key in _done:
            return
        _done.add(key)
    mode = _async_mode()
    if mode is None or interpreting():
        return
    try:
        with mode(_executor()):
            for m in sorted({*ROWS, x.shape[0]}):
                if m <= MAX_ROWS:
                    xs, fs = resized(x, f, m)
                    compile_one(xs, w, fs)
    except Exception as exc:  # a speed-up only: the calls compile their own
        logger.warning(
            "Compiling the projection kernels of every row count ahead failed (%s: %s); "
            "each row count compiles on its first call instead.",
            type(exc).__name__,
            exc,
        )
        return
    logger.debug("compiled the projection kernels of %s for every row count", key)
