"""Device-resident attention metadata, checked on the device: no host sync, nothing corrupted.

An engine that keeps its sequence lengths, block tables and slot mapping on the device
passes them as device tensors (the query lengths stay on the host: they choose the graph).
Reading them on the host would stall the host on the device, so a full-graph step checks
them where they are, before its replay:

- a sequence whose seq_len is below its query length or beyond its row, or whose row holds
  a block id outside the cache or the dummy block in a column it reads, is redirected: its
  row becomes the dummy block, its seq_len its query length, its tokens write the dummy
  slot;
- a token whose slot is not the one its row gives its position, or that shares its slot
  with another token of the step, writes the dummy slot instead.

So a step with bad metadata reads and writes nothing outside its own valid blocks and the
dummy block, whatever the values.

The check costs the host a few calls per step, whatever the batch: staging copies the
given tensors into persistent raw buffers of the largest shapes (three device-to-device
copies; nothing else is written and no graph touched while staging), and the check's own
ops are the first piece of the key's recording: the executor's capture transaction
(xgraph.capture) records them as one graph through the backend's Graph (a CUDA graph on a
GPU, the tape on the CPU), on the key's lease, before the forward, and a replay runs that
graph before the step's. The ops read the raw buffers at the key's padded sizes and the
real counts (the sequences n and the table width w, known on the host and staged with the
step's other host values in the same copy), so rows past n, columns past w and tokens past
n * q, which hold earlier steps' values, are masked: one recording serves every batch
composition of its key. They write the padded metadata the step's graph reads, padding
included. A capture that fails follows the executor's `on_capture_error`, as any capture
does: rolled back, then raised, or the key's check issued eagerly from then on (as safe,
more host time). The raw buffers live where the executor's persistent buffers do (its
arena): sleep gives them and the graphs' memory back, wake restores both; close resets the
check's graphs with the key's.

The first problem is kept in a small device buffer (the field, the index, the value) and
copied to pinned host memory behind the step; the next step whose copy has arrived,
`GraphExecutor.synchronize()` and `close()` raise it as an InputError naming the field.
The redirected sequences' outputs are not valid: the error says so.
`PagedAttention(validate="trusted")` skips the check for engines that guarantee their
tables: the given tensors are copied into the metadata buffers as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .check_call import CheckCall, installed
from .errors import InputError
from .paging import PagedAttention
from .step_attention import StepAttention

# what the error buffer's code names (0: no error)
PROBLEMS = {
    1: ("seq_lens", "is below its query length or beyond its block-table row"),
    2: ("block_tables", "holds a block id outside the cache, or the dummy block"),
    3: ("slot_mapping", "is not the slot its sequence's block table gives its position"),
    4: ("slot_mapping", "is a slot another token of the step writes too"),
}

# the staged buffer of a checked step's real counts: sequences n, block-table width w
COUNTS = "device_counts"
VIEWS_KEPT = 4096  # raw-buffer views kept for reuse, one per (sequences, width, tokens)


@dataclass(frozen=True)
class CheckOps:
    """The check of one full-graph key, `seqs` padded sequences of `query_len` tokens: the
    ops a recording captures, or that run eagerly (call it)."""

    run: Callable[[], None]
    seqs: int
    query_len: int
    sent: Callable[[], None]  # after it ran: its result on its way to the host

    def __call__(self) -> None:
        self.run()


Allocate = Callable[[int], torch.Tensor] | None  # nbytes -> a uint8 device tensor
ALIGN = 64  # bytes: each raw buffer starts on a cache line


@dataclass(frozen=True)
class _Raw:
    """The persistent raw buffers the given tensors are copied into, the error buffer, and
    the constants the captured check reads (largest shapes: every key's check reads a
    prefix); views of one allocation."""

    seq_lens: torch.Tensor  # int64 [max_seqs]
    table: torch.Tensor  # int32 [max_seqs, width]
    slots: torch.Tensor  # int64 [max_tokens]
    error: torch.Tensor  # int64 [3]: the first problem's code, index and value
    rows: torch.Tensor  # arange(max_seqs)
    cols: torch.Tensor  # arange(max(width, max_query_len))
    sentinels: torch.Tensor  # -1 - arange(max_tokens): distinct, never a valid slot

    @classmethod
    def make(
        cls, a: PagedAttention, seqs: int, tokens: int, device: torch.device, allocate: Allocate
    ) -> _Raw:
        """In memory from `allocate(nbytes)` (the executor's arena, which sleep gives back
        and wake restores with its contents), else torch's."""
        width, i64 = a.max_blocks_per_seq, torch.int64
        layout = [(i64, (seqs,)), (torch.int32, (seqs, width)), (i64, (tokens,)), (i64, (3,))]
        layout += [(i64, (seqs,)), (i64, (max(width, a.max_query_len),)), (i64, (tokens,))]
        nbytes = [_nbytes(d, sh) for d, sh in layout]
        starts = [0]
        for n in nbytes:
            starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
        if allocate is None:
            packed = torch.zeros(starts[-1], dtype=torch.uint8, device=device)
        else:
            packed = allocate(starts[-1]).zero_()
        views = [packed[at : at + n] for at, n in zip(starts, nbytes)]
        raw = cls(*(v.view(d).view(sh) for v, (d, sh) in zip(views, layout)))
        raw.rows.copy_(torch.arange(seqs, device=device))
        raw.cols.copy_(torch.arange(len(raw.cols), device=device))
        raw.sentinels.copy_(-1 - torch.arange(tokens, device=device))
        return raw

    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values())


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for x in shape:
        n *= x
    return n


