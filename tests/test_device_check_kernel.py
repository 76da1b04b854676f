"""A backend's one-launch device check (`Kernels.metadata_check`, xgraph.check_call): what
the core hands it, that it replaces the torch ops where it issues the check and leaves them
where it declines, and that a bad one is refused when its backend is activated. The CUDA
kernel itself against the torch ops: adapters/cuda/tests/test_check_kernel.py."""

from __future__ import annotations

import random

import pytest
import torch
from test_device_check import pair, run_both

from xgraph import check_call
from xgraph.backends.cpu.backend import CPUBackend
from xgraph.check_call import CheckCall
from xgraph.errors import IncompleteBackendError
from xgraph.kernels import Kernels


class Spy:
    """A kernel that records each call and issues nothing (`serve`) or declines."""

    def __init__(self, serve: bool) -> None:
        self.serve, self.calls = serve, []

    def __call__(self, call: CheckCall) -> bool:
        self.calls.append(call)
        return self.serve


def steps(spy: Spy, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Decode steps with device metadata (the kernel installed) and host metadata."""
    (dw, _), (dex, hex_) = pair(seed)
    rng = random.Random(seed)
    check_call.install("cpu", spy, "test")
    try:
        return [
            run_both(dw, dex, hex_, dw.decode_step(rng, rng.randint(1, 6)), rng) for _ in range(4)
        ]
    finally:
        check_call.install("cpu", None, "test")
        dex.close(), hex_.close()


def test_a_declining_kernel_sees_the_contracts_buffers_and_the_torch_ops_check() -> None:
    spy = Spy(serve=False)
    for out, ref in steps(spy):
        assert torch.equal(out, ref)
    assert spy.calls  # asked at every recording (and eager run) of a key's check
    for c in spy.calls:
        s, q = c.seq_lens.shape[0], c.query_len
        assert c.table.shape == c.out_table.shape == (s, c.out_table.shape[1])
        assert c.slots.shape == c.out_slots.shape == (s * q,)
        assert c.out_seq_lens.shape == (s,) and c.counts.shape == (2,) and c.error.shape == (3,)
        dtypes = [t.dtype for t in (c.seq_lens, c.table, c.slots, c.out_seq_lens, c.out_slots)]
        assert dtypes == [torch.int64, torch.int32, torch.int64, torch.int32, torch.int64]
        assert 0 <= c.dummy_block < c.num_blocks and c.dummy_slot // c.block_size == c.dummy_block


def test_a_kernel_that_issues_the_check_replaces_the_torch_ops() -> None:
    """A kernel that answers True and writes nothing: the step's graph reads metadata no
    check wrote, so its outputs differ from the host path's (the torch ops did not run)."""
    results = steps(Spy(serve=True))
    assert any(not torch.equal(out, ref) for out, ref in results)


def test_activating_a_backend_installs_its_check_and_a_bad_one_is_refused() -> None:
    spy = Spy(serve=False)

    class WithCheck(CPUBackend):
        def kernels(self) -> Kernels:
            return Kernels(metadata_check=spy)

    class BadCheck(CPUBackend):
        def kernels(self) -> Kernels:
            return Kernels(metadata_check="not a function")  # type: ignore[arg-type]

    try:
        WithCheck().activate()
        assert check_call._kernels["cpu"] is spy
        with pytest.raises(IncompleteBackendError, match="is not callable"):
            BadCheck().activate()
        CPUBackend().activate()
        assert "cpu" not in check_call._kernels
    finally:
        check_call.install("cpu", None, "test")
