"""Every host buffer names its device and dtype: a default device or dtype changes none.

Engines build models, caches and executors under `torch.set_default_device("cuda")`; a host
buffer made without `device="cpu"` then lands on the GPU (a pinned one raises "Only dense
CPU tensors can be pinned"). On the CPU the same bug shows under a default device of
"meta": a host buffer made there has no memory, and numpy views, pinned twins and the
tape's tensors over pool memory fail or stay empty. The executors here are built, captured,
replayed, put to sleep and woken under such defaults, and must give what they give without.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from xgraph.buckets import Buckets
from xgraph.models import Workload

FULL, PIECEWISE = [1, 2, 4, 8], Buckets([8, 16, 32])


@contextlib.contextmanager
def defaults(kind: str):  # type: ignore[no-untyped-def]
    """A default device of "meta" or a default dtype of float64, restored after."""
    if kind == "meta":
        torch.set_default_device("meta")
    else:
        torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


def steps(w: Workload, full: bool, seed: int = 1) -> list:
    rng = random.Random(seed)
    if full:
        return [w.decode_step(rng, n) for n in (3, 1, 8, 3, 5)]
    return [w.prefill_step(rng, [3, 5], [2, 1]), w.prefill_step(rng, [9, 4, 7], [0, 3, 1])]


def run(w: Workload, full: bool, calls: list, device_metadata: bool = False) -> list:
    ex = w.executor(backend="cpu", buckets=FULL if full else PIECEWISE)
    ex.planner.attn_check.cpu_is_device = device_metadata  # host tensors taken as device ones
    outs = [ex(**s.kwargs()).clone() for s in calls]
    ex.sleep()
    ex.wake()
    outs += [ex(**s.kwargs()).clone() for s in calls[:2]]
    staged = ex.planner.staged
    dtypes = [v.dtype for _, v in staged.items()] + [
        v.dtype for b in staged.banks for v in b.views.values()
    ]
    assert all(b.packed.device.type == "cpu" for b in staged.banks)
    assert ex.stats()["eager"] == {}, ex.stats()["eager"]  # every step a graph replay
    ex.close()
    return [outs, dtypes, [t.clone() for t in w.cache.tensors()]]


@pytest.mark.parametrize("kind", ["meta", "float64"])
@pytest.mark.parametrize("mode", ["full", "piecewise", "device metadata"])
def test_a_default_device_or_dtype_changes_no_host_buffer(kind, mode):
    full = mode != "piecewise"
    ws = [Workload.tiny(num_blocks=96, max_blocks=6, max_seqs=16) for _ in range(2)]
    for w in ws:
        w.randomize_cache(1)
    calls = steps(ws[0], full)
    ref = run(ws[1], full, calls, mode == "device metadata")
    with defaults(kind):
        got = run(ws[0], full, calls, mode == "device metadata")
    assert got[1] == ref[1]  # no buffer's dtype follows the default
    for a, b in zip(got[0] + got[2], ref[0] + ref[2]):
        assert a.device.type == "cpu" and torch.equal(a, b)
