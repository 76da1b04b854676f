"""The parameterization-leak check: one key captured under changed per-step metadata, the
recordings compared launch by launch.

The rule (the design's sections 1.3 and 2.2): a dim that enters a launch shape, a workspace
layout or a tiling key cannot be updated after capture. A kernel that sizes its grid from
the longest sequence, or picks its tiling from host sequence lengths, is frozen with the
capture step's values, and later steps of the key replay it wrongly. The capture guard
catches host reads of device data; this check catches launches that follow Python values.

For each key: the base step (xgraph.variants) is captured twice (what differs between the
two is an address or padding, not a leak, and is left out), then once per variation
(sequence lengths, block tables, batch composition). The backend describes each recording
(`Graph.launches()`: CUDA's kernel nodes, the CPU backend's taped ops, the Ascend
simulator's task list) and xgraph.launchdiff compares them. Each recording is captured on
a pool of its own, read, reset and its pool closed: the executor keeps nothing (its graphs,
graph memory and stats are as before), and the steps touch only the dummy slot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .distributed.lockstep import SingleRank
from .errors import InputError, XGraphError
from .interfaces import Backend, Graph
from .launchdiff import PER_CALL, KeyCheck, ParameterizationReport, Site, compare, unchecked
from .launches import root_module, tracking
from .options import Kind, Mode
from .piecewise import FullGraph
from .precapture import checked_sizes
from .safety import register_library_path
from .variants import VARIATIONS, Variant, Variants, describe_steps

logger = logging.getLogger("xgraph")

if TYPE_CHECKING:
    from .executor import GraphExecutor
    from .lifetime import Recording
    from .steps import Staged


class _Readable:
    """The executor's backend as a recording sees it: every graph keeps its launches."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def new_graph(self) -> Graph:
        g = self.backend.new_graph()
        if not g.keep_launches():
            raise unsupported(self.backend)
        return g


def unsupported(backend: Backend) -> XGraphError:
    return XGraphError(
        f"Backend {backend.name!r} cannot read what its graphs record (its Graph's "
        "_keep_launches, or its runtime's readable_graph, answers that it cannot), so the "
        "parameterization check cannot run on it. Run the check on the CPU backend (the same "
        "model code, its ops compared), or where recordings can be read: cpu, cuda, the "
        "simulators."
    )


def _as_library(backend: Backend) -> None:
    """Frames of the backend's package are library code, so layers name the model line (the
    registry does this when it loads a backend; one constructed directly is met here)."""
    package = sys.modules.get(type(backend).__module__.split(".")[0])
    if getattr(package, "__file__", None):
        register_library_path(os.path.dirname(os.path.abspath(package.__file__)))  # type: ignore[union-attr, arg-type]


def supported(backend: Backend) -> bool:
    """Whether this backend's graphs can describe what they record."""
    g = backend.new_graph()
    try:
        return bool(g.keep_launches())
    finally:
        g.reset()


# -- one recording -------------------------------------------------------------------------


def _sites(rec: Recording) -> list[Site]:
    full = isinstance(rec, FullGraph)
    pieces = [rec.graph] if full else [i for i in rec.items if isinstance(i, Graph)]  # type: ignore[attr-defined]
    out: list[Site] = []
    for p, g in enumerate(pieces):
        out += [Site(len(out) + i, None if full else p, la) for i, la in enumerate(g.launches())]
    return out


def record(ex: GraphExecutor, step: Staged, root: Any) -> list[Site]:
    """Warm up, capture the step on a pool of its own, read its launches, release it all
    (the executor's capture transaction records it and keeps nothing)."""
    # module hooks name the layers; a compiled forward would recompile under them
    layers = tracking(root) if not ex.compiled else contextlib.nullcontext()
    with ex.transaction.apart(step, _Readable(ex.backend), layers) as rec:  # type: ignore[arg-type]
        return _sites(rec)


