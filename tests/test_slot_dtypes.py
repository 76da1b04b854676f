"""What an engine's attention tensors may look like: int32 slot mappings (what flash-attn-style
engines build) and block tables padded with -1 past each row's need, on host and device
(`cpu_is_device`) metadata, full and piecewise steps, every backend here."""

from __future__ import annotations

import random

import pytest
import torch

import xgraph
from xgraph import AttentionInputs, InputError
from xgraph.models import Step, Workload

BACKENDS = ["cpu", "ascend-sim"]
BUCKETS = [1, 2, 4, 8, 16]
WIDTH = 6  # max_blocks_per_seq


def _executor(backend: str, on_device: bool, seed: int = 5, **kw):  # type: ignore[no-untyped-def]
    w = Workload.tiny(num_blocks=96, max_blocks=WIDTH, max_seqs=16)
    w.randomize_cache(seed)  # every block holds garbage: a read past a row's need shows
    ex = w.executor(backend=backend, buckets=BUCKETS, attention=w.attention(**kw))
    ex.planner.attn_check.cpu_is_device = on_device  # host tensors go the device path
    return w, ex


def _steps(w: Workload) -> list[Step]:
    """Decode (full graphs), speculative-width decode and prefill / mixed (piecewise) steps."""
    rng = random.Random(2)
    steps = [w.decode_step(rng, n, max_context=20) for n in (3, 8, 1, 5)]
    steps += [w.prefill_step(rng, [5, 3], [2, 0]), w.prefill_step(rng, [1, 7, 2], [9, 0, 4])]
    return steps


def _with(step: Step, table: torch.Tensor, slots: torch.Tensor) -> dict:
    a = step.attn
    seq_lens = torch.tensor(list(a.seq_lens), dtype=torch.int32)
    attn = AttentionInputs(list(a.query_lens), seq_lens, table, slots)
    return {"input_ids": step.input_ids, "positions": step.positions, "attn": attn}


