"""One step's attention inputs, normalized and checked against the paging layout. Writes nothing.

`AttentionCheck.check` turns an `AttentionInputs` (or a mapping with exactly its four
fields) into a `StepAttention`: int64 query and sequence lengths, one int32 block table
(ragged rows padded with the dummy block) and int64 slots, with `query_len` set when every
sequence adds the same number of tokens (1: decode). A step that passes cannot read or
write outside its own blocks:

- lengths: at least one sequence and one token, one seq_len per query length, query
  lengths summing to the step's tokens, 1 <= query_len <= seq_len, at most max_seqs;
- the table: int32, as wide as the layout at most, each row holding every position up to
  its seq_len, every block a sequence reads a real block of the cache (not the dummy);
  columns past a row's last used one are not checked and may hold anything (-1 padding,
  stale ids): they are staged as given, and xgraph's runners never let them reach a
  result;
- the slots (int64, or int32 widened exactly): each token's slot is the one its row gives
  its position, and no two tokens of the step write the same slot.

Every check is a few vectorized numpy operations, none per token or per block; a step of
uniform query length (decode, or speculative verification) takes the shortest form of
each, inside the same checks. Each failure raises an InputError naming the field, the
sequence or token, and what to do.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from .decode_check import DecodeCheck, distinct
from .errors import InputError
from .metadata import AttentionInputs, AttentionMetadata, LaunchState
from .paging import PagedAttention
from .step_fields import host_fields, ints
from .validation import any_true, same

FIELDS = tuple(f.name for f in fields(AttentionInputs))
_SLOTS = (torch.int64, torch.int32)  # slot-mapping tensors: int32 is widened, exactly


@dataclass(slots=True)
class StepAttention:
    """A checked step's attention inputs on the host, as numpy arrays ready to stage."""

    query_lens: np.ndarray  # int64 [seqs]
    seq_lens: np.ndarray  # int64 [seqs] (int32 where given as an int32 tensor)
    table: np.ndarray  # int32 [seqs, width], ragged rows padded with the dummy block
    slots: np.ndarray  # int64 [tokens]; on the device as given, int64 or int32 (cast as staged)
    query_len: int  # the query length every sequence has, 0 where they differ
    on_device: bool = False  # seq_lens, table and slots are device tensors, checked there
    trusted: bool = False  # device metadata staged as given (a launch's own: LaunchState)

    @property
    def is_decode(self) -> bool:
        """One query token per sequence."""
        return self.query_len == 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def on_host(self) -> AttentionInputs:
        """The inputs with device tensors copied to the host (a sync), to be checked there."""
        return AttentionInputs(
            self.query_lens, self.seq_lens.cpu(), self.table.cpu(), self.slots.cpu()
        )

    def metadata(self, device: torch.device) -> AttentionMetadata:
        """Unpadded metadata in fresh tensors (an eager step)."""
        return AttentionMetadata.build(
            self.query_lens.tolist(),
            self.seq_lens.tolist(),
            torch.from_numpy(self.table.copy()),
            torch.from_numpy(self.slots.copy()),
            device,
        )


