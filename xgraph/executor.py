"""GraphExecutor: bucket -> persistent buffers -> capture on miss / replay on hit.

    ex = xgraph.GraphExecutor(model.forward, inputs=[...], attention=PagedAttention(...))
    out = ex(input_ids=ids, positions=pos, attn=xgraph.AttentionInputs(...))

Per step, four moves in one direction: the planner checks the inputs and decides the step
(kind: decode -> full graph, prefill / mixed -> piecewise; key and padding), both writing
nothing; several ranks agree on the decision (xgraph.distributed); the planner stages it
into the persistent buffers, once. Then the key cache replays the key's recording, or the
capture transaction warms up, records and stores it (xgraph.capture), or the step runs
eagerly. Outputs are views of one persistent output buffer sliced to the real size, valid
until the next step (`clone=True` copies). The executor composes those parts and keeps
the engine's API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import sleepmode
from .arena import Arena
from .buckets import Buckets, Dim, Input
from .capture import CaptureTransaction
from .capture_session import capture_session
from .distributed import Lockstep, Parallel, attach
from .errors import ConcurrentStepError, XGraphError
from .interfaces import AttentionRunner, Backend
from .keycache import KeyCache, Runners
from .lifetime import Holdings, Recording, release_when_collected
from .memory import GraphMemory
from .metadata import AttentionInputs
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .pdl_option import PDLOption, requested
from .piecewise import guarded_storages
from .plugins import get_backend
from .pool import SharedPhysicalPool
from .precapture import checked_sizes, query_sizes
from .progress import progress as show_progress
from .steps import Checked, Decision, Staged, StepPlanner

if TYPE_CHECKING:
    from .launchdiff import ParameterizationReport
    from .memory_plan import MemoryPlan

DEFAULT_MAX_TOKENS = 512


class GraphExecutor:
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
        pdl: capture full (decode) graphs with programmatic dependent launch where the
            backend runs it (never piecewise pieces; elsewhere a no-op, `stats()["pdl"]`
            says so). None: XGRAPH_PDL decides (1 on; unset, off). See xgraph.pdl_option.
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
        pdl: bool | None = None,
    ) -> None:
        self.mode = Mode.parse(mode, "mode")
        self.on_capture_error = Fallback.parse(on_capture_error, "on_capture_error")
        self.name, self.compiled = name, compiled
        self.backend = get_backend(backend)
        kernels = self.backend.activate()  # they serve the core's ops (xgraph.linear) now
        self.pdl = PDLOption(kernels, requested(pdl))
        self.device = self.backend.device
        self.arena = Arena.of(self.backend, name)  # persistent buffers sleep can give back
        self.buckets = Buckets.of(buckets, DEFAULT_MAX_TOKENS)
        self.attention = attention
        self.runners = Runners.pick(attention, self.backend, self.mode)
        self.planner = self._planner(inputs, dims, Fallback.parse(on_overflow, "on_overflow"))
        self.memory = GraphMemory.of(self.backend, memory)
        self._steps = self.memory.steps  # steps over shared memory run one at a time
        self.holdings = self._holdings(not isinstance(memory, GraphMemory))
        self._busy = self.holdings.busy  # one step at a time: outputs are shared buffers
        self.cache = KeyCache(
            name, forward, self.runners, self.planner.inputs, self.holdings.graphs, self.buckets.max
        )
        self._finalizer = release_when_collected(self, self.holdings)
        self.lockstep = attach(parallel, self)
        # several ranks: each step's decision is agreed before it is staged; one rank: None
        self._agreeing: Lockstep | None = self.lockstep if self.lockstep.agrees else None
        self.transaction = CaptureTransaction(
            name,
            self.backend,
            self.memory,
            self.cache,
            self.runners,
            guarded=guarded_storages(attention.kv_tensors if attention else ()),
            compiled=compiled,
            on_capture_error=self.on_capture_error,
            lockstep=self.lockstep,
            pdl=self.pdl,
        )

    @property
    def forward(self) -> Callable[..., Any]:
        """The model's forward every step, warm-up and capture calls."""
        return self.cache.forward

    @forward.setter
    def forward(self, fn: Callable[..., Any]) -> None:
        self.cache.forward = fn  # the one the key cache and the capture transaction call

    def _planner(
        self, inputs: Sequence[Input], dims: Sequence[Dim], overflow: Fallback
    ) -> StepPlanner:
        return StepPlanner(
            self.name,
            inputs=inputs,
            dims=dims,
            buckets=self.buckets,
            attention=self.attention,
            device=self.device,
            mode=self.mode,
            on_overflow=overflow,
            copier=self.backend.host_copier,
            decode_runner=self.runners.decode,
            allocate=None if self.arena is None else self.arena.empty,
        )

    def _holdings(self, owns_memory: bool) -> Holdings:
        """Graphs and memory live apart from this object: released by close(), or when it is
        collected (xgraph.lifetime), whichever comes first. They hold the persistent buffers'
        arena and share the graph memory's sleep."""
        held = Holdings(self.name, self.backend, self.memory, owns_memory)
        held.arena = self.arena
        sleepmode.join(held)
        return held

    @property
    def decode_runner(self) -> AttentionRunner | None:
        """Runs full graphs and eager decode steps (None without attention or once closed)."""
        return self.runners.decode

    @decode_runner.setter
    def decode_runner(self, runner: AttentionRunner | None) -> None:
        self.runners.decode = runner

    @property
    def prefill_runner(self) -> AttentionRunner | None:
        """Runs piecewise graphs and other eager steps (None without attention or once closed)."""
        return self.runners.prefill

    @prefill_runner.setter
    def prefill_runner(self, runner: AttentionRunner | None) -> None:
        self.runners.prefill = runner

    def persistent_bytes(self) -> int:
        """Bytes of every persistent buffer the executor holds (inputs, attention metadata,
        outputs); 0 once closed, which gives them back."""
        if self.planner.closed:
            return 0
        return self.planner.persistent_bytes() + self.cache.output_bytes()

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
        if not self._busy.acquire(False):  # no context manager, no keyword: the hot path
            self._refuse("step")
        try:
            if self.holdings.closed:
                raise XGraphError(f"{self.name} is closed; create a new executor.")
            if self.holdings.asleep:
                raise sleepmode.asleep_error(self.name, self.holdings.asleep)
            lock = self._agreeing  # None: one rank, and nothing between the four moves
            if lock is None:
                checked = self.planner.check(inputs, attn)
                step = self.planner.stage(checked, self.planner.decide(checked))
                self._steps.acquire(self.name)
                try:
                    out = self._run(step)
                finally:
                    self._steps.release()
            else:
                out = self._agreed_step(lock, inputs, attn)
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
            if self.holdings.closed:
                raise XGraphError(f"{self.name} is closed; create a new executor.")
            if self.holdings.asleep and what != "close":
                raise sleepmode.asleep_error(self.name, self.holdings.asleep)
            yield
        finally:
            self._busy.release()

    @contextlib.contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """Run `what` as a step would: no step of this executor, and none over its shared
        graph memory, runs meanwhile (ConcurrentStepError, or the documented errors of a
        closed or sleeping executor)."""
        with self._exclusive(what):
            self._steps.acquire(self.name)
            try:
                yield
            finally:
                self._steps.release()

    def _agreed_step(
        self,
        lock: Lockstep,
        inputs: Mapping[str, Any],
        attn: AttentionInputs | None,
        kind: Kind | None = None,
        synthetic: bool = False,
    ) -> Any:
        """check, decide, agree with the peers, stage and run (a refusal told to them)."""
        lock.usable()
        try:
            checked = self.planner.check(inputs, attn, synthetic)
            decision = self.planner.decide(checked, kind)
        except Exception as exc:
            lock.refuse(exc)  # every rank learns why; no rank runs the step
            raise
        decision = lock.agree(checked, decision)
        self._steps.acquire(self.name)  # steps over shared memory run one at a time
        try:
            return lock.run(self._stage_and_run, checked, decision)
        finally:
            self._steps.release()

    def _stage_and_run(self, checked: Checked, decision: Decision) -> Any:
        return self._run(self.planner.stage(checked, decision))

    def _run(self, step: Staged) -> Any:
        cache = self.cache
        if step.kind is Kind.EAGER:
            with self.lockstep.eager(step):  # several ranks: its collectives checked
                return cache.run_eager(step, self.device)
        assert step.key is not None
        entry = cache.entries.get(step.key)
        if entry is not None:
            if step.device_check is not None and not entry.graph.has_check:  # type: ignore[attr-defined]
                self.transaction.add_check(entry, step)  # its first device-metadata step
            cache.replay(entry, step)
            return cache.outputs(step.num_tokens)
        if step.key in cache.eager_keys:
            with self.lockstep.eager(step):
                return cache.run_padded(step, "capture failed earlier")
        return self.transaction.capture(step)

    # -- the executor's own steps ----------------------------------------------------------

    def capture(
        self,
        sizes: Iterable[int] | None = None,
        kind: Kind | str = Kind.FULL,
        progress: bool = True,
        query_len: int = 1,
        **key_dims: int,
    ) -> None:
        """Capture graphs before serving: one per num_tokens size, in the order given.

        Default: every bucket, largest first (what a shared native pool needs). Each capture
        runs on a synthetic step that touches only the dummy slot and block; `key_dims` fix
        the sizes of other shape-determining dims. Sizes are ints from 1 to the largest
        bucket (InputError otherwise); one between buckets is padded to the next.
        `query_len` (an int >= 1) > 1 captures the full graphs of steps of that many tokens
        per sequence (speculative verification); sizes then count sequences.
        """
        k = Kind.parse(kind, "kind")
        if k is Kind.EAGER:
            raise XGraphError("kind='eager': choose 'full' or 'piecewise'.")
        what = f"{self.name}: capturing {k.value} graphs"
        todo = query_sizes(sizes, self.buckets, query_len, what)
        # the collector off (xgraph.capture_session says why); the steps are not replayed
        with capture_session(), self.transaction.precapturing():
            for n in show_progress(todo, what, progress):
                self._synthetic_step(n, k, k, key_dims, query_len)

    def plan_memory(self, kinds: Iterable[Kind | str] | None = None) -> MemoryPlan:
        """The graph memory every bucket will need, measured on twin captures of the largest
        keys and undone (`xgraph.predict_graph_memory`); callable before serving."""
        from .memory_plan import predict_graph_memory

        return predict_graph_memory(self, kinds=kinds)

    def warm_up(
        self, sizes: Iterable[int] | None = None, kind: Kind | str = Kind.FULL, **key_dims: int
    ) -> None:
        """Run the synthetic steps `capture` would record, eagerly, recording nothing: kernels
        compile and load, and libraries set up, before any capture or memory reading. Each
        runs as its capture's warm-up would (staged, on the capture stream), which a later
        `capture` of the same sizes then skips (one rank; xgraph.capture says why)."""
        k = Kind.parse(kind, "kind")
        if k is Kind.EAGER:
            raise XGraphError("kind='eager': choose the layout, 'full' or 'piecewise'.")
        with capture_session():
            for n in checked_sizes(sizes, self.buckets, f"{self.name}: warm-up"):
                self._synthetic_step(n, k, Kind.EAGER, key_dims)

    def _synthetic_step(
        self, n: int, layout: Kind, run: Kind, key_dims: Mapping[str, int], query_len: int = 1
    ) -> None:
        """One of the executor's own steps, down the path of every step."""
        tensors, attn = self.planner.synthetic(n, layout, key_dims, query_len)
        with self._exclusive("capture"):
            lock = self._agreeing
            if lock is not None:
                self._agreed_step(lock, tensors, attn, run, True)
                return
            checked = self.planner.check(tensors, attn, True)
            warm = run is Kind.EAGER  # a warm-up: its capture's, over the staged buffers
            step = self.planner.stage(
                checked, self.planner.decide(checked, layout if warm else run)
            )
            self._steps.acquire(self.name)  # as a step: one at a time over shared memory
            try:
                if warm and step.key is not None:
                    self.transaction.warm(step)
                else:
                    self._run(step)
            finally:
                self._steps.release()

    def idle_step(self) -> None:
        """Under data parallelism, a step with no tokens on this rank: it runs the step the
        others agree on over dummy tokens, so its collectives meet theirs. Returns nothing."""
        with self._exclusive("idle step"):
            agreed = self.lockstep.idle()  # None: no rank has tokens, nothing runs
            if agreed is None:
                return
            assert self._agreeing is not None  # idle() refused one rank already
            self._steps.acquire(self.name)  # as a step: one at a time over shared memory
            try:
                self._agreeing.run(self._stage_and_run, *agreed)
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

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Captures, replays, eager steps by reason, capture seconds, hits per key, bytes,
        and `pdl`: the option, whether the backend runs it here, its graphs' programmatic
        edges (xgraph.pdl_option)."""
        tx, cache = self.transaction, self.cache
        return {
            "captures": tx.captures,
            "replays": cache.replays,
            "eager": dict(cache.eager),
            "capture_seconds": tx.seconds,
            "capture_parts": dict(tx.parts),  # warm_up, record, replay: host seconds
            "hits": cache.hits(),
            "eager_keys": dict(cache.eager_keys),
            "failed_keys": dict(tx.failed_keys),
            "persistent_bytes": self.persistent_bytes(),
            "outside_pool_bytes": tx.outside.bytes,
            "graph_bytes": self.memory.graph_bytes(),
            "memory": self.memory.stats(),
            "asleep": sorted(self.holdings.asleep),
            "keys": cache.keys(),
            "parallel": self.lockstep.stats(),  # None for one rank
            "pdl": self.pdl.stats(cache.entries),
        }

    def synchronize(self) -> None:
        """Wait for queued steps; raise the InputError a device-side metadata check found."""
        with self._exclusive("synchronize"):
            self.backend.synchronize()
            self.planner.raise_pending(wait=True)

    def graph(self, key: tuple) -> Recording | None:
        """The cached recording of a key (describe() lists its pieces), or None."""
        e = self.cache.lookup(key)
        return e.graph if e else None

    # -- giving memory back: for a while (docs/sleep.md) or for good -----------------------

    @property
    def closed(self) -> bool:
        """Whether close() ran (or the executor was released when collected)."""
        return self.holdings.closed

    def sleep(self) -> sleepmode.SleepReport:
        """Give back the physical memory of graph memory and persistent buffers, keeping every
        address: steps raise AsleepError until wake(), which replays every key with no
        recapture. Executors sharing the graph memory sleep too (docs/sleep.md)."""
        return sleepmode.sleep(self, tags=())

    def wake(self) -> sleepmode.WakeReport:
        """Map fresh memory at the addresses sleep() kept; idempotent (docs/sleep.md)."""
        return sleepmode.wake(self, tags=())

    def close(self) -> None:
        """Wait for queued work, reset every graph, give back the persistent buffers and
        graph memory (if owned); any use afterwards raises XGraphError.

        Safe right after steps, with no synchronize of the caller's: replays still queued
        on the device finish before any memory they use is unmapped or freed. What a
        device-side metadata check found and no call raised yet is raised here, as
        `synchronize()` would, once everything is given back. An executor dropped without
        close() releases the same when it is collected (xgraph.lifetime).
        """
        if self.holdings.closed:  # a close that failed midway is finished (idempotent)
            return self.holdings.release(buffers=True)
        with self._exclusive("close"):
            self._finalizer.detach()
            found = self.planner.pending_error()  # read before its buffers go
            self.planner.close()  # first: nothing plans into the buffers that go below
            self.cache.drop_outputs()  # their memory goes with the caller's last view
            self.runners.drop()  # their last step's metadata views the buffers
            self.holdings.release(buffers=True)
        if found is not None:
            raise found

    def __enter__(self) -> GraphExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
