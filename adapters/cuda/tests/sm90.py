"""A kernel compiled for sm_90 (Hopper) without a GPU, in a process of its own: the tests run
Triton's interpreter, whose kernels cannot be compiled. `ptx_of(module, kernel, variants)`
gives each variant's PTX, or skips the test where Triton cannot compile here (no ptxas, no
CUDA backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    module, kernel, variants, divisible = json.loads(sys.argv[1])
    fn = getattr(importlib.import_module(module), kernel)
    out = {}
    for name, (const, types, *options) in variants.items():
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
        consts = {(fn.arg_names.index(k),): v for k, v in const.items()}
        marked = [n for n, t in sig.items() if t.startswith("*") or n in divisible]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
        src = ASTSource(fn, sig, consts, attrs)
        opts = options[0] if options else None
        out[name] = compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    print(json.dumps(out))
    """
)


def ptx_of(
    module: str,
    kernel: str,
    variants: dict[str, tuple[dict, ...]],
    divisible: tuple[str, ...] = (),
) -> dict[str, str]:
    """{variant: PTX} of `module.kernel` compiled per variant: (constexpr values, the types
    of the other arguments that are not i32, such as "*bf16" or "fp32"[, compile options
    such as {"num_stages": 1}]). As a launch specializes them, every pointer and the
    integer arguments named in `divisible` are marked multiples of 16 (what lets Triton
    vectorize, and so pipeline, a load). A variant the kernel rejects fails the test; only
    a Triton without the sm_90 backend skips it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps([module, kernel, variants, list(divisible)])
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, arg], env=env, capture_output=True, text=True, timeout=240
    )
    if r.returncode != 0:
        err = r.stderr.strip()[-600:]
        if any(w in err for w in ("ptxas", "backend", "ImportError", "ModuleNotFoundError")):
            pytest.skip(f"Triton cannot compile for sm_90 here: {err[-300:]}")
        pytest.fail(f"compiling {module}.{kernel} for sm_90 failed: {err}")
    return json.loads(r.stdout.strip().splitlines()[-1])
