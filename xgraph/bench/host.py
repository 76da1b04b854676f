"""`xgraph bench host`: the executor's host overhead per decode step, phase by phase.

Per batch size, the median host wall time in microseconds of each phase of a graph hit,
each call made with an idle device (synchronized before it, outside the timed window), the
phases timed in turn within each iteration so that noise falls on all of them alike:

- `plan`: `StepPlanner.plan`, the whole planning of the step (the copy to the device issued);
- `validate`, `classify`, `stage`: its three moves, called on their own (validate:
  `check`, the token inputs, then the attention inputs normalized and checked against the
  cache; classify: `decide`, the kind, bucket and key; stage: the host twin written, the
  one copy issued);
- `lookup`: the graph cache lookup; `output`: the output views;
- `replay`: the executor's replay call (runner planning, the graph's state checks) minus
  `raw_replay`, the backend's own replay of the same graph (its driver call alone);
- `step`: one whole executor call; `overhead` = step - raw_replay, what xgraph adds to a
  replay of the same graph;
- `engine_step`: the anchor measured in the same run, an engine's own step without xgraph:
  the step's six input tensors (token ids, positions, slots, lengths, query starts, block
  tables) copied from pinned host tensors into static device tensors, one copy each, then
  the same raw replay. It validates nothing, so it is a floor; it also shows how fast this
  host runs such code (host speed moved the overhead by 2x between machines of one kind);
- `beyond_engine` = step - engine_step: what xgraph's step costs beyond that anchor (its
  checks, padding and key; its one copy against the anchor's six). Where the host is slow
  the anchor's copies alone can pass a fixed budget for `overhead`; this column says how
  much of the overhead is xgraph's own.

The forward is `trivial` by default (two ops: a replay costs little, so the subtraction adds
no noise) or the reference `model`. The workload is the one `bench decode` uses on an
accelerator: block tables 512 tokens wide (tensors, as engines keep them), contexts up to
256. The phases are the planner's moves (`check`, `decide`, `stage`) and the key cache's
(`lookup`, `replay`, `outputs`) called on their own: a measurement of the internals, not
an example of the API.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Callable
from typing import Any

import torch

from ..executor import GraphExecutor
from ..interfaces import Backend
from ..models import Step, Workload
from .anchors import as_step, sender
from .report import header, table, workload
from .timing import host_times

PHASES = ("plan", "validate", "classify", "stage", "lookup", "replay", "output")


def _trivial(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A forward of two ops, [tokens, 1]: the replay it records costs next to nothing."""
    return (input_ids + positions)[:, None].float()


def _calls(ex: GraphExecutor, step: Step) -> dict[str, Callable[[], Any]]:
    """One callable per measured phase, on a step whose graph is captured."""
    p = ex.planner
    inputs = {"input_ids": step.input_ids, "positions": step.positions}
    attn = step.attn
    planned = p.plan(inputs, attn)
    entry = ex.cache.entries[planned.key]
    n, key = planned.num_tokens, planned.key
    raw = entry.graph.graph._replay  # type: ignore[attr-defined]  # a FullGraph's backend graph
    # the raw replay first: like the replay inside `step`, it follows the previous step
    calls: dict[str, Callable[[], Any]] = {"raw_replay": raw, "plan": lambda: p.plan(inputs, attn)}
    checked = p.check(inputs, attn)
    decision = p.decide(checked)
    calls.update(
        validate=lambda: p.check(inputs, attn),
        classify=lambda: p.decide(checked),
        stage=lambda: p.stage(checked, decision),
    )
    calls.update(
        lookup=lambda: ex.cache.lookup(key),
        replay=lambda: ex.cache.replay(entry, planned),
        output=lambda: ex.cache.outputs(n),
        step=lambda: ex(**step.kwargs()),
        engine_step=as_step(_engine_send(ex, step), raw),
    )
    return calls


def _engine_send(ex: GraphExecutor, step: Step) -> Callable[[], None]:
    """The anchor's send: each of the step's inputs copied into a static device tensor."""
    a, dev = step.attn, ex.planner.device
    qsl = torch.arange(step.num_tokens + 1, dtype=torch.int32)  # a decode step's starts
    host = [step.input_ids, step.positions, a.slots(), torch.as_tensor(a.seq_lens), qsl, a.table(0)]
    return sender(ex.backend, [t.to(dev) for t in host])


def _medians(backend: Backend, calls: dict[str, Callable[[], Any]], iters: int) -> dict:
    """Median host seconds of each call, the calls taken in turn within each iteration."""
    for fn in calls.values():  # warm-up: lazy views, caches, allocator
        for _ in range(5):
            fn()
    return host_times(backend, calls, iters)


def _row(backend: Backend, ex: GraphExecutor, step: Step, iters: int) -> dict[str, Any]:
    ex(**step.kwargs())  # capture this batch's graph
    t = _medians(backend, _calls(ex, step), iters)
    us = {k: v * 1e6 for k, v in t.items()}
    row: dict[str, Any] = {"batch": step.num_tokens}
    row.update({f"{k}_us": us[k] for k in PHASES if k in us and k != "replay"})
    row["replay_us"] = us["replay"] - us["raw_replay"]
    row["raw_replay_us"] = us["raw_replay"]
    row["step_us"] = us["step"]
    row["overhead_us"] = us["step"] - us["raw_replay"]
    row["engine_step_us"] = us["engine_step"]
    row["beyond_engine_us"] = us["step"] - us["engine_step"]
    return row


def run(
    backend: Backend,
    model: str = "tiny",
    batches: list[int] | None = None,
    iters: int | None = None,
    forward: str = "trivial",
    seed: int = 0,
) -> dict[str, Any]:
    batches = batches or [1, 8, 64, 256]
    accel = backend.device.type != "cpu"
    iters = iters or (300 if accel and forward == "model" else 2000)
    w: Workload = workload(backend, model, max_seqs=max(batches), context=512)
    fwd = w.model.forward if forward == "model" else _trivial
    ex = w.executor(fwd, backend=backend, buckets=batches)
    rng = random.Random(seed)
    rows = []
    for b in batches:
        step = w.decode_step(rng, b, max_context=256)
        step = step.with_tensor_tables(w.max_blocks, w.cache.dummy_block)
        rows.append(_row(backend, ex, step, iters))
    ex.close()
    data = {**header(backend, model, w), "forward": forward, "iters": iters, "cpu": cpu_name()}
    return {**data, "timing": "host wall time, idle device, median", "rows": rows}


def cpu_name() -> str:
    """The host CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarize(data: dict[str, Any]) -> str:
    cols = [
        "batch",
        *(f"{k}_us" for k in PHASES),
        "raw_replay_us",
        "step_us",
        "overhead_us",
        "engine_step_us",
        "beyond_engine_us",
    ]
    rows = [{k: r.get(k, "") for k in cols} for r in data["rows"]]
    return (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}), "
        f"forward: {data['forward']}; host us per decode step, median of {data['iters']}; "
        "overhead = step - raw_replay; engine_step: six pinned copies + the raw replay "
        "(no xgraph); beyond_engine = step - engine_step; "
        f"cpu: {data.get('cpu', '?')}\n\n" + table(rows, cols)
    )
