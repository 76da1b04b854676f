"""Host microseconds of the calls a staged step makes on CUDA (diagnostic): torch's pinned
copy, the driver copier, events, the raw stream lookup, a graph replay. JSON to argv[1].

    python scripts/probe_host_costs.py out.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from xgraph.buffers import TorchCopier


def per_call_us(fn: Callable[[], Any], iters: int = 2000) -> float:
    """Median host microseconds of `fn`, in batches of 20 calls (timer resolution)."""
    for _ in range(50):
        fn()
    ts = []
    for _ in range(iters // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        ts.append((time.perf_counter() - t0) / 20)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main(path: str) -> None:
    import xgraph

    backend = xgraph.get_backend("cuda")
    dev = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    host = torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=True)
    driver = backend.host_copier(dev, host)
    torch_copier = TorchCopier(dev, host)
    ev = torch.Event(device=dev.device)
    small = torch.zeros(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        small.add_(1)

    def cycle(c: Any, n: int) -> Callable[[], None]:
        def f() -> None:
            c.wait()
            c.send(n)

        return f

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["us"] = {
        "driver copier wait+send 256 B": per_call_us(cycle(driver, 256)),
        "driver copier wait+send 16 KiB": per_call_us(cycle(driver, 1 << 14)),
        "driver copier send 256 B": per_call_us(lambda: driver._copy(256)),
        "torch copier wait+send 256 B": per_call_us(cycle(torch_copier, 256)),
        "torch copier wait+send 16 KiB": per_call_us(cycle(torch_copier, 1 << 14)),
        "torch copy_ non_blocking 256 B": per_call_us(
            lambda: dev[:256].copy_(host[:256], non_blocking=True)
        ),
        "torch.Event.record": per_call_us(ev.record),
        "torch.Event.synchronize (done)": per_call_us(ev.synchronize),
        "torch.cuda.current_stream()": per_call_us(torch.cuda.current_stream),
        "_cuda_getCurrentRawStream": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0)),
        "CUDAGraph.replay (1 kernel)": per_call_us(g.replay),
    }
    for k, v in out["us"].items():
        print(f"{k:40s} {v:8.2f} us")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "host-costs.json")
