"""What only an Ascend NPU can prove about xgraph-ascend, checked in one run.

    python adapters/ascend/scripts/hardware_check.py                 # the NPU (backend ascend)
    python adapters/ascend/scripts/hardware_check.py --backend ascend-sim   # the simulator
    python adapters/ascend/scripts/hardware_check.py --backend ascend-sim --sim-era context
    python adapters/ascend/scripts/hardware_check.py --json out.json

Each check prints PASS, FAIL or SKIP with its numbers or reason; the exit status is the
number of failures. Each check runs on a backend object of its own over the same runtime,
so on a capture stream of its own: a capture one check could not end cannot make the next
one's capture_begin fail. After each check, a capture still open on its stream is ended
through aclmdlRICaptureEnd (while any stream of the device captures, every device
synchronize fails with 107027). torch.npu.config.allow_internal_format is set to False
first, so no MatMul falls back to an aclop operator, which cannot be captured.
The checks, in the order of docs/ascend.md ("only hardware can prove"):
  versions            torch_npu, CANN, memory-pool era, device
  vmm_aliasing        one aclrtMallocPhysical handle mapped at two aclrtReserveMemAddress
                      ranges: data written through one is read through the other (HBM), and
                      the DLPack as_tensor over VMM addresses
  capture_replay      an MLP captured as an ACL graph on a side stream replays like eager
  vmm_inside_capture  shared-physical memory: the routed MemPool's ctypes callbacks run
                      aclrtMallocPhysical / aclrtMapMem while the stream captures; graph
                      memory is max(shape), not sum, in ascending order (SKIP in the
                      MemPoolContext era, torch_npu <= 2.12, which has no routed pools)
  recapture_pool      reset every graph of a pool, capture on it again (the pool's keeper
                      graph keeps torch_npu from asserting use_count > 0)
  fused_decode        decode through npu_fused_infer_attention_score with graph task update
                      against the reference decode runner (numerics of the fused op), in
                      bfloat16 (--fused-dtype) with block sizes 16 and 128
  stream_ceiling      how many small graphs capture before the runtime runs out of stream
                      or model resources (207008, 207010, 207005, 207012)
  teardown            closing a shared-physical pool returns device memory to the baseline
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import xgraph
from xgraph import Buckets, CaptureError, GraphExecutor, GraphMemory, Input
from xgraph.models import Workload
from xgraph.pool import SharedPhysicalPool
from xgraph.runners import PagedDecodeRunner

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FUSED_DTYPES = ("bfloat16", "float16")  # all npu_fused_infer_attention_score takes
FUSED_BLOCK_SIZES = (16, 128)  # paged attention needs multiples of 16
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}
# the runtime ran out of what every captured graph holds: streams, model RIs, resources
CEILING_CODES = {
    207008: "ACL_ERROR_RT_NO_STREAM_RESOURCE",
    207010: "ACL_ERROR_RT_NO_MODEL_RESOURCE",
    207005: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL",
    207012: "ACL_ERROR_RT_OVER_LIMIT",
}


class Skip(Exception):
    """The check does not apply to this stack; its message says why."""


def check_versions(backend: Any, args: argparse.Namespace) -> str:
    avail = type(backend).availability()
    versions = {**avail.versions, **backend.runtime.versions(), **args.settings}
    return f"{backend.device_name()}; " + ", ".join(f"{k} {v}" for k, v in versions.items())


def check_vmm_aliasing(backend: Any, args: argparse.Namespace) -> str:
    vm = backend.virtual_memory()
    assert vm is not None, "the backend reports no virtual memory"
    g = vm.granularity
    a, b = vm.reserve(2 * g), vm.reserve(2 * g)
    chunk, mapped = vm.create(g), []
    try:
        for addr in (a, b + g):
            vm.map(addr, chunk)
            mapped.append(addr)
        ta, tb = backend.as_tensor(a, g), backend.as_tensor(b + g, g)
        pattern = torch.randint(0, 256, (g,), dtype=torch.uint8)
        ta.copy_(pattern.to(ta.device))
        backend.synchronize()
        assert torch.equal(tb.cpu(), pattern), "the second mapping does not see the data"
        tb[:4096].fill_(7)
        backend.synchronize()
        assert int(ta[:4096].cpu().min()) == 7, "the first mapping does not see the write"
        del ta, tb
    finally:
        for addr in mapped:
            vm.unmap(addr)
        vm.free(chunk)
        vm.release(a)
        vm.release(b)
    return f"granularity {g >> 20} MiB; {g >> 20} MiB written through one VA, read through another"


def _mlp(backend: Any, dtype: torch.dtype, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    )
    return m.to(device=backend.device, dtype=dtype).eval()


def check_capture_replay(backend: Any, args: argparse.Namespace) -> str:
    mlp = _mlp(backend, args.dtype, 256)
    x = torch.randn(64, 256, device=backend.device, dtype=args.dtype)
    graph, pool = backend.new_graph(), backend.new_pool()
    with torch.no_grad():
        with backend.warmup_context():
            mlp(x)
        with xgraph.graph(graph, pool):
            y = mlp(x)
        worst = 0.0
        for _ in range(5):
            x.copy_(torch.randn(64, 256, dtype=args.dtype))
            graph.replay()
            backend.synchronize()
            worst = max(worst, float((y - mlp(x)).abs().max()))
    graph.reset()
    pool.close()
    assert worst <= TOLERANCE[args.dtype], f"max |replay - eager| = {worst}"
    return f"max |replay - eager| = {worst:.2e} over 5 replays"


def _sizes_executor(backend: Any, memory: Any, sizes: list[int], mlp: Any, dtype: Any) -> Any:
    ex = GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=sorted(set(sizes)),
        memory=memory,
        inputs=[Input("x", dtype, ("num_tokens", 512))],
    )
    for n in sizes:
        ex(x=torch.randn(n, 512, dtype=dtype))
    return ex


def check_vmm_inside_capture(backend: Any, args: argparse.Namespace) -> str:
    support = backend.segments_support()
    if not support.available:  # shared-physical falls back to shared-pool: nothing to check
        raise Skip(f"no routed capture pools on this torch_npu: {support.reason}")
    sizes = [64, 128, 256, 512, 1024, 2048]
    mlp = _mlp(backend, args.dtype, 512)
    results = {}
    for mode, order in (("alone", [max(sizes)]), ("shared-physical", sizes), ("private", sizes)):
        mem = GraphMemory(backend, "private" if mode == "private" else "shared-physical")
        ex = _sizes_executor(backend, mem, order, mlp, args.dtype)
        results[mode] = mem.graph_bytes()
        chunk = mem.physical.chunk_size if mem.physical is not None else 0
        ex.close()
        mem.close()
    assert results["shared-physical"] <= results["alone"] + chunk, results
    assert results["private"] > results["alone"], results
    mib = {k: round(v / 2**20, 1) for k, v in results.items()}
    return (
        f"graph MiB: largest alone {mib['alone']}, shared-physical (ascending) "
        f"{mib['shared-physical']}, private {mib['private']}"
    )


def check_recapture_pool(backend: Any, args: argparse.Namespace) -> str:
    x = torch.arange(8, dtype=torch.float32, device=backend.device)
    pool = backend.new_pool()
    for round_, factor in enumerate((2.0, 3.0, 5.0)):
        graph = backend.new_graph()
        with xgraph.graph(graph, pool):
            y = x * factor
        graph.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.arange(8.0) * factor), f"round {round_}"
        graph.reset()  # the pool's only graph goes: the next capture must still work
    pool.close()
    return "3 capture/replay/reset rounds on one pool, kept by its keeper graph"


def _fused_decode(backend: Any, dtype: torch.dtype, block_size: int) -> tuple[dict, float]:
    """Ten decode steps through the fused runner's graphs against the reference eager."""
    from xgraph_ascend.attention import FusedDecodeRunner

    ex_w, ref_w = (
        Workload.tiny(
            device=backend.device,
            dtype=dtype,
            block_size=block_size,
            num_blocks=160,
            max_blocks=8,
            max_seqs=32,
        )
        for _ in range(2)
    )
    for w in (ex_w, ref_w):
        w.randomize_cache(7)
    buckets = Buckets([1, 2, 4, 8, 16])
    runner = FusedDecodeRunner(backend)
    ex = ex_w.executor(
        backend=backend, buckets=buckets, attention=ex_w.attention(decode_runner=runner)
    )
    rng, worst = random.Random(7), 0.0
    try:
        for batch in [3, 1, 16, 5, 8, 3, 12, 2, 7, 16]:
            step = ex_w.decode_step(rng, batch)
            out = ex(**step.kwargs()).float()
            ref = ref_w.eager(ref_w.padded(step, buckets, full=True), runner=PagedDecodeRunner())
            worst = max(worst, float((out - ref[:batch].float()).abs().max()))
        return ex.stats(), worst
    finally:
        ex.close()


