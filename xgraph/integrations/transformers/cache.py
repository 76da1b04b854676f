"""The paged KV cache xgraph allocates for a transformers model: one (k, v) pair per
attention call of its forward.

Layout per tensor: [num_blocks + 1, block_size, kv_heads, head_dim], the shape
`xgraph.attention` takes, in the heads, head size and dtype of the call it serves (the
probe before the first step saw them; layers of per-layer configs may differ). Without
calls, one pair per layer of the spec, all alike. The last block is reserved: bucket
padding writes its keys and values to `dummy_slot` and padded sequences point at
`dummy_block`, so padding never lands in a real request's blocks. A block allocator hands
out blocks 0..num_blocks-1 only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...paging import PagedKVCache
from .probe import AttentionCall
from .spec import ModelSpec


class PagedCache(PagedKVCache):
    """Paged (k, v) tensors for a ModelSpec (or its attention calls), allocated once."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        calls: Sequence[AttentionCall] | None = None,
    ) -> None:
        dtype = dtype or spec.dtype
        super().__init__(
            spec.num_layers if calls is None else 0,
            spec.num_kv_heads,
            spec.head_dim,
            num_blocks,
            block_size,
            dtype,
            device,
        )
        for call in calls or ():
            shape = (num_blocks + 1, block_size, call.kv_heads, call.head_dim)
            self.layers.append(
                (
                    torch.zeros(shape, dtype=call.dtype, device=device),
                    torch.zeros(shape, dtype=call.dtype, device=device),
                )
            )
