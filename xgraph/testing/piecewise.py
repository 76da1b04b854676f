"""Conformance of piecewise graphs."""

from __future__ import annotations

import pytest

from xgraph.interfaces import Backend

from .base import BackendTests, tiny_workload


class PiecewiseTests(BackendTests):
    """Piecewise graphs: one graph per token count serves every batch composition."""

    def test_compositions_share_one_graph(self, backend: Backend) -> None:
        import random

        from xgraph import Buckets
        from xgraph.buckets import default_sizes

        ex_w, ref_w = (
            tiny_workload(backend, num_blocks=128, max_blocks=32, max_seqs=16) for _ in range(2)
        )
        for w in (ex_w, ref_w):
            w.randomize_cache(11)
        buckets = Buckets(default_sizes(64))
        ex = ex_w.executor(backend=backend, buckets=buckets)
        rng = random.Random(11)
        for comp in ([32, 32], [16] * 4, [8] * 8, [64], [5, 40, 19], [1, 1, 62]):
            step = ex_w.prefill_step(rng, comp, [rng.randint(0, 30) for _ in comp])
            out = ex(**step.kwargs())
            ref = ref_w.eager(ref_w.padded(step, buckets, full=False))[: step.num_tokens]
            self.assert_matches(backend, out, ref)
            for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
                self.assert_matches(backend, a, b)
        assert ex.stats()["keys"] == [("piecewise", 64)]
        layers = ex_w.model.config.num_layers
        assert ex.graph(("piecewise", 64)).describe() == ["piece", "runner"] * layers + ["piece"]
        ex.close()

    def test_bypassed_attention_is_refused(self, backend: Backend) -> None:
        import random

        from xgraph import Buckets, CaptureError
        from xgraph.buckets import default_sizes

        w = tiny_workload(backend, max_blocks=8, max_seqs=8)
        k_cache = w.cache.layers[0][0]

        def forward(input_ids, positions):  # type: ignore[no-untyped-def]
            return k_cache.flatten(1)[positions % 4, :4] + 1.0  # reads the cache directly

        ex = w.executor(
            forward, backend=backend, buckets=Buckets(default_sizes(16)), on_capture_error="raise"
        )
        with pytest.raises(CaptureError, match="KV cache"):
            ex(**w.prefill_step(random.Random(1), [3, 4]).kwargs())
        assert ex.stats()["keys"] == []
        ex.close()
