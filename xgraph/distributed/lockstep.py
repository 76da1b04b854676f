"""The executor's side of graphs across ranks: agreed steps, lockstep captures, idle steps.

`attach(parallel, executor)` gives the executor its lockstep. With more than one rank (or
communication dims) it wraps the executor's planner: each `plan` plans the step locally,
exchanges one fixed-size message per rank on the side group (xgraph.distributed.agreement),
and plans again only where this rank's choice differs from the agreed one (another kind, more
padding). Captures go through `warm_up` and `checked` (xgraph.distributed.capture); a step
that fails on one rank after the ranks agreed on it stops the executor with
DistributedError (its peers are left in collectives it will not join). Without `parallel`
the executor gets `SINGLE`, whose hooks do nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import XGraphError
from ..options import Kind
from ..steps import Step
from ..validation import NUM_TOKENS
from .agreement import IDLE, OK, REFUSED, Agreed, decide, divergence, message, tp_mismatch
from .capture import CaptureCheck, CheckedRecording, is_agreed, mark_agreed, warm_up_scope
from .channel import STEP
from .errors import DistributedError, PeerStepError
from .parallel import Parallel

_local = threading.local()


def comm_size(name: str = "num_comm_tokens") -> int:
    """The agreed size of a communication dim in the step being run or captured (a Python
    int, fixed per graph key). Call it in the forward, e.g. for an MoE all-to-all's capacity."""
    sizes = getattr(_local, "comm", None) or {}
    if name not in sizes:
        raise XGraphError(
            f"comm_size({name!r}): no step with that communication dim is running in this "
            "thread. Call it inside the forward of an executor made with "
            f"Parallel(comm_dims=[{name!r}]), or set it with xgraph.distributed.comm_sizes()."
        )
    return int(sizes[name])


@contextlib.contextmanager
def comm_sizes(**sizes: int) -> Iterator[None]:
    """Set communication dims for code run outside an executor (eager references)."""
    saved = getattr(_local, "comm", None)
    _local.comm = {**(saved or {}), **sizes}
    try:
        yield
    finally:
        _local.comm = saved


class SingleRank:
    """The lockstep of an executor without `parallel`: every hook does nothing, and it has no
    `run`, so the executor calls its own `_run` directly (nothing added to one rank's step)."""

    def warm_up(self, step: Step) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def checked(self, step: Step, recording: Any) -> Any:
        return recording

    def idle(self) -> Step | None:
        raise XGraphError(
            "idle_step() is for data-parallel ranks: create the executor with "
            "parallel=xgraph.Parallel(dp=...)."
        )

    def stats(self) -> dict[str, Any] | None:
        return None


SINGLE = SingleRank()


def attach(parallel: Parallel | None, executor: Any) -> SingleRank | Lockstep:
    """The executor's lockstep; with several ranks its planner now agrees each step."""
    if parallel is None:
        return SINGLE
    if not isinstance(parallel, Parallel):
        raise XGraphError(
            f"parallel= takes an xgraph.Parallel, got {type(parallel).__name__}: "
            "wrap the process groups, e.g. xgraph.Parallel(tp=group)."
        )
    return Lockstep(parallel, executor)


