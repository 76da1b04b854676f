"""Validation of a step's inputs against the executor's declarations; nothing is written before.

Each check names the executor, the input or field, what was found and what to do. Token
inputs are checked against their declared dtype, device and shape, and the symbolic dims
must agree across inputs; attention inputs are normalized here (ragged block tables become
one int32 table) and checked against the paging layout.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .buckets import Dim, Input
from .errors import InputError
from .metadata import AttentionInputs
from .paging import PagedAttention

try:  # the C function behind np.count_nonzero, without its Python wrapper (a fifth of a us)
    from numpy._core.multiarray import count_nonzero as _count
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import count_nonzero as _count  # type: ignore[no-redef]

NUM_TOKENS = "num_tokens"


def _check_tensor(name: str, spec: Input, v: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise InputError(
            f"{name}: input {spec.name!r} must be a torch.Tensor, got {type(v).__name__}."
        )
    if v.dtype != spec.dtype:
        raise InputError(
            f"{name}: input {spec.name!r} has dtype {v.dtype}, declared {spec.dtype}; "
            f"convert it with .to({spec.dtype})."
        )
    if v.device.type != "cpu" and v.device != device:
        raise InputError(
            f"{name}: input {spec.name!r} is on {v.device}; the executor runs on {device}. "
            f"Pass host tensors or tensors on {device}."
        )
    if v.dim() != len(spec.shape):
        raise InputError(
            f"{name}: input {spec.name!r} has shape {tuple(v.shape)}, declared {spec.shape} "
            f"({len(spec.shape)} dims)."
        )
    if spec.bounds is not None and v.numel():
        _check_bounds(name, spec, v)
    return v


def _check_bounds(name: str, spec: Input, v: torch.Tensor) -> None:
    low, high = spec.bounds  # type: ignore[misc]
    if v.device.type == "cpu" and low == 0 and v.dtype == torch.int64:
        # one reduction: as unsigned, a negative value is huge and fails the same compare
        if int(v.numpy().view(np.uint64).max()) < high:
            return
    else:
        a = v.numpy() if v.device.type == "cpu" else v
        if a.min() >= low and a.max() < high:  # a device tensor pays one sync here
            return
    at = tuple(int(i) for i in ((v < low) | (v >= high)).nonzero()[0])
    raise InputError(
        f"{name}: input {spec.name!r}{list(at)} is {v[at].item()}, outside its bounds "
        f"[{low}, {high})."
    )


def _record_sizes(
    name: str, spec: Input, v: torch.Tensor, dims: Mapping[str, Dim], sizes: dict[str, int]
) -> None:
    for axis, (n, s) in enumerate(zip(v.shape, spec.shape)):
        if isinstance(s, int):
            if n != s:
                raise InputError(f"{name}: input {spec.name!r} dim {axis} is {n}, declared {s}.")
            continue
        if sizes.setdefault(s, n) != n:
            raise InputError(
                f"{name}: dim {s!r} is {sizes[s]} in one input and {n} in {spec.name!r}; every "
                "input must agree on it."
            )
        if s != NUM_TOKENS and not dims[s].in_key and n > dims[s].max:
            raise InputError(f"{name}: dim {s!r} is {n}, above its max {dims[s].max}.")


def validate_inputs(
    name: str,
    declared: Sequence[Input],
    dims: Mapping[str, Dim],
    inputs: Mapping[str, Any],
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The step's tensors by name and the size of every symbolic dim they use."""
    names = {i.name for i in declared}
    if inputs.keys() != names:
        missing, unknown = names - set(inputs), set(inputs) - names
        raise InputError(
            f"{name}: inputs {sorted(inputs)} do not match the declared inputs {sorted(names)} "
            f"(missing {sorted(missing)}, unknown {sorted(unknown)})."
        )
    sizes: dict[str, int] = {}
    tensors: dict[str, torch.Tensor] = {}
    for spec in declared:
        v = _check_tensor(name, spec, inputs[spec.name], device)
        _record_sizes(name, spec, v, dims, sizes)
        tensors[spec.name] = v
    if NUM_TOKENS not in sizes:
        raise InputError(f"{name}: no input has a 'num_tokens' dim.")
    return tensors, sizes


