"""The executor's side of graphs across ranks: agreed steps, lockstep captures, idle steps.

`attach(parallel, executor)` gives the executor its lockstep. With more than one rank (or
communication dims) the executor calls `agree(checked, decision)` between deciding a step
and staging it: one fixed-size message per rank on the side group
(xgraph.distributed.agreement), and the agreed decision back, decided again (which writes
nothing) only where this rank's choice differs (another kind, more padding); the step is
then staged once. A rank whose check or decision failed tells the others (`refuse`), and
no rank runs the step. Captures go through `warm_up` and `checked`
(xgraph.distributed.capture); a step that fails on one rank after the ranks agreed on it
stops the executor with DistributedError (its peers are left in collectives it will not
join). Without `parallel` the executor gets `SINGLE`, which agrees with no one: the
executor then calls nothing between the moves of a step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from ..errors import XGraphError
from ..options import Kind
from ..steps import Checked, Decision, Staged
from ..validation import NUM_TOKENS
from .agreement import (
    IDLE,
    OK,
    REFUSED,
    Agreed,
    Stamp,
    configured_alike,
    decide,
    divergence,
    message,
    sequence_mismatch,
    tp_mismatch,
)
from .capture import (
    CaptureCheck,
    CheckedRecording,
    eager_scope,
    is_agreed,
    mark_agreed,
    warm_up_scope,
)
from .channel import STEP
from .errors import DistributedError, OutOfStepError, PeerStepError
from .identity import config_of, differences, digest, inputs_digest
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
    """The lockstep of an executor without `parallel`: every hook does nothing, and
    `agrees` is False, so the executor calls nothing of it on a step (no frame added)."""

    agrees = False

    def warm_up(self, step: Staged) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def checked(self, step: Staged, recording: Any) -> Any:
        return recording

    def eager(self, step: Staged) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def idle(self) -> tuple[Checked, Decision] | None:
        raise XGraphError(
            "idle_step() is for data-parallel ranks: create the executor with "
            "parallel=xgraph.Parallel(dp=...)."
        )

    def stats(self) -> dict[str, Any] | None:
        return None


SINGLE = SingleRank()


def attach(parallel: Parallel | None, executor: Any) -> SingleRank | Lockstep:
    """The executor's lockstep (SINGLE without `parallel`)."""
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
        # the cache sizes prove the ranks are in step (the cache, not the executor: it must
        # stay collectable, its memory released when it is)
        self.cache = executor.cache
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
        self.config = config_of(executor)  # the settings every rank must share
        self.stamp = Stamp(tp=parallel.tp_leader, config=digest(self.config))
        self.seq = 0  # agreements made: the ordinal of the next step
        self.capture: CaptureCheck | None = None
        self.manifests: dict[tuple, dict[str, list]] = {}  # key -> pass -> collectives
        self.counts = {"agreements": 0, "idle_steps": 0, "eager_agreed": 0}
        self.last: Agreed | None = None
        self.broken: str | None = None
        # a group of one rank without communication dims has nothing to agree on
        self.agrees = self.channel is not None or bool(self.comm)
        parallel.prepare(executor.backend)

    # -- agreeing on a step ----------------------------------------------------------------

    def usable(self) -> None:
        """Raise DistributedError if the ranks lost each other (this executor stopped)."""
        if self.broken is not None:
            raise DistributedError(self.broken)
        if self.channel is not None and self.channel.broken is not None:
            self.broken = self.channel.broken
            raise DistributedError(self.broken)

    def agree(self, checked: Checked, decision: Decision) -> Decision:
        """The decision every rank runs, from this rank's own (nothing is staged yet)."""
        agreed = self._exchange(OK, checked, decision, None)
        assert agreed.kind is not None
        if agreed.kind is Kind.EAGER:
            if decision.kind is Kind.EAGER:
                return decision
        elif decision.kind is agreed.kind and all(
            decision.padded.get(d) == p for d, p in agreed.pad_to.items()
        ):
            return decision
        return self._redecide(checked, agreed)

    def refuse(self, exc: Exception) -> None:
        """This rank's check or decision raised `exc`: the peers learn why, none runs it."""
        if self.channel is not None and self.broken is None:
            self._exchange(REFUSED, None, None, exc)

    def idle(self) -> tuple[Checked, Decision] | None:
        """This rank's part of a step in which it has no tokens (None: no rank has any)."""
        self.usable()
        agreed = self._exchange(IDLE, None, None, None)
        self.counts["idle_steps"] += 1
        if agreed.kind is None:
            return None
        graph = agreed.kind is not Kind.EAGER
        n = agreed.pad_to[NUM_TOKENS] if graph else 1
        extra = {d: v for d, v in agreed.pad_to.items() if d != NUM_TOKENS}
        try:
            tensors, attn = self.planner.synthetic(n, agreed.kind if graph else Kind.FULL, extra)
            checked = self.planner.check(tensors, attn, synthetic=True)
        except Exception as exc:  # the others run the agreed step without this rank
            raise self._break(f"planning the agreed step {agreed} failed", exc) from exc
        decision = self._redecide(checked, agreed)
        if decision.reason:
            decision = replace(decision, reason="idle rank")
        return checked, decision

    def _redecide(self, checked: Checked, agreed: Agreed) -> Decision:
        """This rank's decision of the agreed kind and padding (writes nothing)."""
        try:
            d = self.planner.decide(checked, kind=agreed.kind, pad_to=agreed.pad_to or None)
        except Exception as exc:  # the others run the agreed step without this rank
            raise self._break(f"planning the agreed step {agreed} failed", exc) from exc
        if agreed.kind is Kind.EAGER:
            self.counts["eager_agreed"] += 1
            d = replace(d, reason=agreed.reason)
        return d

    def _exchange(
        self,
        status: int,
        checked: Checked | None,
        decision: Decision | None,
        exc: Exception | None,
    ) -> Agreed:
        stamp = replace(self.stamp, cache=self.cache.sizes(), seq=self.seq)
        if self.channel is None:  # one rank: its own decision, communication dims from its tokens
            return self._settle(
                decide([message(status, checked, decision, [], stamp)], [], self.comm)
            )
        if stamp.tp >= 0 and checked is not None:  # a TP group runs one batch: its inputs too
            stamp = replace(stamp, inputs=inputs_digest(checked))
        table = self.channel.exchange(
            message(status, checked, decision, self.dims, stamp), "step agreement"
        )
        self.seq += 1
        if any(m[0] != STEP for m in table):
            raise self._break_with(self.channel.out_of_step(table, "step agreement"))
        self._alike(table)
        self.counts["agreements"] += 1
        refused = [r for r, m in enumerate(table) if m[1] == REFUSED]
        if refused:
            self._refused(refused, exc)
            return Agreed(None)  # this rank refused: its caller raises its own error
        self._out_of_step(sequence_mismatch(table) or divergence(table) or tp_mismatch(table))
        return self._settle(decide(table, self.dims, self.comm))

    def _alike(self, table: list[list[int]]) -> None:
        """Raise on every rank (and stop) where the ranks' executors are set up differently."""
        assert self.channel is not None
        if not configured_alike(table):
            configs = self.channel.gather_objects(self.config, "the executors' settings")
            raise self._break_with(
                DistributedError(
                    f"{self.name}: the ranks' executors are configured differently: "
                    f"{differences(configs)}. The ranks decide every step's kind, key and "
                    "padding by one rule, which needs the same settings on every rank: build "
                    "each rank's executor with the same arguments, then close these executors "
                    "and restart the process group."
                )
            )
        self._out_of_step(sequence_mismatch(table))

    def _out_of_step(self, wrong: str | None) -> None:
        """Raise on every rank (and stop) where the table shows the ranks at other steps."""
        if wrong is not None:
            raise self._break_with(
                OutOfStepError(
                    f"{self.name}: {wrong}. No rank ran this step, and every later one would "
                    "pair the ranks' steps wrongly, so this executor stops here: close it, "
                    "restart the process group, and make every rank call its executor with "
                    "the same steps in the same order."
                )
            )

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

    # -- running, capturing ----------------------------------------------------------------

    def run(self, run: Callable[[Checked, Decision], Any], checked: Checked, d: Decision) -> Any:
        """Stage and run the agreed step; a failure no peer knows of stops the executor."""
        try:
            return run(checked, d)
        except Exception as exc:
            check = self.capture  # this step's capture or eager check, if it made one
            agreed = check is not None and check.failed_everywhere
            if (
                self.channel is None
                or agreed
                or is_agreed(exc)
                or isinstance(exc, DistributedError)
            ):
                raise
            raise self._break(
                f"step {d.key or d.reason!r} failed after the ranks agreed on it", exc
            ) from exc

    def warm_up(self, step: Staged) -> contextlib.AbstractContextManager[None]:
        assert step.key is not None
        labels, record = self.parallel.labels, not self.compiled
        self.capture = CaptureCheck(self.channel, labels, step.key, record)
        return warm_up_scope(self.capture)

    def eager(self, step: Staged) -> contextlib.AbstractContextManager[None]:
        """An eager step's forward with its collectives checked as a capture's are, its end
        agreed (xgraph.distributed.capture); nothing to check on a group of one rank."""
        if self.channel is None:
            return contextlib.nullcontext()
        tokens = step.padded.get(NUM_TOKENS, step.num_tokens)
        key = step.key if step.key is not None else ("eager",)
        labels, record = self.parallel.labels, not self.compiled
        self.capture = CaptureCheck(self.channel, labels, key, record, eager=tokens)
        return eager_scope(self.capture)

    def checked(self, step: Staged, recording: Any) -> CheckedRecording:
        check = self.capture
        if check is None or check.key != step.key:  # warm_up always comes first
            raise XGraphError(f"{self.name}: capture of {step.key} without its warm-up.")
        self.manifests[step.key] = check.manifests  # filled as the capture records
        return CheckedRecording(recording, check)

    # -- state -------------------------------------------------------------------------------

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
