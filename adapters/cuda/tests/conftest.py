"""The CUDA backend for the adapter's own tests (skipped where it is not available), and
Triton's CPU interpreter for the kernel tests on machines without a GPU."""

import os
import sys

import pytest
import torch

import xgraph


def _use_the_interpreter() -> None:
    """TRITON_INTERPRET=1 for a fresh import of triton. Triton makes its language functions
    interpreted when it is imported, and torch may have imported it already (torch._dynamo
    probes for it), so its Python modules (not its native ones, which cannot load twice) and
    any kernels defined over them are dropped and imported again. Done here, once, before
    any test module imports a kernel."""
    os.environ["TRITON_INTERPRET"] = "1"
    stale = ("triton.", "xgraph_cuda.kernels", "xgraph_cuda.triton_runners")
    for name in list(sys.modules):
        if (name == "triton" or name.startswith(stale)) and not name.startswith("triton._C"):
            del sys.modules[name]
    for name in ("kernels", "triton_runners"):  # `from xgraph_cuda import x` reads these
        xc = sys.modules.get("xgraph_cuda")
        if xc is not None and hasattr(xc, name):
            delattr(xc, name)


def _index_scalars_under_numpy_2() -> None:
    """Triton 3.6's interpreter turns a scalar argument into an index with int() of a
    one-element array, which numpy 2.4 refuses for arrays of one dimension; index through
    the element instead (the interpreter calls _patch_lang_tensor at every launch)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests skip themselves
        return
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_index", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    _use_the_interpreter()
    _index_scalars_under_numpy_2()


@pytest.fixture
def backend():  # type: ignore[no-untyped-def]
    try:
        return xgraph.get_backend("cuda")
    except xgraph.BackendUnavailableError as exc:
        pytest.skip(str(exc))
