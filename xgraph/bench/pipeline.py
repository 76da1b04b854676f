"""`xgraph bench pipeline`: decode steps issued back to back with no synchronize, the way an
engine runs them, with the step's attention metadata on the host or on the device.

Per batch size and metadata placement, over `iters` steps of the reference model (a
different random batch each step, graphs captured first):

- `device_us`: one step's device time (the backend's device timer; host wall time on the
  CPU backend), the median of single steps;
- `wall_us`: wall time per step of the whole run, from the first call to the device
  finishing the last (`wall / device`: 1.0 when the device never waits for the host);
- `call_us`: host time per step spent inside the executor's call;
- `wait_us`: of it, the time blocked on a staging bank whose copy had not finished (the
  host ran two steps ahead of the device);
- `issue_us` = call - wait: the host's own work per step (`issue / device`: how much of a
  step's device time the host needs; below 1 the host can prepare the next step meanwhile).

`device` placement passes sequence lengths, block tables and slots as device tensors
(checked on the device by a captured check, xgraph.device_check), token ids and positions as
host tensors; `device, trusted` passes the same to `PagedAttention(validate="trusted")`,
which copies them as given (the check's cost is the difference of the two rows). On the CPU
backend "device" tensors are host tensors taken down the same path. The banks' waits are
timed by wrapping their copiers: a measurement of the internals, not an example.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..executor import GraphExecutor
from ..interfaces import Backend
from ..metadata import AttentionInputs
from ..models import Step, Workload
from . import hooks
from .report import header, table, workload

PLACEMENTS = ("host", "device", "device, trusted")


def _on_device(step: Step, w: Workload, dev: torch.device) -> dict[str, Any]:
    """The step's call arguments with its metadata as an engine keeps it on the device."""
    a = step.attn
    attn = AttentionInputs(
        list(a.query_lens),
        torch.tensor(list(a.seq_lens), dtype=torch.int32).to(dev),
        a.table(w.cache.dummy_block, w.max_blocks).to(dev),
        torch.as_tensor(a.slot_mapping).to(dev),
    )
    return {"input_ids": step.input_ids, "positions": step.positions, "attn": attn}


def _timed_waits(ex: GraphExecutor) -> list[float]:
    """Seconds blocked in each bank's wait, appended per wait (the copiers wrapped)."""
    waits: list[float] = []
    for bank in ex.planner.staged.banks:
        inner: Callable[[], None] = bank.copier.wait

        def wait(inner: Callable[[], None] = inner) -> None:
            t0 = time.perf_counter()
            inner()
            waits.append(time.perf_counter() - t0)

        bank.copier.wait = wait  # type: ignore[method-assign]
    return waits


def _row(backend: Backend, ex: GraphExecutor, calls: list[dict[str, Any]]) -> dict[str, float]:
    """One back-to-back run of `calls` (graphs captured already), and its device time."""
    for c in calls[:3]:
        ex(**c)
    device = hooks.time_on_device(backend, lambda: ex(**calls[0]))
    singles = [hooks.time_on_device(backend, lambda c=c: ex(**c)) for c in calls[:20]]
    waits = _timed_waits(ex)
    backend.synchronize()
    waits.clear()
    in_calls = 0.0
    t0 = time.perf_counter()
    for c in calls:
        t = time.perf_counter()
        ex(**c)
        in_calls += time.perf_counter() - t
    backend.synchronize()
    wall = time.perf_counter() - t0
    ex.synchronize()  # any device-metadata error of the run is raised here
    n = len(calls)
    if device is None:  # no device timer (CPU): the host's synchronized wall time
        device_s = wall / n
    else:
        device_s = statistics.median(s for s in singles if s is not None)
    return {
        "device_us": device_s * 1e6,
        "wall_us": wall / n * 1e6,
        "call_us": in_calls / n * 1e6,
        "wait_us": sum(waits) / n * 1e6,
    }


def run(
    backend: Backend,
    model: str = "tiny",
    batches: list[int] | None = None,
    iters: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    batches = batches or [1, 8, 64]
    iters = iters or 200
    w = workload(backend, model, max_seqs=max(batches), context=512)
    rng = random.Random(seed)
    rows = []
    for placement in PLACEMENTS:
        on_device = placement != "host"
        ex = w.executor(
            backend=backend,
            buckets=sorted(set(batches)),
            on_capture_error="raise",
            attention=w.attention(validate="trusted" if "trusted" in placement else "checked"),
        )
        if on_device and backend.device.type == "cpu":
            ex.planner.attn_check.cpu_is_device = True  # type: ignore[union-attr]
        for b in batches:
            steps = [w.decode_step(rng, b, max_context=256) for _ in range(iters)]
            if on_device:
                calls = [_on_device(s, w, backend.device) for s in steps]
            else:
                calls = [
                    s.with_tensor_tables(w.max_blocks, w.cache.dummy_block).kwargs() for s in steps
                ]
            row = _row(backend, ex, calls)
            row["issue_us"] = row["call_us"] - row["wait_us"]
            row["wall_per_device"] = row["wall_us"] / row["device_us"]
            row["issue_per_device"] = row["issue_us"] / row["device_us"]
            rows.append({"batch": b, "metadata": placement, **row})
        ex.close()
    data = {**header(backend, model, w), "iters": iters, "rows": rows}
    return {**data, "timing": "back to back, no synchronize between steps"}


COLUMNS = [
    "batch",
    "metadata",
    "device_us",
    "wall_us",
    "wall_per_device",
    "call_us",
    "wait_us",
    "issue_us",
    "issue_per_device",
]


def summarize(data: dict[str, Any]) -> str:
    return (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}): decode steps "
        f"issued back to back, {data['iters']} per row; wall and call per step, issue = call - "
        "wait (the host's own work)\n\n" + table(data["rows"], COLUMNS)
    )
