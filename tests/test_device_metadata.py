"""Device-resident attention metadata (xgraph.device_check), on the CPU backend.

The check is torch ops over the given tensors, the same on every device. On the CPU the
planner treats host tensors as device-resident when told to (`cpu_is_device`), so these
tests run the path an engine with cuda tensors takes: nothing read on the host, bad values
redirected to the dummy block, the error raised by the next step or `synchronize()`.
(The H200 run of adapters/cuda/tests/test_cuda_staging.py proves the same with cuda
tensors under torch's sync-debug mode.)
"""

from __future__ import annotations

import random

import pytest
import torch

import xgraph
from xgraph import AttentionInputs
from xgraph.models import Step, Workload

BUCKETS = [1, 2, 4, 8, 16]


class NoHostReads(torch.Tensor):
    """A tensor that refuses to be read on the host (what a sync would be on a GPU)."""

    def _refuse(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("device metadata was read on the host")

    numpy = tolist = item = cpu = __index__ = __int__ = __bool__ = _refuse


def no_host(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(NoHostReads)


def on_device(step: Step, w: Workload) -> AttentionInputs:
    """The step's metadata as an engine keeps it on the device: int32 lengths and tables."""
    a = step.attn
    return AttentionInputs(
        list(a.query_lens),
        no_host(torch.tensor(list(a.seq_lens), dtype=torch.int32)),
        no_host(a.table(w.cache.dummy_block, w.max_blocks)),
        no_host(torch.as_tensor(a.slot_mapping)),
    )


def pair(seed: int, **kw):  # type: ignore[no-untyped-def]
    """Two executors over equal workloads: device metadata on one, host metadata on the other."""
    ws = [Workload.tiny(num_blocks=96, max_blocks=6, max_seqs=16) for _ in range(2)]
    for w in ws:
        w.randomize_cache(seed)
    exs = [w.executor(backend="cpu", buckets=BUCKETS, attention=w.attention(**kw)) for w in ws]
    exs[0].planner.attn_check.cpu_is_device = True
    return ws, exs


def test_device_metadata_gives_what_host_metadata_gives_with_no_host_read():
    (dw, hw), (dex, hex_) = pair(1, max_query_len=3)
    rng = random.Random(1)
    for q, n in [(1, 3), (1, 8), (2, 3), (1, 1), (3, 2), (1, 5)]:
        step = dw.step(rng, [q] * n, [rng.randint(q, 24) for _ in range(n)])
        kw = {"input_ids": step.input_ids, "positions": step.positions}
        out = dex(attn=on_device(step, dw), **kw)
        ref = hex_(attn=step.attn, **kw)
        assert torch.equal(out, ref)
        for a, b in zip(dw.cache.tensors(), hw.cache.tensors()):
            assert torch.equal(a, b)
    assert dex.stats()["hits"] == hex_.stats()["hits"]
    dex.synchronize()  # no error kept
    for ex in (dex, hex_):
        ex.close()


def corrupt(w: Workload, step: Step, how: str, i: int) -> tuple[AttentionInputs, str]:
    a = step.attn
    sl = torch.tensor(list(a.seq_lens), dtype=torch.int32)
    table = a.table(w.cache.dummy_block, w.max_blocks)
    slots = torch.as_tensor(a.slot_mapping).clone()
    bs = w.block_size
    if how == "block id past the cache":
        table[i, (int(sl[i]) - 1) // bs] = w.cache.num_blocks + 7
        field = f"block_tables[{i}] = {w.cache.num_blocks + 7}"
    elif how == "the dummy block":
        table[i, 0] = w.cache.dummy_block
        field = f"block_tables[{i}] = {w.cache.dummy_block}"
    elif how == "negative slot":
        slots[i] = -3
        field = f"slot_mapping[{i}] = -3"
    elif how == "longer than its table":
        sl[i] = w.max_blocks * bs + 5
        field = f"seq_lens[{i}] = {w.max_blocks * bs + 5}"
    elif how == "seq_len 0":
        sl[i] = 0
        field = f"seq_lens[{i}] = 0"
    elif how == "shared slot":
        j = (i + 1) % len(sl)
        slots[j] = slots[i]
        table[j, (int(sl[j]) - 1) // bs] = table[i, (int(sl[i]) - 1) // bs]
        sl[j] = (int(sl[j]) - 1) // bs * bs + (int(sl[i]) - 1) % bs + 1
        field = f"slot_mapping[{max(i, j)}] = {int(slots[i])}"
    attn = AttentionInputs(list(a.query_lens), no_host(sl), no_host(table), no_host(slots))
    return attn, field


HOW = [
    "block id past the cache",
    "the dummy block",
    "negative slot",
    "longer than its table",
    "seq_len 0",
    "shared slot",
]


@pytest.mark.parametrize("how", HOW)
def test_bad_device_metadata_corrupts_nothing_and_is_named_at_the_next_step(how):
    (w, _), (ex, other) = pair(2)
    other.close()
    rng = random.Random(HOW.index(how))
    step = w.decode_step(rng, 4)
    i = rng.randrange(4)
    attn, field = corrupt(w, step, how, i)
    before = [t[: w.cache.num_blocks].clone() for t in w.cache.tensors()]
    out = ex(input_ids=step.input_ids, positions=step.positions, attn=attn)  # not refused
    assert out.isfinite().all()
    # nothing outside the dummy block was written but the slots of the step's valid tokens
    valid = [int(s) for t, s in enumerate(step.attn.slot_mapping) if t != i]
    if how == "shared slot":
        valid = [int(s) for s in step.attn.slot_mapping]
    for b, t in zip(before, w.cache.tensors()):
        flat_b = b.reshape(-1, *b.shape[2:])  # [slots, kv_heads, dim]
        flat_t = t[: w.cache.num_blocks].reshape(flat_b.shape)
        changed = (flat_b != flat_t).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(valid), (how, changed, valid)
    with pytest.raises(xgraph.InputError) as info:  # the next step names the problem
        ex(**w.decode_step(rng, 2).kwargs())
    assert field in str(info.value), str(info.value)
    assert "dummy block" in str(info.value)
    ex(**w.decode_step(rng, 2).kwargs())  # raised once: later steps run
    ex.close()


def test_synchronize_raises_what_the_device_check_found():
    (w, _), (ex, other) = pair(3)
    other.close()
    step = w.decode_step(random.Random(3), 3)
    attn, _ = corrupt(w, step, "negative slot", 1)
    ex(input_ids=step.input_ids, positions=step.positions, attn=attn)
    with pytest.raises(xgraph.InputError, match=r"slot_mapping\[1\] = -3"):
        ex.synchronize()
    ex.synchronize()  # nothing left
    ex.close()


def test_steps_that_are_not_full_graphs_check_device_metadata_on_the_host():
    (w, _), (ex, other) = pair(4)
    other.close()
    rng = random.Random(4)
    prefill = w.prefill_step(rng, [3, 2])
    attn = AttentionInputs(
        [3, 2],
        torch.tensor(list(prefill.attn.seq_lens), dtype=torch.int32),
        prefill.attn.table(w.cache.dummy_block, w.max_blocks),
        torch.as_tensor(prefill.attn.slot_mapping).clone(),
    )
    attn.slot_mapping[4] = -1
    with pytest.raises(xgraph.InputError, match=r"slot_mapping\[4\] is -1"):  # at once
        ex(input_ids=prefill.input_ids, positions=prefill.positions, attn=attn)
    big = w.step(rng, [2] * 9, [rng.randint(2, 20) for _ in range(9)])  # above the buckets:
    sl = torch.tensor(list(big.attn.seq_lens), dtype=torch.int32)  # eager, checked on the host
    sl[3] = 0
    bad = AttentionInputs(
        big.attn.query_lens, sl, big.attn.table(0, w.max_blocks), big.attn.slot_mapping
    )
    with pytest.raises(xgraph.InputError, match="sequence 3 has query_len 2 and seq_len 0"):
        ex(input_ids=big.input_ids, positions=big.positions, attn=bad)
    ex.close()


def test_trusted_device_metadata_is_used_as_given(monkeypatch):
    (dw, _), (dex, hex_) = pair(5, validate="trusted")
    monkeypatch.setattr(
        type(dex.planner.device_check), "_sequences", lambda *a: pytest.fail("checked")
    )
    rng = random.Random(5)
    for b in (3, 7, 2):
        step = dw.decode_step(rng, b)
        kw = {"input_ids": step.input_ids, "positions": step.positions}
        assert torch.equal(dex(attn=on_device(step, dw), **kw), hex_(attn=step.attn, **kw))
    for ex in (dex, hex_):
        ex.close()


def test_device_metadata_shapes_and_dtypes_are_checked_at_once():
    (w, _), (ex, other) = pair(6)
    other.close()
    step = w.decode_step(random.Random(6), 3)
    a = on_device(step, w)
    kw = {"input_ids": step.input_ids, "positions": step.positions}
    fields = {f: getattr(a, f) for f in ("query_lens", "seq_lens", "block_tables", "slot_mapping")}
    cases = [
        ("seq_lens", a.seq_lens.long()[:2], "seq_lens must be [3]"),
        ("block_tables", a.block_tables.long(), "block_tables must be torch.int32"),
        ("slot_mapping", a.slot_mapping[:2], "slot_mapping must be [3]"),
        ("seq_lens", a.seq_lens.float(), "seq_lens must be torch.int32 or torch.int64"),
    ]
    for field, value, needle in cases:
        attn = AttentionInputs(**{**fields, field: value})
        with pytest.raises(xgraph.InputError, match=needle.replace("[", r"\[")):
            ex(attn=attn, **kw)
    ex.close()