@dataclass
class StepAttention:
    """A validated step's attention inputs on the host, as numpy arrays ready to stage."""

    query_lens: np.ndarray  # int64 [seqs]
    seq_lens: np.ndarray  # int64 [seqs]
    table: np.ndarray  # int32 [seqs, width], ragged rows padded with the dummy block
    slots: np.ndarray  # int64 [tokens]
    is_decode: bool  # one query token per sequence

    def inputs(self) -> AttentionInputs:
        """The same values as AttentionInputs (the eager path builds fresh metadata)."""
        return AttentionInputs(
            self.query_lens.tolist(),
            self.seq_lens.tolist(),
            torch.from_numpy(self.table),
            torch.from_numpy(self.slots),
        )


def _host(value: Any, dtype: Any, field: str, name: str, device: torch.device) -> np.ndarray:
    """A tensor (host or this device), array or list as a numpy array of `dtype`."""
    if isinstance(value, torch.Tensor):
        want = torch.int32 if dtype is np.int32 else torch.int64
        if value.dtype != want:
            raise InputError(f"{name}: {field} must be {want}; got {value.dtype}.")
        if value.device.type != "cpu" and value.device != device:
            raise InputError(
                f"{name}: attention inputs must be on the host or on {device}; got {value.device}."
            )
        return value.cpu().numpy()  # on the device: copied once to be checked (a sync)
    return np.asarray(value, dtype=dtype)


def _table(name: str, given: Any, n: int, dummy: int, device: torch.device) -> tuple:
    """(int32 table [n, width], real length of each row)."""
    if isinstance(given, (torch.Tensor, np.ndarray)):
        table = _host(given, np.int32, "block_tables", name, device)
        if table.ndim != 2 or table.shape[0] != n:
            raise InputError(
                f"{name}: block_tables must be int32 [num_seqs={n}, width]; got "
                f"{tuple(table.shape)}."
            )
        return table, np.full(n, table.shape[1], dtype=np.int64)
    if len(given) != n:
        raise InputError(f"{name}: block_tables has {len(given)} rows for {n} sequences.")
    lens = np.fromiter((len(r) for r in given), dtype=np.int64, count=n)
    width = int(lens.max()) if n else 0
    table = np.full((n, width), dummy, dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(given), dtype=np.int32, count=int(lens.sum()))
    table[np.arange(width)[None, :] < lens[:, None]] = flat
    return table, lens


def validate_attention(
    name: str,
    layout: PagedAttention,
    attn: AttentionInputs,
    num_tokens: int,
    max_seqs: int,
    device: torch.device,
    synthetic: bool = False,
) -> StepAttention:
    """The attention inputs normalized (numpy: int64 lengths and slots, an int32 table) and
    checked against the cache: a step that passes cannot read or write outside its own
    blocks. `synthetic` steps (pre-capture) use only the dummy block: their layout is
    trusted. Vectorized: no Python loop over tokens or blocks."""
    ql = np.asarray(attn.query_lens, dtype=np.int64).reshape(-1)
    sl = np.asarray(attn.seq_lens, dtype=np.int64).reshape(-1)
    _check_lengths(name, ql, sl, num_tokens, max_seqs)
    table, rows = _table(name, attn.block_tables, len(ql), layout.dummy_block, device)
    if table.shape[1] > layout.max_blocks_per_seq:
        raise InputError(
            f"{name}: block_tables width {table.shape[1]} is above "
            f"max_blocks_per_seq={layout.max_blocks_per_seq}."
        )
    slots = _host(attn.slot_mapping, np.int64, "slot_mapping", name, device).reshape(-1)
    if slots.shape != (num_tokens,):
        raise InputError(f"{name}: slot_mapping must be [{num_tokens}]; got {slots.shape}.")
    decode = bool((ql == 1).all())
    if not synthetic:
        check_cache_layout(name, layout, ql, sl, table, rows, slots, decode)
    return StepAttention(ql, sl, table, slots, decode)


