"""Device-resident attention metadata, checked on the device: no host sync, nothing corrupted.

An engine that keeps its sequence lengths, block tables and slot mapping on the device
passes them as device tensors (the query lengths stay on the host: they choose the graph).
Reading them on the host would stall the host on the device, so a full-graph step checks
them where they are, with a few torch ops queued on the current stream before the replay
(any device, the CPU too: the same ops):

- a sequence whose seq_len is below its query length or beyond its row, or whose row holds
  a block id outside the cache or the dummy block in a column it reads, is redirected: its
  row becomes the dummy block, its seq_len its query length, its tokens write the dummy
  slot;
- a token whose slot is not the one its row gives its position, or that shares its slot
  with another token of the step, writes the dummy slot instead.

So a step with bad metadata reads and writes nothing outside its own valid blocks and the
dummy block, whatever the values. The first problem is kept in a small device buffer (the
field, the index, the value) and copied to pinned host memory behind the step; the next
step whose copy has arrived, and `GraphExecutor.synchronize()`, raise it as an InputError
naming the field. The redirected sequences' outputs are not valid: the error says so.
`PagedAttention(validate="trusted")` skips the check for engines that guarantee their
tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError
from .paging import PagedAttention

# what the error buffer's code names (0: no error)
PROBLEMS = {
    1: ("seq_lens", "is below its query length or beyond its block-table row"),
    2: ("block_tables", "holds a block id outside the cache, or the dummy block"),
    3: ("slot_mapping", "is not the slot its sequence's block table gives its position"),
    4: ("slot_mapping", "is a slot another token of the step writes too"),
}


@dataclass(frozen=True)
class DeviceViews:
    """The metadata buffers a full-graph step writes on the device: the real sequences'
    seq_lens [n] and block-table rows [n, width], and the real tokens' slots [t]."""

    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


class DeviceCheck:
    """The device-side check of one executor's steps (see the module docstring)."""

    def __init__(self, name: str, layout: PagedAttention, device: torch.device) -> None:
        self.name, self.layout, self.device = name, layout, device
        self.error = torch.zeros(3, dtype=torch.int64, device=device)  # code, index, value
        pin = device.type != "cpu"
        self._host = torch.zeros(3, dtype=torch.int64, pin_memory=pin)
        self._event = torch.Event(device=device) if pin else None
        self.pending = False  # a check's result is on its way to the host
        self._cols: dict[int, torch.Tensor] = {}

    def write(
        self,
        views: DeviceViews,
        seq_lens: torch.Tensor,
        table: torch.Tensor,
        slots: torch.Tensor,
        q: int,
        trusted: bool,
    ) -> None:
        """Write the step's real metadata into the buffers, checked and redirected where
        bad (trusted: as given); queued on the current stream, nothing read on the host."""
        n, w = table.shape
        if trusted:
            views.seq_lens.copy_(seq_lens)
            views.block_tables[:, :w].copy_(table)
            views.slot_mapping.copy_(slots)
            return
        bad_seq, code_seq, value_seq = self._sequences(seq_lens, table, q)
        bad_tok, code_tok = self._tokens(seq_lens, table, slots, q)
        bad_tok |= bad_seq.repeat_interleave(q)
        a = self.layout
        views.seq_lens.copy_(torch.where(bad_seq, q, seq_lens))
        views.block_tables[:, :w].copy_(torch.where(bad_seq[:, None], a.dummy_block, table))
        views.slot_mapping.copy_(torch.where(bad_tok, a.dummy_slot, slots))
        self._record(torch.cat([code_seq, code_tok]), torch.cat([value_seq, slots]), n)

    def _sequences(
        self, seq_lens: torch.Tensor, table: torch.Tensor, q: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bad sequence, its problem code, the value named) per sequence."""
        a = self.layout
        sl = seq_lens.long()
        w = table.shape[1]
        last = torch.div(sl - 1, a.block_size, rounding_mode="floor")  # column of the last block
        bad_len = (sl < q) | (last >= w)
        used = self._columns(w)[None, :] <= last[:, None]
        ids = table.long()
        bad_ids = ((ids < 0) | (ids >= a.num_blocks) | (ids == a.dummy_block)) & used
        bad_block = bad_ids.any(1)
        first_bad = ids.gather(1, bad_ids.byte().argmax(1, keepdim=True))[:, 0]
        code = torch.where(bad_len, 1, torch.where(bad_block, 2, 0))
        return bad_len | bad_block, code, torch.where(bad_len, sl, first_bad)

    def _tokens(
        self, seq_lens: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, q: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bad token, its problem code) per token."""
        bs, w = self.layout.block_size, table.shape[1]
        pos = seq_lens.long()[:, None] - q + self._columns(q)[None, :]  # [n, q]
        col = torch.div(pos, bs, rounding_mode="floor").clamp(0, w - 1)
        expected = (table.long().gather(1, col) * bs + pos % bs).reshape(-1)
        wrong = slots != expected
        ordered, order = slots.sort(stable=True)
        twice = torch.zeros_like(wrong)
        twice[order[1:]] = ordered[1:] == ordered[:-1]  # the later of two tokens on one slot
        code = torch.where(wrong, 3, torch.where(twice, 4, 0))
        return wrong | twice, code

    def _columns(self, w: int) -> torch.Tensor:
        c = self._cols.get(w)
        if c is None:
            c = self._cols[w] = torch.arange(w, device=self.device)
        return c

    def _record(self, codes: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Keep the step's first problem unless an earlier one is kept; copy it behind the
        step to the host."""
        first = (codes != 0).byte().argmax().view(1)  # indexed as a tensor: no host read
        index = torch.where(first < n, first, first - n)
        found = torch.cat([codes.gather(0, first), index, values.long().gather(0, first)])
        self.error.copy_(torch.where(self.error[0] != 0, self.error, found))
        self._host.copy_(self.error, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self.pending = True

    def raise_pending(self, wait: bool = False) -> None:
        """Raise the kept problem as an InputError once its copy has reached the host (or,
        with `wait`, after waiting for it); nothing is waited for otherwise."""
        if not self.pending:
            return
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():
                return
        self.pending = False
        code, index, value = (int(x) for x in self._host)
        if not code:
            return
        self.error.zero_()
        self._host.zero_()
        field, what = PROBLEMS[code]
        kind = "token" if field == "slot_mapping" else "sequence"
        raise InputError(
            f"{self.name}: an earlier step's device metadata had {field}[{index}] = {value}, "
            f"which {what}. Nothing outside the dummy block was read or written for it: that "
            f"{kind} read and wrote the dummy block only, so its outputs in that step are not "
            "valid. Fix the engine's metadata (or check it on the host: pass host tensors)."
        )
