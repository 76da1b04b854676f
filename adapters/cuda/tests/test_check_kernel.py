"""The one-launch device check (kernels/check.py) against the core's torch ops.

Both check the same raw buffers (valid steps, steps with planted problems of every kind,
stale rows, columns and tokens past the step's counts, an error kept from an earlier step):
the padded lengths, block table and slots they write are equal bit for bit, and so is the
first problem kept (its code, index and value). On a GPU the kernel runs natively, without
one in Triton's CPU interpreter (conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from xgraph.device_check import DeviceCheck, _Raw
from xgraph.paging import PagedAttention

pytest.importorskip("triton")

from xgraph_cuda.kernels.check import MAX_TOKENS, metadata_check

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS, WIDTH, BLOCKS = 4, 6, 40  # block size, table width, cache blocks (the last the dummy)
PLANTS = (
    "none",
    "len0",
    "len_long",
    "len_short",
    "id_neg",
    "id_big",
    "id_dummy",
    "unused",
    "slot",
    "twice",
    "shared",
    "pad_twice",
)


def layout(max_seqs: int, q: int, blocks: int = BLOCKS) -> PagedAttention:
    return PagedAttention(
        max_seqs=max_seqs,
        max_blocks_per_seq=WIDTH,
        dummy_slot=(blocks - 1) * BS,
        dummy_block=blocks - 1,
        block_size=BS,
        num_blocks=blocks,
        max_query_len=q,
    )


def fill(raw: _Raw, rng: random.Random, a: PagedAttention, n: int, w: int, plant: str) -> None:
    """A step of n sequences (table width w) in the raw buffers, stale values past it, and
    one planted problem."""
    s, q, blocks = raw.seq_lens.shape[0], a.max_query_len, a.num_blocks
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # stale: what earlier steps left past the counts (anything)
    raw.seq_lens[:s] = torch.randint(-3, 40, (s,), generator=g)
    raw.table[:s] = torch.randint(-2, blocks + 2, (s, WIDTH), generator=g, dtype=torch.int32)
    raw.slots[: s * q] = torch.randint(-5, blocks * BS, (s * q,), generator=g)
    ids = rng.sample(range(blocks - 1), n * w)  # distinct, never the dummy
    for i in range(n):
        length = rng.randint(q, w * BS)
        row = ids[i * w : (i + 1) * w]
        raw.seq_lens[i] = length
        raw.table[i, :w] = torch.tensor(row, dtype=torch.int32)
        for k in range(q):
            pos = length - q + k
            raw.slots[i * q + k] = row[pos // BS] * BS + pos % BS
    i = rng.randrange(n)
    last = (int(raw.seq_lens[i]) - 1) // BS
    if plant == "len0":
        raw.seq_lens[i] = rng.choice([0, -2])
    elif plant == "len_long":
        raw.seq_lens[i] = w * BS + rng.randint(1, 9)
    elif plant == "len_short" and q > 1:
        raw.seq_lens[i] = q - 1
    elif plant.startswith("id_"):
        bad = {"id_neg": -1, "id_big": blocks + 3, "id_dummy": blocks - 1}[plant]
        raw.table[i, rng.randint(0, last)] = bad
    elif plant == "unused" and last + 1 < w:
        raw.table[i, rng.randint(last + 1, w - 1)] = -7  # past the row's end: not a problem
    elif plant == "slot":
        raw.slots[i * q + rng.randrange(q)] += rng.choice([1, -1, BS])
    elif plant == "twice" and n * q > 1:
        t, u = rng.sample(range(n * q), 2)
        raw.slots[max(t, u)] = raw.slots[min(t, u)]
    elif plant == "shared" and n > 1:  # two rows alike: right slots, written twice
        j, k = sorted(rng.sample(range(n), 2))
        raw.seq_lens[k], raw.table[k] = raw.seq_lens[j], raw.table[j]
        raw.slots[k * q : (k + 1) * q] = raw.slots[j * q : (j + 1) * q]
    elif plant == "pad_twice" and s * q > n * q:  # a padded token repeating a real slot
        raw.slots[rng.randrange(n * q, s * q)] = raw.slots[rng.randrange(n * q)]


def outputs(s: int, q: int) -> dict[str, torch.Tensor]:
    return {
        "seq_lens": torch.full((s,), -9, dtype=torch.int32, device=DEVICE),
        "block_tables": torch.full((s, WIDTH), -9, dtype=torch.int32, device=DEVICE),
        "slot_mapping": torch.full((s * q,), -9, dtype=torch.int64, device=DEVICE),
    }


def both(seed: int, s: int, q: int, plant: str, kept: tuple[int, int, int] = (0, 0, 0)):  # type: ignore[no-untyped-def]
    """(reference outputs and error, kernel outputs and error) of one step."""
    rng = random.Random(seed)
    n, w = rng.randint(1, s), rng.randint(2, WIDTH)
    a = layout(s, q, max(BLOCKS, s * WIDTH + 1))
    counts = torch.tensor([n, w], device=DEVICE)
    check = DeviceCheck("check", a, DEVICE, counts, (s, s * q))
    raw = check._raw = _Raw.make(a, s, s * q, torch.device("cpu"), None)
    fill(raw, rng, a, n, w, plant)
    if DEVICE.type != "cpu":
        check._raw = raw = _Raw(*(t.to(DEVICE) for t in vars(raw).values()))
    results = []
    for use_kernel in (False, True):
        raw.error.copy_(torch.tensor(kept))
        out = outputs(s, q)
        if use_kernel:
            assert metadata_check(check._call(raw, out, s, q))
        else:
            check._check(out, s, q)  # the torch ops (no kernel installed for this call)
        results.append(({k: v.cpu() for k, v in out.items()}, raw.error.cpu().tolist()))
    return results


def same(ref, got) -> None:  # type: ignore[no-untyped-def]
    (ref_out, ref_err), (out, err) = ref, got
    for name in ref_out:
        assert torch.equal(ref_out[name], out[name]), name
    assert err[0] == ref_err[0]
    if ref_err[0]:  # with no problem the torch ops leave a value the host never reads
        assert err == ref_err


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("plant", PLANTS)
def test_the_kernel_writes_and_keeps_what_the_torch_ops_do(plant: str, q: int) -> None:
    for seed in range(4):
        s = random.Random(seed).choice([1, 5, 8]) if q == 1 else 4
        same(*both(seed * 31 + len(plant), s, q, plant))


def test_an_error_kept_from_an_earlier_step_stays() -> None:
    ref, got = both(7, 6, 1, "slot", kept=(2, 3, 11))
    same(ref, got)
    assert got[1] == [2, 3, 11]


def test_tiles_past_one_of_each_kind() -> None:
    """More sequences and tokens than one tile holds: the first problem is found across
    tiles, and duplicates across tiles."""
    for seed, plant in enumerate(["none", "twice", "id_big", "slot"]):
        same(*both(100 + seed, 70, 2, plant))


def test_a_key_past_the_kernels_bound_is_declined() -> None:
    a = layout(MAX_TOKENS + 1, 1)
    s = MAX_TOKENS + 1
    counts = torch.tensor([1, 1], device=DEVICE)
    check = DeviceCheck("check", a, DEVICE, counts, (s, s))
    raw = check._raw = _Raw.make(a, s, s, DEVICE, None)
    assert not metadata_check(check._call(raw, outputs(s, 1), s, 1))


def test_the_switch_picks_the_kernel_by_default_and_the_torch_ops_when_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from xgraph_cuda import checks

    from xgraph.errors import XGraphError

    monkeypatch.delenv(checks.CHECK_ENV, raising=False)
    assert checks.metadata_check() is metadata_check
    monkeypatch.setenv(checks.CHECK_ENV, "torch")
    assert checks.metadata_check() is None
    monkeypatch.setenv(checks.CHECK_ENV, "triton")
    assert checks.metadata_check() is metadata_check
    monkeypatch.setenv(checks.CHECK_ENV, "fast")
    with pytest.raises(
        XGraphError, match="XGRAPH_CUDA_CHECK='fast'; use one of auto, torch, triton"
    ):
        checks.metadata_check()


def test_without_triton_auto_takes_the_torch_ops_and_triton_fails_loudly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    from xgraph_cuda import checks

    from xgraph.errors import XGraphError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    monkeypatch.setenv(checks.CHECK_ENV, "auto")
    assert checks.metadata_check() is None
    monkeypatch.setenv(checks.CHECK_ENV, "triton")
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_CHECK=triton but triton is not installed"):
        checks.metadata_check()
