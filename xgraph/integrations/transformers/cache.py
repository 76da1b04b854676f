"""The paged KV cache xgraph allocates for a transformers model: one (k, v) pair per layer.

Layout per tensor: [num_blocks + 1, block_size, kv_heads, head_dim] in the model's dtype,
the shape `xgraph.attention` takes. The last block is reserved: bucket padding writes its
keys and values to `dummy_slot` and padded sequences point at `dummy_block`, so padding
never lands in a real request's blocks. A block allocator hands out blocks 0..num_blocks-1
only.
"""

from __future__ import annotations

import torch

from ...metadata import KVCache
from .spec import ModelSpec


class PagedCache:
    """Per-layer paged (k, v) tensors for a ModelSpec, allocated once at construction."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype or spec.dtype
        shape = (num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: the dummy block is read by padded sequences before any write
        self.layers: list[KVCache] = [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(spec.num_layers)
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def slot(self, row: list[int], position: int) -> int:
        """The cache slot of `position` in a sequence whose block-table row is `row`."""
        return row[position // self.block_size] * self.block_size + position % self.block_size
