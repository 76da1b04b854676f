"""Graph memory known before the KV cache: capture the largest key of each kind, read, undo.

    plan = xgraph.predict_graph_memory(decode_ex, prefill_ex)   # or decode_ex.plan_memory()
    plan.total_bytes   # what capturing every bucket will hold: pool, executables, outputs

Shared-physical memory makes graph memory the maximum over captures, not the sum, so the
capture of the largest key of each kind (the full decode graph of the largest bucket, the
pieces of the largest piecewise bucket) needs as much pool memory as every bucket will:
that is `pool_bytes`, measured, not extrapolated. What a captured graph costs outside every
pool (the driver's executable: its nodes, kept in device memory) grows with the number of
graphs instead; it is measured on the device around the same captures, per graph of each
kind (over `EXECUTABLE_SAMPLES` keys spread over the buckets, `samples`),
and counted once per bucket (`executable_bytes`). Backends whose recordings cost the
device nothing (`Backend.graph_executables` False: the CPU reference) report 0. The CUDA
driver keeps the memory of freed executables for later ones, so a plan reads them only
before the process's first graphs are freed: plan at start-up, as an engine sizes its cache.
An executor's first capture also makes its output buffers (the largest bucket's rows, the
forward's outputs: logits can be the largest memory of all); the twins make the same ones,
and `output_bytes` counts them for each executor that has none yet.

The captures run in twin executors of the ones given (the same forward, inputs, buckets,
attention and mode) over a fresh graph memory of the same mode, closed before the call
returns: no graph, pool, address space or chunk is left behind, and the executors given
are untouched. Only the dummy slot and block of the KV cache are written, so an engine
builds its executors over a placeholder cache of a few blocks, plans, then allocates the
real cache from what is left (docs/engine-integration.md, "Sizing the KV cache").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import XGraphError
from .memory import GraphMemory
from .options import Kind, MemoryMode, Mode

if TYPE_CHECKING:
    from .executor import GraphExecutor

logger = logging.getLogger("xgraph")

EXECUTABLE_SAMPLES = 16  # graphs of each kind whose executables are measured, largest first
KINDS_OF_MODE = {
    Mode.AUTO: (Kind.FULL, Kind.PIECEWISE),
    Mode.FULL: (Kind.FULL,),
    Mode.PIECEWISE: (Kind.PIECEWISE,),
    Mode.EAGER: (),
}


@dataclass
class KindPlan:
    """One kind of graph of one executor: its largest key, its graphs, their executables."""

    executor: str
    kind: str
    largest: int  # num_tokens of the key captured
    graphs: int  # graphs of this kind every bucket makes
    executable_bytes_per_graph: int


@dataclass
class MemoryPlan:
    """What capturing every bucket will hold (see the module docstring)."""

    pool_bytes: int
    kinds: list[KindPlan] = field(default_factory=list)
    executables_measured: bool = False  # False: the backend's recordings cost the device 0
    seconds: float = 0.0
    # the output buffers (the largest bucket's rows) each executor's first capture makes,
    # for executors that have none yet
    output_bytes: int = 0

    @property
    def graphs(self) -> int:
        return sum(k.graphs for k in self.kinds)

    @property
    def executable_bytes(self) -> int:
        return sum(k.graphs * k.executable_bytes_per_graph for k in self.kinds)

    @property
    def total_bytes(self) -> int:
        """What to keep back from the KV cache for the captures: the pool, the executables
        and the output buffers they will make."""
        return self.pool_bytes + self.executable_bytes + self.output_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool_bytes": self.pool_bytes,
            "executable_bytes": self.executable_bytes,
            "output_bytes": self.output_bytes,
            "total_bytes": self.total_bytes,
            "graphs": self.graphs,
            "executables_measured": self.executables_measured,
            "seconds": self.seconds,
            "kinds": [vars(k) for k in self.kinds],
        }


def predict_graph_memory(
    *executors: GraphExecutor, kinds: Iterable[Kind | str] | None = None
) -> MemoryPlan:
    """The graph memory every bucket of `executors` will need (see the module docstring).

    `kinds` narrows the kinds planned (default: those the executor's mode captures: auto
    both, full decode graphs, piecewise pieces). Executors over one GraphMemory share its
    pool, so their plan is the maximum of theirs; separate memories add up. Shared-pool
    memory is planned as if the largest key is captured first (its only good order);
    private memory (the sum of shapes) cannot be planned from the largest keys: refused.
    """
    if not executors:
        raise XGraphError("predict_graph_memory: give at least one executor.")
    wanted = None if kinds is None else {Kind.parse(k, "kinds") for k in kinds}
    t0 = time.perf_counter()
    plan = MemoryPlan(0, executables_measured=executors[0].backend.graph_executables)
    groups: dict[int, list[GraphExecutor]] = {}
    for ex in executors:
        _check(ex)
        groups.setdefault(id(ex.memory), []).append(ex)
    for group in groups.values():
        plan.pool_bytes += _plan_memory(group, wanted, plan)
    plan.seconds = time.perf_counter() - t0
    logger.info(
        "graph memory plan: %d pool + %d executable + %d output bytes for %d graphs (%.2f s)",
        plan.pool_bytes,
        plan.executable_bytes,
        plan.output_bytes,
        plan.graphs,
        plan.seconds,
    )
    return plan


def measured_graph_memory(*executors: GraphExecutor) -> int:
    """What the executors' captures hold now, read as a plan predicts it: the physical (or
    pool) bytes of each distinct graph memory, the executables measured outside them (on
    backends whose recordings cost the device memory) and the executors' output buffers.
    After a plan in the same process it can read low: the CUDA driver gives the real
    captures memory it kept from the plan's closed ones, which their own readings never
    see; the device's reading from before the plan to after the captures holds it
    (docs/startup.md, "Graph memory before the KV cache")."""
    memories = {id(ex.memory): ex.memory for ex in executors}
    total = sum(m.graph_bytes() for m in memories.values())
    total += sum(ex.cache.output_bytes() for ex in {id(ex): ex for ex in executors}.values())
    if executors and executors[0].backend.graph_executables:
        total += sum(ex.stats()["outside_pool_bytes"] or 0 for ex in executors)
    return total


def _check(ex: GraphExecutor) -> None:
    if ex.memory.mode is MemoryMode.PRIVATE:
        raise XGraphError(
            f"predict_graph_memory: {ex.name} uses private graph memory (the sum of every "
            "shape), which the largest keys cannot predict. Plan over 'shared-physical' (the "
            "default with VMM) or 'shared-pool' memory."
        )
    if ex.lockstep.stats() is not None:
        raise XGraphError(
            f"predict_graph_memory: {ex.name} runs across ranks; its captures need every rank "
            "together. Plan on one rank with an executor built without parallel=."
        )


def _plan_memory(group: Sequence[GraphExecutor], wanted: set[Kind] | None, plan: MemoryPlan) -> int:
    """Twins of the group's executors over one fresh memory: the pool bytes they held."""
    first = group[0]
    physical = first.memory.physical
    memory = GraphMemory(
        first.backend,
        first.memory.mode,
        chunk_size=None if physical is None else physical.chunk_size,
    )
    try:
        for ex in group:
            _plan_executor(ex, memory, wanted, plan)
        return memory.graph_bytes()
    finally:
        memory.close()


