"""The steps the parameterization check captures for one key: a base and its variations.

Every step is synthetic, like pre-capture's: its tokens carry the inputs' fills and write
only the dummy slot; block tables may name real blocks, which attention only reads. All
steps of a key pad to that key; each variation changes one kind of per-step metadata that a
graph must take as data:

- "sequence lengths": the longest the block-table width allows instead of the shortest;
- "block tables": rows of real block ids instead of the dummy block;
- "batch composition": another number of sequences (decode: the fewest that still pad to
  the bucket; prefill: shorter sequences over fewer real tokens).

A full graph of q > 1 tokens per sequence (speculative verification, keyed by (tokens, q))
is checked as decode is, counting sequences: the base is `size` sequences of q tokens each
at seq_len q, the batch variation the fewest sequences that pad to the same count.

A variation the key leaves no room for (a bucket of one token, a table one block wide) is
listed as not varied, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .metadata import AttentionInputs
from .options import Kind

if TYPE_CHECKING:
    from .steps import StepPlanner

VARIATIONS = {
    "seq_lens": "sequence lengths",
    "block_tables": "block tables",
    "batch": "batch composition",
}


@dataclass
class Variant:
    """One step to capture: what it changes (base: nothing), its inputs and attention."""

    name: str
    tensors: dict[str, torch.Tensor]
    attn: AttentionInputs | None


@dataclass
class _Layout:
    """A step's sequences: query and kv lengths, block-table rows."""

    query_lens: list[int]
    seq_lens: list[int]
    rows: list[list[int]]


class Variants:
    """Builds the base step of a key of `size` tokens and its variations."""

    def __init__(
        self,
        planner: StepPlanner,
        size: int,
        kind: Kind,
        key_dims: dict[str, int],
        query_len: int = 1,
    ):
        self.planner, self.size, self.kind, self.key_dims = planner, size, kind, key_dims
        self.q = query_len  # > 1: size counts sequences of q tokens (a full graph)
        below = [s for s in planner.buckets.sizes if s < size]
        self.fewest = (max(below) if below else 0) + 1  # fewest tokens (sequences) padding to size
        self.not_varied: list[str] = []

    def build(self, vary: list[str]) -> list[Variant]:
        """The base step, then one step per variation the key leaves room for."""
        a = self.planner.attention
        base = self._base() if a is not None else None
        out = [self._variant("base", self.size * self.q, base)]
        for name in vary:
            layout, why = self._vary(name, base)
            if why:
                self.not_varied.append(f"{VARIATIONS[name]}: {why}")
                continue
            tokens = sum(layout.query_lens) if layout is not None else self.fewest
            out.append(self._variant(VARIATIONS[name], tokens, layout))
        return out

    def _variant(self, name: str, tokens: int, layout: _Layout | None) -> Variant:
        tensors, _ = self.planner.synthetic(tokens, self.kind, self.key_dims)
        a = self.planner.attention
        if layout is None or a is None:
            return Variant(name, tensors, None)
        slots = [a.dummy_slot] * tokens
        return Variant(
            name, tensors, AttentionInputs(layout.query_lens, layout.seq_lens, layout.rows, slots)
        )

    # -- layouts ---------------------------------------------------------------------------

    def _base(self) -> _Layout:
        a = self.planner.attention
        assert a is not None
        if self.kind is Kind.FULL:  # decode: q tokens per sequence, as many as the bucket
            lens = [self.q] * self.size
        else:
            lens = self._split(self.size, self._chunk())
        return _Layout(lens, list(lens), [[a.dummy_block] * a.max_blocks_per_seq for _ in lens])

    def _chunk(self) -> int:
        """The base prefill sequences' length: half a table, so context fits after them."""
        a = self.planner.attention
        assert a is not None
        per_seq = a.max_blocks_per_seq * a.block_size
        half = max(1, per_seq // 2)
        return half if -(-self.size // half) <= self.planner.max_seqs else per_seq

    @staticmethod
    def _split(n: int, chunk: int) -> list[int]:
        return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])

    def _vary(self, name: str, base: _Layout | None) -> tuple[_Layout | None, str]:
        """The base changed in `name`, or (None, why not)."""
        if base is None:  # no attention: only the real number of tokens can change
            if name != "batch":
                return None, "the executor drives no attention"
            if self.fewest >= self.size:
                return None, f"every step of bucket {self.size} has {_count(self.size, 'token')}"
            return None, ""
        return getattr(self, f"_vary_{name}")(base)

    def _vary_seq_lens(self, base: _Layout) -> tuple[_Layout | None, str]:
        a = self.planner.attention
        assert a is not None
        per_seq = a.max_blocks_per_seq * a.block_size
        if self.kind is Kind.FULL:
            lens = [max(self.q, per_seq - i % a.block_size) for i in range(len(base.seq_lens))]
        else:  # context before the new tokens, up to the table's width
            lens = [per_seq for _ in base.query_lens]
        if lens == base.seq_lens:
            return None, f"the block table holds {per_seq} tokens, all used already"
        return _Layout(base.query_lens, lens, base.rows), ""

    def _vary_block_tables(self, base: _Layout) -> tuple[_Layout | None, str]:
        a = self.planner.attention
        assert a is not None
        ids = [i for i in range(a.num_blocks) if i != a.dummy_block]
        if not ids:
            return None, "the cache has no block besides the dummy"
        w = a.max_blocks_per_seq
        rows = [[ids[(i * w + j) % len(ids)] for j in range(w)] for i in range(len(base.rows))]
        return _Layout(base.query_lens, base.seq_lens, rows), ""

    def _vary_batch(self, base: _Layout) -> tuple[_Layout | None, str]:
        a = self.planner.attention
        assert a is not None
        if self.kind is Kind.FULL:
            if self.fewest >= self.size:
                return (
                    None,
                    f"every decode step of bucket {self.size} has {_count(self.size, 'sequence')}",
                )
            lens = [self.q] * self.fewest
        else:
            lens = self._split(self.fewest, max(1, base.query_lens[0] // 2))
            if lens == base.query_lens or len(lens) > self.planner.max_seqs:
                return None, f"bucket {self.size} takes no other split into sequences"
        rows = [[a.dummy_block] * a.max_blocks_per_seq for _ in lens]
        return _Layout(lens, list(lens), rows), ""


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def describe_steps(steps: list[Any]) -> list[Variant]:
    """Engine-given steps (keyword arguments of a step call) as variants: the first is the
    base, the others are named by their position."""
    out = []
    for i, kwargs in enumerate(steps):
        given = dict(kwargs)
        attn = given.pop("attn", None)
        out.append(Variant("base" if i == 0 else f"step {i + 1}", given, attn))
    return out
