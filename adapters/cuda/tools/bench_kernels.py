"""The decode kernels on a GPU: correct against torch, bitwise repeatable, and how close to
the memory bandwidth each configuration streams its weights.

    python adapters/cuda/tools/bench_kernels.py --json out/kernels.json \\
        [--models qwen3-0.6b,qwen3-8b] [--rows 1,2,4,8,16,32,64] [--jobs 12]

Projections: for each model's four (qkv with its input RMSNorm and per-head QK-norm +
rotary; o_proj with the residual add; gate_up with the RMSNorm; down with SiLU-mul and the
residual add), each row count, and each configuration of `kernels.tuning.candidates` (every
one at rows 1, 8 and 64, the default `pick` at the others), the fused kernel against:
`torch` (the unfused reference ops over cuBLAS, what the step ran before), `cublas` (the
GEMM alone) and `skinny` (the earlier kernel with the unfused ops, where it serves). Each
call runs over enough copies of the weights (256 MiB together) that none stays in L2, all
of them in one captured CUDA graph; device time per call from events over its replays.
TB/s counts the weights, the input rows and the output (and residual) once; `of copy` sets
it against a 1 GiB device-to-device copy measured first. `err` is ||y - y_ref|| / ||y_ref||
against float32 math on the same bf16 inputs; `repeat` whether three calls gave the same
bits (a split reduction finished in the wrong order, or a race, shows there).

Attention: decode over 256-token contexts at batch 1, 8 and 64 with each model's heads, one
launch (store + attention + merge) against three (XGRAPH_CUDA_DECODE=split), 8 layers'
caches in turn.

`--jobs N` compiles the kernels first in N processes (Triton's disk cache keeps them), so
the sweep itself only loads binaries. The last thing printed is one table per section.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from xgraph.fusion import Fusion, HeadNorm, reference
from xgraph.models import Qwen3Config

ROWS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_ROWS = (1, 8, 64)
MODELS = ("qwen3-0.6b", "qwen3-8b")
ROTATE_BYTES = 256 << 20
REPS = 10
TOL = 2e-2  # bf16 operands and output: 1e-3 .. 1e-2


@dataclass
class Case:
    model: str
    proj: str  # qkv, o, gate_up, down
    rows: int
    n: int
    k: int
    heads: tuple[int, int, int] | None = None  # (hq, hkv, head_dim) for qkv

    @property
    def id(self) -> str:
        return f"{self.model}/{self.proj}/m{self.rows}"

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * 2


def cases(models: list[str], rows: list[int]) -> list[Case]:
    """Every (model, projection, rows) the sweep measures, in that order."""
    out = []
    for name in models:
        c = Qwen3Config.named(name)
        h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
        heads = (c.num_heads, c.num_kv_heads, d)
        shapes = {
            "qkv": ((c.num_heads + 2 * c.num_kv_heads) * d, h, heads),
            "o": (h, c.num_heads * d, None),
            "gate_up": (2 * i, h, None),
            "down": (h, i, None),
        }
        for proj, (n, k, hd) in shapes.items():
            out += [Case(name, proj, m, n, k, hd) for m in rows]
    return out


@dataclass
class Inputs:
    x: torch.Tensor
    weights: list[torch.Tensor]
    fusion: Fusion

    def fp32(self) -> tuple[torch.Tensor, torch.Tensor, Fusion]:
        """The first copy's inputs in float32 (the reference's)."""
        f = self.fusion
        h = f.heads
        heads = None
        if h is not None:
            qw, kw = h.q_weight.float(), h.k_weight.float()
            heads = HeadNorm(qw, kw, h.eps, h.cos_sin, h.heads, h.kv_heads)
        norm = f.norm.float() if f.norm is not None else None
        res = f.residual.float() if f.residual is not None else None
        return self.x.float(), self.weights[0].float(), Fusion(norm, f.eps, f.gated, res, heads)


def make_inputs(
    case: Case, copies: int | None = None, seed: int = 0, device: str = "cuda"
) -> Inputs:
    """Random bf16 inputs on the GPU; enough weight copies to pass ROTATE_BYTES."""
    g = torch.Generator(device=device).manual_seed(seed)
    dev, bf = torch.device(device), torch.bfloat16

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)

    m, n, k = case.rows, case.n, case.k
    copies = copies or max(1, min(64, -(-ROTATE_BYTES // case.weight_bytes)))
    weights = [rand(n, k, scale=0.02) for _ in range(copies)]
    width = 2 * k if case.proj == "down" else k
    x = rand(m, width)
    if case.proj == "qkv":
        hq, hkv, d = case.heads  # type: ignore[misc]
        cs = torch.randn(m, 2, d, generator=g, device=dev)
        heads = HeadNorm(1 + rand(d, scale=0.1), 1 + rand(d, scale=0.1), 1e-6, cs, hq, hkv)
        f = Fusion(1 + rand(k, scale=0.1), 1e-6, heads=heads)
    elif case.proj == "o":
        f = Fusion(residual=rand(m, n))
    elif case.proj == "gate_up":
        f = Fusion(1 + rand(k, scale=0.1), 1e-6)
    else:
        f = Fusion(gated=True, residual=rand(m, n))
    return Inputs(x, weights, f)


def variants(case: Case, sms: int) -> dict[str, Callable]:
    """name -> fn(x, w, fusion) for every variant measured on this case."""
    from xgraph_cuda import projection
    from xgraph_cuda.kernels import around, skinny
    from xgraph_cuda.kernels.tuning import candidates, pick

    head_dim = case.heads[2] if case.heads else None
    default = pick(case.rows, case.n, case.k, sms, head_dim)
    configs = [default]
    if case.rows in SWEEP_ROWS:
        configs = candidates(case.rows, case.n, case.k, sms, head_dim)
    out: dict[str, Callable] = {}
    for c in configs:
        name = ("default " if c == default else "") + config_name(c)
        out[name] = lambda x, w, f, c=c: projection.run(x, w, f, c)
    out["torch"] = lambda x, w, f: reference(x, w, f, F.linear)

    def gemm(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor:
        return F.linear(x[:, : w.shape[1]], w)

    out["cublas"] = gemm
    out["cublas+around"] = lambda x, w, f: around.run(x, w, f)  # the fused ops as own kernels
    probe_x = torch.empty(case.rows, case.k, dtype=torch.bfloat16)
    if skinny.serves(probe_x, torch.empty(case.n, case.k, dtype=torch.bfloat16)):
        out["skinny"] = lambda x, w, f: reference(x, w, f, skinny.skinny_linear)
    return out


def config_name(c: Any) -> str:
    form = "mma" if c.mma else "fma"
    return f"{form} m{c.block_m} n{c.block_n} k{c.block_k} s{c.split} w{c.warps} st{c.stages}"


def graph_us(fn: Callable[[], Any], calls: int) -> float:
    """Device us per call of `fn` (making `calls` calls), replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPS):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (REPS * calls)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    e = float((y.float() - ref).norm() / ref.norm())
    return e if e == e else float("inf")  # NaN never passes


