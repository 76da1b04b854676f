"""How much a GraphModel serves at once: the numbers its cache and buffers are sized from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import CapacityError
from .spec import ModelSpec

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Limits:
    """How much the model serves at once; every buffer and the cache are sized from these.

    max_model_len: longest sequence, prompt and generated tokens together (default: the
        config's max_position_embeddings, at most 2048).
    max_seqs: sequences running at once (decode batch).
    num_blocks: cache blocks besides the reserved one (default: max_seqs full sequences).
    max_num_tokens: tokens per step (prefill chunk budget) and the largest bucket.
    """

    block_size: int = 16
    max_model_len: int | None = None
    max_seqs: int = 8
    num_blocks: int | None = None
    max_num_tokens: int = 256

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None
        return -(-self.max_model_len // self.block_size)

    def resolve(self, spec: ModelSpec) -> Limits:
        """Defaults filled in from the model; nonsensical values refused."""
        length = self.max_model_len or min(
            spec.max_position or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN
        )
        out = dataclasses.replace(self, max_model_len=length)
        if out.num_blocks is None:
            out = dataclasses.replace(out, num_blocks=out.max_seqs * out.max_blocks_per_seq)
        for field in dataclasses.fields(out):
            if getattr(out, field.name) < 1:
                raise CapacityError(
                    f"{spec.name}: {field.name} must be >= 1, got {getattr(out, field.name)}."
                )
        if spec.max_position is not None and length > spec.max_position:
            skipped = (
                f" (max_position_embeddings less the first {spec.pad_position + 1}, which "
                "its embeddings skip)"
                if spec.pad_position is not None
                else " (max_position_embeddings)"
            )
            raise CapacityError(
                f"{spec.name}: max_model_len={length} is above the {spec.max_position} "
                f"positions the model's position embeddings hold{skipped}; lower it."
            )
        spec.check_context(length)
        return out
