"""Host microseconds of a fused projection call (Qwen3-0.6B's qkv shape, a norm prologue,
float32 input over bf16 weights) through each layer on its way to the kernel: xgraph's
`xgraph::fused_linear` op (defined on the dispatcher, `xgraph.opdef`), the same kernel
behind a `torch.library.custom_op` (the definition it replaced), the op's Python answer,
and the adapter's `projection.fused`; under inference mode and under `torch.no_grad()`
(the executor's mode), at 64 rows (cuBLAS with the norm's kernel) and 16 (the decode
kernel). Each the best of 5 rounds of 300 calls, the two ops interleaved twice:

    OUT=out python experiments/op_dispatch.py

Writes `$OUT/op-dispatch.json`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from probe_common import best_host_us, write
from torch import Tensor

import xgraph
from xgraph import linear as core_linear
from xgraph.fusion import Fusion


@torch.library.custom_op("xgraph_probe::fused_linear", mutates_args=())
def _custom_op(
    x: Tensor,
    weight: Tensor,
    norm: Tensor | None,
    eps: float,
    gated: bool,
    residual: Tensor | None,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    head_eps: float,
    cos_sin: Tensor | None,
    heads: int,
    kv_heads: int,
) -> Tensor:
    """The fused projection behind torch.library.custom_op, as xgraph defined it before."""
    f = core_linear._fusion(
        norm, eps, gated, residual, q_weight, k_weight, head_eps, cos_sin, heads, kv_heads
    )
    return core_linear._fused_answer(x, weight, f)


def host_us(fn: Callable[[], Any]) -> float:
    """Host us per call: the best of 5 rounds of 300, the device drained between rounds."""
    return round(best_host_us(fn, 300, sync=torch.cuda.synchronize), 1)


def row(rows: int, w: Tensor, g: Tensor) -> dict[str, Any]:
    from xgraph_cuda import projection

    x = torch.randn(rows, w.shape[1], device=w.device)
    f = Fusion(norm=g, eps=1e-6)
    args = (x, w, g, 1e-6, False, None, None, None, 0.0, None, 0, 0)
    ours, theirs = (
        torch.ops.xgraph.fused_linear.default,
        torch.ops.xgraph_probe.fused_linear.default,
    )
    out: dict[str, Any] = {"rows": rows}
    for label, mode in (("inference", torch.inference_mode), ("no_grad", torch.no_grad)):
        with mode():
            for _ in range(2):  # interleaved: the host's drift falls on both
                out[f"xgraph_op_{label}_us"] = host_us(lambda: ours(*args))
                out[f"custom_op_{label}_us"] = host_us(lambda: theirs(*args))
    with torch.no_grad():
        out["answer_us"] = host_us(lambda: core_linear._fused_answer(x, w, f))
        out["projection_fused_us"] = host_us(lambda: projection.fused(x, w, f))
    return out


def main() -> None:
    xgraph.get_backend("cuda").activate()
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    rows = [row(m, w, g) for m in (64, 16)]
    for r in rows:
        print(r)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    write("op-dispatch.json", data)


if __name__ == "__main__":
    main()
