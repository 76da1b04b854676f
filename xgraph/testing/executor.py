"""Conformance of GraphExecutor on the backend."""

from __future__ import annotations

from typing import ClassVar

import torch

from xgraph.interfaces import Backend

from .base import BackendTests, tiny_workload


class ExecutorTests(BackendTests):
    """GraphExecutor on this backend: decode as full graphs equals eager on the padded batch."""

    buckets: ClassVar[list[int]] = [1, 2, 4, 8, 16]

    def test_decode_steps_match_padded_eager(self, backend: Backend) -> None:
        import random

        from xgraph.buckets import Buckets

        ex_w, ref_w = (
            tiny_workload(backend, num_blocks=160, max_blocks=6, max_seqs=24) for _ in range(2)
        )
        for w in (ex_w, ref_w):
            w.randomize_cache(7)
        buckets = Buckets(self.buckets)
        ex = ex_w.executor(backend=backend, buckets=buckets)
        rng = random.Random(7)
        for batch in [3, 1, 16, 5, 20, 8, 3, 12, 2, 7, 1, 16]:
            step = ex_w.decode_step(rng, batch)
            out = ex(**step.kwargs())
            ref = step if batch > buckets.max else ref_w.padded(step, buckets, full=True)
            self.assert_matches(backend, out, ref_w.eager(ref)[:batch])
            for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
                self.assert_matches(backend, a, b)
        s = ex.stats()
        assert s["captures"] == len(self.buckets) and s["eager"] == {"above largest bucket": 1}
        assert s["replays"] == 11 and s["graph_bytes"] > 0
        ex.close()

    def test_capture_failure_on_one_key_falls_back_and_others_replay(
        self, backend: Backend
    ) -> None:
        import random
        import warnings

        from xgraph import XGraphWarning

        w = tiny_workload(backend, max_blocks=4, max_seqs=24)

        def forward(input_ids, positions):  # type: ignore[no-untyped-def]
            h = w.model.forward_logits(input_ids, positions)
            if input_ids.shape[0] == 4:
                h = h * (h[0, 0].item() != 1e9)  # host read on this bucket only
            return h

        ex = w.executor(forward, backend=backend, buckets=self.buckets)
        rng = random.Random(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in [3, 1, 4, 8, 3, 2]:
                step = w.decode_step(rng, batch)
                ex(**step.kwargs())
        assert sum(issubclass(c.category, XGraphWarning) for c in caught) == 1
        s = ex.stats()
        assert ("full", 4) in s["eager_keys"] and "item()" in s["eager_keys"][("full", 4)]
        assert set(s["hits"]) == {("full", 1), ("full", 2), ("full", 8)}
        assert s["eager"] == {"capture failed": 1, "capture failed earlier": 2}
        ex.close()

    def test_composite_key_dims_get_their_own_graphs(self, backend: Backend) -> None:
        from xgraph import Dim, GraphExecutor, Input

        dev = backend.device
        w = torch.randn(8, 8, device=dev)

        def forward(x, comm):  # type: ignore[no-untyped-def]
            return x @ w + comm.sum(0, keepdim=True)

        ex = GraphExecutor(
            forward,
            backend=backend,
            buckets=[1, 2, 4],
            inputs=[
                Input("x", torch.float32, ("num_tokens", 8)),
                Input("comm", torch.float32, ("num_comm_tokens", 8)),
            ],
            dims=[Dim("num_comm_tokens", max=32, buckets=[8, 16, 32])],
        )
        x = torch.randn(3, 8)
        for c in (5, 12, 7, 30):
            comm = torch.randn(c, 8)
            out = ex(x=x, comm=comm)
            # padding adds zero rows to the sum: equal up to summation order
            torch.testing.assert_close(out, forward(x.to(dev), comm.to(dev)), rtol=1e-5, atol=1e-5)
        assert ex.stats()["keys"] == [("full", 4, 16), ("full", 4, 32), ("full", 4, 8)]
        ex.close()
