"""From how many rows a projection runs on cuBLAS instead of the decode kernels.

XGRAPH_CUDA_CUBLAS_ROWS: calls of this many rows or more run their product on cuBLAS, the
ops fused around it as kernels of their own (kernels/around.py); 1 to 65, default 33 (65:
the decode kernels for all their 64 rows). Calls past 64 rows always go that way. The
default sits between the crossovers measured in whole decode steps (docs/kernels.md, "Rows
for cuBLAS"): past 32 rows at Qwen3-0.6B, past 16 at Qwen3-8B.
"""

from __future__ import annotations

import functools
import os

from xgraph.adapter import XGraphError

from .kernels.tuning import MAX_ROWS

CUBLAS_ROWS_ENV = "XGRAPH_CUDA_CUBLAS_ROWS"
CUBLAS_ROWS = 33


def cublas_rows() -> int:
    """The row count from which projections run on cuBLAS (XGRAPH_CUDA_CUBLAS_ROWS)."""
    return _parse(os.environ.get(CUBLAS_ROWS_ENV, "").strip())


@functools.lru_cache(maxsize=8)  # read at every projection call: parse each value once
def _parse(raw: str) -> int:
    if not raw:
        return CUBLAS_ROWS
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if not 1 <= rows <= MAX_ROWS + 1:
        raise XGraphError(
            f"{CUBLAS_ROWS_ENV}={raw!r}; give a row count from 1 to {MAX_ROWS + 1} (calls of "
            f"that many rows or more run on cuBLAS; {MAX_ROWS + 1}: none up to {MAX_ROWS})."
        )
    return rows
