"""The forward a GraphModel's executor runs: the model's own, on one flattened batch row."""

from __future__ import annotations

from typing import Any

import torch

from .attention import Answer, bound
from .spec import ModelSpec


class ModelForward:
    """`forward(input_ids, positions) -> logits`, both [tokens]: all of a step's tokens, from
    every sequence, through the model as batch 1, with position_ids from the step.

    It holds the model and the binding, never the GraphModel, so a GraphModel nobody closed
    is still collected (and its finalizer runs).
    """

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.model, self.spec = model, spec
        self.binding: Answer | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.binding is not None
        return self.run(self.binding, input_ids, positions)

    def run(self, answer: Answer, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """One forward whose attention calls `answer` takes (a step's binding, the probe)."""
        ids = input_ids.unsqueeze(0)
        with bound(answer):
            out = self.model(
                input_ids=ids,
                position_ids=self.position_ids(input_ids, positions).unsqueeze(0),
                # given, so transformers never reads the ids on the host to guess whether
                # they are padded; "xgraph" has no mask function, so no mask is built
                attention_mask=torch.ones_like(ids),
                use_cache=False,
            )
        return out.logits[0]

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the model's embeddings expect. RoBERTa-style embeddings number tokens from
        padding_idx + 1 and give padding tokens padding_idx (what transformers does when it
        is given no position ids); `positions` then counts, for each token, the tokens
        before it in its sequence that are not padding (the generation loop does)."""
        pad = self.spec.pad_position
        if pad is None:
            return positions
        return torch.where(input_ids == pad, pad, positions + pad + 1)
