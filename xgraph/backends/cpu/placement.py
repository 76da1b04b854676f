"""PlaceInPool: host tensors made in a block land in a HostCachingPool's blocks.

What `torch.cuda.use_mem_pool` does for CUDA tensors, for host memory, which torch's own
allocator gives no pool to: a TorchDispatchMode that moves every fresh output of an op (one
that aliases no input) into a block of the pool, freed back to the pool when the tensor
goes. Copying each result once costs what an allocation touches anyway. Every host tensor
made in the block counts: on a backend whose device is the host, host and device memory are
one (the memory regions of `xgraph.regions` use it so).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class BlockPool(Protocol):
    """What PlaceInPool needs of a HostCachingPool."""

    def alloc(self, nbytes: int) -> int: ...
    def free(self, address: int) -> None: ...
    def owns(self, address: int) -> bool: ...


class PlaceInPool(TorchDispatchMode):
    """Moves the fresh host outputs of every op into `pool` (see the module docstring)."""

    def __init__(self, pool: BlockPool) -> None:
        super().__init__()
        self.pool = pool

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        multi = len(schema.returns) > 1
        rets = list(out) if multi else [out]
        for i, (r, rs) in enumerate(zip(rets, schema.returns)):
            if rs.alias_info is not None:  # a view or the mutated input: already in place
                continue
            if isinstance(r, torch.Tensor):
                rets[i] = self._place(r)
            elif isinstance(r, (list, tuple)):
                rets[i] = type(r)(self._place(x) if isinstance(x, torch.Tensor) else x for x in r)
        return tuple(rets) if multi else rets[0]

    def _place(self, t: torch.Tensor) -> Any:
        if t.device.type != "cpu" or t.layout is not torch.strided:
            return t
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0 or self.pool.owns(st.data_ptr()):
            return t
        address = self.pool.alloc(n)
        block = torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.uint8)
        weakref.finalize(block.untyped_storage(), self.pool.free, address).atexit = False
        block.untyped_storage().copy_(st)
        placed = torch.empty(0, dtype=t.dtype, device="cpu")
        return placed.set_(block.untyped_storage(), t.storage_offset(), t.shape, t.stride())
