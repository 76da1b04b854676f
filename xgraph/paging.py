"""Paged KV caches: the cache tensors (PagedKVCache), and what the executor needs to drive
`xgraph.attention` over them (PagedAttention)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import XGraphError
from .interfaces import AttentionRunner
from .metadata import KVCache


class PagedKVCache:
    """Per-layer (k, v) caches of shape [num_blocks + 1, block_size, kv_heads, head_dim].

    The last block is reserved: bucket padding writes its k/v to `dummy_slot` (the first
    slot of that block) and padded sequences point their block tables at `dummy_block`, so
    padding never lands in a real request's cache. Zeros, not empty: padded sequences read
    the dummy block before anything is written there.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.layers: list[KVCache] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    @property
    def dummy_block(self) -> int:
        return self.num_blocks

    @property
    def dummy_slot(self) -> int:
        return self.num_blocks * self.block_size

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (the piecewise capture refuses ops that touch them directly)."""
        return [t for kv in self.layers for t in kv]

    def real(self) -> list[torch.Tensor]:
        """Views of every layer's cache without the reserved block (for comparisons)."""
        return [t[: self.num_blocks] for t in self.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def slot(self, row: list[int], position: int) -> int:
        """The cache slot of `position` in a sequence whose block-table row is `row`."""
        return row[position // self.block_size] * self.block_size + position % self.block_size


@dataclass
class PagedAttention:
    """The paging layout of the KV cache and the runners that attend over it.

    Metadata buffers are sized for `max_seqs` sequences (at least the largest bucket, for
    decode) and `max_blocks_per_seq` block-table columns of `block_size` slots. Padded
    tokens write their k/v to `dummy_slot`; padded sequences point at `dummy_block` with
    seq_len 1. Runners left None come from the backend, else the reference ones.
    `max_query_len` > 1 also runs steps whose sequences all add the same number q <=
    max_query_len of tokens (speculative verification: 1 + the draft tokens) as full
    graphs, keyed by q; the decode runner must serve it (`AttentionRunner.max_query_len`).
    `validate`: "checked" (default) checks every step's metadata, on the host, or where it
    is given as device tensors for a full graph, on the device (`xgraph.device_check`);
    "trusted" uses device metadata as given, for engines that guarantee their tables.
    """

    max_seqs: int
    max_blocks_per_seq: int
    dummy_slot: int
    dummy_block: int
    block_size: int
    kv_tensors: Sequence[torch.Tensor] = ()
    decode_runner: AttentionRunner | None = None
    prefill_runner: AttentionRunner | None = None
    num_blocks: int = 0  # blocks per cache tensor, the dummy included; 0: from kv_tensors
    max_query_len: int = 1
    validate: str = "checked"

    def __post_init__(self) -> None:
        if not self.num_blocks:
            if not self.kv_tensors:
                raise XGraphError(
                    "PagedAttention needs num_blocks (or kv_tensors) to check block ids; use "
                    "PagedAttention.for_cache(cache, ...) or pass num_blocks=."
                )
            self.num_blocks = int(self.kv_tensors[0].shape[0])
        if type(self.max_query_len) is not int or self.max_query_len < 1:
            raise XGraphError(
                f"PagedAttention: max_query_len={self.max_query_len!r}; give an int >= 1 (1: "
                "only decode steps of one token per sequence run as full graphs)."
            )
        if self.validate not in ("checked", "trusted"):
            raise XGraphError(
                f"PagedAttention: validate={self.validate!r}; choose 'checked' or 'trusted'."
            )
        if not 0 <= self.dummy_block < self.num_blocks:
            raise XGraphError(
                f"PagedAttention: dummy_block {self.dummy_block} is outside the cache's "
                f"{self.num_blocks} blocks."
            )

    @classmethod
    def for_cache(
        cls, cache: Any, max_seqs: int, max_blocks_per_seq: int, **kwargs: Any
    ) -> PagedAttention:
        """From a cache with dummy_slot, dummy_block, block_size and tensors() (PagedKVCache)."""
        return cls(
            max_seqs=max_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            dummy_slot=cache.dummy_slot,
            dummy_block=cache.dummy_block,
            block_size=cache.block_size,
            kv_tensors=list(cache.tensors()),
            **kwargs,
        )
