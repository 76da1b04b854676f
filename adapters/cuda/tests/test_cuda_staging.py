"""The CUDA HostCopier (GPU only): prefixes arrive byte for byte, in stream order, from any
thread; `wait` returns only once the copy has read the host buffer."""

from __future__ import annotations

import threading

import pytest
import torch

from xgraph.buffers import TorchCopier


@pytest.fixture
def pair(backend):  # type: ignore[no-untyped-def]
    device = torch.zeros(1 << 20, dtype=torch.uint8, device=backend.device)
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    return backend, device, host


def test_the_backend_offers_the_driver_copier(pair, monkeypatch):
    backend, device, host = pair
    from xgraph_cuda.staging import DriverCopier

    assert isinstance(backend.host_copier(device, host), DriverCopier)
    monkeypatch.setenv("XGRAPH_CUDA_STAGING", "torch")
    assert backend.host_copier(device, host) is None
    monkeypatch.setenv("XGRAPH_CUDA_STAGING", "fast")
    with pytest.raises(Exception, match="choose 'driver'"):
        backend.host_copier(device, host)


@pytest.mark.parametrize("kind", ["driver", "torch"])
def test_prefixes_arrive_in_stream_order(pair, kind):
    backend, device, host = pair
    copier = backend.host_copier(device, host) if kind == "driver" else TorchCopier(device, host)
    for i, n in enumerate([7, 4096, 1 << 20, 64]):
        copier.wait()
        host[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        # a long kernel queued first: the copy must not overtake it on the stream
        torch.cuda._sleep(1_000_000)
        copier.send(n)
        device[:n].add_(1)  # runs after the copy on the same stream
        copier.wait()
        expected = host[:n].to(torch.int16).add(1).remainder(256).to(torch.uint8)
        assert torch.equal(device[:n].cpu(), expected), f"copy {i} of {n} bytes"


def test_a_fresh_thread_can_send(pair):
    backend, device, host = pair
    copier = backend.host_copier(device, host)
    host[:256] = 9
    errors: list[BaseException] = []

    def send() -> None:
        try:
            copier.send(256)
            copier.wait()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert torch.equal(device[:256].cpu(), torch.full((256,), 9, dtype=torch.uint8))


# -- the step path on the GPU: device metadata with no sync, two staging banks -------------


def _executors(backend, **attention):  # type: ignore[no-untyped-def]
    """Two executors over equal workloads on the GPU (device metadata / host metadata)."""
    from xgraph.models import Workload

    ws = [Workload.tiny(device=backend.device, num_blocks=96, max_blocks=6, max_seqs=16)]
    ws.append(Workload.tiny(device=backend.device, num_blocks=96, max_blocks=6, max_seqs=16))
    for w in ws:
        w.randomize_cache(3)
    buckets = [1, 2, 4, 8, 16]
    exs = [
        w.executor(backend=backend, buckets=buckets, attention=w.attention(**attention)) for w in ws
    ]
    return ws, exs


def _device_attn(step, w, device):  # type: ignore[no-untyped-def]
    from xgraph import AttentionInputs

    a = step.attn
    return AttentionInputs(
        list(a.query_lens),
        torch.tensor(list(a.seq_lens), dtype=torch.int32, device=device),
        a.table(w.cache.dummy_block, w.max_blocks).to(device),
        torch.as_tensor(a.slot_mapping).to(device),
    )


def _replay_with_no_host_sync(dex, hex_, steps, calls):  # type: ignore[no-untyped-def]
    """The steps again on device metadata (`calls`), any host sync an error, each output equal
    to host metadata's; then both executors closed."""
    torch.cuda.synchronize()
    outs = []
    torch.cuda.set_sync_debug_mode("error")  # any host sync in a step raises
    try:
        for s, attn in zip(steps, calls):
            outs.append(dex(input_ids=s.input_ids, positions=s.positions, attn=attn, clone=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s, out in zip(steps, outs):
        assert torch.equal(out, hex_(**s.kwargs(), clone=True))
    dex.synchronize()
    for ex in (dex, hex_):
        ex.close()


def test_device_metadata_runs_with_no_host_sync(backend):  # type: ignore[no-untyped-def]
    import random

    (dw, _), (dex, hex_) = _executors(backend, max_query_len=3)
    rng = random.Random(0)
    plan = [(1, 3), (1, 8), (2, 3), (3, 2), (1, 5), (1, 3), (2, 3)]
    steps = [dw.step(rng, [q] * n, [rng.randint(q, 24) for _ in range(n)]) for q, n in plan]
    calls = [_device_attn(s, dw, backend.device) for s in steps]
    for s, attn in zip(steps, calls):  # captures (they synchronize) and the host references
        kw = {"input_ids": s.input_ids, "positions": s.positions}
        assert torch.equal(dex(attn=attn, clone=True, **kw), hex_(attn=s.attn, clone=True, **kw))
    _replay_with_no_host_sync(dex, hex_, steps, calls)


PLANTS = [
    "block id past the cache",
    "negative slot",
    "longer than its table",
    "copy of another sequence",
]


def _plant(w, step, attn, how):  # type: ignore[no-untyped-def]
    """One problem of each code planted in sequence (token) 2; (what the error names, the
    token whose own slot must keep its value)."""
    bs, i = w.block_size, 2
    sl_i = int(step.attn.seq_lens[i])
    slots = [int(s) for s in step.attn.slot_mapping]
    if how == "block id past the cache":
        attn.block_tables[i, (sl_i - 1) // bs] = w.cache.num_blocks + 5
        return f"block_tables[{i}] = {w.cache.num_blocks + 5}", i
    if how == "negative slot":
        attn.slot_mapping[i] = -7
        return f"slot_mapping[{i}] = -7", i
    if how == "longer than its table":
        attn.seq_lens[i] = w.max_blocks * bs + 3
        return f"seq_lens[{i}] = {w.max_blocks * bs + 3}", i
    # sequence 3 given sequence 2's blocks and slot: its token writes a slot twice
    attn.seq_lens[3], attn.block_tables[3] = attn.seq_lens[i], attn.block_tables[i]
    attn.slot_mapping[3] = attn.slot_mapping[i]
    return f"slot_mapping[3] = {slots[i]}", 3


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("how", PLANTS)
def test_bad_device_metadata_is_named_by_synchronize_and_corrupts_nothing(backend, how, warm):  # type: ignore[no-untyped-def]
    """Each of the check's four problems, on a key's first step (warm-up, capture, replay)
    and on a key whose check graph replays: named by synchronize(), and nothing written
    outside the dummy block but the valid tokens' own slots."""
    import random

    import xgraph

    (w, _), (ex, other) = _executors(backend)
    other.close()
    rng = random.Random(1)
    if warm:
        first = w.decode_step(rng, 4)
        ex(**{**first.kwargs(), "attn": _device_attn(first, w, backend.device)})
        ex.synchronize()
    step = w.decode_step(rng, 4)
    attn = _device_attn(step, w, backend.device)
    needle, bad = _plant(w, step, attn, how)
    before = [t[: w.cache.num_blocks].clone() for t in w.cache.tensors()]
    ex(input_ids=step.input_ids, positions=step.positions, attn=attn)  # queued, not refused
    with pytest.raises(xgraph.InputError) as info:
        ex.synchronize()
    assert needle in str(info.value)
    valid = {int(s) for t, s in enumerate(step.attn.slot_mapping) if t != bad}
    for b, t in zip(before, w.cache.tensors()):
        flat_b = b.reshape(-1, *b.shape[2:])
        flat_t = t[: w.cache.num_blocks].reshape(flat_b.shape)
        changed = set((flat_b != flat_t).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed <= valid
    assert [sq for sq, g in ex.cache.checks() if g is not None] == [(4, 1)]
    ex.close()


def test_the_device_check_is_one_cuda_graph_per_key_for_every_batch_composition(backend):  # type: ignore[no-untyped-def]
    """Several batch compositions per key: one captured check each key (a CUDA graph), no
    host sync in a step, and outputs equal to host metadata's."""
    import random
    import warnings

    import xgraph
    from xgraph.device import StreamGraph

    (dw, _), (dex, hex_) = _executors(backend, max_query_len=3)
    rng = random.Random(5)
    plan = [(1, 5), (1, 7), (1, 8), (1, 6), (2, 3), (2, 4), (3, 2), (3, 1), (1, 5), (2, 3)]
    steps = [dw.step(rng, [q] * n, [rng.randint(q, 24) for _ in range(n)]) for q, n in plan]
    calls = [_device_attn(s, dw, backend.device) for s in steps]
    with warnings.catch_warnings():
        warnings.simplefilter("error", xgraph.XGraphWarning)  # every check captured
        for s, attn in zip(steps, calls):  # first steps of keys capture (they synchronize)
            kw = {"input_ids": s.input_ids, "positions": s.positions, "clone": True}
            assert torch.equal(dex(attn=attn, **kw), hex_(attn=s.attn, **kw))
    checks = dex.cache.checks()  # each key's first piece: its check, a CUDA graph
    assert sorted(sq for sq, _ in checks) == [(1, 3), (2, 3), (4, 2), (8, 1)]
    assert all(isinstance(g, StreamGraph) for _, g in checks)
    _replay_with_no_host_sync(dex, hex_, steps, calls)
    assert not dex.cache.checks()


def test_a_device_metadata_step_issues_a_few_host_ops(backend):  # type: ignore[no-untyped-def]
    """Counted with a dispatch mode around one step (a CUDA graph's replay is not an op):
    the three copies into the check's raw buffers and the error's copy beside a
    host-metadata step's ops; none of the check's own."""
    import collections
    import random

    from torch.utils._python_dispatch import TorchDispatchMode

    class HostOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    (dw, _), (dex, hex_) = _executors(backend)
    step = dw.decode_step(random.Random(6), 8)
    dev = {"input_ids": step.input_ids, "positions": step.positions}
    dev["attn"] = _device_attn(step, dw, backend.device)
    host = step.with_tensor_tables(dw.max_blocks, dw.cache.dummy_block).kwargs()
    counted = []
    for ex, kw in ((dex, dev), (hex_, host)):
        ex(**kw)  # captures
        ex(**kw)
        with HostOps() as c:
            ex(**kw)
        counted.append(c.ops)
    on_device, on_host = counted
    print(f"\ndevice {dict(on_device)}\nhost {dict(on_host)}")
    assert (on_device - on_host)["aten.copy_.default"] == 4
    assert sum(on_device.values()) <= sum(on_host.values()) + 6
    for op in ("aten.sort.stable", "aten.where.self", "aten.gather.default", "aten.cat.default"):
        assert op not in on_device
    dex.synchronize()
    for ex in (dex, hex_):
        ex.close()


def test_a_step_returns_before_the_device_reaches_it(backend):  # type: ignore[no-untyped-def]
    """Two staging banks: with the device busy, two steps are issued without waiting for it
    (each waits only for its own bank's copy, two steps back); their results are right."""
    import random
    import time

    (w, _), (ex, ref) = _executors(backend)
    rng = random.Random(2)
    steps = [w.decode_step(rng, 3) for _ in range(3)]
    ex(**steps[0].kwargs())  # capture
    ref(**steps[0].kwargs())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # about a second of device work queued first
    queued = time.perf_counter()
    outs = [ex(**s.kwargs()).clone() for s in steps[1:]]
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    assert issued - queued < 0.2 * (done - t0), (issued - queued, done - t0)
    for s, out in zip(steps[1:], outs):
        assert torch.equal(out, ref(**s.kwargs()))
    for e in (ex, ref):
        e.close()