def _plan_executor(
    ex: GraphExecutor, memory: GraphMemory, wanted: set[Kind] | None, plan: MemoryPlan
) -> None:
    kinds = [k for k in KINDS_OF_MODE[ex.mode] if wanted is None or k in wanted]
    if not kinds:
        return
    twin = _twin(ex, memory)
    try:
        key_dims, per_key = _key_dims(ex)
        sizes = samples(ex.buckets.sizes, ex.backend.graph_executables)
        for kind in kinds:
            before = twin.stats()["outside_pool_bytes"] or 0
            twin.capture(sizes, kind=kind, progress=False, **key_dims)
            grown = (twin.stats()["outside_pool_bytes"] or 0) - before
            per_graph = max(grown, 0) // len(sizes) if ex.backend.graph_executables else 0
            graphs = len(ex.buckets.sizes) * per_key
            plan.kinds.append(KindPlan(ex.name, kind.value, ex.buckets.max, graphs, per_graph))
        if not ex.cache.has_outputs:  # the twin's first capture made the same buffers
            plan.output_bytes += twin.cache.output_bytes()
    finally:
        twin.close()


def samples(sizes: Iterable[int], executables: bool) -> list[int]:
    """The sizes a plan captures, largest first (it needs the pool every bucket will).
    Where executables cost device memory, more: the driver's reading moves in pages, so one
    graph's cost is read over several, and a graph's nodes can differ by size (a kernel
    library choosing by shape: few-row kernels for small buckets, GEMMs for large ones), so
    they are spread evenly over every bucket, not the largest few."""
    ordered = sorted(sizes, reverse=True)
    if not executables:
        return ordered[:1]
    if len(ordered) <= EXECUTABLE_SAMPLES:
        return ordered
    rest, picks = ordered[1:], EXECUTABLE_SAMPLES - 1
    return [ordered[0], *(rest[(i * len(rest)) // picks] for i in range(picks))]


def _key_dims(ex: GraphExecutor) -> tuple[dict[str, int], int]:
    """The largest size of each further shape-determining dim, and the keys they multiply
    each num_tokens bucket into."""
    dims = {n: d for n, d in ex.planner.dims.items() if d.buckets and n != "num_tokens"}
    largest = {n: max(d.buckets or ()) for n, d in dims.items()}
    return largest, math.prod(len(set(d.buckets or ())) for d in dims.values())


def _twin(ex: GraphExecutor, memory: GraphMemory) -> GraphExecutor:
    """An executor like `ex` over `memory`: its captures are the plan's, never `ex`'s."""
    return type(ex)(
        ex.forward,
        inputs=ex.planner.inputs,
        backend=ex.backend,
        buckets=ex.buckets,
        dims=[d for n, d in ex.planner.dims.items() if n != "num_tokens"],
        attention=ex.attention,
        memory=memory,
        mode=ex.mode,
        on_capture_error="raise",
        name=f"{ex.name}-plan",
        compiled=ex.compiled,
        pdl=ex.pdl.enabled,
    )
