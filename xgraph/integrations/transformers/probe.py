"""Before the first step: one eager forward that shows what every attention call does.

A config does not say everything: a layer may call attention twice (DiffLlama), a model
may run its layers in a loop (Dory, HRM), pass a mask of its own (Doge's learned bias),
attend bidirectionally, or hand over layers whose heads differ from layer to layer.
GraphModel runs its forward once on a few tokens with every attention call answered here
(plain causal attention over the call's own keys and values, no cache) and records the
calls in order. That list sizes the cache: one layer per call, in the call's own heads,
head size and dtype. Whatever the paged runners would compute differently is refused
now, naming the module and the reason, before anything is allocated or any step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .decode_check import check_decode
from .errors import UnsupportedModelError
from .spec import ModelSpec

# keyword arguments that change what attention computes and that the paged runners do not do
UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the forward, in order; the cache gives it a layer of its own."""

    index: int
    where: str  # "call 3: model.layers.1.self_attn (LlamaAttention)"
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    module: Any = field(repr=False, compare=False)


class Probe:
    """Answers the attention calls of the probe forward: checks and records each one."""

    def __init__(self, spec: ModelSpec, model: Any, max_model_len: int, tokens: int) -> None:
        self.spec, self.max_model_len, self.tokens = spec, max_model_len, tokens
        self.names = {id(m): n for n, m in model.named_modules()}
        self.is_decoder = getattr(model.config, "is_decoder", None)
        self.calls: list[AttentionCall] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # each call's keys and values

    def begin(self) -> None:
        self.calls, self.kv = [], []

    def end(self) -> None:
        if not self.calls:
            raise self.spec.refuse(
                "its attention does not go through transformers' AttentionInterface: its "
                "forward made no attention call through the 'xgraph' implementation, so its "
                "attention would bypass xgraph's paged cache"
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
        name = self.names.get(id(module), "?")
        where = f"attention call {len(self.calls)} ({name}, {type(module).__name__})"
        self._check_shapes(where, q, k, v)
        self._check_kind(where, module, kwargs)
        self._check_mask(where, mask)
        self.calls.append(
            AttentionCall(len(self.calls), where, k.shape[1], k.shape[3], k.dtype, module)
        )
        self.kv.append((k, v))
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, 1),
            v.repeat_interleave(groups, 1),
            is_causal=True,
            scale=scaling,
        )
        return out.transpose(1, 2)  # [1, tokens, heads, dim], as transformers' functions

    def _refuse(self, where: str, reason: str, hint: str = "") -> UnsupportedModelError:
        return self.spec.refuse(f"{where} {reason}", hint)

    def _check_shapes(self, where: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
            raise self._refuse(where, f"hands over {shapes}, not [1, heads, tokens, dim]")
        if {q.shape[2], k.shape[2], v.shape[2]} != {self.tokens}:
            raise self._refuse(
                where,
                f"attends over other tokens than the forward's {self.tokens} ({shapes}): "
                "keys it keeps itself (a memory, a past, cross-attention) are not in the "
                "paged cache",
            )
        if k.shape[1] != v.shape[1] or not q.shape[3] == k.shape[3] == v.shape[3]:
            raise self._refuse(
                where,
                f"hands over {shapes}: queries, keys and values of different sizes, and "
                "the paged cache stores keys and values at one head size",
            )
        if q.shape[1] % k.shape[1]:
            raise self._refuse(
                where, f"has {q.shape[1]} query heads for {k.shape[1]} kv heads ({shapes})"
            )
        if not q.dtype == k.dtype == v.dtype:
            raise self._refuse(
                where, f"hands over q, k, v in {q.dtype}, {k.dtype}, {v.dtype}: one dtype only"
            )

    def _check_kind(self, where: str, module: Any, kwargs: dict[str, Any]) -> None:
        window = kwargs.get("sliding_window")
        if window is not None and not (isinstance(window, int) and window >= self.max_model_len):
            raise self._refuse(
                where,
                f"uses a sliding window of {window} tokens, shorter than max_model_len="
                f"{self.max_model_len}",
                f"Build it with max_model_len <= {window}: the window then never cuts a sequence.",
            )
        bad = [f"{w} ({n}=)" for n, w in UNSUPPORTED_KWARGS.items() if kwargs.get(n) is not None]
        if bad:
            raise self._refuse(
                where, f"asks for {', '.join(bad)}, which the paged runners do not compute"
            )
        if kwargs.get("dropout"):
            raise self._refuse(
                where,
                f"asks for dropout={kwargs['dropout']}",
                "Put the model in eval mode (model.eval()).",
            )
        causal = kwargs.get("is_causal")
        if not (causal if causal is not None else getattr(module, "is_causal", True)):
            hint = (
                "Build it as a decoder (is_decoder=True in its config)."
                if self.is_decoder is False
                else ""
            )
            raise self._refuse(
                where,
                "is bidirectional (is_causal is False); the paged runners compute causal "
                "attention only",
                hint,
            )

    def _check_mask(self, where: str, mask: Any) -> None:
        """A mask that is plain causal is what the runners compute; anything else is not."""
        if mask is None:
            return
        n = self.tokens
        causal = torch.ones(n, n, dtype=torch.bool, device=getattr(mask, "device", None)).tril()
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (n, n):
            if mask.dtype == torch.bool:
                plain = bool(torch.equal(mask, causal.expand_as(mask)))
            else:
                masked = mask.masked_select(~causal.expand_as(mask))
                plain = bool(
                    torch.equal(mask == 0, causal.expand_as(mask))
                    and (masked < torch.finfo(mask.dtype).min / 2).all()
                )
            if plain:
                return
        raise self._refuse(
            where,
            f"passes an attention mask of its own ({type(mask).__name__} "
            f"{tuple(getattr(mask, 'shape', ()))}) that is not plain causal: a learned "
            "bias or a pattern the paged runners do not compute",
        )


def probe(
    forward: Callable[[Any, torch.Tensor, torch.Tensor], Any],
    spec: ModelSpec,
    model: Any,
    max_model_len: int,
    device: torch.device,
) -> tuple[AttentionCall, ...]:
    """Run `forward(answer, input_ids, positions)` on a few tokens, then on the last one
    alone as a decode step would (decode_check.py); the attention calls it made."""
    n = min(4, max_model_len)
    ids = torch.arange(1, n + 1, device=device) % spec.vocab_size
    positions = torch.arange(n, device=device)
    p = Probe(spec, model, max_model_len, n)
    with torch.no_grad():
        logits = forward(p, ids, positions)
        if n > 1:
            check_decode(forward, p, logits, ids, positions)
    return tuple(p.calls)
