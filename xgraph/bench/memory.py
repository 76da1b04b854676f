"""`xgraph bench memory`: graph memory per capture order, full and piecewise, two model families.

For each model family (registered in `xgraph.bench`: the reference model; transformers'
LlamaForCausalLM, which the transformers integration registers) and graph kind (full
decode graphs at vLLM's capture sizes; piecewise graphs at SGLang-style prefill sizes), in
one process:

- a first pass running every size once eagerly, no graph (ascending, reported as `first_use`
  with its driver reading): what the process spends the first time it meets a shape
  (kernels compiled or loaded on first use, library workspaces) outlives every executor and
  an eager engine pays it as well, so it is measured here and charged to no order; then one
  capture of the largest size, closed again (`first_capture_driver_bytes`): what a process's
  first capture sets up once;
- the limit: the largest size captured alone into fresh memory;
- one fresh executor per order (ascending, random, largest-first) capturing every size into
  fresh shared-physical memory (with `all_modes`, also shared-pool and private).

Each run reports graph memory two ways: the driver's reading (memory in use after returning
cached allocator memory, minus a baseline taken once the model, the KV cache and the
persistent input buffers exist; accelerators that report one: it includes the output
buffers the first capture allocates, the same in every run, reported as
`output_buffer_bytes`) and the pool's own bytes (physical chunks in shared-physical memory,
native pool segments otherwise); the executor's
`outside_pool_bytes` (what the captures left in use outside graph memory, e.g. the driver's
graph executables); the number of graphs; and both readings over the limit's.
Every section and run is isolated: a failure is recorded where it happened and the rest run.

Graph executables: the driver keeps memory for every instantiated graph, outside any pool
(about 3 KB per kernel node on an H200: 2.6 MiB for a 849-node decode graph of the eager
reference forward), and keeps it after the graph is destroyed, for the next graphs to reuse.
So the first run of a section (ascending) shows it, as memory outside the pool, and the runs
after it reuse what that run left: their driver readings leave it out. It is a cost per
graph, the same in every order (measured on its own at commit 32b7ae8:
docs/results/h200/gpu-time-pass/graph-exec.json, LOG 2026-11-30, GPU-time pass).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ..buckets import sglang_piecewise_sizes, vllm_capture_sizes
from ..interfaces import Backend
from ..memory import GraphMemory
from . import build_target, default_largest, hooks, target_families
from .readings import MiB, driver_reading, measure, settle
from .report import attempt, error_text, note, table

MODES = ("shared-physical", "shared-pool", "private")
ORDERS = ("ascending", "random", "largest-first")
KINDS = ("full", "piecewise")
LIMIT_MODE = "shared-physical"  # the limit is captured like the runs it is compared with


def ordered(sizes: list[int], order: str, seed: int) -> list[int]:
    if order == "largest-first":
        return sorted(sizes, reverse=True)
    if order == "ascending":
        return sorted(sizes)
    if order == "random":
        return random.Random(seed).sample(sizes, len(sizes))
    raise ValueError(f"unknown order {order!r}")


def default_sizes(family: str, kind: str, accel: bool) -> list[int]:
    """The sizes a family's `kind` graphs are captured at by default (its registration's
    largest size, xgraph.bench.default_largest)."""
    largest = default_largest(family, kind, accel)
    return vllm_capture_sizes(largest) if kind == "full" else sglang_piecewise_sizes(largest)


def _capture(
    backend: Backend, target: Any, kind: str, mode: str, sizes: list[int], order: list[int]
) -> dict[str, Any]:
    """Capture `order` one size at a time into fresh `mode` memory; readings after each."""
    mem = GraphMemory(backend, mode)
    ex = target.executor(kind, sizes, mem)
    driver = driver_reading(backend)
    try:
        base, held = settle(backend), ex.persistent_bytes()
        curve, pool_curve = [], []
        for n in order:
            ex.capture([n], kind=kind, progress=False)
            now = settle(backend)
            # the output buffers come with the first capture (a transformers forward returns
            # logits: [largest size, vocab] of them); reported, not subtracted: the caching
            # allocator may place them in segments the baseline already holds, so their size
            # is not what they add, and every executor here allocates the same ones
            outputs = ex.persistent_bytes() - held
            curve.append((now or 0) - (base or 0) if driver else mem.graph_bytes())
            pool_curve.append(mem.graph_bytes())
        s = ex.stats()
        out = {
            "mode": mem.mode.value,
            "graphs": s["captures"],
            "driver_bytes": curve[-1] if driver else None,
            "pool_bytes": pool_curve[-1],
            "graph_bytes": curve[-1],  # the driver's reading where there is one, else the pool's
            "outside_pool_bytes": s["outside_pool_bytes"],
            "output_buffer_bytes": outputs,
            "capture_seconds": s["capture_seconds"],
            "curve_bytes": curve,
            "pool_curve_bytes": pool_curve,
        }
        if mem.physical is not None:
            out["physical"] = mem.physical.stats()
        return out
    finally:
        ex.close()
        mem.close()
        settle(backend)


def _first_use(backend: Backend, target: Any, kind: str, sizes: list[int]) -> dict[str, Any]:
    """Every size run once eagerly (ascending) on the layout of `kind`, then the largest
    captured once and closed: what a process pays once, before anything is measured."""
    ex = target.executor(kind, sizes, None, mode="eager")
    try:
        base, curve = settle(backend), []
        for n in sorted(sizes):
            ex.warm_up([n], kind=kind)
            now = settle(backend)
            curve.append(None if now is None or base is None else now - base)
        out = {"steps": ex.stats()["eager"], "driver_bytes": curve[-1], "curve_bytes": curve}
    finally:
        ex.close()
        settle(backend)
    # a process's first capture sets up what every later one shares (measured on an H200:
    # about 100 MiB the driver keeps); charged here, not to the limit
    first = _capture(backend, target, kind, LIMIT_MODE, sizes, [max(sizes)])
    out["first_capture_driver_bytes"] = first["driver_bytes"]
    return out


def _over_limit(run: dict[str, Any], limit: dict[str, Any]) -> None:
    if limit.get("graph_bytes"):
        run["x_limit"] = run["graph_bytes"] / limit["graph_bytes"]
    if limit.get("pool_bytes"):
        run["x_limit_pool"] = run["pool_bytes"] / limit["pool_bytes"]


def _section(
    backend: Backend,
    target: Any,
    section: dict[str, Any],
    modes: tuple[str, ...],
    seed: int,
    save: Callable[[], None],
) -> None:
    """The limit, then every mode and order, into `section` (saved after each run)."""
    kind, sizes = section["kind"], section["sizes"]
    largest = [max(sizes)]

    def first_use() -> dict[str, Any]:
        return {"first_use": _first_use(backend, target, kind, sizes)}

    def limit_capture() -> dict[str, Any]:
        return {"limit": _capture(backend, target, kind, LIMIT_MODE, sizes, largest)}

    attempt(section, "first_use", first_use)
    attempt(section, "limit", limit_capture)  # the orders run even if this fails
    limit = section.get("limit", {})
    section["runs"] = []
    for mode in modes:
        for order in ORDERS:
            run: dict[str, Any] = {"mode": mode, "order": order}
            section["runs"].append(run)
            if attempt(
                run,
                "run",
                lambda m=mode, o=order: _capture(
                    backend, target, kind, m, sizes, ordered(sizes, o, seed)
                ),
            ):
                run["order"] = order
                _over_limit(run, limit)
                note(
                    f"memory {section['model']} {kind} {mode} {order}: {run['graphs']} "
                    f"graphs, {run['graph_bytes'] / MiB:.1f} MiB, "
                    f"x{run.get('x_limit', float('nan')):.2f} limit"
                )
            save()


def _family(
    backend: Backend,
    family: str,
    model: str,
    sizes: dict[str, list[int]],
    data: dict[str, Any],
    modes: tuple[str, ...],
    seed: int,
    save: Callable[[], None],
) -> None:
    """Every kind of one family; a family that cannot be built is listed as skipped."""
    full_max = max(sizes.get("full", [1]))
    pw_max = max(sizes.get("piecewise", [1]))
    try:
        target = build_target(family, backend, model, full_max, pw_max)
    except ImportError as exc:  # its library is an extra not installed (MissingExtraError)
        data["skipped"][family] = f"skipped: {exc}"
        note(f"memory: {family} {data['skipped'][family]}")
        return
    except Exception as exc:  # a family failing to build must not hide the other
        data["skipped"][family] = f"failed to build: {error_text(exc)}"
        note(f"memory: {family} {data['skipped'][family]}")
        return
    try:
        for kind, ks in sizes.items():
            section = {
                "family": family,
                "model": target.model,
                "dtype": target.dtype,
                "kind": kind,
                "sizes": ks,
            }
            data["sections"].append(section)
            attempt(
                section,
                "section",
                lambda s=section: _section(backend, target, s, modes, seed, save),
            )
            save()
    finally:
        target.close()
        settle(backend)


def run(
    backend: Backend,
    model: str = "tiny",
    sizes: list[int] | None = None,
    piecewise_sizes: list[int] | None = None,
    families: tuple[str, ...] | None = None,
    kinds: tuple[str, ...] = KINDS,
    all_modes: bool = False,
    seed: int = 0,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`sizes` (full graphs) and `piecewise_sizes` override each family's defaults;
    `families`: the registered ones (xgraph.bench.target_families) when None."""
    accel = backend.device.type != "cpu"
    given = {"full": sizes, "piecewise": piecewise_sizes}
    modes = MODES if all_modes else (LIMIT_MODE,)
    data: dict[str, Any] = {
        "backend": backend.name,
        "device": hooks.device_name(backend),
        "model": model,
        "measure": measure(backend),
        "modes": list(modes),
        "orders": list(ORDERS),
        "sections": [],
        "skipped": {},
    }
    save = checkpoint or (lambda _: None)
    for family in target_families() if families is None else families:
        fs = {k: sorted(given[k] or default_sizes(family, k, accel)) for k in kinds}
        _family(backend, family, model, fs, data, modes, seed, lambda: save(data))
    return data


