"""The LM head outside the graphs: logits only for the rows that sample.

A causal LM is a decoder (transformers' base model: embeddings, layers, final norm) and a
head (`lm_head`, and for some families a scaling after it). Engines run the decoder for
every token and the head only for the rows whose next token is chosen: the last token of
each sequence's final prompt chunk, and every decode token. So the graphs hold the
decoder and return its final hidden states, and `Head` turns the chosen rows into logits
after the step (a prompt of 2048 tokens pays one row of the vocabulary projection, not
2048).

The split is checked before the first step, on the probe's tokens: the model's own logits
must equal the head applied to the decoder's hidden states. The scalings transformers'
families apply after the projection are applied the same way (Gemma's
`final_logit_softcapping`, Cohere's `logit_scale`, Granite's `logits_scaling`); a model
whose logits are something else (an MLM head over a decoder, another scaling) keeps the
head inside the graphs, with logits for every token, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("xgraph")


def _scalings(model: Any) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """What the family's forward does to the projected logits, in its order."""
    config = model.config
    out: list[Callable[[torch.Tensor], torch.Tensor]] = []
    scale = getattr(model, "logit_scale", None)  # Cohere: logits * logit_scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        out.append(lambda x: x * scale)
    divisor = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor != 1:
        out.append(lambda x: x / divisor)
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma: tanh(x / cap) * cap
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
        out.append(lambda x: torch.tanh(x / cap) * cap)
    return out


class Head:
    """`head(hidden [rows, hidden]) -> logits [rows, vocab]`: the model's LM head."""

    def __init__(self, decoder: Any, projection: Any, model: Any) -> None:
        self.decoder, self.projection = decoder, projection
        self.scalings = _scalings(model)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projection(hidden)
        for scale in self.scalings:
            logits = scale(logits)
        return logits


def _parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, projection): the base model and the output embeddings, when both exist."""
    decoder = getattr(model, "base_model", None)
    try:
        projection = model.get_output_embeddings()
    except Exception:  # families without output embeddings raise
        return None
    if decoder is None or decoder is model or not isinstance(projection, torch.nn.Module):
        return None
    return decoder, projection


def split_head(
    full: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor],
    model: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
) -> Head | None:
    """The model's Head if its logits are the head over the decoder's hidden states on the
    probe's tokens (`full(ids, positions)`: the model's logits; `hidden(decoder, ids,
    positions)`: the decoder's), else None (the head stays inside the graphs)."""
    parts = _parts(model)
    if parts is None:
        return None
    head = Head(*parts, model)
    try:
        with torch.no_grad():
            logits = full(ids, positions)
            got = head(hidden(head.decoder, ids, positions)).float()
    except Exception as exc:  # a base model that does not take these arguments
        logger.info("%s: the LM head stays in the graphs (%s)", type(model).__name__, exc)
        return None
    want = logits.float()
    # the same kernels on the same rows: equal, up to rounding in 16-bit
    bound = (1e-5 if logits.dtype == torch.float32 else 4e-3) * (1 + float(want.abs().max()))
    if got.shape != want.shape or not float((got - want).abs().max()) <= bound:
        logger.info(
            "%s: its logits are not its LM head over its decoder's hidden states; the head "
            "stays in the graphs (logits for every token)",
            type(model).__name__,
        )
        return None
    return head
