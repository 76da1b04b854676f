"""The parameterization check over a Hugging Face Qwen3 routed through xgraph.attention.

A tiny randomly initialised Qwen3ForCausalLM (transformers' own classes, as the other
transformers tests build it) in a GraphModel: its decode full graphs and prefill pieces
launch the same ops whatever the sequence lengths, block tables and batch composition, and
the layers are named by the model's own module paths. The same through `xgraph check
--model FOLDER` on a saved copy.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, tiny  # noqa: E402

from xgraph.cli import main as xgraph_main  # noqa: E402
from xgraph.integrations.transformers import GraphModel  # noqa: E402
from xgraph.runners import PagedDecodeRunner  # noqa: E402


def test_a_transformers_qwen3_passes_for_both_kinds():
    with GraphModel(tiny("qwen3"), backend="cpu", on_capture_error="raise", **LIMITS) as gm:
        stats = gm.stats()
        report = gm.executor.check_parameterization(sizes=[4, 8])
        assert gm.stats() == stats
    assert report.ok and not report.unstable, report
    keys = [k.key for k in report.keys]
    assert keys == [("full", 4), ("full", 8), ("piecewise", 4), ("piecewise", 8)]
    assert all(k.launches > 50 and len(k.varied) == 3 for k in report.keys)


def test_a_leaky_runner_under_a_transformers_qwen3_is_named_by_its_module_path():
    class Leak(PagedDecodeRunner):
        graph_safe = True

        def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
            super().run(q, k, v, out, kv_cache, scale)
            longest = max(int(n) for n in self.planned().seq_lens_host)
            out.add_(torch.zeros(longest).sum())  # the planted leak

    with GraphModel(tiny("qwen3"), backend="cpu", **LIMITS) as gm:
        gm.executor.decode_runner = Leak()
        report = gm.executor.check_parameterization(kind="full")
    layers = {d.site.launch.layer.split(" at ")[0] for d in report.differences}
    assert layers == {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_xgraph_check_runs_on_a_model_folder(tmp_path, capsys):
    tiny("qwen3").save_pretrained(tmp_path / "qwen3")
    code = xgraph_main(
        ["check", "--backend", "cpu", "--model", str(tmp_path / "qwen3"), "--block-size", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("parameterization check on cpu: no leak.")
    assert "('full', 4): 5 recordings of" in out and "('piecewise', 4)" in out