def _check_lengths(
    name: str, ql: np.ndarray, sl: np.ndarray, num_tokens: int, max_seqs: int
) -> None:
    n = len(ql)
    if n == 0 or num_tokens == 0:
        raise InputError(f"{name}: a step needs at least one sequence and one token; got none.")
    if len(sl) != n:
        raise InputError(f"{name}: {n} query_lens but {len(sl)} seq_lens.")
    total = int(ql.sum())
    if total != num_tokens:
        raise InputError(
            f"{name}: query_lens sum to {total}, but the inputs have {num_tokens} tokens."
        )
    if (ql < 1).any() or (ql > sl).any():
        i = int(np.flatnonzero((ql < 1) | (ql > sl))[0])
        raise InputError(
            f"{name}: sequence {i} has query_len {ql[i]} and seq_len {sl[i]}; every sequence "
            "needs 1 <= query_len <= seq_len."
        )
    if n > max_seqs:
        raise InputError(f"{name}: {n} sequences, above max_seqs={max_seqs}.")


def check_cache_layout(
    name: str,
    layout: PagedAttention,
    ql: np.ndarray,
    sl: np.ndarray,
    table: np.ndarray,
    rows: np.ndarray,
    slots: np.ndarray,
    decode: bool,
) -> None:
    """Each sequence's blocks exist, are its own to use, and hold every position up to its
    seq_len; each token's slot is the one its sequence's table gives its position."""
    bs, dummy, nb = layout.block_size, layout.dummy_block, layout.num_blocks
    need = (sl + (bs - 1)) // bs
    cols = int(need.max())
    if cols > rows.min() and (need > rows).any():  # one scalar test when all rows fit
        i = int(np.flatnonzero(need > rows)[0])
        raise InputError(
            f"{name}: block_tables: sequence {i} needs {need[i]} blocks for seq_len {sl[i]} "
            f"(block_size {bs}) but its row holds {rows[i]}. Give it enough blocks."
        )
    used = table[:, :cols]  # only the columns some sequence reads
    ids = used.view(np.uint32)  # a negative id becomes huge: one compare finds both ends
    # the usual layout puts the dummy last: then one compare refuses it too
    bad = ids >= dummy if dummy == nb - 1 else (ids >= nb) | (ids == dummy)
    if bad.any():
        bad &= np.arange(used.shape[1])[None, :] < need[:, None]  # columns past a row's need
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise InputError(
                f"{name}: block_tables: sequence {i} uses block id {int(used[i, j])} at column "
                f"{j}; block ids run from 0 to {nb - 1}, and {dummy} is the reserved dummy "
                "block."
            )
    if decode:  # one token per sequence, at position seq_len - 1
        seq, pos = np.arange(len(sl)), sl - 1
    else:
        seq = np.repeat(np.arange(len(ql)), ql)
        starts = np.cumsum(ql) - ql
        pos = (sl - ql)[seq] + np.arange(len(seq)) - starts[seq]
    block, offset = np.divmod(pos, bs)
    expected = used[seq, block] * bs + offset  # int64: pos is int64
    if (slots != expected).any():
        t = int(np.flatnonzero(slots != expected)[0])
        raise InputError(
            f"{name}: slot_mapping[{t}] is {slots[t]}, but sequence {int(seq[t])} keeps "
            f"position {pos[t]} at slot {expected[t]} (its block table row, block_size {bs}). "
            "Slots must follow the block tables."
        )


# -- the decode fast path ------------------------------------------------------------------
# A check answers the step's arrays, or None. None never refuses a step: the planner then runs
# the full validation above on it, which raises the exact error, or accepts a form the fast
# path leaves out (device tensors, other dtypes, prefill). Constants are 0-d arrays: numpy
# compares an array with one faster than with a Python int.