def check_fused_decode(backend: Any, args: argparse.Namespace) -> str:
    dtype = DTYPES[args.fused_dtype]
    tol = 10 * TOLERANCE[dtype]  # logits after the whole model
    parts = []
    for block_size in FUSED_BLOCK_SIZES:
        s, worst = _fused_decode(backend, dtype, block_size)
        assert worst <= tol, f"block {block_size}: max |fused graph - reference| = {worst} > {tol}"
        parts.append(
            f"block {block_size}: {s['replays']} replays, {s['captures']} graphs, "
            f"max |logit diff| = {worst:.2e}"
        )
    return f"{args.fused_dtype}; " + "; ".join(parts)


def check_stream_ceiling(backend: Any, args: argparse.Namespace) -> str:
    x = torch.ones(16, device=backend.device)
    pool, graphs = backend.new_pool(), []
    stop = f"no limit up to {args.max_graphs}"
    try:
        for _ in range(args.max_graphs):
            g = backend.new_graph()
            try:
                with xgraph.graph(g, pool):
                    x.add_(1)
            except CaptureError as exc:
                code = _code(exc)
                if code not in CEILING_CODES:
                    raise
                stop = f"{CEILING_CODES[code]} ({code})"
                break
            graphs.append(g)
    finally:
        for g in graphs:
            g.reset()
        pool.close()
    return f"{len(graphs)} graphs captured ({stop})"