class Lockstep:
    """One executor's agreement with its peers (see the module docstring)."""

    def __init__(self, parallel: Parallel, executor: Any) -> None:
        self.parallel = parallel
        self.name, self.compiled = executor.name, executor.compiled
        self.channel = parallel.channel
        # the cache sizes prove the ranks are in step (the dicts, not the executor: it must
        # stay collectable, its memory released when it is)
        self._cached = (executor._graphs, executor._eager_keys)
        planner = executor.planner
        self.planner = planner
        self.dims = list(planner.key_buckets)
        self.comm = {}
        for d in parallel.comm_dims:
            if d not in planner.key_buckets:
                raise XGraphError(
                    f"{self.name}: comm dim {d!r} must be a declared key dim: add "
                    f"xgraph.Dim({d!r}, max=..., buckets=[...]) to dims=."
                )
            self.comm[d] = planner.key_buckets[d]
        if len(self.dims) > 8:
            raise XGraphError(f"{self.name}: at most 8 key dims can be agreed across ranks.")
        self.token_input = next(
            ((i.name, i.shape.index(NUM_TOKENS)) for i in planner.inputs if NUM_TOKENS in i.shape),
            None,
        )
        self.capture: CaptureCheck | None = None
        self.manifests: dict[tuple, dict[str, list]] = {}  # key -> pass -> collectives
        self.counts = {"agreements": 0, "replans": 0, "idle_steps": 0, "eager_agreed": 0}
        self.last: Agreed | None = None
        self.broken: str | None = None
        if self.channel is not None or self.comm:
            executor.planner = AgreedPlanner(self)
        parallel.prepare(executor.backend)

    # -- agreeing on a step ----------------------------------------------------------------

    def plan(
        self, inputs: Mapping[str, Any], attn: Any, kind: Kind | None, synthetic: bool
    ) -> Step:
        self._usable()
        pad = self._own_comm(inputs)
        try:
            local = self.planner.plan(inputs, attn, kind=kind, synthetic=synthetic, pad_to=pad)
        except Exception as exc:
            if self.channel is not None:
                self._agree(None, REFUSED, exc)
            raise
        agreed = self._agree(local, OK, None)
        return self._conform(local, agreed, inputs, attn, synthetic)

    def idle(self) -> Step | None:
        """This rank's part of a step in which it has no tokens (None: no rank has any)."""
        self._usable()
        agreed = self._agree(None, IDLE, None)
        self.counts["idle_steps"] += 1
        if agreed.kind is None:
            return None
        graph = agreed.kind is not Kind.EAGER
        n = agreed.pad_to[NUM_TOKENS] if graph else 1
        extra = {d: v for d, v in agreed.pad_to.items() if d != NUM_TOKENS}
        tensors, attn = self.planner.synthetic(n, agreed.kind if graph else Kind.FULL, extra)
        step = self._replan(tensors, attn, agreed, True)
        step.reason = step.reason and "idle rank"
        return step

    def _own_comm(self, inputs: Mapping[str, Any]) -> dict[str, int] | None:
        """Communication dims as this rank alone would size them (its own tokens)."""
        if not self.comm or self.token_input is None:
            return None
        name, axis = self.token_input
        try:
            n = int(inputs[name].shape[axis])
        except (KeyError, AttributeError, IndexError, TypeError):
            return None  # the planner names what is wrong with the inputs
        return {d: n for d in self.comm}

    def _agree(self, local: Step | None, status: int, exc: Exception | None) -> Agreed:
        if self.channel is None:  # one rank: its own plan, communication dims from its tokens
            agreed = decide([message(local, status, self.dims, self._cache(), -1)], [], self.comm)
            return self._settle(agreed)
        mine = message(local, status, self.dims, self._cache(), self.parallel.tp_leader)
        table = self.channel.exchange(mine, "step agreement")
        if any(m[0] != STEP for m in table):
            raise self._break_with(self.channel.out_of_step(table, "step agreement"))
        self.counts["agreements"] += 1
        refused = [r for r, m in enumerate(table) if m[1] == REFUSED]
        if refused:
            self._refused(refused, exc)
            return Agreed(None)  # this rank refused: its caller raises its own error
        wrong = divergence(table)
        if wrong is not None:
            raise self._break_with(DistributedError(f"{self.name}: {wrong}."))
        wrong = tp_mismatch(table)
        if wrong is not None:
            raise PeerStepError(f"{self.name}: {wrong}. No rank ran this step.")
        return self._settle(decide(table, self.dims, self.comm))

    def _settle(self, agreed: Agreed) -> Agreed:
        self.last, self.capture = agreed, None
        _local.comm = agreed.comm
        return agreed

    def _refused(self, ranks: list[int], exc: Exception | None) -> None:
        """Some rank refused the step: every rank learns why, and none runs it."""
        assert self.channel is not None
        text = None if exc is None else f"{type(exc).__name__}: {exc}"
        texts = self.channel.gather_objects(text, "the reasons a step was refused")
        if exc is not None:
            mark_agreed(exc)
            return  # the caller raises its own error
        why = "; ".join(f"rank {r}: {texts[r]}" for r in ranks)
        raise mark_agreed(
            PeerStepError(
                f"{self.name}: rank(s) {ranks} refused this step ({why}). No rank ran it."
            )
        )

    def _conform(
        self, local: Step, agreed: Agreed, inputs: Mapping[str, Any], attn: Any, synthetic: bool
    ) -> Step:
        """This rank's plan if it is the agreed one, else the agreed plan."""
        assert agreed.kind is not None
        if agreed.kind is Kind.EAGER:
            if local.kind is Kind.EAGER:
                return local
        elif local.kind is agreed.kind and all(
            local.padded.get(d) == p for d, p in agreed.pad_to.items()
        ):
            return local
        return self._replan(inputs, attn, agreed, synthetic)

    def _replan(
        self, inputs: Mapping[str, Any], attn: Any, agreed: Agreed, synthetic: bool
    ) -> Step:
        self.counts["replans"] += 1
        try:
            step = self.planner.plan(
                inputs, attn, kind=agreed.kind, synthetic=synthetic, pad_to=agreed.pad_to or None
            )
        except Exception as exc:  # the others run the agreed step without this rank
            raise self._break(f"planning the agreed step {agreed} failed", exc) from exc
        if agreed.kind is Kind.EAGER:
            self.counts["eager_agreed"] += 1
            step.reason = agreed.reason
        return step

    # -- running, capturing ----------------------------------------------------------------

    def run(self, run: Callable[[Step], Any], step: Step) -> Any:
        """Run the agreed step; a failure no peer knows of stops the executor."""
        try:
            return run(step)
        except Exception as exc:
            check = self.capture
            agreed = check is not None and check.key == step.key and check.failed_everywhere
            if (
                self.channel is None
                or agreed
                or is_agreed(exc)
                or isinstance(exc, DistributedError)
            ):
                raise
            raise self._break(
                f"step {step.key or step.reason!r} failed after the ranks agreed on it", exc
            ) from exc

    def warm_up(self, step: Step) -> contextlib.AbstractContextManager[None]:
        assert step.key is not None
        labels, record = self.parallel.labels, not self.compiled
        self.capture = CaptureCheck(self.channel, labels, step.key, record)
        return warm_up_scope(self.capture)

    def checked(self, step: Step, recording: Any) -> CheckedRecording:
        check = self.capture
        if check is None or check.key != step.key:  # warm_up always comes first
            raise XGraphError(f"{self.name}: capture of {step.key} without its warm-up.")
        self.manifests[step.key] = check.manifests  # filled as the capture records
        return CheckedRecording(recording, check)

    # -- state -------------------------------------------------------------------------------

    def _cache(self) -> tuple[int, int]:
        return len(self._cached[0]), len(self._cached[1])

    def _usable(self) -> None:
        if self.broken is not None:
            raise DistributedError(self.broken)
        if self.channel is not None and self.channel.broken is not None:
            self.broken = self.channel.broken
            raise DistributedError(self.broken)

    def _break(self, what: str, exc: BaseException) -> DistributedError:
        return self._break_with(
            DistributedError(
                f"{self.name} on rank {self.parallel.rank}: {what} ({type(exc).__name__}: "
                f"{str(exc).strip()[:300]}). The other ranks cannot complete their "
                "collectives with this one, so this executor stops here: close it (its memory "
                "is freed as usual) and restart the process group."
            )
        )

    def _break_with(self, exc: DistributedError) -> DistributedError:
        self.broken = str(exc)
        return exc

    def stats(self) -> dict[str, Any]:
        ch = self.channel
        return {
            "rank": self.parallel.rank,
            "world_size": self.parallel.world_size,
            **self.counts,
            "agreement_seconds": ch.seconds if ch is not None else 0.0,
            "exchanges": ch.exchanges if ch is not None else 0,
            "comm": dict(self.last.comm) if self.last is not None else {},
            "manifests": {
                k: [str(c) for c in m.get("capture", m.get("warm-up", []))]
                for k, m in self.manifests.items()
            },
            "broken": self.broken,
        }


