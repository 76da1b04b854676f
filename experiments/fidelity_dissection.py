"""Where the decode step's distance from float32 comes from: one process, one model, the
bench's fidelity probe (`xgraph.bench.fidelity`: four seeded cache states, float32 LM head)
over variants of the projections and of the residual stream's dtype.

Variants (comma list, first argument; batches second):
- `inductor`: torch.compile of the reference forward, torch's kernels (the anchor; its
  numbers equal reduce-overhead's); `inductor:casts`: the same with Inductor's
  `emulate_precision_casts` (every bf16 cast the code writes is kept);
- `torch`: the eager forward, torch's kernels (cuBLAS and the unfused ops);
- `kernels`: the eager forward over the CUDA adapter's fused kernels (the float32 stream);
  `kernels:bf16`: the same with the stream kept in bf16;
  `kernels:only=qkv+o` (any of qkv, o, gate_up, down): only those fusions fused;
- `ideal`: the fused kernels' math in torch float32 ops (products of bf16 operands summed
  in float32, one rounding per output); `ideal:bf16`, its stream in bf16;
  `ideal:bf16:norm32`: bf16 stream, each norm reading the unrounded sum (the one rounding
  torch.compile avoids by fusing the add into the norm); `ideal:bf16:norm32:round`: also the
  projection rounded before the add (torch.compile's rounding points, emulated).

    XGRAPH_CUDA_LINEAR=triton OUT=out python experiments/fidelity_dissection.py \
        inductor,inductor:casts,torch,kernels,kernels:bf16,ideal:bf16,ideal:bf16:norm32 1,8

Prints and writes $OUT/fidelity-dissection.json: per batch, each variant's distance and its
ratio to the first variant's.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch._inductor.config as inductor_config

from xgraph import linear as core_linear
from xgraph.attention import step_context
from xgraph.bench.anchors import static_inputs
from xgraph.bench.decode import _steps
from xgraph.bench.fidelity import Fidelity
from xgraph.bench.report import workload
from xgraph.fusion import Fusion
from xgraph.models import qwen3
from xgraph.plugins import get_backend


class Ideal:
    """The fused kernels' math in torch ops, with a side table of unrounded stream sums
    (`norm32`: a norm prologue reads the sum its bf16 stream was rounded from)."""

    def __init__(self, flags: set[str]) -> None:
        self.flags = flags
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        got = self.sums.get(id(x))
        return got[1] if "norm32" in self.flags and got and got[0] is x else x.float()

    def fused(self, x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor | None:
        if x.dim() != 2:
            return None
        acc = self._product(x, w, f)
        if f.residual is not None:
            if "round" in self.flags:
                acc = acc.to(w.dtype).float()
            total = acc + f.residual.float()
            y = total.to(torch.promote_types(w.dtype, f.residual.dtype))
            self.sums[id(y)] = (y, total)
            return y
        if f.heads is not None:
            return _heads(acc, f.heads).to(w.dtype)
        return acc.to(w.dtype)

    def _product(self, x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor:
        xf, k = x.float(), w.shape[1]
        if f.norm is not None:
            xf = self.stream(x)
            ss = xf.square().sum(-1)
            acc = (xf * f.norm.float()).to(w.dtype).float() @ w.float().T
            return acc * torch.rsqrt(ss / k + f.eps)[:, None]
        if f.gated:
            g, u = xf.chunk(2, -1)
            xf = g / (1 + torch.exp(-g)) * u
        return xf.to(w.dtype).float() @ w.float().T


def _heads(acc: torch.Tensor, h: Any) -> torch.Tensor:
    t, d, qk = acc.shape[0], h.head_dim, h.heads + h.kv_heads
    heads = acc.view(t, -1, d)
    x = heads[:, :qk]
    wq = h.q_weight.float().expand(h.heads, d)
    wt = torch.cat([wq, h.k_weight.float().expand(h.kv_heads, d)])
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + h.eps) * wt
    cos, sin = h.cos_sin[:, 0:1], h.cos_sin[:, 1:2]
    y = y * cos + y.roll(d // 2, -1) * sin
    return torch.cat([y, heads[:, qk:]], 1).reshape(t, -1)


def _kind(f: Fusion) -> str:
    if f.heads is not None:
        return "qkv"
    if f.norm is not None:
        return "gate_up"
    return "down" if f.gated else "o"


@contextmanager
def _bf16_stream(model: Any, ideal: Ideal | None):
    """The model's stream kept in its own dtype; with `ideal`, the final norm reads the
    unrounded sum as the layers' norms do."""
    saved, norm = qwen3.stream_dtype, model.model.norm
    qwen3.stream_dtype = lambda x: x.dtype
    if ideal is not None:

        def final(x: torch.Tensor, residual: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.nn.functional.rms_norm(
                ideal.stream(x), (x.shape[-1],), norm.weight.float(), norm.eps
            )
            return y.to(x.dtype), x

        norm.forward = final
    try:
        yield
    finally:
        qwen3.stream_dtype = saved
        norm.__dict__.pop("forward", None)


def _kernels(name: str, flags: list[str], model: Any, stack: ExitStack, device: str) -> None:
    """Install the variant's projection kernels on `device` (restored by `stack`)."""
    plain, fused = core_linear.installed(device), core_linear.installed_fused(device)
    stack.callback(core_linear.install, device, plain, "restored", fused)
    if name in ("torch", "inductor"):
        core_linear.install(device, None, "experiment", None)
    elif name == "ideal":
        ideal = Ideal(set(flags))
        core_linear.install(device, plain, "experiment", ideal.fused)
        stack.callback(ideal.sums.clear)
        if "bf16" in flags:
            stack.enter_context(_bf16_stream(model, ideal if "norm32" in flags else None))
    else:
        only = [f[5:].split("+") for f in flags if f.startswith("only=")]
        if only:
            keep = set(only[0])

            def pick(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor | None:
                return fused(x, w, f) if _kind(f) in keep else None

            core_linear.install(device, plain, "experiment", pick)
        if "bf16" in flags:
            stack.enter_context(_bf16_stream(model, None))


def _sample(fid: Fidelity, w: Any, backend: Any, batch: int, step: Any, variant: str) -> None:
    name, *flags = variant.split(":")
    model = w.model
    ids, pos, ctx, _ = static_inputs(backend, w, step)
    with ExitStack() as stack:
        _kernels(name, flags, model, stack, backend.device.type)
        fn = model.forward
        if name == "inductor":
            torch._dynamo.reset()
            inductor_config.emulate_precision_casts = "casts" in flags
            stack.callback(setattr, inductor_config, "emulate_precision_casts", False)
            fn = torch.compile(model.forward, dynamic=False)

        def run() -> torch.Tensor:
            with torch.no_grad(), step_context(ctx):
                return fn(ids, pos).clone()

        fid.sample(variant, batch, step, run)
    print(f"{variant} at batch {batch}: sampled", flush=True)


def main() -> None:
    variants = sys.argv[1].split(",")
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8]
    backend = get_backend(None)  # the best available: cuda on a GPU machine
    backend.activate()
    w = workload(backend, os.environ.get("MODEL", "qwen3-0.6b"), max_seqs=64, context=512)
    for t in w.model.kv_cache.tensors():
        torch._dynamo.mark_static_address(t, guard=False)
    steps = _steps(w, [1, 8, 64], 0, True)  # the bench's steps (the same seed and sizes)
    fid = Fidelity(w)
    for b in batches:
        for v in variants:
            _sample(fid, w, backend, b, steps[b], v)
    out: dict[str, Any] = {"device": str(backend.device), "rows": {}}
    if backend.device.type == "cuda":
        out["device"] = torch.cuda.get_device_name()
    for b, d in fid.finish().items():
        base = d[variants[0]]
        out["rows"][b] = {v: {"distance": x, "ratio": x / base} for v, x in d.items()}
        print(b, json.dumps({v: round(x / base, 3) for v, x in d.items()}), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fidelity-dissection.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
