"""A simple block allocator: a free list of the cache's blocks, the reserved one excluded."""

from __future__ import annotations

from .errors import CapacityError


class BlockAllocator:
    """Hands out cache blocks 0..num_blocks-1; the dummy block (num_blocks) is never given."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(
                f"{n} cache blocks asked for, {len(self._free)} of {self.num_blocks} free. "
                "Give the model more blocks (num_blocks) or run fewer sequences at once."
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Give blocks back; a block that is not handed out is an error (a double free would
        let two sequences share a block and overwrite each other's keys and values)."""
        stray = [b for b in blocks if b not in self._used]
        if stray:
            raise CapacityError(f"blocks {stray} released but not allocated (double free).")
        self._used.difference_update(blocks)
        self._free.extend(reversed(blocks))