class TokenCheck:
    """The declared inputs of an executor whose only symbolic dim is num_tokens (axis 0)."""

    def __init__(self, declared: Sequence[Input]) -> None:
        self.count = len(declared)
        self.specs = [
            (i.name, i.dtype, len(i.shape), tuple(i.shape[1:]), _bounds(i.bounds, i.dtype))
            for i in declared
        ]

    def check(self, inputs: Mapping[str, Any]) -> tuple[int, list[np.ndarray]] | None:
        """(num_tokens, numpy views of the inputs in declaration order) if every input is a
        host tensor of its declared dtype and shape with its values within bounds."""
        if len(inputs) != self.count:
            return None
        n = -1
        arrays: list[np.ndarray] = []
        for name, dtype, ndim, tail, bounds in self.specs:
            v = inputs.get(name)
            if type(v) is not torch.Tensor or v.dtype is not dtype or not v.is_cpu:
                return None
            shape = v.shape
            if len(shape) != ndim or v.requires_grad or (ndim > 1 and shape[1:] != tail):
                return None
            if n != shape[0]:
                if n >= 0:
                    return None
                n = shape[0]
            a = v.numpy()
            if bounds is not None and n:
                if type(bounds) is tuple:
                    if a.min() < bounds[0] or a.max() >= bounds[1]:
                        return None
                elif _count(a.view(np.uint64) >= bounds):
                    return None
            arrays.append(a)
        return (n, arrays) if n > 0 else None


def _bounds(bounds: tuple[int, int] | None, dtype: Any) -> Any:
    """[0, high) of int64 values: one unsigned compare (a negative value is huge as unsigned)."""
    if bounds is not None and bounds[0] == 0 and dtype is torch.int64 and bounds[1] >= 0:
        return np.array(bounds[1], dtype=np.uint64)
    return bounds


def _int64(value: Any, strict: bool) -> np.ndarray | None:
    """A host tensor (int64; any integer dtype unless `strict`) or a list / array as int64."""
    if type(value) is torch.Tensor:
        if not value.is_cpu or value.requires_grad or value.dtype.is_floating_point:
            return None
        if value.dtype is torch.int64:
            return value.numpy()
        if strict or value.dtype.is_complex or value.dtype is torch.bool:
            return None
        return value.numpy().astype(np.int64)
    try:
        if type(value) is list and len(value) >= 32:
            try:  # struct packs a list of ints about twice as fast as numpy converts it
                return np.frombuffer(struct.pack(f"{len(value)}q", *value), dtype=np.int64)
            except struct.error:  # floats, or out of range: numpy decides, as before
                pass
        return np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None


def _all_ones(query_lens: Any, n: int) -> bool:
    if type(query_lens) is list:  # list.count compares in C, no Python loop
        return len(query_lens) == n and query_lens.count(1) == n
    q = _int64(query_lens, strict=False)
    return q is not None and q.size == n and not _count(q != 1)


@dataclass(slots=True)
class DecodeAttention:
    """A decode step's attention inputs as host arrays, lengths checked, layout not yet."""

    seq_lens: np.ndarray  # int64 [n]
    slots: np.ndarray  # int64 [n]
    table: np.ndarray  # int32 [n, width], or the ids of ragged rows one after another
    lens: np.ndarray  # uint64: the width (0-d), or the length of each ragged row
    last: np.ndarray  # int64 [n]: the column of each sequence's last block
    offset: np.ndarray  # int64 [n]: its position in that block


