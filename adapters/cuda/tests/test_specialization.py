"""Which row counts make new binaries of the CUDA adapter's kernels.

Triton specializes an integer argument on its value being 1 or a multiple of 16, so a row
count passed as one compiles a new binary for 1, 16, 48 and the rest: measured on an H100,
a cold process of the transformers Qwen3 compiled 39 kernels (18.4 s) in its warm-ups
(docs/startup.md). The prefill attention's token and tile counts only bound its padding and
its loop over tiles, so it takes them unspecialized: one binary for every bucket. The
projections keep their row count specialized (without it the decode step was 5.9% slower
at batch 1 and 4.2% at 64 on an H100) and compile its binaries together instead
(xgraph_cuda/family.py). Checked in a process of its own: Triton's interpreter, which the
other tests run, keeps no specialization list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# kernel: the arguments that vary with the step's rows or tokens and are not specialized
ROWS = {
    "xgraph_cuda.kernels.gemv:_gemv_kernel": [],
    "xgraph_cuda.kernels.qkv:_qkv_kernel": [],
    "xgraph_cuda.kernels.prefill:_prefill_kernel": ["num_tiles", "num_tokens", "total_rows"],
}

_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    out = {}
    for name in json.loads(sys.argv[1]):
        module, kernel = name.split(":")
        fn = getattr(importlib.import_module(module), kernel)
        out[name] = [p.name for p in fn.params if p.do_not_specialize]
    print(json.dumps(out))
    """
)


def test_only_the_projections_row_counts_make_new_binaries():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(list(ROWS))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-600:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, rows in ROWS.items():
        assert sorted(got[name]) == sorted(rows), name