def _cell(v: int | None) -> Any:
    return v / MiB if v is not None else "n/a"


def _section_text(s: dict[str, Any]) -> str:
    sizes = s["sizes"]
    head = (
        f"{s['family']} ({s['model']}, {s.get('dtype', '')}), {s['kind']} graphs, "
        f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]}"
    )
    if "runs" not in s:
        return f"{head}: failed: {s.get('section_error')}"
    lim = s.get("limit")
    head += (
        f"; limit ({sizes[-1]} alone): driver {_cell(lim['driver_bytes'])} MiB, "
        f"pool {lim['pool_bytes'] / MiB:.1f} MiB"
        if lim
        else f"; limit failed: {s.get('limit_error')}"
    )
    first = s.get("first_use")
    if first:
        head += (
            f"; first use (every size once, eagerly, before the rest): driver "
            f"{_cell(first['driver_bytes'])} MiB, then a first capture: "
            f"{_cell(first.get('first_capture_driver_bytes'))} MiB"
        )
    rows = []
    for r in s["runs"]:
        row: dict[str, Any] = {"mode": r["mode"], "order": r["order"]}
        if "run_error" in r:
            rows.append({**row, "graphs": f"failed: {r['run_error']}"})
            continue
        rows.append(
            {
                **row,
                "graphs": r["graphs"],
                "driver MiB": _cell(r["driver_bytes"]),
                "pool MiB": r["pool_bytes"] / MiB,
                "outside pool MiB": _cell(r["outside_pool_bytes"]),
                "x limit (driver)": r.get("x_limit", "n/a")
                if r["driver_bytes"] is not None
                else "n/a",
                "x limit (pool)": r.get("x_limit_pool", "n/a"),
                "capture s": r["capture_seconds"],
            }
        )
    cols = [
        "mode",
        "order",
        "graphs",
        "driver MiB",
        "pool MiB",
        "outside pool MiB",
        "x limit (driver)",
        "x limit (pool)",
        "capture s",
    ]
    return f"{head}\n\n{table(rows, cols)}"


def summarize(data: dict[str, Any]) -> str:
    head = f"{data['backend']} / {data['device']}; measure: {data['measure']}"
    parts = [head] + [_section_text(s) for s in data["sections"]]
    parts += [f"{family}: {why}" for family, why in data["skipped"].items()]
    if data["sections"] and data["measure"].startswith("driver"):
        parts.append(
            "Outside pool: mostly graph executables, which the driver keeps per graph and "
            "reuses after a graph is destroyed; the first run with the most graphs (each "
            "section's ascending run) shows them, runs after it reuse that memory."
        )
    return "\n\n".join(parts)
