"""The paged KV cache xgraph allocates for a transformers model: one (k, v) pair per layer.

Layout per tensor: [num_blocks + 1, block_size, kv_heads, head_dim] in the model's dtype,
the shape `xgraph.attention` takes. The last block is reserved: bucket padding writes its
keys and values to `dummy_slot` and padded sequences point at `dummy_block`, so padding
never lands in a real request's blocks. A block allocator hands out blocks 0..num_blocks-1
only.
"""

from __future__ import annotations

import torch

from ...paging import PagedKVCache
from .spec import ModelSpec


class PagedCache(PagedKVCache):
    """Per-layer paged (k, v) tensors for a ModelSpec, allocated once at construction."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            num_blocks,
            block_size,
            dtype or spec.dtype,
            device,
        )
