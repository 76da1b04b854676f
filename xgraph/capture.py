"""The capture transaction: every capture of an executor, one path, all or nothing.

    outputs = tx.capture(step)     # a miss: warm up, lease, record, store (or roll back)
    tx.warm(step)                  # a capture's warm-up alone (GraphExecutor.warm_up)
    with tx.precapturing(): ...    # the executor's own captures: no replay of their steps
    tx.add_check(entry, step)      # a key recorded for host metadata meets device metadata
    with tx.apart(step, backend, around) as rec: ...   # recorded, read, dropped (no store)

A capture warms the forward up once, eagerly (lazy initialisation, autotuning, workspaces;
its outputs fix the persistent output buffers), takes a lease of graph memory, records the
key's pieces on it (the device-metadata check first, where the step's metadata is on the
device, then the forward and the copy of its outputs) and stores the recording in the key
cache. Any failure, Ctrl-C included, aborts the recording and rolls the lease back; the
key then follows `on_capture_error`: raised, or run eagerly from then on (warned). Across
ranks the lockstep checks both passes' collectives (xgraph.distributed.capture). On one rank of a
backend whose runtime refuses host reads in a capture itself (CUDA), a full key of an eager
forward records without the per-op guard, which costs more host time than the ops
(device -> host copies stay refused); a failed one is diagnosed by its forward once more,
eagerly, under the guard's checks, which name the op and the model line. With the
executor's PDL option on (xgraph.pdl_option), a full key's warm-up and record run inside
the backend's PDL capture option and its programmatic edges are counted right after the
record, before the capture's memory reading ends; piecewise keys never take PDL.

Pre-capture (`GraphExecutor.capture`, the memory plan's twins) records synthetic steps
whose outputs nobody reads, so a capture there returns without replaying its step: on a
device that replay is the whole forward run again, for nothing; the key's first real step
replays it as every hit does. A pre-capture step that `warm` already warmed up (the same
synthetic step, staged the same way, in the same thread, so on the same capture stream: the
same shapes, kernels and lazy initialisation) skips its warm-up too, on one rank (across
ranks the lockstep checks a warm-up pass before every recording) and after the executor's
first capture (whose warm-up fixes the output buffers). The recording plans the runner on
the step's metadata itself, as the warm-up did before it.

A miss costs the backend's own synchronize at capture begin and none of the executor's, and
no `empty_cache` but before the first capture allocates the output buffers (the
warm-up's cached memory is returned first, so the buffers pin none of it) and at the first
miss after a rollback (the rolled-back pool's segments go back). The
outside-pool meter reads the backend's memory around each capture: the default
allocator's cache is untouched in between, so it cancels out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from .attention import step_context
from .callsite import warn_at_caller
from .errors import CaptureError, ReplayError, VirtualMemoryError
from .interfaces import Backend, CapturePool
from .keycache import KeyCache, Runners, input_hint
from .lifetime import Entry, Recording
from .memory import GraphMemory, Lease, OutsidePoolMeter
from .options import Fallback, Kind
from .pdl_option import PDLOption
from .piecewise import FullGraph, PiecewiseGraph
from .safety import block_host_copies, checking_host_reads
from .steps import Staged
from .validation import NUM_TOKENS

logger = logging.getLogger("xgraph")


class CaptureTransaction:
    """The captures of one executor (see the module docstring)."""

    def __init__(
        self,
        name: str,
        backend: Backend,
        memory: GraphMemory,
        cache: KeyCache,
        runners: Runners,
        *,
        guarded: set[int],
        compiled: bool,
        on_capture_error: Fallback,
        lockstep: Any,
        pdl: PDLOption,
    ) -> None:
        """`guarded`: the KV cache's storages (piecewise pieces refuse ops on them);
        `compiled`: the forward runs compiled code (per-op checks left out); `lockstep`:
        the executor's (its warm_up, checked and eager hooks); `pdl`: its PDL option
        (full keys warmed up and recorded with programmatic dependent launch)."""
        self.name, self.backend, self.memory, self.cache = name, backend, memory, cache
        self.runners, self.guarded, self.compiled = runners, guarded, compiled
        self.on_capture_error, self.lockstep, self.pdl = on_capture_error, lockstep, pdl
        self.outside = OutsidePoolMeter(memory)
        self.captures = 0
        self.seconds = 0.0
        self.failed_keys: dict[tuple, str] = {}
        self.rolled_back = False  # a pool parked by a rollback, its segments not back yet
        # (key, tokens, thread) that `warm` warmed up: a thread's captures run on its own
        # capture stream, where the warm-up set up what is per stream (cuBLAS workspaces)
        self.warmed: set[tuple[tuple, int, int]] = set()
        # host seconds of the captures' warm-ups, recordings (lease, forward, graph end) and
        # own replays: where a capture's time goes (xgraph bench startup reports them)
        self.parts: Counter[str] = Counter({"warm_up": 0.0, "record": 0.0, "replay": 0.0})
        self._precapture = False

    def recording(self, kind: Kind, pool: CapturePool, backend: Backend | None = None) -> Recording:
        """A fresh recording of a key of this kind on `pool` (graphs of `backend`: a
        recording kept apart, which keeps the per-op guard)."""
        checks = not self.compiled  # per-op checks would make Dynamo run the forward eagerly
        b = backend or self.backend
        if kind is Kind.FULL:
            unguarded = backend is None and self._unguarded()
            return FullGraph(b, pool, self.runners.decode, checks and not unguarded)
        return PiecewiseGraph(b, pool, self.runners.prefill, self.guarded, checks)

    def _unguarded(self) -> bool:
        """Whether a full key records without the per-op guard: on one rank of a backend
        whose runtime refuses host reads in a capture itself; a failed capture is diagnosed
        after (`_diagnose`). Across ranks the guard stays, so no rank runs a diagnosis off
        the lockstep. Piecewise keys keep it: it refuses attention inside a piece."""
        return self.backend.capture_refuses_host_reads and self.lockstep.stats() is None

    # -- a miss ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def precapturing(self) -> Iterator[None]:
        """Captures in the block are of the executor's own steps (see the module docstring):
        not replayed, and warmed up only where `warm` did not already."""
        outer, self._precapture = self._precapture, True
        try:
            yield
        finally:
            self._precapture = outer

    def capture(self, step: Staged) -> Any:
        """Record the step's key and store it, then replay it: the step's outputs (None for a
        pre-capture step: not replayed)."""
        assert step.key is not None
        t0 = time.perf_counter()
        self._prepare(step)
        t1 = time.perf_counter()
        self.outside.start()
        lease: Lease | None = None
        graph: Recording | None = None
        try:  # a reservation that fails is a failed capture like any other
            lease = self.memory.begin()
            graph = self.lockstep.checked(step, self.recording(step.kind, lease.pool))
            self.pdl.prepare(step.kind, graph)
            with self.pdl.around(step.kind):
                self._record(step, graph)
            self.pdl.captured(step.key, step.kind, graph)  # metered with the capture
        except BaseException as exc:  # a transaction: Ctrl-C mid-capture rolls back too
            self._roll_back(graph, lease, exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: re-raised
                raise
            failure = lease.space.failure if lease and lease.space else None
            return self.failed(step, failure or self._diagnose(step, graph, exc))
        t2 = time.perf_counter()
        seconds = t2 - t0
        entry = Entry(step.kind, graph, lease, seconds)
        self.cache.store(step.key, entry)
        self.captures += 1
        self.seconds += seconds
        self.parts["warm_up"] += t1 - t0
        self.parts["record"] += t2 - t1
        self.outside.stop()
        logger.info("%s: captured %s in %.3f s", self.name, step.key, seconds)
        if self._precapture:
            return None  # nobody reads it; the key's first real step replays the graph
        self.cache.replay(entry, step, hit=False)  # the capture step's own result
        self.parts["replay"] += time.perf_counter() - t2
        return self.cache.outputs(step.num_tokens)

    def _prepare(self, step: Staged) -> None:
        """Before the recording: its warm-up (where it runs), the settle where one is due,
        and the first time, the output buffers."""
        layout = None
        if self._warms(step):
            with self.pdl.around(step.kind):  # the launch variants the record takes compile here
                layout = self.warm_up(step)
        if layout is not None or self.rolled_back:
            # the warm-up's cached memory goes back before the output buffers are made for
            # good; after a rollback, the parked pool's segments go back while its memory
            # is there (the memory's books count them until then)
            self.backend.empty_cache()
            self.rolled_back = False
        if layout is not None:  # the first capture: the output buffers
            self.cache.allocate_outputs(layout)

    def warm(self, step: Staged) -> None:
        """A capture's warm-up alone, counted as an eager "warm-up" step; a pre-capture of
        the same step later skips its own (see the module docstring)."""
        assert step.key is not None
        with self.pdl.around(step.kind):  # as the capture's own warm-up would run
            self.warm_up(step)
        self.cache.eager["warm-up"] += 1
        if self.lockstep.stats() is None and step.device_check is None:
            self.warmed.add(_mark(step))

    def _warms(self, step: Staged) -> bool:
        """Whether this capture runs its own warm-up (see the module docstring)."""
        mark = _mark(step)
        if mark not in self.warmed:
            return True
        self.warmed.discard(mark)  # one warm-up serves one capture (a retry warms again)
        return not (self._precapture and self.cache.has_outputs)

    def warm_up(self, step: Staged) -> list[tuple] | None:
        """The forward once, eagerly, on the staged buffers (the device check first); the
        output buffers' layout the first time."""
        return self.cache.check_outputs(self._warm(step), step.padded[NUM_TOKENS])

    def _warm(self, step: Staged) -> Any:
        runner = self.runners.of_graph(step.kind)
        try:
            with self.backend.warmup_context(), self.lockstep.warm_up(step):
                if step.device_check is not None:
                    with torch.no_grad():
                        step.device_check()  # writes the metadata the forward reads
                return self.cache.forward_eagerly(step.views, step.metadata, runner)
        except IndexError as exc:  # as a replay names it: the step's inputs, not a capture
            raise ReplayError(
                f"{self.name}: {type(exc).__name__}: {exc} (key {step.key}, in the warm-up "
                f"before its capture). {input_hint(self.cache.inputs)} Nothing was captured; "
                "the key is captured at its next valid step, and this step's result is not "
                "available."
            ) from exc

    def _record(self, step: Staged, graph: Recording) -> None:
        """The key's pieces: the device check (device metadata), then the forward and the
        copy of its outputs into the persistent buffers."""
        tb = step.padded[NUM_TOKENS]
        runner = self.runners.of_graph(step.kind)
        if step.metadata is not None and runner is not None:
            runner.plan(step.metadata)  # as the warm-up did, where it ran
        unguarded = self._recorded_unguarded(graph)
        with torch.no_grad(), block_host_copies() if unguarded else contextlib.nullcontext():
            if step.device_check is not None:
                graph.record_check(step.device_check)  # type: ignore[attr-defined]
            graph.begin()
            if graph.context is None:
                result = self.cache.forward(**step.views)
            else:
                with step_context(graph.context):  # type: ignore[arg-type]
                    result = self.cache.forward(**step.views)
            self.cache.write_outputs(result, tb)
            del result
        graph.end()

    def _recorded_unguarded(self, graph: Recording | None) -> bool:
        """Whether `graph` records an eager forward's full key without the per-op guard."""
        return isinstance(graph, FullGraph) and not graph.check_ops and not self.compiled

    def _diagnose(self, step: Staged, graph: Recording | None, exc: Exception) -> Exception:
        """The error of a failed capture. Where it recorded without the per-op guard, the
        forward runs once more, eagerly, under every check a guarded capture makes, so a
        host read is named by its op and model line; the runtime's own error where the
        checks find none."""
        if not self._recorded_unguarded(graph) or isinstance(
            exc, (CaptureError, VirtualMemoryError)
        ):
            return exc
        try:
            with checking_host_reads(self.backend.device):
                self._warm(step)
        except CaptureError as found:
            found.__cause__ = exc
            return found
        except Exception:  # the forward fails eagerly too: the capture's error says more
            return exc
        return exc

    def _roll_back(self, graph: Recording | None, lease: Lease | None, exc: BaseException) -> None:
        self.rolled_back = True
        # the recording's finished frames (the forward's, below this one) hold tensors in
        # the memory the rollback releases, and a traceback printed later reads them
        # (pytest reprs every frame's arguments): reading released memory faults. Their
        # locals go; the traceback keeps its lines.
        traceback.clear_frames(exc.__traceback__)
        try:
            if graph is not None:
                graph.abort()
        finally:
            if lease is not None:
                self.memory.rollback(lease)

    def failed(self, step: Staged, exc: Exception) -> Any:
        """A capture that failed (rolled back): the policy, raise or eager from now on."""
        key = step.key
        assert key is not None
        reason = f"{type(exc).__name__}: {exc}"
        self.failed_keys[key] = reason
        if self.on_capture_error is Fallback.RAISE:
            if isinstance(exc, (CaptureError, VirtualMemoryError)):
                raise exc
            raise CaptureError(
                f"{self.name}: capturing {key} failed ({reason}). Nothing was kept; fix the "
                "model or use on_capture_error='eager'."
            ) from exc
        self.cache.mark_eager(key, reason)
        msg = (
            f"{self.name}: capturing {key} failed and was rolled back; this key runs eagerly "
            f"from now on (on_capture_error='eager'). Cause: {reason}"
        )
        warn_at_caller(msg)
        logger.warning(msg)
        with self.lockstep.eager(step):
            return self.cache.run_padded(step, "capture failed")

    # -- the device check of a key recorded for host metadata ------------------------------

    def add_check(self, entry: Entry, step: Staged) -> None:
        """Record the device check as the first piece of a key recorded without one (its
        first steps had host metadata), on a lease of its own; the policy on failure."""
        ops = step.device_check
        assert ops is not None and step.key is not None
        lease: Lease | None = None
        with torch.no_grad():
            with self.backend.warmup_context():
                ops()  # lazy initialisation stays out of the capture
            try:
                lease = self.memory.begin()
                entry.graph.record_check(ops, lease.pool)  # type: ignore[attr-defined]
                return
            except BaseException as exc:
                if lease is not None:
                    self.memory.rollback(lease)
                    self.rolled_back = True
                if not isinstance(exc, Exception):
                    raise
                failure = exc
        reason = f"{type(failure).__name__}: {failure}"
        self.failed_keys[step.key] = f"device check: {reason}"
        if self.on_capture_error is Fallback.RAISE:
            raise CaptureError(
                f"{self.name}: capturing the device-metadata check of {step.key} failed "
                f"({reason}). Nothing was kept; the key still replays for host metadata. Pass "
                "host metadata, or use on_capture_error='eager'."
            ) from failure
        entry.graph.run_check_eagerly(ops)  # type: ignore[attr-defined]
        msg = (
            f"{self.name}: the device-metadata check of {ops.seqs} sequences of "
            f"{ops.query_len} tokens could not be captured ({reason}); this key checks its "
            "device metadata with the same ops issued eagerly each step (as safe, more host "
            "time; on_capture_error='eager')."
        )
        warn_at_caller(msg)
        logger.warning(msg)

    # -- a recording kept apart ------------------------------------------------------------

    @contextlib.contextmanager
    def apart(
        self, step: Staged, backend: Backend, around: contextlib.AbstractContextManager[Any]
    ) -> Iterator[Recording]:
        """Warm up and record `step` on a pool of its own with graphs made by `backend`, the
        forward under `around`; the block reads the recording, which is then reset and its
        pool closed: nothing is stored (the parameterization check)."""
        self._warm(step)  # its outputs dropped at once, before the recording's pool is made
        pool = self.backend.new_pool()
        rec: Recording | None = None
        try:
            rec = self.recording(step.kind, pool, backend)
            prefill = self.runners.prefill
            if step.kind is Kind.PIECEWISE and step.metadata is not None and prefill:
                prefill.plan(step.metadata)
            rec.begin()
            with torch.no_grad(), around:
                if rec.context is None:
                    result = self.cache.forward(**step.views)
                else:
                    with step_context(rec.context):  # type: ignore[arg-type]
                        result = self.cache.forward(**step.views)
                del result  # pool memory: gone before the recording is read and reset
            rec.end()
            yield rec
            rec.reset()
        except BaseException:
            if rec is not None:
                rec.abort()
            raise
        finally:
            self.backend.synchronize()
            pool.close()


def _mark(step: Staged) -> tuple[tuple, int, int]:
    assert step.key is not None
    return step.key, step.num_tokens, threading.get_ident()