class AttentionCheck:
    """The attention inputs of one executor's steps (see the module docstring)."""

    def __init__(
        self, name: str, layout: PagedAttention, max_seqs: int, device: torch.device
    ) -> None:
        self.name, self.layout, self.max_seqs, self.device = name, layout, max_seqs, device
        self.cpu_is_device = False
        self.dummy, self.nb = layout.dummy_block, layout.num_blocks
        self.width = layout.max_blocks_per_seq
        bs = self.bs = layout.block_size
        # a power of two: shift and mask instead of // and %
        self.shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else None
        ones = np.ones(max_seqs, dtype=np.int64)  # a decode step's query lengths
        ones.flags.writeable = False
        self.ones = [ones[:n] for n in range(max_seqs + 1)]  # sliced once per count
        self.seq_index = np.arange(max_seqs, dtype=np.int64)
        self.cols = cols = np.arange(self.width)
        # row k: the columns a sequence whose last block is at column k reads
        self.used = cols[None, :] <= cols[:, None]
        # with the dummy last, one unsigned compare against a per-column ceiling finds a
        # negative id, an id past the cache and the dummy, in used columns only
        self.one_compare = 0 < self.dummy == self.nb - 1
        ceiling = np.where(self.used, self.dummy - 1, np.iinfo(np.uint32).max)
        self.ceiling = ceiling.astype(np.uint32)
        self._by_width: dict[int, tuple[np.ndarray | None, np.ndarray]] = {}
        self.bs64, self.mask = np.array(bs, dtype=np.int64), bs - 1  # 0-d: see DecodeCheck
        # a decode step's checks in fewer calls (where it finds a problem, the checks below
        # run and name it)
        self.decode = DecodeCheck(layout, self.ceiling, max_seqs) if self.one_compare else None

    # -- normalize -------------------------------------------------------------------------

    def check(
        self, attn: Any, num_tokens: int, synthetic: bool = False, host: bool = False
    ) -> StepAttention:
        """The step's attention arrays, checked; `synthetic` steps (the executor's own, over
        the dummy block) are checked for their shapes only. Device tensors (unless `host`)
        are checked for their shapes here and for their values on the device, by
        `xgraph.device_check` as they are staged."""
        if type(attn) is not AttentionInputs:
            attn = self._given(attn)
        # host tensors of the usual dtypes and ranks viewed at once (never device metadata:
        # a LaunchState, or host tensors where the CPU counts as the device)
        usual = (
            host_fields(attn.seq_lens, attn.block_tables, attn.slot_mapping, self.width)
            if type(attn) is AttentionInputs and not self.cpu_is_device
            else None
        )
        if usual is None and not host and (self._resident(attn) or type(attn) is LaunchState):
            return self._device(attn, num_tokens)
        ql, q = self._query_lens(attn.query_lens)
        n = len(ql)
        if usual is not None and len(usual[1]) == n:
            sl, table, slots = usual
            rows: Any = table.shape[1]
        else:  # field by field, each form's errors named
            sl = ints(self.name, attn.seq_lens, "seq_lens", 1)
            table, rows = self._table(attn.block_tables, n)
            slots = ints(self.name, attn.slot_mapping, "slot_mapping", 0, torch.int64)
        h = StepAttention(ql, sl, table, slots, q)
        total = q * n if q else int(ql.sum())
        if not n or len(sl) != n or total != num_tokens or n > self.max_seqs:
            self._counts(h, num_tokens)
        if len(slots) != num_tokens:
            raise InputError(
                f"{self.name}: slot_mapping must be [{num_tokens}]; got ({len(slots)},)."
            )
        if q == 1 and type(rows) is int and not synthetic and self.decode is not None:
            if self.decode.passes(sl, table, slots):
                return h
        if q != 1 and (q < 1 or any_true(ql > sl) or any_true(ql < 1)):
            self._bad_lengths(ql, sl)
        end = sl - 1  # the position of each sequence's last token
        last = end >> self.shift if self.shift is not None else end // self.bs
        # seq_len >= 1 and the row holds its last block, in one unsigned compare
        if any_true(last.view(np.uint32 if last.dtype == np.int32 else np.uint64) >= rows):
            self._short_rows(h, rows, last)
        if not synthetic:
            self._layout(h, end, last)
        return h

    def _counts(self, h: StepAttention, num_tokens: int) -> None:
        n = len(h.query_lens)
        if not n or not num_tokens:
            raise InputError(
                f"{self.name}: a step needs at least one sequence and one token; got none."
            )
        if len(h.seq_lens) != n:
            raise InputError(f"{self.name}: {n} query_lens but {len(h.seq_lens)} seq_lens.")
        total = int(h.query_lens.sum())
        if total != num_tokens:
            raise InputError(
                f"{self.name}: query_lens sum to {total}, but the inputs have {num_tokens} tokens."
            )
        raise InputError(f"{self.name}: {n} sequences, above max_seqs={self.max_seqs}.")

    def _short_rows(self, h: StepAttention, rows: Any, last: np.ndarray) -> None:
        self._bad_lengths(h.query_lens, h.seq_lens)
        u = last.view(np.uint32 if last.dtype == np.int32 else np.uint64)
        i = int(np.flatnonzero(u >= rows)[0])
        have = rows if isinstance(rows, int) else int(rows[i])
        raise InputError(
            f"{self.name}: block_tables: sequence {i} needs {int(last[i]) + 1} blocks for "
            f"seq_len {h.seq_lens[i]} (block_size {self.bs}) but its row holds {have}. Give "
            "it enough blocks."
        )

    def _resident(self, attn: AttentionInputs) -> bool:
        """Whether a field is a device tensor (`cpu_is_device`: host tensors count too, so
        CPU runs exercise the device path)."""
        sl, table, slots = attn.seq_lens, attn.block_tables, attn.slot_mapping
        if (
            (type(sl) is torch.Tensor and not sl.is_cpu)
            or (type(table) is torch.Tensor and not table.is_cpu)
            or (type(slots) is torch.Tensor and not slots.is_cpu)
        ):
            return True
        return self.cpu_is_device and any(isinstance(v, torch.Tensor) for v in (sl, table, slots))

    def _device(self, attn: AttentionInputs, num_tokens: int) -> StepAttention:
        """Device metadata: query lengths on the host (a device tensor is copied: it chooses
        the graph), the other fields as tensors of the executor's device, shapes checked."""
        ql, q = self._query_lens(attn.query_lens)
        n = len(ql)
        sl = self._tensor(attn.seq_lens, "seq_lens", (torch.int32, torch.int64), (n,))
        table = self._tensor(attn.block_tables, "block_tables", (torch.int32,), None, n)
        if table.dim() != 2 or table.shape[0] != n:
            raise InputError(
                f"{self.name}: block_tables must be int32 [num_seqs={n}, width]; got "
                f"{tuple(table.shape)}."
            )
        if table.shape[1] > self.width:
            self._too_wide(table.shape[1])
        # int32 slots (flash-attn-style engines) stay as given: the copy into the int64
        # metadata buffers casts them, exactly
        slots = self._tensor(attn.slot_mapping, "slot_mapping", _SLOTS, None).reshape(-1)
        h = StepAttention(ql, sl, table, slots, q, True, type(attn) is LaunchState)
        total = q * n if q else int(ql.sum())
        if not n or total != num_tokens or n > self.max_seqs:
            self._counts(h, num_tokens)
        if len(slots) != num_tokens:
            raise InputError(
                f"{self.name}: slot_mapping must be [{num_tokens}]; got ({len(slots)},)."
            )
        return h

    def _tensor(
        self, value: Any, field: str, dtypes: tuple, shape: tuple[int, ...] | None, n: int = 0
    ) -> torch.Tensor:
        """A field as a tensor on the executor's device (host values are copied there)."""
        if not isinstance(value, torch.Tensor):
            if field == "block_tables":
                given = self._table(value, n)[0]
            else:
                given = ints(self.name, value, field, 1, dtypes[0])
            value = torch.from_numpy(np.ascontiguousarray(given)).to(self.device)
        if value.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise InputError(
                f"{self.name}: {field} must be {want}; got {value.dtype}. Pass "
                f"{field}.to({dtypes[0]})."
            )
        if value.device != self.device and not (self.cpu_is_device and value.is_cpu):
            raise InputError(
                f"{self.name}: {field} is on {value.device}; the executor runs on "
                f"{self.device}. Pass host tensors or tensors on {self.device}."
            )
        if shape is not None and tuple(value.shape) != shape:
            raise InputError(
                f"{self.name}: {field} must be {list(shape)}; got {tuple(value.shape)}."
            )
        return value

    def _given(self, attn: Any) -> AttentionInputs:
        """An AttentionInputs (a subclass too), or a mapping with exactly its fields."""
        if isinstance(attn, AttentionInputs):
            return attn
        if isinstance(attn, Mapping):
            got, want = set(map(str, attn)), set(FIELDS)
            if got == want and len(attn) == len(FIELDS):
                return AttentionInputs(**attn)
            raise InputError(
                f"{self.name}: attn= as a mapping needs exactly the fields {list(FIELDS)}; "
                f"missing {sorted(want - got)}, unknown {sorted(got - want)}."
            )
        raise InputError(
            f"{self.name}: attn= must be xgraph.AttentionInputs (or a mapping of its fields "
            f"{list(FIELDS)}); got {type(attn).__name__}."
        )

    def _query_lens(self, given: Any) -> tuple[np.ndarray, int]:
        """(int64 query lengths, the query length they share or 0)."""
        if type(given) is list and given:
            q = given[0]
            if type(q) is int and given.count(q) == len(given):  # compares in C
                n = len(given)
                if q == 1 and n <= self.max_seqs:
                    return self.ones[n], 1
                return ints(self.name, given, "query_lens", 1), q
        ql = ints(self.name, given, "query_lens", 1)
        if not len(ql):
            return ql, 0
        first = int(ql[0])
        if first == 1 and len(ql) <= self.max_seqs and not any_true(ql != 1):
            return self.ones[len(ql)], 1
        return ql, first if not any_true(ql != first) else 0

    def _table(self, given: Any, n: int) -> tuple[np.ndarray, Any]:
        """(int32 table [n, width], the real length of each row: the width, or per row)."""
        if type(given) is torch.Tensor and given.dtype is torch.int32 and given.is_cpu:
            table = given.numpy()  # the usual form: no copy
            if table.ndim == 2 and table.shape[0] == n and table.shape[1] <= self.width:
                return table, table.shape[1]
        if isinstance(given, (torch.Tensor, np.ndarray)):
            table = ints(self.name, given, "block_tables", 2, torch.int32)
            if table.shape[0] != n:
                raise InputError(
                    f"{self.name}: block_tables must be int32 [num_seqs={n}, width]; got "
                    f"{tuple(table.shape)}."
                )
            w = table.shape[1]
            if w > self.width:
                self._too_wide(w)
            return table, w
        return self._ragged(given, n)

    def _ragged(self, given: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of block ids of any lengths."""
        try:
            if len(given) != n:
                raise InputError(
                    f"{self.name}: block_tables has {len(given)} rows for {n} sequences."
                )
            lens = np.fromiter(map(len, given), dtype=np.int64, count=n)
            flat = list(itertools.chain.from_iterable(given))
        except TypeError:
            raise InputError(
                f"{self.name}: block_tables must be an int32 tensor [seqs, width] or a list of "
                f"rows of block ids; got {type(given).__name__}."
            ) from None
        ids = ints(self.name, flat, "block_tables", 1, torch.int32)
        w = int(lens.max()) if n else 0
        if w > self.width:
            self._too_wide(w)
        table = np.full((n, w), self.dummy, dtype=np.int32)
        table[self.cols[:w][None, :] < lens[:, None]] = ids
        return table, lens.view(np.uint64)

    def _too_wide(self, w: int) -> None:
        raise InputError(
            f"{self.name}: block_tables width {w} is above max_blocks_per_seq={self.width}. "
            f"Pass block_tables[:, :{self.width}] if the columns past it are padding, or "
            "raise PagedAttention(max_blocks_per_seq=)."
        )

    # -- check -----------------------------------------------------------------------------

    def _bad_lengths(self, ql: np.ndarray, sl: np.ndarray) -> None:
        bad = (ql < 1) | (ql > sl)
        if any_true(bad):
            i = int(np.flatnonzero(bad)[0])
            raise InputError(
                f"{self.name}: sequence {i} has query_len {ql[i]} and seq_len {sl[i]}; every "
                "sequence needs 1 <= query_len <= seq_len."
            )

    def _layout(self, h: StepAttention, end: np.ndarray, last: np.ndarray) -> None:
        """Block ids a sequence reads, then each token's slot and their uniqueness."""
        table = h.table
        n, w = table.shape
        ids = table.view(np.uint32)
        ceiling, starts = self._by_width.get(w) or self._width(w)
        if ceiling is not None:
            bad = ids > ceiling.take(last, axis=0)
        else:
            bad = ((ids >= self.nb) | (ids == self.dummy)) & self.used[:, :w].take(last, axis=0)
        if any_true(bad):
            self._bad_block(h, bad, last)
        if h.query_len == 1:  # one token per sequence, at its last position
            seq, pos = self.seq_index[:n], end
            at = starts[:n] + last
            offset = end & self.mask if self.shift is not None else end % self.bs
        else:
            seq, pos = self._positions(h)
            if self.shift is not None:
                col, offset = pos >> self.shift, pos & self.mask
            else:
                col, offset = np.divmod(pos, self.bs)
            at = seq * w + col
        blocks = table.take(at)  # of the flattened table
        expected = blocks * self.bs64 + offset
        if not same(h.slots, expected):
            t = int(np.flatnonzero(h.slots != expected)[0])
            raise InputError(
                f"{self.name}: slot_mapping[{t}] is {h.slots[t]}, but sequence {int(seq[t])} "
                f"keeps position {pos[t]} at slot {expected[t]} (its block table row, "
                f"block_size {self.bs}). Slots must follow the block tables."
            )
        self._unique(h, seq)

    def _bad_block(self, h: StepAttention, bad: np.ndarray, last: np.ndarray) -> None:
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise InputError(
            f"{self.name}: block_tables: sequence {i} uses block id {int(h.table[i, j])} at "
            f"column {j}; the columns it reads (0 to {int(last[i])}: seq_len "
            f"{int(h.seq_lens[i])}, block_size {self.bs}) must hold cache blocks, ids 0 to "
            f"{self.nb - 1} other than the reserved dummy block {self.dummy}. Columns past "
            "them may hold anything (-1 padding too)."
        )

    def _width(self, w: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Per table width, made once: the ceilings of `_layout`'s one compare (when the
        dummy is the last block), and where each row starts in the flattened table."""
        ceiling = np.ascontiguousarray(self.ceiling[:, :w]) if self.one_compare else None
        got = self._by_width[w] = (ceiling, self.seq_index * w)
        return got

    def _positions(self, h: StepAttention) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, position) of each token: sequence-major, each sequence's tokens at
        its last query_len positions."""
        sl, q, n = h.seq_lens, h.query_len, len(h.seq_lens)
        if q:
            seq = np.repeat(self.seq_index[:n], q)
            pos = (sl[:, None] - q + np.arange(q)[None, :]).reshape(-1)
            return seq, pos
        ql = h.query_lens
        seq = np.repeat(self.seq_index[:n], ql)
        starts = np.cumsum(ql) - ql
        return seq, (sl - ql)[seq] + np.arange(len(seq)) - starts[seq]

    def _unique(self, h: StepAttention, seq: np.ndarray) -> None:
        """No two tokens of the step write one slot (`distinct`), else the first pair named."""
        if distinct(h.slots):
            return
        s = h.slots.copy()
        s.sort()
        order = np.argsort(h.slots, kind="stable")
        i = int(np.flatnonzero(s[1:] == s[:-1])[0])
        a, b = sorted((int(order[i]), int(order[i + 1])))
        raise InputError(
            f"{self.name}: slot_mapping: tokens {a} and {b} (sequences {int(seq[a])} and "
            f"{int(seq[b])}) both write cache slot {int(s[i])}; two tokens of one step "
            "cannot share a slot. Give each sequence its own blocks to write."
        )