class AgreedPlanner:
    """The executor's planner under several ranks: `plan` agrees; the rest is the planner's."""

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep = lockstep
        self.inner = lockstep.planner

    def plan(
        self,
        inputs: Mapping[str, Any],
        attn: Any,
        kind: Kind | None = None,
        synthetic: bool = False,
    ) -> Step:
        return self.lockstep.plan(inputs, attn, kind, synthetic)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def group_stats(executor: Any) -> dict[str, Any]:
    """Every rank's graph memory and counts, and the group's totals: collective over the
    agreeing ranks (call it on every rank at the same point)."""
    s = executor.stats()
    mine = {
        k: s[k]
        for k in ("captures", "replays", "graph_bytes", "persistent_bytes", "outside_pool_bytes")
    }
    mine["keys"] = [repr(k) for k in s["keys"]]
    lock = executor.lockstep
    channel = lock.channel if isinstance(lock, Lockstep) else None
    ranks = [mine] if channel is None else channel.gather_objects(mine, "group stats")
    graph = [r["graph_bytes"] for r in ranks]
    return {
        "ranks": ranks,
        "graph_bytes_max": max(graph),
        "graph_bytes_total": sum(graph),
        "same_keys": all(r["keys"] == ranks[0]["keys"] for r in ranks),
    }
