"""The executor's own steps (pre-capture, idle ranks, the parameterization check): inputs
that touch only the dummy slot and block.

Token inputs carry their declared fill; attention rows name the dummy block and every
token writes the dummy slot. Such a step is checked like any other (`synthetic=True` lets
it name the dummy block, which real steps may not read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .buckets import Dim, Input
from .errors import XGraphError
from .metadata import AttentionInputs
from .options import Kind
from .paging import PagedAttention
from .validation import NUM_TOKENS


class SyntheticSteps:
    """Builds the synthetic steps of one executor's declared inputs and attention."""

    def __init__(
        self,
        name: str,
        inputs: Sequence[Input],
        dims: Mapping[str, Dim],
        attention: PagedAttention | None,
        full_query_len: int,
    ) -> None:
        self.name, self.inputs, self.dims = name, list(inputs), dims
        self.attention, self.full_query_len = attention, full_query_len

    def build(
        self, n: int, kind: Kind, key_dims: Mapping[str, int], query_len: int = 1
    ) -> tuple[dict[str, torch.Tensor], AttentionInputs | None]:
        """`n` tokens, or for a full graph of `query_len` > 1, n sequences of that many."""
        if query_len > 1:
            if kind is not Kind.FULL or not 1 < query_len <= self.full_query_len:
                raise XGraphError(
                    f"{self.name}: query_len={query_len} names full graphs of that many tokens "
                    f"per sequence; the decode runner serves 1 to {self.full_query_len} "
                    "(kind='full')."
                )
            attn = self._query(n, query_len)
            return self._inputs(n * query_len, key_dims), attn
        tensors = self._inputs(n, key_dims)
        if self.attention is None:
            return tensors, None
        return tensors, self._attention(n, decode=kind is Kind.FULL)

    def _inputs(self, n: int, key_dims: Mapping[str, int]) -> dict[str, torch.Tensor]:
        sizes = {NUM_TOKENS: n, **key_dims}
        for name, d in self.dims.items():
            default = n if d.pad_like == NUM_TOKENS else (d.buckets[0] if d.buckets else 1)
            sizes.setdefault(name, default)
        return {
            spec.name: torch.full(
                [s if isinstance(s, int) else sizes[s] for s in spec.shape],
                spec.fill,
                dtype=spec.dtype,  # type: ignore[arg-type]
                device="cpu",  # host values, staged like a caller's
            )
            for spec in self.inputs
        }

    def _attention(self, n: int, decode: bool) -> AttentionInputs:
        """Decode: n single-token sequences. Piecewise: as few sequences as the block-table
        width allows (host-planned runners cost per sequence), over the dummy block."""
        a = self.attention
        assert a is not None
        if decode:
            return AttentionInputs([1] * n, [1] * n, [[a.dummy_block]] * n, [a.dummy_slot] * n)
        per_seq = a.max_blocks_per_seq * a.block_size
        lens = [per_seq] * (n // per_seq) + ([n % per_seq] if n % per_seq else [])
        tables = [[a.dummy_block] * -(-q // a.block_size) for q in lens]
        return AttentionInputs(lens, lens, tables, [a.dummy_slot] * n)

    def _query(self, n: int, q: int) -> AttentionInputs:
        """n sequences of q tokens over the dummy block (seq_len q)."""
        a = self.attention
        assert a is not None
        row = [a.dummy_block] * -(-q // a.block_size)
        return AttentionInputs([q] * n, [q] * n, [row] * n, [a.dummy_slot] * (n * q))
