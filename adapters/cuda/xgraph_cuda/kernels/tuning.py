"""Launch configurations of the projection kernels, chosen from shapes alone (no autotuning:
a decode graph records one launch per projection, and the first step must not time kernels).

A decode projection reads its weight matrix once and does next to no arithmetic, so what
sets its time is how many weight bytes are in flight across the GPU. The rules, for a GPU
of `sms` multiprocessors:

- tensor-core form (`mma`) by default: 64 weight rows per program against the input rows
  padded to 16 / 32 / 64, BLOCK_K = 128: 16 KiB of weights per K step, three stages. As
  launched (pointers and strides multiples of 16, which Triton specializes on), a 16-bit
  input's loop is pipelined (`cp.async`, 60 KiB of shared memory at 16 rows and 96 at 64;
  adapters/cuda/tests/test_stream_projection.py compiles it so). A float32 input (the
  residual stream) asks one stage (`stages_for`) and is not: measured whole-step against
  its pipelined launch, that was faster at batch 1 and 64 (docs/kernels.md);
- split K across `split` programs (a power of two, at most 16, each walking at least two
  K tiles) while the grid holds at most three programs per multiprocessor: a 1024-column output
  has 16 column tiles, far too few alone; the split's partials are summed by the tile's
  last program (`fixup`), in a fixed order. The qkv kernel's split instead fills whole
  waves of programs (`wave_split`), any count up to 16;
- the multiply-add form (`mma=False`, rows <= 2) is kept for the sweep
  (adapters/cuda/tools/bench_kernels.py), which measures each form on the device.

`candidates` lists the configurations the sweep tries per shape; `pick` is the default.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_ROWS = 64  # decode buckets up to here; prefill-sized calls go to cuBLAS
MAX_SPLIT = 16


class Config(NamedTuple):
    mma: bool  # tensor-core dot (else float32 multiply-adds)
    block_m: int  # input rows per program (padded)
    block_n: int  # weight rows (output columns) per program; head_dim for the qkv kernel
    block_k: int
    split: int  # programs along K per column tile
    warps: int
    stages: int


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def block_m_for(m: int, mma: bool) -> int:
    """Rows a program holds: the tensor cores' minimum of 16, else the rows themselves."""
    return max(16, _pow2(m)) if mma else _pow2(m)


PER_SM = 3  # programs per multiprocessor the split aims at


def split_for(tiles: int, k: int, block_k: int, sms: int, per_sm: int = PER_SM) -> int:
    """The largest power-of-two K split whose grid holds at most `per_sm` programs per
    multiprocessor, keeping at least two K tiles per program. Three rather than two was
    measured in whole decode steps on an H100 (docs/kernels.md): Qwen3-0.6B's gate/up
    projection goes from 192 to 384 programs, 1.1-1.8 / 3.6-3.8 / 0.7-1.3% off the step at
    batch 1 / 8 / 64 in two calls, while doubling Qwen3-8B's splits too (past three a
    multiprocessor) cost 15%."""
    split = 1
    while split < MAX_SPLIT and tiles * split * 2 <= per_sm * sms and k >= 2 * block_k * split * 2:
        split *= 2
    return split


def k_share(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(K per program, a multiple of block_k; the programs K then needs along it: some
    splits need fewer, K being shared in whole tiles)."""
    share = -(-k // split)
    per = -(-share // block_k) * block_k
    return per, -(-k // per)


def splits_needed(k: int, split: int, block_k: int) -> int:
    """The programs a split of `split` really launches along K (`k_share`)."""
    return k_share(k, split, block_k)[1]


def wave_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """The K split that fills the most of the waves its grid takes (programs over whole
    waves of `sms`), each program walking at least two K tiles; ties go to the smaller.
    For the qkv kernel, whose few column tiles are whole heads: at the Qwen3-8B shape (48
    tiles, 132 SMs) a split of 11 fills four waves exactly, where the power of two (4)
    leaves 192 programs in two waves of 264; measured on an H100 (the whole decode step,
    docs/kernels.md) 3.0% faster at batch 1 and 4.3% at batch 8."""
    best, best_fill = 1, 0.0
    for split in range(1, MAX_SPLIT + 1):
        if k < 2 * block_k * split:
            break
        programs = tiles * splits_needed(k, split, block_k)
        fill = programs / (-(-programs // sms) * sms)
        if fill > best_fill + 1e-9:
            best, best_fill = split, fill
    return best


def pick(m: int, n: int, k: int, sms: int, head_dim: int | None = None) -> Config:
    """The default configuration of an [m, k] x [n, k]^T product (`head_dim`: the qkv
    kernel, whose programs own whole heads, split to fill whole waves up to 16 rows:
    `wave_split`)."""
    block_n = head_dim or 64
    tiles = -(-n // block_n)
    block_k = 128 if head_dim is None or head_dim <= 128 else 64
    # whole waves where measured (up to 16 rows); wider qkv tiles keep the power of two,
    # their partials (the split's count of [head_dim + 1, rows] each) not measured
    if head_dim is not None and m <= 16:
        split = wave_split(tiles, k, block_k, sms)
    else:  # the qkv kernel's wider tiles keep two a multiprocessor, as measured before
        split = split_for(tiles, k, block_k, sms, PER_SM if head_dim is None else 2)
    return Config(True, block_m_for(m, True), block_n, block_k, split, 4, 3)


def stages_for(c: Config, x: torch.dtype, w: torch.dtype) -> int:
    """The launch's num_stages: the configuration's, but one for an input wider than the
    weights (see the module doc: it keeps the measured kernel's structure)."""
    return 1 if x != w else c.stages


def candidates(m: int, n: int, k: int, sms: int, head_dim: int | None = None) -> list[Config]:
    """Configurations the device sweep compares for one shape: the default, a deeper and a
    shallower split, a wider K step, a fourth stage and eight warps (more weight bytes in
    flight per program, for a GPU whose memory outruns the default), (not qkv) narrower
    and, past 16 rows, wider column tiles, and (rows <= 2, not qkv) the multiply-add form."""
    base = pick(m, n, k, sms, head_dim)
    out = [base]
    for split in (base.split * 2, base.split // 2):
        if 1 <= split <= MAX_SPLIT and k >= split * base.block_k:
            out.append(base._replace(split=split))
    out.append(base._replace(block_k=base.block_k * 2, stages=2))
    out.extend((base._replace(stages=4), base._replace(warps=8)))
    if head_dim is None:
        out.append(base._replace(block_n=32, split=min(MAX_SPLIT, base.split * 2)))
    if head_dim is None and m > 16:
        out.extend(wide_tiles(base, n, k, sms))
    if m <= 2 and head_dim is None:
        bm = block_m_for(m, False)
        tiles = -(-n // 16)
        out.append(Config(False, bm, 16, 256, split_for(tiles, k, 256, sms), 4, 1))
    return list(dict.fromkeys(out))


def wide_tiles(base: Config, n: int, k: int, sms: int) -> list[Config]:
    """128-column tiles past 16 rows, at four and eight warps: each program loads its input
    rows once per K step whatever its width, so at 64 rows a 64-column tile reads as many
    input bytes as weight bytes, and 128 columns halve that (measured: docs/kernels.md,
    "Rows for cuBLAS"; 256 columns at two stages did not compile)."""
    split = split_for(-(-n // 128), k, base.block_k, sms)
    return [base._replace(block_n=128, split=split, warps=w) for w in (4, 8)]
