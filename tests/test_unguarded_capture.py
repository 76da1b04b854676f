"""Full graphs without the per-op guard where the runtime refuses host reads itself
(`Backend.capture_refuses_host_reads`: CUDA; here the simulated runtime of the dummy
adapter, which enforces CUDA's rule): no guard on the dispatch stack while a full key
records, the guard kept for piecewise pieces and on backends that do not claim it; a
failed capture names the host read (its op and model line), chained from the runtime's
own error, or keeps the runtime's error where no check finds one; device -> host copies
stay refused (a non-blocking copy into pinned memory would record without error)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from xgraph_dummy.backend import DummyBackend

from xgraph import CaptureError
from xgraph.graphs import _CaptureGuard, capturing_graph
from xgraph.models import Workload
from xgraph.plugins import get_backend
from xgraph.safety import block_host_copies
from xgraph.testing.sim import SimError

BUCKETS = [1, 2, 4, 8]


def _guarded_while_recording(backend, mode: str) -> list[bool]:  # type: ignore[no-untyped-def]
    """For every capture of a few steps: whether a capture guard was on the stack."""
    w = Workload.tiny(device=backend.device, max_blocks=4, max_seqs=16)
    seen: list[bool] = []

    def forward(input_ids, positions):  # type: ignore[no-untyped-def]
        if capturing_graph() is not None:
            stack = _get_current_dispatch_mode_stack()
            seen.append(any(isinstance(m, _CaptureGuard) for m in stack))
        return w.model.forward_logits(input_ids, positions)

    ex = w.executor(forward, backend=backend, buckets=BUCKETS, mode=mode)
    rng = random.Random(0)
    for batch in (3, 1, 8):
        step = w.decode_step(rng, batch) if mode == "full" else w.prefill_step(rng, [batch])
        ex(**step.kwargs())
    ex.close()
    return seen


def test_full_graphs_record_unguarded_only_where_the_runtime_refuses_host_reads() -> None:
    assert DummyBackend.capture_refuses_host_reads
    seen = _guarded_while_recording(DummyBackend(), "full")
    assert seen and not any(seen)
    assert all(_guarded_while_recording(get_backend("cpu"), "full"))  # the CPU claims nothing


def test_piecewise_pieces_keep_the_guard() -> None:
    seen = _guarded_while_recording(DummyBackend(), "piecewise")
    assert seen and all(seen)  # it refuses attention and KV-cache ops inside a piece


def _reads_on_bucket_4(w: Workload):  # type: ignore[no-untyped-def]
    def forward(input_ids, positions):  # type: ignore[no-untyped-def]
        h = w.model.forward_logits(input_ids, positions)
        if input_ids.shape[0] == 4:
            h = h * (h[0, 0].item() != 1e9)  # host read: the line the error must name
        return h

    return forward


def test_a_failed_unguarded_capture_names_the_host_read() -> None:
    backend = DummyBackend()
    w = Workload.tiny(device=backend.device, max_blocks=4, max_seqs=16)
    ex = w.executor(
        _reads_on_bucket_4(w), backend=backend, buckets=BUCKETS, on_capture_error="raise"
    )
    rng = random.Random(1)
    ex(**w.decode_step(rng, 2).kwargs())
    before = ex.stats()["graph_bytes"]
    with pytest.raises(CaptureError) as info:
        ex(**w.decode_step(rng, 3).kwargs())
    msg = str(info.value)
    assert "_local_scalar_dense" in msg and "h[0, 0].item()" in msg, msg
    assert f"{__file__.split('/')[-1]}:" in msg
    assert isinstance(info.value.__cause__, SimError)  # the runtime refused it first
    assert ex.stats()["graph_bytes"] == before  # rolled back
    ex(**w.decode_step(rng, 8).kwargs())  # other keys still capture and replay
    ex(**w.decode_step(rng, 8).kwargs())
    assert ex.stats()["captures"] == 2 and ("full", 8) in ex.stats()["hits"]
    ex.close()


def test_a_failure_no_check_names_keeps_the_runtime_error() -> None:
    backend = DummyBackend()
    w = Workload.tiny(device=backend.device, max_blocks=4, max_seqs=16)
    ex = w.executor(backend=backend, buckets=BUCKETS, on_capture_error="raise")
    rng = random.Random(2)
    ex(**w.decode_step(rng, 2).kwargs())
    backend.runtime.faults.inject("capture_end", 1)
    with pytest.raises(CaptureError, match=r"capturing \('full', 4\) failed.*SIM_ERROR") as info:
        ex(**w.decode_step(rng, 3).kwargs())
    assert "reads device data" not in str(info.value)  # the checks found nothing to name
    ex(**w.decode_step(rng, 3).kwargs())  # the fault fired once: the key captures now
    assert ex.stats()["captures"] == 2
    ex.close()


def test_device_to_host_copies_are_refused_in_this_thread_only() -> None:
    dev = torch.empty(4, device="meta")  # any tensor off the host
    host = torch.empty(4)
    with block_host_copies():
        for copy in (
            lambda: dev.to("cpu", non_blocking=True),
            lambda: dev.to(device=torch.device("cpu")),
            lambda: dev.to(host),
            dev.cpu,
            lambda: host.copy_(dev, non_blocking=True),
        ):
            with pytest.raises(CaptureError, match=r"device tensor|device_tensor"):
                copy()
        assert dev.to(torch.float16).dtype == torch.float16  # not a copy to the host
        assert host.to("cpu") is host and host.cpu() is host
        other: list[type] = []
        t = threading.Thread(target=lambda: other.append(_error_of(dev.cpu)))
        t.start()
        t.join()
        assert other == [NotImplementedError]  # torch's own (no data), not refused there
    assert _error_of(dev.cpu) is NotImplementedError  # nor after the scope


def _error_of(fn) -> type:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as exc:  # a meta tensor has no data to copy
        return type(exc)
    return type(None)
