"""What one 2 MiB chunk's mapping costs the host: cuMemMap and cuMemSetAccess per chunk, and
cuMemSetAccess once over a range of N chunks mapped one by one (the question: does the pool
gain from setting access once per range rather than once per chunk).

    OUT=out python experiments/vmm_map_cost.py [--chunks 64] [--rounds 20]

Writes $OUT/vmm-map-cost.json: median host microseconds per chunk of each call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from cuda.bindings import driver as cu


def _ok(result: tuple) -> object:
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {result[0]}")
    return result[1] if len(result) > 1 else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    g = int(_ok(cu.cuMemGetAllocationGranularity(prop, flag)))
    n = args.chunks
    handles = [_ok(cu.cuMemCreate(g, prop, 0)) for _ in range(n)]
    rows: dict[str, list[float]] = {"map": [], "set_access_each": [], "set_access_once": []}
    rows["unmap"] = []
    for r in range(args.rounds):
        base = int(_ok(cu.cuMemAddressReserve(n * g, g, 0, 0)))
        t0 = time.perf_counter()
        for i, h in enumerate(handles):
            _ok(cu.cuMemMap(base + i * g, g, 0, h, 0))
        t1 = time.perf_counter()
        if r % 2:
            _ok(cu.cuMemSetAccess(base, n * g, [acc], 1))
            rows["set_access_once"].append((time.perf_counter() - t1) / n * 1e6)
        else:
            for i in range(n):
                _ok(cu.cuMemSetAccess(base + i * g, g, [acc], 1))
            rows["set_access_each"].append((time.perf_counter() - t1) / n * 1e6)
        rows["map"].append((t1 - t0) / n * 1e6)
        t2 = time.perf_counter()
        for i in range(n):
            _ok(cu.cuMemUnmap(base + i * g, g))
        rows["unmap"].append((time.perf_counter() - t2) / n * 1e6)
        _ok(cu.cuMemAddressFree(base, n * g))
    for h in handles:
        _ok(cu.cuMemRelease(h))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out.update(chunks=n, granularity=g, device=torch.cuda.get_device_name())
    print(json.dumps(out, indent=1))
    path = os.path.join(os.environ.get("OUT", "."), "vmm-map-cost.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
