"""`xgraph check`: the parameterization check from the shell (exit status 0 clean, 1 leaks)."""

from __future__ import annotations

import pytest
import torch

import xgraph.runners
from xgraph.cli import main
from xgraph.runners import PagedDecodeRunner, reference_runners


def test_the_reference_model_checks_clean(capsys):
    assert main(["check", "--backend", "cpu", "--kind", "full", "--sizes", "2,8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "parameterization check on cpu: no leak."
    assert out[1].startswith("  ('full', 2): 4 recordings of ")  # base twice, 2 variations
    assert out[3].startswith("  ('full', 8): 5 recordings of ")
    assert out[1].endswith("identical under changed sequence lengths, block tables")
    assert (
        out[2] == "    not varied: batch composition: every decode step of bucket 2 has 2 sequences"
    )


def test_a_leak_exits_1_with_the_report(capsys, monkeypatch):
    class Leak(PagedDecodeRunner):
        graph_safe = True

        def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
            super().run(q, k, v, out, kv_cache, scale)
            n = max(int(s) for s in self.planned().seq_lens_host)
            out.add_(torch.zeros(n).sum())

    monkeypatch.setattr(
        xgraph.runners, "reference_runners", lambda: {**reference_runners(), "decode": Leak()}
    )
    assert main(["check", "--backend", "cpu", "--kind", "full"]) == 1
    out = capsys.readouterr().out
    assert "size: (1,) -> (128,) (sequence lengths changed)" in out  # 8 blocks of 16
    assert "What to do (full graphs)" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kind", "eager"], "invalid choice: 'eager'"),
        (["--sizes", "0"], "sizes must be positive"),
        (["--block-size", "0"], "at least 1"),
    ],
)
def test_bad_options_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_size_above_the_buckets_is_a_library_error(capsys):
    assert main(["check", "--backend", "cpu", "--sizes", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xgraph: error: check: check_parameterization: sizes holds 1000")