@dataclass
class Row:
    case: str
    variant: str
    us: float | None = None
    tb_s: float | None = None
    of_copy: float | None = None
    err: float | None = None
    repeat: bool | None = None
    error: str | None = None


def moved_bytes(case: Case) -> int:
    x = case.rows * case.k * 2 * (2 if case.proj == "down" else 1)
    y = case.rows * case.n * 2 * (2 if case.proj in ("o", "down") else 1)
    return case.weight_bytes + x + y


def check(row: Row, fn: Callable, inp: Inputs) -> None:
    """The variant's error against float32 math, and whether three calls agree bitwise."""
    x, w32, f32 = inp.fp32()
    ref = reference(x, w32, f32, F.linear)
    outs = [fn(inp.x, inp.weights[0], inp.fusion) for _ in range(3)]
    row.err = rel_err(outs[0], ref) if row.variant != "cublas" else None
    row.repeat = all(torch.equal(outs[0], o) for o in outs[1:])


def measure(case: Case, name: str, fn: Callable, inp: Inputs, bw: float) -> Row:
    """One variant on one case: error, repeatability, device time."""
    row = Row(case.id, name)
    try:
        check(row, fn, inp)
        ws = inp.weights
        row.us = graph_us(lambda: [fn(inp.x, w, inp.fusion) for w in ws], len(ws))
        row.tb_s = moved_bytes(case) / (row.us * 1e-6) / 1e12
        row.of_copy = row.tb_s * 1e12 / bw if bw else None
    except Exception as exc:  # a failing variant is a row, not the end of the sweep
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def _copy_us(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return graph_us(lambda: dst.copy_(src), 1)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    us = _copy_us(nbytes)
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)


def _warm(items: list[tuple[str, str, int]]) -> None:
    """Compile every variant of these cases once (a worker process: Triton's disk cache keeps
    the binaries for the sweep)."""
    from xgraph_cuda.kernels import sm_count

    sms = sm_count(torch.device("cuda"))
    for model, proj, rows in items:
        case = next(c for c in cases([model], [rows]) if c.proj == proj)
        inp = make_inputs(case, copies=1)
        for name, fn in variants(case, sms).items():
            if name not in ("torch", "cublas"):
                try:
                    fn(inp.x, inp.weights[0], inp.fusion)
                except Exception:
                    pass  # the sweep reports it
        torch.cuda.synchronize()


def warm_up(todo: list[Case], jobs: int) -> float:
    """Compile in `jobs` processes; seconds taken."""
    t0 = time.perf_counter()
    items = [(c.model, c.proj, c.rows) for c in todo]
    shares = [items[i::jobs] for i in range(jobs)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_warm, args=(s,)) for s in shares if s]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.terminate()
    return time.perf_counter() - t0