def _code(exc: BaseException) -> int | None:
    from xgraph_ascend.errors import acl_code

    return acl_code(exc)


def check_teardown(backend: Any, args: argparse.Namespace) -> str:
    before = backend.memory_in_use()
    assert before is not None, "the backend reports no memory in use"
    pool = SharedPhysicalPool(backend.virtual_memory())
    n = 64 << 20
    for _ in range(4):
        backend.as_tensor(pool.new_space().alloc(n), n).fill_(1)
    backend.synchronize()
    during = backend.memory_in_use()
    pool.close()
    backend.synchronize()
    after = backend.memory_in_use()
    assert during - before >= n and after - before < n // 8, (before, during, after)
    return f"+{(during - before) >> 20} MiB for 4 spaces of 64 MiB, then +{(after - before) >> 20}"


CHECKS: list[Callable[[Any, argparse.Namespace], str]] = [
    check_versions,
    check_vmm_aliasing,
    check_capture_replay,
    check_vmm_inside_capture,
    check_recapture_pool,
    check_fused_decode,
    check_stream_ceiling,
    check_teardown,
]


def fresh_backend(backend: Any) -> Any:
    """A backend object over the same runtime, with streams (a capture stream) of its own."""
    return type(backend)(backend.runtime)


def end_stuck_capture(backend: Any) -> str:
    """End a capture a check left open on its capture stream (through ACL); '' if none."""
    rt = backend.runtime
    stream = backend.capture_stream()
    if not rt.is_capturing(stream) or not rt.acl.has("aclmdlRICaptureEnd", "aclmdlRIDestroy"):
        return ""
    ri = ctypes.c_void_p()
    rc = rt.acl.aclmdlRICaptureEnd(rt.stream_handle(stream), ctypes.byref(ri))
    if ri.value:
        rt.acl.aclmdlRIDestroy(ri.value)
    if rc:
        return (
            f"its capture stream is still capturing (aclmdlRICaptureEnd: {rc}); later checks "
            "fail on any device synchronize (107027)"
        )
    return "a capture it left open was ended through aclmdlRICaptureEnd"


