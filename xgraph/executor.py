"""GraphExecutor: bucket -> persistent buffers -> capture on miss / replay on hit.

    ex = xgraph.GraphExecutor(model.forward, inputs=[...], attention=PagedAttention(...))
    out = ex(input_ids=ids, positions=pos, attn=xgraph.AttentionInputs(...))

Per step: the planner validates everything (nothing is written before the step is known
good), picks the kind (decode -> full graph, prefill / mixed -> piecewise), pads to the
bucket and writes the persistent buffers; then the executor replays the cached graph for
the key, or warms up, captures and caches it, or runs eagerly. Outputs are views of one
persistent output buffer sliced to the real size, valid until the next step (`clone=True`
copies).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import sleepmode
from .arena import Arena
from .attention import InlineRunner, step_context
from .buckets import Buckets, Dim, Input
from .distributed import Parallel, attach
from .errors import (
    CaptureError,
    ConcurrentStepError,
    ReplayError,
    VirtualMemoryError,
    XGraphError,
    XGraphWarning,
)
from .interfaces import AttentionRunner, Backend
from .lifetime import Entry, Holdings, Recording, release_when_collected
from .memory import GraphMemory, Lease, OutsidePoolMeter, settle
from .metadata import AttentionInputs
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .piecewise import FullGraph, PiecewiseGraph, guarded_storages
from .plugins import get_backend
from .pool import SharedPhysicalPool
from .precapture import PreCapture
from .release import Release
from .runners import runners_for
from .steps import Step, StepPlanner

if TYPE_CHECKING:
    from .launchdiff import ParameterizationReport

logger = logging.getLogger("xgraph")

DEFAULT_MAX_TOKENS = 512


@dataclass
class ExecutorStats:
    captures: int = 0
    replays: int = 0
    eager: Counter = field(default_factory=Counter)  # reason -> steps
    capture_seconds: float = 0.0
    failed_keys: dict[tuple, str] = field(default_factory=dict)


class GraphExecutor(PreCapture, Release):
    """Runs a forward through cached graphs, one per bucket key (see the module docstring).

    Args:
        forward: the model's forward; called with the declared inputs as keyword arguments
            (views of persistent buffers, padded to the bucket) and returning a tensor, or a
            tuple / list / dict of tensors whose first dim is the padded number of tokens.
        inputs: declared inputs; shapes use "num_tokens" and the names of `dims`.
        backend: a name, a Backend, or None (XGRAPH_BACKEND, else the best available).
        buckets: the num_tokens bucket sizes (a list or a Buckets); default: 1, 2, 4, 8, then
            multiples of 16 up to 512 (`xgraph.buckets.default_sizes`).
        dims: further symbolic dims (shape-determining ones carry their own buckets).
        attention: paged-attention settings when the model calls `xgraph.attention`.
        memory: a MemoryMode name ("shared-physical", the default with VMM; "shared-pool";
            "private"), or a GraphMemory / SharedPhysicalPool shared with other executors.
        mode: a Mode: "auto" (decode -> full graph, other batches -> piecewise), "full"
            (full graphs for decode, eager otherwise), "piecewise", "eager".
        on_overflow: a Fallback for steps above the largest bucket: "eager" (logged once)
            or "raise" (BucketOverflowError).
        on_capture_error: a Fallback for a failed capture (always rolled back): "eager"
            (that key runs eagerly from then on, warned once) or "raise" (CaptureError).
        compiled: the forward runs torch.compile'd code. Captures then leave out the
            per-op host-read guard and the piecewise bypass check (under a dispatch mode
            Dynamo would run the eager forward instead); a host read still fails the
            capture in the runtime, and Tensor.tolist / numpy stay blocked. Host-recording
            backends (cpu) keep the guard and record the eager ops.
        parallel: the torch.distributed groups of this rank (xgraph.Parallel): the ranks then
            agree on every step and capture together (docs/distributed.md). None: one rank.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        inputs: Sequence[Input],
        backend: str | Backend | None = None,
        buckets: Buckets | Sequence[int] | None = None,
        dims: Sequence[Dim] = (),
        attention: PagedAttention | None = None,
        memory: str | GraphMemory | SharedPhysicalPool | None = None,
        mode: Mode | str = Mode.AUTO,
        on_overflow: Fallback | str = Fallback.EAGER,
        on_capture_error: Fallback | str = Fallback.EAGER,
        name: str = "executor",
        compiled: bool = False,
        parallel: Parallel | None = None,
    ) -> None:
        self.mode = Mode.parse(mode, "mode")
        self.on_capture_error = Fallback.parse(on_capture_error, "on_capture_error")
        self.forward, self.name, self.compiled = forward, name, compiled
        self.backend = get_backend(backend)
        self.backend.activate()  # its kernels serve the core's ops (xgraph.linear) from now on
        self.device = self.backend.device
        self._arena = Arena.of(self.backend, name)  # persistent buffers sleep can give back
        self.buckets = Buckets.of(buckets, DEFAULT_MAX_TOKENS)
        self.attention = attention
        self.decode_runner, self.prefill_runner = self._runners(attention)
        self.planner = StepPlanner(
            name,
            inputs=inputs,
            dims=dims,
            buckets=self.buckets,
            attention=attention,
            device=self.device,
            mode=self.mode,
            on_overflow=Fallback.parse(on_overflow, "on_overflow"),
            copier=self.backend.host_copier,
            decode_runner=self.decode_runner,
            allocate=None if self._arena is None else self._arena.empty,
        )
        self._guarded = guarded_storages(attention.kv_tensors if attention else ())
        self._eager_keys: dict[tuple, str] = {}
        self._out_bufs: list[torch.Tensor] | None = None
        self._out_spec: Any = None
        self._out_views: dict[int, Any] = {}
        self._stats = ExecutorStats()
        self.memory = GraphMemory.of(self.backend, memory)
        self._steps = self.memory.steps  # steps over shared memory run one at a time
        self._outside = OutsidePoolMeter(self.memory)
        self._held = self._holdings(not isinstance(memory, GraphMemory))
        self._busy = self._held.busy  # one step at a time: outputs are shared buffers
        self._graphs: dict[tuple, Entry] = self._held.graphs
        self._finalizer = release_when_collected(self, self._held)
        self.lockstep = attach(parallel, self)  # several ranks: self.planner agrees each step
        # several ranks: a failure after the agreement stops the executor; one rank: none
        self._lockstep_run = getattr(self.lockstep, "run", None)

    def _holdings(self, owns_memory: bool) -> Holdings:
        """Graphs and memory live apart from this object: released by close(), or when it is
        collected (xgraph.lifetime), whichever comes first. They hold the persistent buffers'
        arena and the device check's graphs (on this graph memory), and share its sleep."""
        held = Holdings(self.name, self.backend, self.memory, owns_memory)
        held.arena = self._arena
        self.planner.attach(held)
        sleepmode.join(held)
        return held

    def _runners(
        self, attention: PagedAttention | None
    ) -> tuple[AttentionRunner | None, AttentionRunner | None]:
        if attention is None:
            return None, None
        decode, prefill = runners_for(self.backend, attention)
        if self.mode in (Mode.AUTO, Mode.FULL) and not decode.graph_safe:
            raise XGraphError(
                f"{type(decode).__name__} is not graph-safe, so decode cannot run as a full "
                f"graph (mode={self.mode.value!r}). Pass a graph-safe decode_runner, or use "
                "mode='piecewise'."
            )
        return decode, prefill

    def persistent_bytes(self) -> int:
        """Bytes of every persistent buffer the executor holds (inputs, attention metadata,
        outputs); 0 once closed, which gives them back."""
        if self.planner.closed:
            return 0
        return self.planner.persistent_bytes() + sum(b.nbytes for b in self._out_bufs or [])

    # -- step ------------------------------------------------------------------------------

    def __call__(
        self, attn: AttentionInputs | None = None, clone: bool = False, **inputs: torch.Tensor
    ) -> Any:
        """Run one step; returns the forward's outputs sliced to the real number of tokens.

        Not reentrant and not for concurrent use: a call while another thread's step runs
        raises ConcurrentStepError (outputs are views of one set of persistent buffers, so
        two overlapping steps could not both be right). Serialize steps in the engine.
        Steps of executors sharing graph memory wait for each other (`memory.steps`).
        """
        if not self._busy.acquire(blocking=False):  # not a context manager: the hot path
            self._refuse("step")
        try:
            if self._held.closed:
                raise XGraphError(f"{self.name} is closed; create a new executor.")
            if self._held.asleep:
                raise sleepmode.asleep_error(self.name, self._held.asleep)
            step = self.planner.plan(inputs, attn)
            self._steps.acquire(self.name)
            try:
                run = self._lockstep_run  # no frame between for one rank: warnings' lines
                out = self._run(step) if run is None else run(self._run, step)
            finally:
                self._steps.release()
            if clone:  # inside the lock: the next step may overwrite the buffers right after
                flat, spec = tree_flatten(out)
                out = tree_unflatten([t.clone() for t in flat], spec)
        finally:
            self._busy.release()
        return out

    def _refuse(self, what: str) -> None:
        raise ConcurrentStepError(
            f"{self.name}: a {what} was started while another step of this executor is "
            "running (another thread, or the forward calling its own executor). A "
            "GraphExecutor runs one step at a time: serialize the calls, or give each "
            "thread its own executor."
        )

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            self._refuse(what)
        try:
            if self._held.closed:
                raise XGraphError(f"{self.name} is closed; create a new executor.")
            if self._held.asleep and what != "close":
                raise sleepmode.asleep_error(self.name, self._held.asleep)
            yield
        finally:
            self._busy.release()

    def _run(self, step: Step) -> Any:
        if step.kind is Kind.EAGER:
            self._stats.eager[step.reason] += 1
            views = {k: v.to(self.device) for k, v in step.tensors.items()}
            decode = step.attn is None or step.attn.is_decode
            return self._eager_forward(views, step, Kind.FULL if decode else Kind.PIECEWISE)
        assert step.key is not None
        entry = self._graphs.get(step.key)
        if entry is not None:
            self._replay(entry, step, hit=True)
            return self._outputs(step.num_tokens)
        if step.key in self._eager_keys:
            return self._run_padded(step, "capture failed earlier")
        return self._capture(step)

    def _runner(self, kind: Kind) -> AttentionRunner | None:
        return self.decode_runner if kind is Kind.FULL else self.prefill_runner

    def _replay(self, entry: Entry, step: Step, hit: bool) -> None:
        entry.hits += hit
        self._stats.replays += 1
        if step.metadata is not None and (runner := self._runner(entry.kind)) is not None:
            runner.plan(step.metadata)
        try:
            entry.graph.replay()
        except ReplayError as exc:  # no cost on the hot path until a replay fails
            raise self._replay_failed(step, exc) from exc

    def _replay_failed(self, step: Step, exc: ReplayError) -> ReplayError:
        specs = self.planner.inputs
        loose = [i.name for i in specs if not i.dtype.is_floating_point and i.bounds is None]
        hint = (
            f"Integer inputs without bounds: {', '.join(loose)}; an index outside its table "
            "(a token id past the vocabulary, a position past the rotary table) fails so. "
            "Declare Input(..., bounds=(low, high)) (the reference model's inputs() does) so "
            "such a step is refused before anything runs."
            if loose
            else "Check the step's inputs against the model."
        )
        return ReplayError(
            f"{self.name}: {exc} (key {step.key}). {hint} The graph is unchanged and "
            "replays valid steps; this step's result is not available."
        )

    def _outputs(self, n: int) -> Any:
        out = self._out_views.get(n)  # views of the output buffers, made once per size
        if out is None:
            assert self._out_bufs is not None
            out = tree_unflatten([b[:n] for b in self._out_bufs], self._out_spec)
            self._out_views[n] = out
        return out

    # -- eager paths -----------------------------------------------------------------------

    def _eager_forward(self, views: Mapping[str, torch.Tensor], step: Step, kind: Kind) -> Any:
        runner = self._runner(kind)
        with torch.no_grad():
            if runner is None or step.metadata is None:
                return self.forward(**views)
            runner.plan(step.metadata)
            with step_context(InlineRunner(runner)):
                return self.forward(**views)

    def _run_padded(self, step: Step, reason: str) -> Any:
        """Eager on the padded buffers (a key whose capture failed)."""
        self._stats.eager[reason] += 1
        flat, spec = tree_flatten(self._eager_forward(step.views, step, step.kind))
        return tree_unflatten([t[: step.num_tokens] for t in flat], spec)

    # -- capture ---------------------------------------------------------------------------

    def _ensure_out_buffers(self, result: Any, tb: int) -> list[tuple] | None:
        """Check the outputs; the first time, the (shape, dtype, device) of the buffers."""
        flat, spec = tree_flatten(result)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != tb:
                raise XGraphError(
                    f"{self.name}: every forward output must be a tensor whose first dim is the "
                    f"padded number of tokens ({tb}); got {type(t).__name__} "
                    f"{tuple(getattr(t, 'shape', ()))}."
                )
        if self._out_bufs is None:
            self._out_spec = spec
            return [(t.shape[1:], t.dtype, t.device) for t in flat]
        if spec != self._out_spec or any(
            b.shape[1:] != t.shape[1:] or b.dtype != t.dtype for b, t in zip(self._out_bufs, flat)
        ):
            raise XGraphError(
                f"{self.name}: the forward's outputs changed structure, shape or dtype between "
                "buckets; they must stay the same."
            )
        return None

    def _recording(self, kind: Kind, lease: Lease) -> Recording:
        checks = not self.compiled  # per-op checks would make Dynamo run the forward eagerly
        if kind is Kind.FULL:
            return FullGraph(self.backend, lease.pool, self.decode_runner, checks)
        return PiecewiseGraph(self.backend, lease.pool, self.prefill_runner, self._guarded, checks)

    def _record(self, step: Step, graph: Recording) -> None:
        """Record the forward and the copy of its outputs into the persistent buffers."""
        tb = step.padded["num_tokens"]
        if step.kind is Kind.PIECEWISE and step.metadata is not None and self.prefill_runner:
            self.prefill_runner.plan(step.metadata)
        graph.begin()
        with torch.no_grad():
            if graph.context is None:
                result = self.forward(**step.views)
            else:
                with step_context(graph.context):
                    result = self.forward(**step.views)
            self._ensure_out_buffers(result, tb)
            assert self._out_bufs is not None
            for buf, t in zip(self._out_bufs, tree_flatten(result)[0]):
                buf[:tb].copy_(t)
            del result
        graph.end()

    def _capture(self, step: Step) -> Any:
        assert step.key is not None
        t0 = time.perf_counter()
        # warm-up: the forward runs eagerly once (lazy init, autotuning, workspaces) and its
        # outputs fix the persistent output buffers
        with self.backend.warmup_context(), self.lockstep.warm_up(step):
            warm = self._eager_forward(step.views, step, step.kind)
        layout = self._ensure_out_buffers(warm, step.padded["num_tokens"])
        del warm
        # the warm-up's activations go back to the device before anything persistent is
        # allocated, so neither the output buffers nor a graph pool pin a warm-up segment
        settle(self.backend)
        if layout is not None:
            self._out_bufs = [
                torch.empty((self.buckets.max, *shp), dtype=dt, device=dev)
                for shp, dt, dev in layout
            ]
        self._outside.start()
        lease: Lease | None = None
        graph: Recording | None = None
        try:  # a reservation that fails is a failed capture like any other
            lease = self.memory.begin()
            graph = self.lockstep.checked(step, self._recording(step.kind, lease))
            self._record(step, graph)
        except BaseException as exc:  # a transaction: Ctrl-C mid-capture rolls back too
            try:
                if graph is not None:
                    graph.abort()
            finally:
                if lease is not None:
                    self.memory.rollback(lease)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: re-raised
                raise
            failure = lease.space.failure if lease and lease.space else None
            return self._capture_failed(step, failure or exc)
        seconds = time.perf_counter() - t0
        entry = Entry(step.kind, graph, lease, seconds)
        self._graphs[step.key] = entry
        self._stats.captures += 1
        self._stats.capture_seconds += seconds
        self._outside.stop()
        logger.info("%s: captured %s in %.3f s", self.name, step.key, seconds)
        self._replay(entry, step, hit=False)  # the capture step's own result
        return self._outputs(step.num_tokens)

    def _capture_failed(self, step: Step, exc: Exception) -> Any:
        key = step.key
        assert key is not None
        reason = f"{type(exc).__name__}: {exc}"
        self._stats.failed_keys[key] = reason
        if self.on_capture_error is Fallback.RAISE:
            if isinstance(exc, (CaptureError, VirtualMemoryError)):
                raise exc
            raise CaptureError(
                f"{self.name}: capturing {key} failed ({reason}). Nothing was kept; fix the "
                "model or use on_capture_error='eager'."
            ) from exc
        self._eager_keys[key] = reason
        msg = (
            f"{self.name}: capturing {key} failed and was rolled back; this key runs eagerly "
            f"from now on (on_capture_error='eager'). Cause: {reason}"
        )
        warnings.warn(msg, XGraphWarning, stacklevel=5)  # the engine's step call
        logger.warning(msg)
        return self._run_padded(step, "capture failed")

    def idle_step(self) -> None:
        """Under data parallelism, a step with no tokens on this rank: it runs the step the
        others agree on over dummy tokens, so its collectives meet theirs. Returns nothing."""
        with self._exclusive("idle step"):
            step = self.lockstep.idle()  # None: no rank has tokens, nothing runs
            if step is None:
                return
            self._steps.acquire(self.name)  # as a step: one at a time over shared memory
            try:
                self.lockstep.run(self._run, step)  # idle() refused one rank already
            finally:
                self._steps.release()

    def check_parameterization(
        self,
        sizes: Iterable[int] | None = None,
        kind: Kind | str | None = None,
        *,
        steps: Sequence[Mapping[str, Any]] | None = None,
        vary: Sequence[str] = ("seq_lens", "block_tables", "batch"),
        query_lens: Iterable[int] | None = None,
        **key_dims: int,
    ) -> ParameterizationReport:
        """Capture keys under changed per-step metadata, compare the recordings launch by
        launch and report every launch that follows it or a per-call value; nothing is kept
        (see xgraph.parameterization and docs/executor.md)."""
        from .parameterization import check_parameterization

        return check_parameterization(self, sizes, kind, steps, vary, key_dims, query_lens)

    # -- reporting and teardown ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Captures, replays, eager steps by reason, capture seconds, hits per key, bytes."""
        s = self._stats
        return {
            "captures": s.captures,
            "replays": s.replays,
            "eager": dict(s.eager),
            "capture_seconds": s.capture_seconds,
            "hits": {k: e.hits for k, e in self._graphs.items()},
            "eager_keys": dict(self._eager_keys),
            "failed_keys": dict(s.failed_keys),
            "persistent_bytes": self.persistent_bytes(),
            "outside_pool_bytes": self._outside.bytes,
            "graph_bytes": self.memory.graph_bytes(),
            "memory": self.memory.stats(),
            "asleep": sorted(self._held.asleep),
            "keys": sorted(self._graphs, key=repr),
            "parallel": self.lockstep.stats(),  # None for one rank
        }

    def synchronize(self) -> None:
        """Wait for queued steps; raise the InputError a device-side metadata check found."""
        with self._exclusive("synchronize"):
            self.backend.synchronize()
            self.planner.raise_pending(wait=True)

    def graph(self, key: tuple) -> Recording | None:
        """The cached recording of a key (describe() lists its pieces), or None."""
        e = self._graphs.get(key)
        return e.graph if e else None

    def __enter__(self) -> GraphExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
