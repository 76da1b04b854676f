"""Conformance of sleep and wake: memory given back by the driver's reading, every captured
key replayed after wake with no recapture, weights and KV cache kept bit for bit across an
offloading sleep, failed wakes rolled back with balanced books."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from xgraph.interfaces import Backend

from .base import VirtualMemoryFixture
from .faults import books, fail_driver_call

HIDDEN, WIDE = 256, 4096  # intermediates of 4 MiB at 256 tokens: several chunks of any VMM
# a wake's create or map fails: in graph memory (its second, after one succeeded), or in the
# persistent buffers, which wake after graph memory (so the undo spans both)
WAKE_FAULTS = [(c, at) for c in ("_create_chunk", "_map_chunk") for at in ("graphs", "buffers")]
WEIGHTS, KV = "conformance-weights", "conformance-kv-cache"  # regions live for the process


def mlp_executor(backend: Backend, sizes: list[int], memory: str | None = None) -> Any:
    """A full-graph executor over a wide MLP whose weights are plain device tensors."""
    import torch.nn.functional as F

    from xgraph import GraphExecutor, Input

    g = torch.Generator().manual_seed(5)
    w1, w2 = (
        torch.randn(HIDDEN, WIDE, generator=g, device="cpu").mul(0.05).to(backend.device)
        for _ in "ab"
    )
    w3 = torch.randn(WIDE, HIDDEN, generator=g, device="cpu").mul(0.05).to(backend.device)

    def forward(x):  # type: ignore[no-untyped-def]
        return (F.silu(x @ w1) * (x @ w2)) @ w3

    inputs = [Input("x", torch.float32, ("num_tokens", HIDDEN))]
    return GraphExecutor(
        forward,
        inputs=inputs,
        backend=backend,
        buckets=sizes,
        memory=memory,
        on_capture_error="raise",
    )


def scratch_held(backend: Backend) -> int:
    """Bytes of the scratch chunks that cover sleeping ranges now: one per VirtualMemory of
    the backend (graph memory and regions; persistent buffers), held while anything sleeps."""
    from xgraph.arena import buffer_memory

    vms = {id(v): v for v in (backend.virtual_memory(), buffer_memory(backend)) if v is not None}
    return sum(v.scratch_held() for v in vms.values())  # type: ignore[attr-defined]


def given_back(backend: Backend, awake: int, asleep: int, held: int) -> None:
    """The reading dropped by >= 95% of `held` (bytes by the books), less the scratch chunks
    that now cover the ranges. On a backend whose device is the host the reading counts only
    pages ever written (a chunk's untouched tail has none), so there it is >= 95% of what the
    reading saw before the sleep."""
    scratch = scratch_held(backend)
    if backend.device.type == "cpu":
        assert awake > 0 and asleep <= 0.05 * awake + scratch, (awake, asleep, held, scratch)
    else:
        assert awake - asleep >= 0.95 * held - scratch, (awake, asleep, held, scratch)


class SleepTests(VirtualMemoryFixture):
    """Sleep and wake: graph memory, persistent buffers and memory regions given back and
    restored at the same addresses."""

    sleep_sizes: ClassVar[list[int]] = [16, 64, 256]

    @pytest.fixture
    def sleepable(self, backend: Backend, vm: Any, routes_segments: bool) -> Backend | None:
        """The backend where it has shared-physical graph memory, which sleep needs; else
        None, once the documented refusals are checked (the tests then have nothing to do)."""
        if vm is not None and routes_segments:
            return backend
        from xgraph.errors import XGraphError
        from xgraph.sleepmode import memory_region

        ex = mlp_executor(backend, [16], "shared-pool")
        ex(x=torch.randn(16, HIDDEN))
        with pytest.raises(XGraphError, match="needs 'shared-physical' graph memory"):
            ex.sleep()
        ex.close()
        with pytest.raises(XGraphError, match="cannot place tensors in memory that sleep"):
            memory_region(WEIGHTS, type(backend)())
        return None

    @pytest.fixture
    def own(self, sleepable: Backend | None) -> Backend | None:
        """A backend instance of the same class for region tests: regions live as long as the
        process, so they stay off the instance every other test shares."""
        return None if sleepable is None else type(sleepable)()

    def memory_for_buffers(self, vm: Any, routes_segments: bool) -> str:
        """Graph memory for the tests of persistent buffers, which need no sleep."""
        return "shared-physical" if vm is not None and routes_segments else "shared-pool"

    def _replay_all(self, ex: Any) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        g = torch.Generator().manual_seed(9)
        xs = {n: torch.randn(n, HIDDEN, generator=g, device="cpu") for n in self.sleep_sizes}
        return xs, {n: ex(x=x, clone=True) for n, x in xs.items()}

    def test_sleep_gives_back_graph_memory_and_wake_replays_every_key(
        self, sleepable: Backend
    ) -> None:
        from xgraph.sleepmode import address_ranges, memory_reading

        if sleepable is None:
            return  # the fixture checked the documented refusal
        backend = sleepable
        ex = mlp_executor(backend, self.sleep_sizes)
        xs, before = self._replay_all(ex)
        captures, held = ex.stats()["captures"], ex.memory.graph_bytes()
        ranges = address_ranges(ex)
        awake = memory_reading(backend, ranges)
        report = ex.sleep()
        asleep = memory_reading(backend, ranges)
        assert report.released_bytes >= held > 0
        if awake is not None and asleep is not None:  # a backend with no reading: the books
            given_back(backend, awake, asleep, held)
        assert ex.sleep().released_bytes == 0  # idempotent
        assert ex.wake().restored_bytes == report.released_bytes
        assert ex.wake().restored_bytes == 0
        for n, x in xs.items():
            self.assert_matches(backend, ex(x=x), before[n])
        s = ex.stats()
        assert s["captures"] == captures == len(self.sleep_sizes) and s["asleep"] == []
        ex.close()

    def test_a_step_while_asleep_raises_and_close_while_asleep_gives_everything_back(
        self, sleepable: Backend, vm: Any
    ) -> None:
        import gc

        from xgraph.arena import buffer_memory
        from xgraph.errors import AsleepError

        if sleepable is None:
            return  # the fixture checked the documented refusal
        backend = sleepable
        buffers = buffer_memory(backend)
        gc.collect()
        start = books(vm), books(buffers)
        ex = mlp_executor(backend, self.sleep_sizes)
        xs, _ = self._replay_all(ex)
        ex.sleep()
        with pytest.raises(AsleepError, match=r"wake\(\)"):
            ex(x=xs[16])
        with pytest.raises(AsleepError, match=r"wake\(\)"):
            ex.capture([64])
        ex.close()  # no wake, no synchronize
        assert (books(vm), books(buffers)) == start

    def test_close_gives_the_buffers_back_and_a_closed_executor_refuses(
        self, backend: Backend, vm: Any, routes_segments: bool
    ) -> None:
        """Without virtual memory the buffers are torch's, and only the refusals are left."""
        import gc

        from xgraph.arena import buffer_memory
        from xgraph.errors import XGraphError
        from xgraph.options import Kind
        from xgraph.sleepmode import memory_reading

        buffers = buffer_memory(backend)
        assert (buffers is None) == (vm is None)
        gc.collect()
        start = books(buffers) if buffers is not None else None
        ex = mlp_executor(backend, self.sleep_sizes, self.memory_for_buffers(vm, routes_segments))
        xs, before = self._replay_all(ex)
        out = ex(x=xs[16])  # a view of the output buffer, kept past the close
        planner = ex.planner  # taken before the close: it refuses too
        assert ex.persistent_bytes() > 0
        if buffers is not None:
            ranges, held = ex.arena.segments.ranges(), ex.arena.segments.nbytes
            awake = memory_reading(backend, ranges)
            assert books(buffers) != start and held > 0
        ex.close()  # no synchronize: close waits for the queued steps itself
        if buffers is not None:
            assert books(buffers) == start  # every segment given back, not left to the GC
            closed = memory_reading(backend, ranges)
            if awake is not None and closed is not None:
                given_back(backend, awake, closed, held)
        self.assert_matches(backend, out, before[16])  # outputs go with the caller's views
        assert ex.persistent_bytes() == 0 and ex.stats()["persistent_bytes"] == 0
        refused = [
            lambda: ex(x=xs[16]),
            lambda: ex.capture([16]),
            lambda: ex.warm_up([16]),
            lambda: ex.idle_step(),
            lambda: ex.synchronize(),
            lambda: ex.sleep(),
            lambda: ex.wake(),
            lambda: planner.plan({"x": xs[16]}, None),
            lambda: planner.synthetic(16, Kind.FULL, {}),
            lambda: planner.staged,
        ]
        for call in refused:  # the documented error, never one from memory that is gone
            with pytest.raises(XGraphError, match="is closed"):
                call()
        ex.close()  # idempotent
        if buffers is not None:
            assert books(buffers) == start

    def test_an_executor_dropped_without_close_gives_its_buffers_back(
        self, backend: Backend, vm: Any, routes_segments: bool
    ) -> None:
        import gc

        from xgraph.arena import buffer_memory

        buffers = buffer_memory(backend)
        if buffers is None:
            return  # no virtual memory: the buffers are torch's (the vm fixture checked it)
        gc.collect()
        start = books(buffers)
        ex = mlp_executor(backend, self.sleep_sizes, self.memory_for_buffers(vm, routes_segments))
        self._replay_all(ex)
        assert books(buffers) != start
        del ex
        gc.collect()
        assert books(buffers) == start

    @pytest.mark.parametrize("call, at", WAKE_FAULTS)
    def test_a_failed_wake_rolls_back_and_the_next_wake_works(
        self, sleepable: Backend, vm: Any, call: str, at: str
    ) -> None:
        from xgraph.errors import AsleepError, VirtualMemoryError

        if sleepable is None:
            return  # the fixture checked the documented refusal
        backend = sleepable
        ex = mlp_executor(backend, self.sleep_sizes)
        xs, before = self._replay_all(ex)
        buffers = ex.arena.vm  # the persistent buffers' own VirtualMemory
        target, nth = (vm, 2) if at == "graphs" else (buffers, 1)
        ex.sleep()
        asleep = books(vm), books(buffers)
        with fail_driver_call(target, call, nth=nth) as fault:
            with pytest.raises(VirtualMemoryError, match="injected"):
                ex.wake()
        assert fault.fired and (books(vm), books(buffers)) == asleep
        with pytest.raises(AsleepError):
            ex(x=xs[16])
        ex.wake()
        for n, x in xs.items():
            self.assert_matches(backend, ex(x=x), before[n])
        assert ex.stats()["captures"] == len(self.sleep_sizes)
        ex.close()

    # -- memory regions --------------------------------------------------------------------

    def _in_regions(self, backend: Backend) -> Any:
        """The tiny reference model with its weights and an 8 MiB KV cache in regions."""
        from xgraph import PagedKVCache
        from xgraph.errors import XGraphError
        from xgraph.models import Qwen3Model, Workload
        from xgraph.sleepmode import memory_region

        try:
            with memory_region(WEIGHTS, backend):
                model = Qwen3Model.build("tiny", num_blocks=1, block_size=4, device=backend.device)
            c = model.config
            with memory_region(KV, backend):
                cache = PagedKVCache(
                    c.num_layers, c.num_kv_heads, c.head_dim, 4096, 4, device=backend.device
                )
        except XGraphError as exc:  # the documented refusal: pools that cannot route them
            if "cannot place tensors" in str(exc):
                return None
            raise
        model.kv_cache = cache
        model.mark_cache_static()
        return Workload(model, max_blocks=8, max_seqs=16)

    def _steps(self, w: Any) -> list[Any]:
        import random

        rng = random.Random(13)
        decode = [w.decode_step(rng, n) for n in (1, 5, 16)]
        return [*decode, w.prefill_step(rng, [7, 9], [0, 3])]  # full graphs and a piecewise one

    def _workload_in_regions(self, own: Backend | None, seed: int) -> Any:
        """_in_regions' workload with its KV cache randomised from `seed`; None where there is
        nothing to do (the fixture checked the documented refusal, or the regions were refused,
        saying why)."""
        if own is None:
            return None
        w = self._in_regions(own)
        if w is not None:
            w.randomize_cache(seed)
        return w

    def _replayed(self, w: Any, backend: Backend) -> tuple[Any, list[Any], list[Any], list[Any]]:
        """An executor over the workload, its steps, the KV cache before them and each step's
        output."""
        ex = w.executor(backend=backend, buckets=[1, 2, 4, 8, 16])
        steps = self._steps(w)
        kv0 = [t.clone() for t in w.cache.tensors()]
        before = [ex(**s.kwargs(), clone=True) for s in steps]
        return ex, steps, kv0, before

    def _assert_replays_match(
        self, backend: Backend, w: Any, ex: Any, steps: list[Any], kv0: list[Any], before: list[Any]
    ) -> None:
        """From the KV cache of before the steps, each step replays to its output of then."""
        for t, k in zip(w.cache.tensors(), kv0):
            t.copy_(k)
        for s, out in zip(steps, before):
            self.assert_matches(backend, ex(**s.kwargs()), out)

    def test_regions_and_graphs_sleep_and_wake_with_weights_and_kv_kept_bitwise(
        self, own: Backend
    ) -> None:
        import xgraph
        from xgraph.errors import AsleepError
        from xgraph.sleepmode import address_ranges, memory_reading, regions

        w = self._workload_in_regions(own, 4)
        if w is None:
            return  # nothing to do (refused)
        backend = own
        ex, steps, kv0, before = self._replayed(w, backend)
        kv1 = [t.clone() for t in w.cache.tensors()]
        weights = [p.clone() for p in w.model.parameters()]
        captures, tags = ex.stats()["captures"], [WEIGHTS, KV]
        held = ex.memory.graph_bytes() + sum(r.nbytes for r in regions(backend, tags))
        ranges = address_ranges(ex, tags=tags)
        awake = memory_reading(backend, ranges)
        report = xgraph.sleep(ex, tags=tags, offload=tags)
        asleep = memory_reading(backend, ranges)
        assert report.released_bytes >= held
        if awake is not None and asleep is not None:  # a backend with no reading: the books
            given_back(backend, awake, asleep, held)
        with pytest.raises(AsleepError, match="memory region"):
            ex(**steps[0].kwargs())
        xgraph.wake(ex, tags=tags)
        assert all(torch.equal(a, b) for a, b in zip(w.cache.tensors(), kv1))
        assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), weights))
        self._assert_replays_match(backend, w, ex, steps, kv0, before)
        assert ex.stats()["captures"] == captures
        ex.close()

    def test_a_dropped_kv_cache_comes_back_zeroed_and_weights_kept(self, own: Backend) -> None:
        import xgraph

        w = self._workload_in_regions(own, 5)
        if w is None:
            return  # nothing to do (refused)
        backend = own
        weights = [p.clone() for p in w.model.parameters()]
        report = xgraph.sleep(tags=[WEIGHTS, KV], offload=WEIGHTS, backend=backend)
        assert report.offloaded_bytes < report.released_bytes  # the cache was not copied
        xgraph.wake(tags=[WEIGHTS, KV], backend=backend)
        assert all(not t.any() for t in w.cache.tensors())
        assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), weights))

    @pytest.mark.parametrize("at", ["regions", "graphs"])
    def test_a_failed_wake_of_regions_and_graphs_goes_back_to_sleep(
        self, own: Backend, at: str
    ) -> None:
        import xgraph
        from xgraph.errors import VirtualMemoryError
        from xgraph.sleepmode import regions

        w = self._workload_in_regions(own, 6)
        if w is None:
            return  # nothing to do (refused)
        backend = own
        ex, steps, kv0, before = self._replayed(w, backend)
        tags, vm = [WEIGHTS, KV], backend.virtual_memory()
        xgraph.sleep(ex, tags=tags, offload=tags)
        asleep = books(vm)
        # regions wake first: fail inside them (the second chunk), or in the graph memory
        # after both regions were restored
        nth = (
            2
            if at == "regions"
            else sum(len(r.segments.segments) for r in regions(backend, tags)) + 1
        )
        with fail_driver_call(vm, "_create_chunk", nth=nth) as fault:
            with pytest.raises(VirtualMemoryError, match="injected"):
                xgraph.wake(ex, tags=tags)
        assert fault.fired and books(vm) == asleep
        assert all(r.asleep for r in regions(backend, tags))
        xgraph.wake(ex, tags=tags)
        self._assert_replays_match(backend, w, ex, steps, kv0, before)
        ex.close()
