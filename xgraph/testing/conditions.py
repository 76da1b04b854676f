"""Conformance under the conditions engines run in: inference mode, a default device, a
default dtype.

Engines run their models under `torch.inference_mode()`, where the dispatcher hands
composite ops over undecomposed (`to`, `contiguous`, `reshape` may copy where their schema
says they alias), and build models, caches and executors under
`torch.set_default_device(device)`, where a tensor made without a device lands on it. Each
test builds the workloads, the executor and the eager reference inside the condition,
captures and replays full graphs (decode) and piecewise graphs (mixed prefill) there, and
checks every output and the KV cache against eager; the condition is restored after.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from xgraph.interfaces import Backend

from .base import BackendTests, tiny_workload

FULL_BUCKETS = [1, 2, 4, 8]
PIECEWISE_BUCKETS = [8, 16, 32]
DECODE_BATCHES = [3, 1, 8, 5, 2, 3]
# (query lengths, cached tokens before them): mixed prefill, decode rows among them too
COMPOSITIONS = [([5, 9], [2, 0]), ([16, 16], [0, 4]), ([3, 1, 1], [6, 9, 2]), ([20], [1])]


def upcasting(model: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's forward with a norm that upcasts (a real copy, whatever the dtype) and
    mutates its copy in place: under inference mode a recorder that takes the copy for a
    view replays the in-place ops on stale data."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = model.forward(input_ids, positions)
        u = h.to(torch.float32, copy=True)
        u.mul_(torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6))
        u.mul_(2.0)
        u.add_(h.float())
        return model.compute_logits(u.to(h.dtype))

    return forward


@contextlib.contextmanager
def default_device_or_dtype(backend: Backend, which: str) -> Iterator[None]:
    """`torch.set_default_device(backend.device)` or `torch.set_default_dtype(float64)`,
    restored after (torch has no getter for the default device: it is restored to none)."""
    dtype = torch.get_default_dtype()
    if which == "device":
        torch.set_default_device(backend.device)
    else:
        torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(dtype)


class EngineConditionTests(BackendTests):
    """Full and piecewise graphs built, captured and replayed under inference mode, a default
    device and a default dtype equal eager under the same condition."""

    def run_condition_steps(self, backend: Backend, kind: str, forward: str = "model") -> None:
        """Two equal workloads: graphs on one, eager on the other, over one step sequence."""
        full = kind == "full"
        ex_w, ref_w = (
            tiny_workload(backend, num_blocks=96, max_blocks=10, max_seqs=16) for _ in range(2)
        )
        for w in (ex_w, ref_w):
            w.randomize_cache(5)
        up = forward == "upcasting"
        fn, ref_fn = (upcasting(w.model) if up else None for w in (ex_w, ref_w))
        from xgraph import Buckets

        buckets = Buckets(FULL_BUCKETS if full else PIECEWISE_BUCKETS)
        ex = ex_w.executor(fn, backend=backend, buckets=buckets)
        rng = random.Random(5)
        if full:
            steps = [ex_w.decode_step(rng, n) for n in DECODE_BATCHES]
        else:
            steps = [ex_w.prefill_step(rng, q, extra) for q, extra in COMPOSITIONS]
        try:
            for step in steps:
                out = ex(**step.kwargs())
                ref = ref_w.eager(ref_w.padded(step, buckets, full), forward=ref_fn)
                self.assert_matches(backend, out, ref[: step.num_tokens])
                for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
                    self.assert_matches(backend, a, b)
            s = ex.stats()
            assert s["eager"] == {} and s["replays"] > 0, s  # every step a graph's
            assert {k[0] for k in s["keys"]} == {kind}, s["keys"]
        finally:
            ex.close()

    @pytest.mark.parametrize("kind", ["full", "piecewise"])
    def test_inference_mode(self, backend: Backend, kind: str) -> None:
        """Built, captured and replayed under inference mode, the forward upcasting with a
        real copy and mutating it in place."""
        with torch.inference_mode():
            self.run_condition_steps(backend, kind, forward="upcasting")

    @pytest.mark.parametrize("which", ["device", "float64"])
    @pytest.mark.parametrize("kind", ["full", "piecewise"])
    def test_a_default_device_or_dtype(self, backend: Backend, kind: str, which: str) -> None:
        """Built, captured and replayed under `torch.set_default_device(backend.device)` or
        `torch.set_default_dtype(torch.float64)`, restored after."""
        with default_device_or_dtype(backend, which):
            self.run_condition_steps(backend, kind)
        assert torch.get_default_dtype() == torch.float32
        assert torch.empty(1).device.type == "cpu"
