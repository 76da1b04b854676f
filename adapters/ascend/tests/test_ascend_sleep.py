"""Sleep and wake through the simulated aclrt runtime: the driver's books, a sleep right after
queued replays (no rule broken), failures of aclrtMallocPhysical and aclrtMapMem during wake,
and the older torch_npu era, where nothing can sleep."""

from __future__ import annotations

import random

import pytest
import torch
from xgraph_ascend.sim.libacl import GRAN

import xgraph
from xgraph import PagedKVCache, VirtualMemoryError, XGraphError
from xgraph.arena import buffer_memory
from xgraph.errors import AsleepError
from xgraph.models import Qwen3Model, Workload


def _engine(sim):  # type: ignore[no-untyped-def]
    with xgraph.memory_region("weights", sim):
        model = Qwen3Model.build("tiny", num_blocks=1, block_size=4)
    c = model.config
    with xgraph.memory_region("kv_cache", sim):
        model.kv_cache = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 2048, 4)
    w = Workload(model, max_blocks=8, max_seqs=16)
    w.randomize_cache(2)
    return w, w.executor(backend=sim, buckets=[1, 2, 4, 8, 16])


def test_sleep_gives_every_handle_back_and_keeps_every_range(sim) -> None:  # type: ignore[no-untyped-def]
    rt = sim.runtime
    w, ex = _engine(sim)
    rng = random.Random(1)
    steps = [w.decode_step(rng, n) for n in (2, 9, 16)]
    for s in steps:
        ex(**s.kwargs())  # replays queued, no synchronize: sleep must wait for them
    awake = rt.books()
    vms = (sim.virtual_memory(), buffer_memory(sim))  # graph memory and regions; buffers
    mapped = sum(vm.mapped_bytes() for vm in vms)
    kv, weights = [t.clone() for t in w.cache.tensors()], [p.clone() for p in w.model.parameters()]
    used = rt.mem_get_info()[1] - rt.mem_get_info()[0]
    report = xgraph.sleep(ex, offload=("weights", "kv_cache"))
    asleep = rt.books()
    # what is left: one scratch handle of one granule per VirtualMemory, mapped at every
    # granule of every range that was mapped
    assert asleep["handles"] == len(vms) and asleep["mappings"] == mapped // GRAN
    assert sum(vm.covered_bytes() for vm in vms) == mapped > 0
    assert asleep["reservations"] == awake["reservations"]  # every address kept
    assert rt.mem_get_info()[0] == rt.lib.capacity - len(vms) * GRAN
    assert report.released_bytes == used
    xgraph.wake(ex)
    assert rt.books() == awake and rt.lib.violations == []
    assert all(vm.covered_bytes() == 0 and vm.covers() == 0 for vm in vms)
    assert all(torch.equal(a, b) for a, b in zip(w.cache.tensors(), kv))
    assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), weights))
    ex.close()


@pytest.mark.parametrize("call", ["aclrtMallocPhysical", "aclrtMapMem"])
@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_a_wake_the_driver_fails_goes_back_to_sleep(sim, call, at) -> None:  # type: ignore[no-untyped-def]
    rt = sim.runtime
    w, ex = _engine(sim)
    step = w.decode_step(random.Random(4), 5)
    cache = [t.clone() for t in w.cache.tensors()]
    out = ex(**step.kwargs(), clone=True)
    for t, k in zip(w.cache.tensors(), cache):
        t.copy_(k)
    held = rt.books()["handles" if call == "aclrtMallocPhysical" else "mappings"]
    after = {"first": 0, "middle": held // 2, "last": held - 1}[at]  # wake remakes `held`
    xgraph.sleep(ex, offload=("weights", "kv_cache"))
    asleep = rt.books()
    rt.faults.inject(call, 207001, after=after)
    with pytest.raises(VirtualMemoryError, match=call):
        xgraph.wake(ex)
    assert rt.faults.pending() == {} and rt.books() == asleep
    with pytest.raises(AsleepError):
        ex(**step.kwargs())
    xgraph.wake(ex)
    assert torch.equal(ex(**step.kwargs()), out)
    ex.close()


def test_the_context_era_refuses_regions_and_sleep(make_sim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import xgraph.memory

    monkeypatch.setattr(xgraph.memory, "_warned", set())  # shown once a process: show it here
    backend = make_sim(era="context")
    with pytest.raises(XGraphError, match="cannot place tensors in memory that sleep gives back"):
        xgraph.memory_region("weights", backend)
    w = Workload.tiny(num_blocks=64)
    with pytest.warns(xgraph.XGraphWarning, match="shared-pool"):
        ex = w.executor(backend=backend, buckets=[1, 2])
    with pytest.raises(XGraphError, match="needs 'shared-physical'"):
        ex.sleep()
    ex.close()


def test_touching_slept_memory_on_the_simulated_npu_leaves_the_process_alive() -> None:
    """Reads, writes and eager forwards over slept weights, KV cache, graph memory and
    buffers hit the scratch handle, not unmapped addresses; wake restores every graph."""
    import json
    import subprocess
    import sys

    from xgraph.testing.sleep_touch import MARKER

    proc = subprocess.run(
        [sys.executable, "-m", "xgraph.testing.sleep_touch", "--backend", "ascend-sim"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -11: SIGSEGV
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(MARKER), proc.stdout[-2000:]
    got = json.loads(line[len(MARKER) :])
    assert got["nonzero_bytes_read"] == 0 and got["step_refused"] and got["ranges"] >= 2
    for check in ("weights_kept", "kv_zeroed", "replays_equal", "no_recapture", "scratch_freed"):
        assert got[check] is True, check
    assert got["books_balanced"] is True


@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_a_sleep_the_driver_fails_while_mapping_the_scratch_finishes_when_called_again(
    sim, at
) -> None:  # type: ignore[no-untyped-def]
    """aclrtMapMem refused during sleep (only the scratch handle is mapped then): the sleep
    raises with the driver's books exact, the next sleep finishes, and wake restores all."""
    rt = sim.runtime
    w, ex = _engine(sim)
    step = w.decode_step(random.Random(8), 6)
    cache = [t.clone() for t in w.cache.tensors()]
    out = ex(**step.kwargs(), clone=True)
    for t, k in zip(w.cache.tensors(), cache):
        t.copy_(k)
    awake = rt.books()
    vms = (sim.virtual_memory(), buffer_memory(sim))
    granules = sum(vm.mapped_bytes() for vm in vms) // GRAN  # the maps a sleep makes
    after = {"first": 0, "middle": granules // 2, "last": granules - 1}[at]
    rt.faults.inject("aclrtMapMem", 207001, after=after)
    with pytest.raises(VirtualMemoryError, match="aclrtMapMem"):
        xgraph.sleep(ex, offload=("weights", "kv_cache"))
    assert rt.faults.pending() == {}
    # the driver holds what the books say: each real mapping, the scratch at each covered
    # granule, and one handle per live chunk (the scratch among them)
    books = rt.books()
    assert books["mappings"] == sum(
        vm.live()["mappings"] - vm.covers() + vm.covered_bytes() // GRAN for vm in vms
    )
    assert books["handles"] == sum(vm.live()["chunks"] for vm in vms)
    xgraph.sleep(ex, offload=("weights", "kv_cache"))
    assert rt.books()["mappings"] == granules
    xgraph.wake(ex)
    assert rt.books() == awake and rt.lib.violations == []
    assert torch.equal(ex(**step.kwargs()), out)
    ex.close()