# -- the check -----------------------------------------------------------------------------


def _kinds(ex: GraphExecutor, kind: Kind | str | None) -> list[Kind]:
    if kind is not None:
        k = Kind.parse(kind, "kind")
        if k is Kind.EAGER:
            raise XGraphError("kind='eager': choose 'full' or 'piecewise' (eager records nothing).")
        return [k]
    served = {  # without attention every step is a decode step (full graphs)
        Mode.AUTO: [Kind.FULL, Kind.PIECEWISE] if ex.attention is not None else [Kind.FULL],
        Mode.FULL: [Kind.FULL],
        Mode.PIECEWISE: [Kind.PIECEWISE],
    }
    if ex.mode not in served:
        raise XGraphError(
            f"{ex.name}: mode='eager' records no graphs, so nothing leaks; nothing to check."
        )
    return served[ex.mode]


def _sizes(ex: GraphExecutor, sizes: Iterable[int] | None) -> list[int]:
    """Bucket sizes to check: the given ones padded to their buckets, else one of 4 or more
    tokens (room for every variation) or the largest."""
    if sizes is None:
        big = [s for s in ex.buckets.sizes if s >= 4]
        return [min(big) if big else ex.buckets.max]
    out: list[int] = []
    for n in checked_sizes(sizes, ex.buckets, f"{ex.name}: check_parameterization"):
        b = ex.buckets.pad(n)
        if b is not None and b not in out:
            out.append(b)
    return out


def _query_lens(ex: GraphExecutor, query_lens: Iterable[int] | None) -> list[int]:
    """Query lengths of the full graphs to check: given, else 1 and the longest the
    executor's full graphs serve (speculative verification keys them by it)."""
    top = ex.planner.full_query_len
    if query_lens is None:
        return sorted({1, top})
    out = list(query_lens) if not isinstance(query_lens, (int, str)) else [query_lens]
    for q in out:
        if type(q) is not int or not 1 <= q <= top:
            raise InputError(
                f"{ex.name}: query_lens holds {q!r}; full graphs here serve 1 to {top} tokens "
                "per sequence (PagedAttention(max_query_len=...) sets the longest)."
            )
    return sorted(set(out))


def _sequences(ex: GraphExecutor, sizes: Iterable[int] | None, q: int, strict: bool) -> list[int]:
    """Sequence counts to check full graphs of q > 1 tokens per sequence at: the given sizes
    padded to buckets (those past the largest bucket at q tokens each refused when `strict`,
    else left out), or one bucket of 4 or more that fits, or the largest that does."""
    top = ex.buckets.max
    if sizes is None:
        fit = [s for s in ex.buckets.sizes if s * q <= top]
        big = [s for s in fit if s >= 4]
        return [min(big) if big else max(fit)] if fit else []
    padded = _sizes(ex, sizes)
    over = [n for n in padded if n * q > top]
    if over and strict:
        raise InputError(
            f"{ex.name}: check_parameterization: {over[0]} sequences (a bucket) of {q} "
            f"tokens are above the largest bucket ({top}); give at most {top // q} sequences."
        )
    return [n for n in padded if n * q <= top]


def _keys(
    ex: GraphExecutor,
    kinds: list[Kind],
    sizes: Iterable[int] | None,
    qs: list[int],
    strict: bool,
) -> list[tuple[Kind, int, int]]:
    """(kind, size, query length) of every key to check; for q > 1 sizes count sequences of
    q tokens (`strict`: the query lengths were given, so a size that cannot hold them is
    refused rather than left out)."""
    out: list[tuple[Kind, int, int]] = []
    for k in kinds:
        for q in qs if k is Kind.FULL else [1]:
            if q == 1:
                out += [(k, n, 1) for n in _sizes(ex, sizes)]
            else:
                out += [(k, n, q) for n in _sequences(ex, sizes, q, strict)]
    return out