def sweep(todo: list[Case], bw: float, quiet: bool) -> list[Row]:
    from xgraph_cuda.kernels import sm_count

    sms = sm_count(torch.device("cuda"))
    rows: list[Row] = []
    for case in todo:
        inp = make_inputs(case)
        for name, fn in variants(case, sms).items():
            r = measure(case, name, fn, inp, bw)
            rows.append(r)
            if not quiet:
                print(f"  {case.id} {name}: {r.us} us, err {r.err}, {r.error or ''}", flush=True)
        del inp
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[Row]) -> list[dict[str, Any]]:
    """Per case: the best kernel configuration, the default, and the old paths."""
    out = []
    for cid in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case == cid]
        ok = [
            r
            for r in mine
            if r.us
            and r.variant not in ("torch", "cublas", "skinny")
            and (r.err or 0) < TOL
            and r.repeat is not False
        ]
        best = min(ok, key=lambda r: r.us or 0.0, default=None)
        default = next((r for r in mine if r.variant.startswith("default")), None)
        line: dict[str, Any] = {"case": cid}
        if best is not None:
            line.update(best=best.variant, best_us=best.us, tb_s=best.tb_s, of_copy=best.of_copy)
        if default is not None:
            line.update(default_us=default.us, default_err=default.err)
            line["default_repeat"] = default.repeat
        for old in ("torch", "cublas", "skinny"):
            r = next((r for r in mine if r.variant == old), None)
            if r is not None and r.us:
                line[f"{old}_us"] = r.us
        bad = [r.variant for r in mine if r.error or (r.err or 0) >= TOL or r.repeat is False]
        line["failing"] = ", ".join(bad)
        out.append(line)
    return out


def table(lines: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(line.get(c)) for c in cols) + " |" for line in lines]
    return "\n".join(out)


@dataclass
class AttentionRow:
    model: str
    batch: int
    mode: str
    us: float | None = None
    err: float | None = None
    repeat: bool | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


def attention_inputs(model: str, batch: int, layers: int) -> tuple:
    """Metadata of `batch` sequences of 256 tokens on shuffled blocks, `layers` caches of
    random bf16 rows, and one step's q, k, v."""
    from xgraph.metadata import AttentionInputs

    c = Qwen3Config.named(model)
    hq, hkv, d, bs, ctx = c.num_heads, c.num_kv_heads, c.head_dim, 16, 256
    per = ctx // bs
    blocks = list(range(batch * per))
    random.Random(batch).shuffle(blocks)
    tables = [blocks[i * per : (i + 1) * per] for i in range(batch)]
    slots = [t[-1] * bs + bs - 1 for t in tables]
    dev = torch.device("cuda")
    md = AttentionInputs([1] * batch, [ctx] * batch, tables, slots).metadata(
        dev, fill_block=batch * per
    )
    shape = (batch * per + 1, bs, hkv, d)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=dev).bfloat16()

    caches = [(rand(*shape), rand(*shape)) for _ in range(layers)]
    return md, caches, rand(batch, hq, d), rand(batch, hkv, d), rand(batch, hkv, d)


def attention_case(model: str, batch: int, fused: bool, layers: int = 8) -> AttentionRow:
    """Decode attention over 256-token contexts, `layers` caches in turn (graph replays),
    against the reference runner; twice, for the bits."""
    from xgraph_cuda.triton_runners import TritonPagedDecodeRunner

    from xgraph.runners import PagedDecodeRunner

    row = AttentionRow(model, batch, "one launch" if fused else "three launches")
    try:
        md, caches, q, k, v = attention_inputs(model, batch, layers)
        scale = q.shape[-1] ** -0.5
        ref = torch.empty_like(q)
        ref_runner = PagedDecodeRunner()
        ref_runner.plan(md)
        ref_runner.run(q, k, v, ref, caches[0], scale)
        runner = TritonPagedDecodeRunner(fused=fused)
        runner.plan(md)
        out = torch.empty_like(q)
        outs = []
        for _ in range(2):
            runner.run(q, k, v, out, caches[0], scale)
            outs.append(out.clone())
        row.err = rel_err(outs[0], ref.float())
        row.repeat = torch.equal(outs[0], outs[1])
        row.us = graph_us(lambda: [runner.run(q, k, v, out, kv, scale) for kv in caches], layers)
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="where to write every row")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--jobs", type=int, default=1, help="processes that compile first")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; torch.cuda.is_available() is False.")
        return 2
    models = [m for m in args.models.split(",") if m]
    todo = cases(models, [int(r) for r in args.rows.split(",") if r])
    warm_s = warm_up(todo, args.jobs) if args.jobs > 1 else 0.0
    bw = copy_bandwidth()
    rows = sweep(todo, bw, args.quiet)
    attn: list[AttentionRow] = []
    if not args.no_attention:
        for model in models:
            for batch in (1, 8, 64):
                attn += [attention_case(model, batch, fused) for fused in (True, False)]
    lines = summary(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        data = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw}
        data.update(warm_up_s=warm_s, rows=[asdict(r) for r in rows], summary=lines)
        data["attention"] = [asdict(a) for a in attn]
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; compile warm-up {warm_s:.1f} s")
    if attn:
        a_cols = ["model", "batch", "mode", "us", "err", "repeat", "error"]
        print(table([asdict(a) for a in attn], a_cols))
    cols = ["case", "best", "best_us", "tb_s", "of_copy", "default_us", "default_err"]
    cols += ["default_repeat", "torch_us", "cublas_us", "skinny_us", "failing"]
    print(table(lines, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
