"""Device-side step feedback: a decode step's chosen tokens become the next step's inputs.

After each decode step of a multi-step launch (xgraph.decode_loop), `Feedback.advance`
moves every sequence one token on, on the device, with tensor ops only (no host read, so
it is captured with the steps):

- the chosen token is kept in the launch's output, and becomes the next input id;
- a sequence finishes at one of its stop tokens, or when it has produced its budget of
  tokens, or when it would need a cache block it was not given (see below); a finished
  sequence stays finished for the rest of the launch;
- a running sequence's position and seq_len grow by one, and its next slot is read from
  its block-table row; where the row holds no real block for the new position (the
  padding's dummy block), the next block of the launch's free list is taken, in sequence
  order (a prefix sum over the sequences that need one), and written into the row; a
  sequence that finds the list used up stops;
- a finished sequence's tokens write the dummy slot: its inputs stay as they were, so it
  keeps running over what it had, and no write of it reaches the KV cache again.

The state lives in the executor's buffers (the declared inputs and the attention metadata
the decode runner reads), so the next step's attention sees it. A `Feedback` keeps those
buffers as they were staged and `restore` puts them back: the buffers end a launch as they
started it, so a launch is a function of what the host staged (the executor runs a forward
eagerly before capturing it, and again as a graph). `advance` is a function of tensors only,
so xgraph.loop_step can run it (with the token choice) under torch.compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .metadata import AttentionMetadata

# why a sequence finished (the launch's `reasons` output)
RUNNING, STOPPED, BUDGET, NO_BLOCKS = 0, 1, 2, 3


@dataclass
class LoopBuffers:
    """What a launch reads and advances: views of the executor's buffers for `n` padded
    sequences (one token each)."""

    input_ids: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    budget: torch.Tensor  # int64 [n]: tokens each sequence may still produce (0: padding)
    stop_ids: torch.Tensor  # int64 [n, S]: each sequence's stop tokens, -1 unused
    free_blocks: torch.Tensor  # int64 [F]: blocks the launch may hand out, in order
    free_count: torch.Tensor  # int64 [1]: how many of them are real
    md: AttentionMetadata  # seq_lens, slot_mapping, block_tables the runner reads

    @property
    def seqs(self) -> int:
        return self.input_ids.shape[0]


def advance(
    tokens: torch.Tensor,
    generated: torch.Tensor,
    reasons: torch.Tensor,
    used: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    budget: torch.Tensor,
    stop_ids: torch.Tensor,
    free_blocks: torch.Tensor,
    free_count: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    table: torch.Tensor,
    *,
    block_size: int,
    dummy_block: int,
    dummy_slot: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step on: this step's chosen tokens [n] in; (the tokens as the launch reports
    them, -1 for sequences that had finished before this step; generated, reasons, used
    after it) out. input_ids, positions, seq_lens, slot_mapping and the block-table rows
    `table` [n, W] are advanced in place. Tensor ops only, the same under torch.compile."""
    live = reasons == RUNNING
    out = torch.where(live, tokens, -1)
    generated = generated + live.long()
    stop = (stop_ids == tokens[:, None]).any(1) & live
    spent = live & ~stop & (generated >= budget)
    reasons = torch.where(stop, STOPPED, torch.where(spent, BUDGET, reasons))
    go = reasons == RUNNING
    input_ids.copy_(torch.where(go, tokens, input_ids))
    positions.add_(go.long())
    seq_lens.add_(go.to(seq_lens.dtype))
    # a running sequence whose new position falls in a column without a real block takes
    # the next block of the free list (in sequence order); one that finds none stops
    width = table.shape[1]
    col = torch.div(positions, block_size, rounding_mode="floor")
    past = col >= width  # the row cannot hold it: no block can be given
    c = col.clamp(0, width - 1)
    have = table.long().gather(1, c[:, None])[:, 0]
    need = go & (past | (have == dummy_block) | (have < 0))
    want = need & ~past
    at = used + torch.cumsum(want.long(), 0) - 1  # this sequence's place in the list
    ok = want & (at < free_count)
    given = free_blocks.gather(0, at.clamp(0, free_blocks.shape[0] - 1))
    cell = torch.where(ok, given, have).to(table.dtype)
    table.scatter_(1, c[:, None], cell[:, None])
    used = used + ok.long().sum()
    reasons = torch.where(need & ~ok, NO_BLOCKS, reasons)
    go = reasons == RUNNING  # a sequence that found no block stops here
    block = table.long().gather(1, c[:, None])[:, 0]
    slot = block * block_size + positions % block_size
    slot_mapping.copy_(torch.where(go, slot, dummy_slot))
    return out, generated, reasons, used


class Feedback:
    """One launch's per-sequence state on the device, advanced after every step."""

    def __init__(self, buf: LoopBuffers, block_size: int, dummy_block: int, dummy_slot: int):
        self.buf = buf
        self.step = functools.partial(
            advance, block_size=block_size, dummy_block=dummy_block, dummy_slot=dummy_slot
        )
        n, md, device = buf.seqs, buf.md, buf.input_ids.device
        self._saved = [
            t.clone() for t in (buf.input_ids, buf.positions, md.seq_lens[:n], md.slot_mapping[:n])
        ]
        self._table = md.block_tables[:n].clone()
        self.generated = torch.zeros(n, dtype=torch.int64, device=device)
        self.reasons = torch.where(buf.budget > 0, RUNNING, BUDGET).to(torch.int64)
        self.used = torch.zeros(1, dtype=torch.int64, device=device)

    def state(self) -> tuple[torch.Tensor, ...]:
        """What `advance` takes after the tokens: the state, then the buffers it reads and
        advances."""
        b, md, n = self.buf, self.buf.md, self.buf.seqs
        return (
            self.generated,
            self.reasons,
            self.used,
            b.input_ids,
            b.positions,
            b.budget,
            b.stop_ids,
            b.free_blocks,
            b.free_count,
            md.seq_lens[:n],
            md.slot_mapping[:n],
            md.block_tables[:n],
        )

    def advance(self, x: torch.Tensor, step: Callable[..., Any] | None = None) -> torch.Tensor:
        """Take this step's chosen tokens [n] (or what `step` chooses them from: `step(x,
        *state())` returns what `advance` does, by default `advance` itself); the tokens as
        the launch reports them (-1 for sequences that had finished before this step)."""
        out, self.generated, self.reasons, self.used = (step or self.step)(x, *self.state())
        return out

    def tables(self) -> torch.Tensor:
        """The sequences' block-table rows as the launch left them (blocks it gave)."""
        return self.buf.md.block_tables[: self.buf.seqs].clone()

    def restore(self) -> None:
        """Put every advanced buffer back as the host staged it."""
        b, md, n = self.buf, self.buf.md, self.buf.seqs
        ids, pos, seq_lens, slots = self._saved
        b.input_ids.copy_(ids)
        b.positions.copy_(pos)
        md.seq_lens[:n].copy_(seq_lens)
        md.slot_mapping[:n].copy_(slots)
        md.block_tables[:n].copy_(self._table)