def _vary(vary: Sequence[str]) -> list[str]:
    names = [vary] if isinstance(vary, str) else list(vary)
    bad = [v for v in names if v not in VARIATIONS]
    if bad:
        raise InputError(f"vary={bad}: choose from {sorted(VARIATIONS)}.")
    return names


class _Check:
    """One run of the check over an executor (its step lock held by the caller)."""

    def __init__(self, ex: GraphExecutor) -> None:
        self.ex = ex
        self.root = root_module(ex.forward)
        self.report = ParameterizationReport(ex.backend.name)

    def plan(self, v: Variant, kind: Kind | None, synthetic: bool) -> Staged:
        step = self.ex.planner.plan(v.tensors, v.attn, kind=kind, synthetic=synthetic)
        if step.kind is Kind.EAGER or step.key is None:
            raise XGraphError(
                f"{self.ex.name}: the {v.name} step runs eagerly ({step.reason}), so it has "
                "no graph to check; give steps that run as graphs (within the buckets)."
            )
        return step

    def key(
        self, variants: list[Variant], kind: Kind | None, synthetic: bool, not_varied: list[str]
    ) -> None:
        """Capture the base twice and every other variant once; add what differs."""
        base_step = self.plan(variants[0], kind, synthetic)
        key = base_step.key
        assert key is not None
        base = record(self.ex, base_step, self.root)
        again = record(self.ex, self.plan(variants[0], kind, synthetic), self.root)
        self.report.add(key, compare(key, base, again), PER_CALL)  # the same step twice
        for v in variants[1:]:
            step = self.plan(v, kind, synthetic)
            if step.key != key:
                raise XGraphError(
                    f"{self.ex.name}: the {v.name} step maps to key {step.key}, the base to "
                    f"{key}; every step of one check must map to the same key."
                )
            self.report.add(key, compare(key, base, record(self.ex, step, self.root)), v.name)
        names = [v.name for v in variants[1:]]
        check = KeyCheck(key, len(base), len(variants) + 1, names, not_varied, unchecked(base))
        self.report.keys.append(check)


def check_parameterization(
    ex: GraphExecutor,
    sizes: Iterable[int] | None,
    kind: Kind | str | None,
    steps: Sequence[Mapping[str, Any]] | None,
    vary: Sequence[str],
    key_dims: dict[str, int],
    query_lens: Iterable[int] | None = None,
) -> ParameterizationReport:
    """GraphExecutor.check_parameterization (see its docstring)."""
    if not isinstance(ex.lockstep, SingleRank):
        raise XGraphError(
            f"{ex.name}: the parameterization check runs on one rank, and this executor agrees "
            "every step with its peers (parallel=...): captures here alone would wait in "
            "collectives the other ranks never join. Check the model in a process of its own "
            "without parallel= (on the CPU backend, say), where its launches are the same."
        )
    names = _vary(vary)
    if steps is not None and len(steps) < 2:
        raise InputError(f"{ex.name}: steps= takes two or more steps of one key to compare.")
    kinds = _kinds(ex, kind) if steps is None else []
    qs = _query_lens(ex, query_lens)
    if max(qs) > 1 and Kind.FULL not in kinds and steps is None:
        raise InputError(f"{ex.name}: query_lens={qs} name full graphs; this check has none.")
    todo = _keys(ex, kinds, sizes, qs, query_lens is not None) if steps is None else []
    if not supported(ex.backend):
        raise unsupported(ex.backend)
    _as_library(ex.backend)
    check = _Check(ex)
    with ex.hold("parameterization check"):  # as a step: one at a time over shared memory
        if steps is not None:
            check.key(describe_steps(list(steps)), None, False, [])
        for k, n, q in todo:
            logger.info("%s: parameterization check of %s %d (q %d)", ex.name, k.value, n, q)
            v = Variants(ex.planner, n, k, key_dims, q)
            check.key(v.build(names), k, True, v.not_varied)
    return check.report