def run_check(check: Callable[[Any, argparse.Namespace], str], backend: Any, args: Any) -> dict:
    name = check.__name__.removeprefix("check_")
    own = fresh_backend(backend)
    t0 = time.perf_counter()
    try:
        status, detail = "PASS", check(own, args)
    except Skip as why:
        status, detail = "SKIP", str(why)
    except Exception as exc:  # a failed check is a result, the next one still runs
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    try:
        note = end_stuck_capture(own)
    except Exception as exc:
        note = f"ending a capture it left open failed: {type(exc).__name__}: {exc}"
    if note:
        detail = f"{detail} [{note}]"
    seconds = time.perf_counter() - t0
    print(f"{status:<5} {name:<19} {detail}  ({seconds:.1f} s)", flush=True)
    return {
        "check": name,
        "status": status,
        "ok": status != "FAIL",
        "detail": detail,
        "seconds": seconds,
    }


def run(backend: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [run_check(check, backend, args) for check in CHECKS]


def npu_settings() -> dict[str, str]:
    """Settings that keep captures to aclnn operators (torch_npu only; none on the sim)."""
    config = getattr(getattr(torch, "npu", None), "config", None)
    if config is None or not hasattr(config, "allow_internal_format"):
        return {}
    config.allow_internal_format = False  # else MatMul may run as an aclop operator
    return {"allow_internal_format": "False"}


def make_backend(args: argparse.Namespace) -> Any:
    """The backend to check: the registry's, or a simulator of the era `--sim-era` names."""
    if args.sim_era is None:
        return xgraph.get_backend(args.backend)
    from xgraph_ascend.backend import AscendSimBackend
    from xgraph_ascend.sim import SimRuntime

    return AscendSimBackend(SimRuntime(era=args.sim_era))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="ascend", help="ascend (an NPU) or ascend-sim")
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    p.add_argument(
        "--fused-dtype",
        default="bfloat16",
        choices=FUSED_DTYPES,
        help="dtype of the fused_decode check (the fused op takes no float32)",
    )
    p.add_argument("--max-graphs", type=int, default=2048)
    p.add_argument(
        "--sim-era",
        default=None,
        choices=("owner", "context"),
        help="with --backend ascend-sim: the torch_npu memory-pool era to simulate (owner: "
        ">= 2.13, context: <= 2.12; default: XGRAPH_ASCEND_SIM_ERA, else owner)",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.sim_era is not None and args.backend != "ascend-sim":
        p.error("--sim-era applies to --backend ascend-sim only")
    args.dtype = DTYPES[args.dtype]
    backend = make_backend(args)
    args.settings = npu_settings()
    print(f"xgraph-ascend hardware check on {backend!r}", flush=True)
    results = run(backend, args)
    counts = {k: sum(r["status"] == k for r in results) for k in ("PASS", "FAIL", "SKIP")}
    failed = counts["FAIL"]
    print(f"{counts['PASS']} passed, {failed} failed, {counts['SKIP']} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend.name, "results": results}, f, indent=2)
    return failed


if __name__ == "__main__":
    sys.exit(main())
