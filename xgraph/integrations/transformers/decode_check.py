"""The probe's second forward: its last token alone, its earlier ones through the cache.

xgraph runs a step's tokens, from every sequence, through the model as one flattened row,
and a decode step holds one token of each sequence: only attention may see other tokens,
through the cache. A model that mixes tokens anywhere else (a convolution or a token
shift over the sequence, routing that depends on the batch) would run and differ. So the
probe runs its last token once more on its own, each attention call answered over the
keys and values the first forward recorded for the earlier tokens plus its own: the
logits must be those the first forward gave that token, or the model is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class DecodeProbe:
    """Answers the decode forward's calls from the first forward's keys and values.

    `first` is the probe.Probe of the first forward (its calls, kv, spec and tokens); not
    imported, since probe.py runs this check."""

    def __init__(self, first: Any) -> None:
        self.first = first
        self.count = 0

    def begin(self) -> None:
        self.count = 0

    def end(self) -> None:
        if self.count != len(self.first.calls):
            raise self._differ(f"{self.count} attention calls, not {len(self.first.calls)}")

    def _differ(self, what: str) -> Exception:
        return self.first.spec.refuse(
            f"its forward of one token made {what} as the forward of {self.first.tokens} "
            "tokens did: its attention calls depend on the number of tokens"
        )

    def attend(
        self,
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        i = self.count
        self.count += 1
        calls = self.first.calls
        if i >= len(calls) or calls[i].module is not module or k.shape[2] != 1:
            raise self._differ(f"attention call {i} from {type(module).__name__}, not the same")
        past_k, past_v = self.first.kv[i]
        keys = torch.cat([past_k[:, :, :-1], k], dim=2)
        values = torch.cat([past_v[:, :, :-1], v], dim=2)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), scale=scaling
        )
        return out.transpose(1, 2)


def check_decode(
    forward: Callable[[Any, torch.Tensor, torch.Tensor], Any],
    first: Any,
    logits: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Refuse a model whose last probe token gets other logits as a decode step."""
    alone = forward(DecodeProbe(first), ids[-1:], positions[-1:])
    want, got = logits[-1].float(), alone[-1].float()
    # float32 runs agree closely; 16-bit ones round the two ways differently
    tolerance = (1e-3 if logits.dtype == torch.float32 else 5e-2) * (1 + float(want.abs().max()))
    apart = float((want - got).abs().max())
    if not apart <= tolerance:  # NaN too
        raise first.spec.refuse(
            f"its last probe token gets logits {apart:.3g} apart (more than {tolerance:.3g}) "
            f"when its {first.tokens - 1} earlier tokens come through the cache, as in a "
            "decode step, instead of running in the same forward: something outside "
            "attention mixes tokens or positions (a convolution or token shift over "
            "the sequence, routing that depends on the batch, an attention layer that does "
            "not go through transformers' AttentionInterface, positions not taken from "
            "position_ids), which a step of many sequences' tokens would get wrong"
        )
