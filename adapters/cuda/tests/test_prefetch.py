"""The projections' entry (xgraph_cuda.kernels.prefetch): how much of its weights a program
asks L2 for, that the ask is off where it cannot run, and, compiled for Hopper, that the
ask comes before the PDL wait (and the early release before the wait where asked for)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from xgraph_cuda.kernels import prefetch


def test_share_is_the_whole_slice_where_the_matrix_fits():
    assert prefetch.share(total=8 << 20, per=512, block_k=128, budget=16 << 20) == 512


def test_share_is_the_fitting_fraction_in_whole_tiles():
    # 200 MiB against a 16 MiB budget: 8% of a 4096-column share, rounded down to 128s
    assert prefetch.share(200 << 20, 4096, 128, 16 << 20) == 256
    # never less than one tile
    assert prefetch.share(10 << 30, 4096, 128, 16 << 20) == 128


def test_no_ask_off_the_gpu_or_when_switched_off(monkeypatch):
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    cols, opts = prefetch.options(w, 256, 128)
    assert cols == 0 and opts["PREFETCH"] is False
    assert opts["LINE"] == 64  # 128-byte lines of bf16
    monkeypatch.delenv("XGRAPH_CUDA_PREFETCH", raising=False)
    assert prefetch.mode() == "off"
    monkeypatch.setenv("XGRAPH_CUDA_PREFETCH", "on")
    assert prefetch.mode() == "on"
    assert prefetch.options(w, 256, 128)[0] == 0  # on, but not on the GPU
    monkeypatch.setenv("XGRAPH_CUDA_PREFETCH", "bogus")
    assert prefetch.mode() == "off"


def test_early_release_is_an_explicit_choice(monkeypatch):
    monkeypatch.delenv("XGRAPH_CUDA_PDL_TRIGGER", raising=False)
    assert prefetch.early() is False
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "early")
    assert prefetch.early() is True


# Compiled for sm_90 in a process of its own: the tests here run Triton's interpreter,
# whose kernels cannot be compiled.
_PTX = textwrap.dedent(
    """
    import json, sys
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from xgraph_cuda.kernels import gemv
    fn = gemv._gemv_kernel
    out = {}
    for name, pre, early in (("ask", True, False), ("early", True, True), ("none", False, False)):
        const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=2, NORM=True, GATED=False,
                     RESIDUAL=True, MMA=True, EVEN=True, UPCAST=False, PRECISION="tf32",
                     PDL=True, PREFETCH=pre, LINE=64, EARLY=early)
        ptrs = dict(X="*bf16", W="*bf16", Y="*bf16", R="*bf16", G="*bf16", Part="*fp32",
                    Count="*i32")
        sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "eps" else "i32")
               for n in fn.arg_names}
        consts = {(fn.arg_names.index(k),): v for k, v in const.items()}
        ptx = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        def at(s):
            return ptx.find(s)
        out[name] = dict(ask=at("prefetch.global.L2"), wait=at("griddepcontrol.wait"),
                         release=at("griddepcontrol.launch_dependents"))
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ptx_order():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _PTX], env=env, capture_output=True, text=True, timeout=240
    )
    if r.returncode != 0:
        pytest.skip(f"Triton cannot compile for sm_90 here: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_weights_are_asked_for_before_the_wait(ptx_order):
    ask = ptx_order["ask"]
    assert 0 <= ask["ask"] < ask["wait"] < ask["release"]


def test_early_release_comes_before_the_wait(ptx_order):
    early = ptx_order["early"]
    assert 0 <= early["ask"] < early["release"] < early["wait"]


def test_no_ask_compiled_in_without_prefetch(ptx_order):
    none = ptx_order["none"]
    assert none["ask"] == -1 and 0 <= none["wait"] < none["release"]
