"""Slept memory touched on a GPU (issue 33, item 8): an access to an unmapped cuMem address
is an illegal address that ends the CUDA context, so every range sleep gives back is covered
by one scratch handle of one granule. A child process touches every slept tensor and wakes;
driver failures while the scratch is mapped (cuMemMap, cuMemSetAccess) or unmapped
(cuMemUnmap) keep the books exact. Skipped without a GPU.

    python -m pytest -q adapters/cuda/tests/test_cuda_sleep.py
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_touching_slept_memory_leaves_the_process_and_its_context_alive() -> None:
    from xgraph.testing.sleep_touch import MARKER

    proc = subprocess.run(
        [sys.executable, "-m", "xgraph.testing.sleep_touch", "--backend", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(MARKER), proc.stdout[-2000:]
    got = json.loads(line[len(MARKER) :])
    assert got["nonzero_bytes_read"] == 0 and got["step_refused"] and got["ranges"] >= 2
    for check in ("weights_kept", "kv_zeroed", "replays_equal", "no_recapture", "scratch_freed"):
        assert got[check] is True, check
    assert got["books_balanced"] is True


@contextlib.contextmanager
def failing(call: str, nth: int) -> Iterator[dict[str, int]]:
    """The nth call of the cuda-python driver function `call` returns OUT_OF_MEMORY."""
    from cuda.bindings import driver as cu

    real, seen = getattr(cu, call), {"n": 0, "fired": 0}

    def fake(*args):  # type: ignore[no-untyped-def]
        seen["n"] += 1
        if seen["n"] == nth:
            seen["fired"] = 1
            return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        return real(*args)

    setattr(cu, call, fake)
    try:
        yield seen
    finally:
        setattr(cu, call, real)


def mlp(backend):  # type: ignore[no-untyped-def]
    from xgraph import GraphExecutor, Input

    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 4096, generator=g).mul(0.05).to(backend.device)
    return GraphExecutor(
        lambda x: torch.tanh(x @ w) @ w.T,
        inputs=[Input("x", torch.float32, ("num_tokens", 512))],
        backend=backend,
        buckets=[16, 256],
    )


@needs_cuda
@pytest.mark.parametrize(
    "stage, call, nth",
    [
        ("sleep", "cuMemMap", 1),
        ("sleep", "cuMemMap", 3),
        ("sleep", "cuMemSetAccess", 1),
        ("wake", "cuMemUnmap", 1),
        ("wake", "cuMemUnmap", 4),
    ],
)
def test_a_driver_failure_on_the_scratch_keeps_the_books_and_the_next_call_finishes(
    backend, stage, call, nth
) -> None:  # type: ignore[no-untyped-def]
    from xgraph.arena import buffer_memory
    from xgraph.errors import AsleepError, VirtualMemoryError

    ex = mlp(backend)
    xs = {n: torch.randn(n, 512, device=backend.device) for n in (16, 256)}
    before = {n: ex(x=x, clone=True) for n, x in xs.items()}
    vms = (backend.virtual_memory(), buffer_memory(backend))
    awake = [vm.live() for vm in vms]
    if stage == "wake":
        ex.sleep()
    asleep = [vm.live() for vm in vms]
    with failing(call, nth) as seen, pytest.raises(VirtualMemoryError, match=call):
        ex.sleep() if stage == "sleep" else ex.wake()
    assert seen["fired"]
    if stage == "wake":
        assert [vm.live() for vm in vms] == asleep  # the wake went back to sleep
    with pytest.raises(AsleepError):
        ex(x=xs[16])
    if stage == "sleep":
        ex.sleep()  # finishes the job
    ex.wake()
    assert [vm.live() for vm in vms] == awake
    assert all(vm.scratch_held() == 0 for vm in vms)
    for n, x in xs.items():
        torch.testing.assert_close(ex(x=x), before[n], rtol=0, atol=1e-6)
    assert ex.stats()["captures"] == 2
    ex.close()
