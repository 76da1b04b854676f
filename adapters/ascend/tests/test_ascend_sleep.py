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


def test_the_context_era_refuses_regions_and_sleep(make_sim) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim(era="context")
    with pytest.raises(XGraphError, match="cannot place tensors in memory that sleep gives back"):
        xgraph.memory_region("weights", backend)
    w = Workload.tiny(num_blocks=64)
    with pytest.warns(xgraph.XGraphWarning, match="shared-pool"):
        ex = w.executor(backend=backend, buckets=[1, 2])
    with pytest.raises(XGraphError, match="needs 'shared-physical'"):
        ex.sleep()
    ex.close()
