"""Host microseconds of launching an executor's decode graph, against the same forward
captured by hand, per batch, across memory modes and capture orders: whether the executor
step's host time beyond the raw replay lies in its Python or in the graph launch itself.

    OUT=out XGRAPH_CUDA_LINEAR=triton XGRAPH_PDL=1 python experiments/graph_launch_cost.py \\
        --model qwen3-0.6b --buckets 1,8,64

Per case (memory mode, capture order) and batch: the executor step's host us, the host us
of `replay()` on the torch graph the step replays (found by watching which graph a step
launches), and the hand-captured graph's (`native_anchor`), each the median of `--iters`
calls with an idle device. Writes `$OUT/graph-launch-cost.json`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from probe_common import buckets_of, decode_workload, parser, write

from xgraph.bench.anchors import native_anchor
from xgraph.bench.timing import host_time


def host_us(backend, fn, iters: int) -> float:
    return host_time(backend, fn, iters) * 1e6


@contextmanager
def watched():
    """The torch graphs replayed inside the block, in order."""
    seen: list = []
    cls = torch.cuda.CUDAGraph
    kept = cls.replay

    def replay(self):
        seen.append(self)
        return kept(self)

    cls.replay = replay
    try:
        yield seen
    finally:
        cls.replay = kept


def case(backend, w, steps, mode: str, order: list[int], iters: int) -> dict:
    ex = w.executor(
        w.model.forward,
        backend=backend,
        buckets=sorted(steps),
        memory=mode,
        on_capture_error="raise",
    )
    out = {}
    for b in order:  # the first call of each batch captures it
        ex(**steps[b].kwargs())
    for b in sorted(steps):
        call = lambda s=steps[b]: ex(**s.kwargs())  # noqa: E731
        for _ in range(3):
            call()
        with watched() as seen:
            call()
        row = {"step_us": host_us(backend, call, iters), "graphs_per_step": len(seen)}
        if seen:
            row["graph_replay_us"] = host_us(backend, seen[-1].replay, iters)
        out[str(b)] = row
        print(mode, order, b, row, flush=True)
    ex.close()
    return out


def main() -> None:
    p = parser()
    p.add_argument("--modes", default="shared-physical,shared-pool")
    a = p.parse_args()
    buckets = buckets_of(a)
    backend, w, steps = decode_workload(a.model, buckets)
    out: dict = {"model": a.model, "device": str(backend.device), "cases": {}, "anchor": {}}
    with torch.no_grad():
        for b in buckets:
            anchor = native_anchor(backend, w, steps[b])
            if anchor is not None:
                replay, _ = anchor
                out["anchor"][str(b)] = host_us(backend, replay, a.iters)
                print("anchor", b, out["anchor"][str(b)], flush=True)
                del anchor, replay
        for mode in a.modes.split(","):
            for name, order in (("ascending", buckets), ("descending", buckets[::-1])):
                out["cases"][f"{mode}/{name}"] = case(backend, w, steps, mode, order, a.iters)
    write("graph-launch-cost.json", out)


if __name__ == "__main__":
    main()