def _minus_one_past_need(step: Step, bs: int) -> torch.Tensor:
    """The step's table at the full width, -1 in every column past each row's last used."""
    a = step.attn
    table = a.table(-1, WIDTH)
    for i, sl in enumerate(a.seq_lens):
        table[i, -(-int(sl) // bs) :] = -1
    return table


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_slots_and_minus_one_padding_equal_int64_and_dummy_padding(backend, on_device):
    """Three executors over equal workloads see the same steps: int64 slots with the table
    padded with the dummy block (the reference), int32 slots, and -1 padding. Outputs and
    caches stay bitwise equal to the reference's, step after step."""
    runs = [_executor(backend, on_device) for _ in range(3)]
    w0 = runs[0][0]
    for step in _steps(w0):
        dummy = step.attn.table(w0.cache.dummy_block, WIDTH)
        minus = _minus_one_past_need(step, w0.block_size)
        slots64 = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
        forms = [(dummy, slots64), (dummy, slots64.to(torch.int32)), (minus, slots64)]
        outs = [ex(**_with(step, t, s)) for (_, ex), (t, s) in zip(runs, forms)]
        for out in outs[1:]:
            assert torch.equal(out, outs[0])
        for w, _ in runs[1:]:
            for a, b in zip(w.cache.tensors(), w0.cache.tensors()):
                assert torch.equal(a, b)
    kinds = {k[0] for k in runs[0][1].stats()["keys"]}
    assert kinds == {"full", "piecewise"}  # both kinds of graph ran every form
    hits = runs[0][1].stats()["hits"]
    for _, ex in runs:
        ex.synchronize()  # device metadata: no problem was found, so nothing is raised
        assert ex.stats()["hits"] == hits
        ex.close()


def test_trusted_device_metadata_takes_int32_slots_and_minus_one_padding():
    """validate="trusted" copies device metadata as it is: the copy into the int64 slot
    buffer casts, and -1 past a row's need is never followed."""
    runs = [_executor("cpu", True, validate="trusted") for _ in range(2)]
    w0 = runs[0][0]
    for step in _steps(w0)[:4]:  # decode: full graphs, where device metadata is used as given
        slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
        dummy = step.attn.table(w0.cache.dummy_block, WIDTH)
        ref = runs[0][1](**_with(step, dummy, slots))
        got = runs[1][1](**_with(step, _minus_one_past_need(step, w0.block_size), slots.int()))
        assert torch.equal(got, ref)
    for _, ex in runs:
        ex.close()


def test_eager_steps_take_int32_slots():
    """A step above the largest bucket runs eagerly from the same checked arrays."""
    runs = [_executor("cpu", False) for _ in range(2)]
    w0 = runs[0][0]
    step = w0.prefill_step(random.Random(4), [9, 11])  # 20 tokens: above 16
    slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
    table = step.attn.table(w0.cache.dummy_block, WIDTH)
    with pytest.warns(xgraph.XGraphWarning, match="above the largest bucket"):
        ref = runs[0][1](**_with(step, table, slots))
    got = runs[1][1](**_with(step, _minus_one_past_need(step, w0.block_size), slots.int()))
    assert torch.equal(got, ref)
    for _, ex in runs:
        ex.close()


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_what_a_row_and_the_slots_may_not_hold_is_refused_clearly(on_device):
    w, ex = _executor("cpu", on_device)
    step = w.decode_step(random.Random(3), 3, max_context=20)
    slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
    table = _minus_one_past_need(step, w.block_size)
    # int16 slots and int64 tables: refused, naming what to pass
    with pytest.raises(InputError, match=r"slot_mapping must be torch.int64 or torch.int32"):
        ex(**_with(step, table, slots.to(torch.int16)))
    with pytest.raises(InputError, match=r"block_tables\.to\(torch\.int32\)"):
        ex(**_with(step, table.long(), slots))
    # a table wider than the layout, even if the extra columns are padding
    wide = torch.cat([table, torch.full((3, 2), -1, dtype=torch.int32)], 1)
    with pytest.raises(InputError, match=r"width 8 is above max_blocks_per_seq=6.*\[:, :6\]"):
        ex(**_with(step, wide, slots))
    ex.close()


def test_minus_one_in_a_used_column_is_refused_on_the_host():
    w, ex = _executor("cpu", False)
    step = w.step(random.Random(3), [1, 1], [9, 3])  # rows of 3 and 1 used columns
    table = _minus_one_past_need(step, w.block_size)
    table[0, 1] = -1  # column 1 of sequence 0 holds its position 4..7
    slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
    with pytest.raises(
        InputError,
        match=r"sequence 0 uses block id -1 at column 1; the columns it reads \(0 to 2.*past",
    ):
        ex(**_with(step, table, slots))
    ex.close()


def test_minus_one_in_a_used_column_is_redirected_on_the_device():
    """On the device the same row is redirected to the dummy block and raised next call."""
    w, ex = _executor("cpu", True)
    step = w.step(random.Random(3), [1, 1], [9, 3])
    table = _minus_one_past_need(step, w.block_size)
    table[0, 1] = -1
    slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int32)
    ex(**_with(step, table, slots))
    with pytest.raises(InputError, match=r"block_tables\[0\] = -1"):
        ex.synchronize()
    ex.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int32_slots_and_minus_one_padding_on_cuda_tensors():
    """cuda tensors: int32 slots and -1 padding give what int64 slots and dummy padding give,
    through the CUDA backend's own runners, with no error kept."""
    runs = []
    for _ in range(2):
        w = Workload.tiny(device="cuda", num_blocks=96, max_blocks=WIDTH, max_seqs=16)
        w.randomize_cache(5)
        runs.append((w, w.executor(backend="cuda", buckets=BUCKETS, attention=w.attention())))
    w0 = runs[0][0]
    for step in _steps(w0):
        slots = torch.as_tensor(step.attn.slot_mapping, dtype=torch.int64)
        dummy = step.attn.table(w0.cache.dummy_block, WIDTH)
        minus = _minus_one_past_need(step, w0.block_size)
        a = step.attn
        for seq_lens, table, s, (_, ex) in [
            (torch.tensor(list(a.seq_lens), dtype=torch.int32), dummy, slots, runs[0]),
            (torch.tensor(list(a.seq_lens), dtype=torch.int32), minus, slots.int(), runs[1]),
        ]:
            attn = AttentionInputs(list(a.query_lens), seq_lens.cuda(), table.cuda(), s.cuda())
            out = ex(input_ids=step.input_ids.cuda(), positions=step.positions.cuda(), attn=attn)
            if ex is runs[0][1]:
                ref = out.clone()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for _, ex in runs:
        ex.synchronize()
        ex.close()