class DeviceCheck:
    """The device-side check of one executor's steps (see the module docstring)."""

    def __init__(
        self,
        name: str,
        layout: PagedAttention,
        device: torch.device,
        counts: torch.Tensor,
        sizes: tuple[int, int],
        allocate: Allocate = None,
    ) -> None:
        """`counts`: the staged int64 [2] (n, w) on the device; `sizes`: the most sequences
        and tokens of a full graph; `allocate`: where the raw buffers live."""
        self.name, self.layout, self.device = name, layout, device
        self.counts, self.sizes, self.allocate = counts, sizes, allocate
        pin = device.type != "cpu"
        self._host = torch.zeros(3, dtype=torch.int64, device="cpu", pin_memory=pin)
        self._host_np = self._host.numpy()  # read without torch's dispatch
        self._event = torch.Event(device=device) if pin else None
        self.pending = False  # a check's result is on its way to the host
        self._raw: _Raw | None = None  # made at the first checked step
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._ops: dict[tuple[int, int], CheckOps] = {}  # (seqs, q) -> the key's check

    # -- per step --------------------------------------------------------------------------

    def stage(
        self, h: StepAttention, out: dict[str, torch.Tensor], num_seqs: int, trusted: bool
    ) -> CheckOps | None:
        """Write a step's device metadata where the key's graph reads it (the views `out`
        of a full graph of `num_seqs` sequences, whose padding the host copy has sent):
        trusted, into `out` as given (None returned); checked, into the raw buffers only,
        and the key's check returned, to run before the step's graph (its first piece).
        Queued on the current stream, nothing read on the host."""
        n, w = h.table.shape
        t = len(h.slots)
        if trusted:
            out["seq_lens"][:n].copy_(h.seq_lens)
            out["block_tables"][:n, :w].copy_(h.table)
            out["slot_mapping"][:t].copy_(h.slots)
            return None
        sl, table, slots = self._raw_views(n, w, t)
        sl.copy_(h.seq_lens)
        table.copy_(h.table)
        slots.copy_(h.slots)
        q = h.query_len
        ops = self._ops.get((num_seqs, q))
        if ops is None:
            ops = CheckOps(partial(self._issue, out, num_seqs, q), num_seqs, q, self.sent)
            self._ops[(num_seqs, q)] = ops
        return ops

    def sent(self) -> None:
        """After a step's check ran: its first problem on its way to the host (raised by
        the next step whose copy has arrived, or `raise_pending(wait=True)`)."""
        self._host.copy_(self._raw.error, non_blocking=True)  # type: ignore[union-attr]
        if self._event is not None:
            self._event.record()
        self.pending = True

    def _raw_views(self, n: int, w: int, t: int) -> tuple[torch.Tensor, ...]:
        """Where the given tensors go in the raw buffers (made once per shape)."""
        got = self._views.get((n, w, t))
        if got is None:
            raw = self._raw
            if raw is None:
                raw = self._raw = _Raw.make(self.layout, *self.sizes, self.device, self.allocate)
            got = (raw.seq_lens[:n], raw.table[:n, :w], raw.slots[:t])
            if len(self._views) >= VIEWS_KEPT:  # tables of ever new widths: kept bounded
                self._views.clear()
            self._views[(n, w, t)] = got
        return got

    # -- the check of one key --------------------------------------------------------------

    def _issue(self, out: dict[str, torch.Tensor], s: int, q: int) -> None:
        self._check(out, s, q)  # looked up at each call: a recording or an eager run

    def _check(self, out: dict[str, torch.Tensor], s: int, q: int) -> None:
        """The check over the raw buffers at the key's sizes (s sequences of q tokens), masked
        by the staged counts; writes the padded metadata and keeps the first problem."""
        raw = self._raw
        assert raw is not None
        kernel = installed(self.device.type)
        if kernel is not None and kernel(self._call(raw, out, s, q)):
            return
        a = self.layout
        n, w = self.counts[0], self.counts[1]
        real = raw.rows[:s] < n
        code_seq, value_seq, keep = self._sequences(raw, s, q, real, w)
        code_tok, good_tok = self._tokens(raw, s, q, keep, real)
        cols = raw.cols[: a.max_blocks_per_seq]
        out["seq_lens"].copy_(torch.where(keep, raw.seq_lens[:s], q))
        rows = keep[:, None] & (cols < w)[None, :]
        out["block_tables"].copy_(torch.where(rows, raw.table[:s], a.dummy_block))
        out["slot_mapping"].copy_(torch.where(good_tok, raw.slots[: s * q], a.dummy_slot))
        codes = torch.cat([code_seq, code_tok])
        values = torch.cat([value_seq, raw.slots[: s * q]])
        first = (codes != 0).byte().argmax().view(1)  # indexed as a tensor: no host read
        index = torch.where(first < s, first, first - s)
        found = torch.cat([codes.gather(0, first), index, values.gather(0, first)])
        error = raw.error
        error.copy_(torch.where(error[0] != 0, error, found))

    def _call(self, raw: _Raw, out: dict[str, torch.Tensor], s: int, q: int) -> CheckCall:
        a = self.layout
        return CheckCall(
            raw.seq_lens[:s],
            raw.table[:s],
            raw.slots[: s * q],
            self.counts,
            raw.error,
            out["seq_lens"],
            out["block_tables"],
            out["slot_mapping"],
            q,
            a.block_size,
            a.num_blocks,
            a.dummy_block,
            a.dummy_slot,
        )

    def _sequences(
        self, raw: _Raw, s: int, q: int, real: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(problem code, the value named, written as given) per sequence: real ones only."""
        a = self.layout
        sl = raw.seq_lens[:s]
        last = torch.div(sl - 1, a.block_size, rounding_mode="floor")  # its last block's column
        bad_len = (sl < q) | (last >= w)
        used = raw.cols[None, : a.max_blocks_per_seq] <= last[:, None]  # columns past w: unused
        ids = raw.table[:s].long()
        bad_ids = ((ids < 0) | (ids >= a.num_blocks) | (ids == a.dummy_block)) & used
        bad_block = bad_ids.any(1)
        first_bad = ids.gather(1, bad_ids.byte().argmax(1, keepdim=True))[:, 0]
        code = torch.where(real, torch.where(bad_len, 1, torch.where(bad_block, 2, 0)), 0)
        keep = real & ~(bad_len | bad_block)
        return code, torch.where(bad_len, sl, first_bad), keep

    def _tokens(
        self, raw: _Raw, s: int, q: int, keep: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(problem code, written as given) per token: real ones only (n * q of them, in
        order), and no token of a redirected sequence written."""
        bs, width = self.layout.block_size, self.layout.max_blocks_per_seq
        sl, slots = raw.seq_lens[:s], raw.slots[: s * q]
        pos = sl[:, None] - q + raw.cols[None, :q]  # [s, q]
        col = torch.div(pos, bs, rounding_mode="floor").clamp(0, width - 1)
        expected = (raw.table[:s].long().gather(1, col) * bs + pos % bs).reshape(-1)
        real_tok = real[:, None].expand(s, q).reshape(-1)
        wrong = slots != expected
        # padded tokens hold earlier steps' slots: distinct negative stand-ins instead
        ordered, order = torch.where(real_tok, slots, raw.sentinels[: s * q]).sort(stable=True)
        twice = torch.zeros_like(wrong).scatter_(0, order[1:], ordered[1:] == ordered[:-1])
        code = torch.where(real_tok, torch.where(wrong, 3, torch.where(twice, 4, 0)), 0)
        good = keep[:, None].expand(s, q).reshape(-1) & ~(wrong | twice)
        return code, good

    # -- errors and teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Drop every view of the staged and raw buffers (their memory is given back with
        the last view); the planner refuses every step from here on."""
        self.counts = self.counts.new_empty(0)
        self._raw = None
        self._views.clear()
        self._ops.clear()

    def raise_pending(self, wait: bool = False) -> None:
        """Raise the kept problem as an InputError once its copy has reached the host (or,
        with `wait`, after waiting for it); nothing is waited for otherwise."""
        found = self.pending_error(wait)
        if found is not None:
            raise found

    def pending_error(self, wait: bool = False) -> InputError | None:
        """The kept problem as an InputError, taken (as `raise_pending`), or None."""
        if not self.pending:
            return None
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():
                return None
        self.pending = False
        code, index, value = (int(x) for x in self._host_np)
        if not code:
            return None
        if self._raw is not None:
            self._raw.error.zero_()
        self._host_np[:] = 0
        field, what = PROBLEMS[code]
        kind = "token" if field == "slot_mapping" else "sequence"
        return InputError(
            f"{self.name}: an earlier step's device metadata had {field}[{index}] = {value}, "
            f"which {what}. Nothing outside the dummy block was read or written for it: that "
            f"{kind} read and wrote the dummy block only, so its outputs in that step are not "
            "valid. Fix the engine's metadata (or check it on the host: pass host tensors)."
        )

    def nbytes(self) -> int:
        """Bytes of the raw buffers and constants (0 before the first checked step)."""
        return 0 if self._raw is None else self._raw.nbytes()
