"""The forward a GraphModel's executor runs: the model's own, on one flattened batch row."""

from __future__ import annotations

from typing import Any

import torch

from .attention import Answer, bound
from .head import Head
from .spec import ModelSpec


class ModelForward:
    """`forward(input_ids, positions)`, both [tokens]: all of a step's tokens, from every
    sequence, through the model as batch 1, with position_ids from the step. It returns the
    decoder's final hidden states [tokens, hidden] when the LM head runs outside the graphs
    (`head`, head.py), else the model's logits [tokens, vocab].

    `compiled`, when set, runs the body instead of the plain one (the same function under
    torch.compile: xgraph.compiled.TokenCompiled). It holds the model and the binding,
    never the GraphModel, so a GraphModel nobody closed is still collected (and its
    finalizer runs).
    """

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.model, self.spec = model, spec
        self.binding: Answer | None = None
        self.head: Head | None = None
        self.compiled: Any = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.binding is not None
        with bound(self.binding):
            return (self.compiled or self.body)(input_ids, positions)

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What one step computes, its attention calls taken by the bound answer."""
        if self.head is None:
            return self.logits(input_ids, positions)
        return self.hidden(self.head.decoder, input_ids, positions)

    def run(self, answer: Answer, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """The model's logits, its attention calls taken by `answer` (the probe's)."""
        with bound(answer):
            return self.logits(input_ids, positions)

    def _kwargs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        ids = input_ids.unsqueeze(0)
        return dict(
            input_ids=ids,
            position_ids=self.position_ids(input_ids, positions).unsqueeze(0),
            # given, so transformers never reads the ids on the host to guess whether
            # they are padded; "xgraph" has no mask function, so no mask is built
            attention_mask=torch.ones_like(ids),
            use_cache=False,
        )

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(**self._kwargs(input_ids, positions)).logits[0]

    def hidden(self, decoder: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """The decoder's final hidden states [tokens, hidden]."""
        return decoder(**self._kwargs(input_ids, positions)).last_hidden_state[0]

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the model's embeddings expect. RoBERTa-style embeddings number tokens from
        padding_idx + 1 and give padding tokens padding_idx (what transformers does when it
        is given no position ids); `positions` then counts, for each token, the tokens
        before it in its sequence that are not padding (the generation loop does)."""
        pad = self.spec.pad_position
        if pad is None:
            return positions
        return torch.where(input_ids == pad, pad, positions + pad + 1)