class DecodeCheck:
    """The attention inputs of a decode step (one query token per sequence), checked as
    `validate_attention` checks them, in a few vectorized operations: `check` the lengths
    before staging, `check_staged` the block ids and slots on the staged table."""

    def __init__(self, layout: PagedAttention, max_seqs: int, staged: np.ndarray) -> None:
        self.dummy, self.nb = layout.dummy_block, layout.num_blocks
        self.width = w = layout.max_blocks_per_seq
        self.staged = staged  # the host twin of the block tables, [max_seqs, width]
        self.flat = staged.reshape(-1)  # a view: the buffer is contiguous
        self.row_starts = np.arange(max_seqs) * w
        self.one = np.array(1, dtype=np.int64)
        self.bs = np.array(layout.block_size, dtype=np.int64)
        bs = layout.block_size  # a power of two: shift and mask instead of // and %
        self.shift = np.array(bs.bit_length() - 1, np.int64) if bs & (bs - 1) == 0 else None
        self.mask = np.array(bs - 1, dtype=np.int64)
        self.cols = np.arange(w)
        self.widths = [np.array(i, dtype=np.uint64) for i in range(w + 1)]  # row lengths
        # row k: the columns a sequence whose last block is at column k reads
        self.used = self.cols[None, :] <= self.cols[:, None]
        # with the dummy last, one unsigned compare against a per-column ceiling finds a
        # negative id, an id past the cache and the dummy, in used columns only
        ceiling = np.where(self.used, self.dummy - 1, np.iinfo(np.uint32).max)
        one_compare = 0 < self.dummy == self.nb - 1
        self.ceiling = ceiling.astype(np.uint32) if one_compare else None
        self.ones = np.ones(max_seqs, dtype=np.int64)  # the query lengths of a decode step
        self.ones.flags.writeable = False
        # int32 ids times the block size overflow int32 only in a cache of 2**31 slots
        self.wide = self.nb * layout.block_size >= 2**31

    def check(self, attn: AttentionInputs, n: int) -> DecodeAttention | None:
        """A decode step of `n` sequences whose rows hold every sequence's last block."""
        if n > len(self.ones) or not _all_ones(attn.query_lens, n):
            return None
        sl = _int64(attn.seq_lens, strict=False)
        slots = _int64(attn.slot_mapping, strict=True)
        got = self._table(attn.block_tables, n)
        if sl is None or slots is None or got is None or sl.shape != (n,) or slots.size != n:
            return None
        pos = sl - self.one
        last = pos >> self.shift if self.shift is not None else pos // self.bs
        if _count(last.view(np.uint64) >= got[1]):  # seq_len >= 1, the row holds it
            return None
        if slots.ndim != 1:
            slots = slots.reshape(-1)
        offset = pos & self.mask if self.shift is not None else pos % self.bs
        return DecodeAttention(sl, slots, got[0], got[1], last, offset)

    def _table(self, given: Any, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(the table, row lengths as in DecodeAttention)."""
        if type(given) is torch.Tensor:
            if given.dtype is not torch.int32 or not given.is_cpu or given.requires_grad:
                return None
            table = given.numpy()
        elif type(given) is np.ndarray:
            table = np.asarray(given, dtype=np.int32)
        elif type(given) is list and len(given) == n:
            try:
                lens = np.fromiter(map(len, given), dtype=np.int64, count=n)
                flat = np.fromiter(itertools.chain.from_iterable(given), np.int32, lens.sum())
            except (TypeError, ValueError, OverflowError):
                return None
            return (flat, lens.view(np.uint64)) if lens.max() <= self.width else None
        else:
            return None
        if table.ndim != 2 or table.shape[0] != n or table.shape[1] > self.width:
            return None
        return table, self.widths[table.shape[1]]

    def stage(self, d: DecodeAttention, n: int, tb: int) -> np.ndarray:
        """Write the table into rows [:tb] of the staged tables (padding: the dummy block)."""
        rows = self.staged[:tb]
        if d.table.ndim == 1:  # ragged rows, in row-major order
            rows[:n] = self.dummy
            rows[:n][self.cols < d.lens[:, None].view(np.int64)] = d.table
        else:
            w = d.table.shape[1]
            rows[:n, :w] = d.table
            if w < self.width:
                rows[:n, w:] = self.dummy
        if n < tb:
            rows[n:] = self.dummy
        return rows[:n]

    def check_staged(self, d: DecodeAttention, rows: np.ndarray) -> bool:
        """Every block a sequence reads is a real block, and each token's slot is the one its
        row gives its position; `rows` are the staged rows of the step's sequences."""
        ids = rows.view(np.uint32)
        if self.ceiling is not None:  # take gathers whole rows faster than indexing does
            bad = ids > self.ceiling.take(d.last, axis=0)
        else:
            bad = ((ids >= self.nb) | (ids == self.dummy)) & self.used.take(d.last, axis=0)
        if _count(bad):
            return False
        block = self.flat[self.row_starts[: len(rows)] + d.last]
        if self.wide:
            block = block.astype(np.int64)
        return not _count(block * self.bs + d.offset != d.slots)
