"""Conformance of steps from two threads: two executors step concurrently, one refuses.

Engines step from more than one thread (a scheduler thread and a warm-up thread, one
thread per model of a pipeline). Two executors, each with its own workload and graph
memory, step at the same time from two threads (captures included): each thread's
outputs and KV cache equal those of the same steps run in one thread. One executor
called from a second thread while its step runs raises ConcurrentStepError at once and
writes nothing; the running step completes and equals eager.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import torch

from xgraph.errors import ConcurrentStepError
from xgraph.interfaces import Backend

from .base import BackendTests, tiny_workload

BUCKETS = [1, 2, 4, 8]
BATCHES = [3, 1, 8, 5, 2, 7, 4, 1, 6, 8]
TIMEOUT = 120  # seconds: a thread that hangs fails the test instead of the run


def _layout() -> dict[str, int]:
    return {"num_blocks": 96, "max_blocks": 6, "max_seqs": 16}


def join(threads: list[threading.Thread], stop: Any = None) -> None:
    """Join every thread (each within TIMEOUT). A Ctrl-C meanwhile is raised only once they
    have ended (`stop` asks them to, at their next step): a thread left stepping past its
    test would meet the interpreter's exit, which releases the executors it steps."""
    interrupted: BaseException | None = None
    for t in threads:
        while True:
            try:
                t.join(TIMEOUT)
                break
            except BaseException as exc:  # KeyboardInterrupt: join again, then raise it
                interrupted = interrupted or exc
                if stop is not None:
                    stop()
    if interrupted is not None:
        raise interrupted


class ThreadTests(BackendTests):
    """Two executors in two threads step concurrently; one executor refuses a second
    thread's step while its own runs."""

    def thread_steps(self, backend: Backend, seed: int, barrier: Any = None) -> list:
        """One executor over its own workload: its decode steps' outputs and final cache."""
        w = tiny_workload(backend, **_layout(), seed=seed)
        w.randomize_cache(seed)
        ex = w.executor(backend=backend, buckets=BUCKETS)
        rng = random.Random(seed)
        outs = []
        try:
            for n in BATCHES:
                if barrier is not None:
                    barrier.wait(TIMEOUT)  # both threads inside their steps at once
                outs.append(ex(**w.decode_step(rng, n).kwargs(), clone=True))
            backend.synchronize()
            s = ex.stats()  # a capture another thread's broke would run eagerly, unseen
            assert s["eager"] == {} and s["captures"] == len(BUCKETS), s["failed_keys"]
            return [outs, [t.clone() for t in w.cache.tensors()]]
        finally:
            ex.close()

    def test_two_executors_step_concurrently_as_in_one_thread(self, backend: Backend) -> None:
        alone = [self.thread_steps(backend, seed) for seed in (1, 2)]
        barrier, results, errors = threading.Barrier(2), {}, {}

        def run(seed: int) -> None:
            try:
                results[seed] = self.thread_steps(backend, seed, barrier)
            except BaseException as exc:  # reported by the test's thread
                errors[seed] = repr(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        join(threads, barrier.abort)
        assert not any(t.is_alive() for t in threads), "a stepping thread hung"
        assert not errors, errors
        for seed, (outs, cache) in zip((1, 2), alone):
            got_outs, got_cache = results[seed]
            for a, b in zip(got_outs + got_cache, outs + cache):
                self.assert_matches(backend, a, b)

    def test_a_step_from_a_second_thread_is_refused_while_one_runs(self, backend: Backend) -> None:
        w = tiny_workload(backend, **_layout())
        w.randomize_cache(3)
        ref = tiny_workload(backend, **_layout())
        ref.randomize_cache(3)
        inside, release, hold = threading.Event(), threading.Event(), {"on": False}

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            if hold["on"]:  # the first (eager) warm-up of a new key: held inside the step
                hold["on"] = False
                inside.set()
                release.wait(TIMEOUT)
            return w.model.forward_logits(input_ids, positions)

        ex = w.executor(forward, backend=backend, buckets=BUCKETS)
        rng = random.Random(3)
        first, second = w.decode_step(rng, 3), w.decode_step(rng, 2)
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["y"] = ex(**first.kwargs(), clone=True)
            except BaseException as exc:  # reported by the test's thread
                out["error"] = repr(exc)
                inside.set()

        hold["on"] = True
        worker = threading.Thread(target=run)
        worker.start()
        try:
            assert inside.wait(TIMEOUT), "the first step never started"
            cache = [t.clone() for t in w.cache.tensors()]
            try:
                ex(**second.kwargs())
                refused = None
            except ConcurrentStepError as exc:
                refused = str(exc)
            assert refused is not None and "one step at a time" in refused, refused
            for a, b in zip(w.cache.tensors(), cache):  # the refused step wrote nothing
                assert torch.equal(a.cpu(), b.cpu())
        finally:
            release.set()
            join([worker])
        try:
            assert not worker.is_alive() and "error" not in out, out.get("error")
            from xgraph import Buckets

            buckets = Buckets(BUCKETS)
            for step, got in ((first, out["y"]), (second, ex(**second.kwargs()))):
                expect = ref.eager(ref.padded(step, buckets, full=True))[: step.num_tokens]
                self.assert_matches(backend, got, expect)
        finally:
            ex.close()
