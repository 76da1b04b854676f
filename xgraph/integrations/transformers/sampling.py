"""Choosing the next token from a step's last-token logits: greedy, or sampled."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ...errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (argmax); above 0 samples from softmax(logits / temperature),
    restricted to the top_k most likely tokens when top_k > 0 and to the smallest set of
    most likely tokens whose probabilities reach top_p when top_p < 1; seed makes it
    repeatable. A value outside those ranges is an InputError naming it."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _real(t) or not (math.isfinite(t) and t >= 0):
            raise InputError(
                f"SamplingParams: temperature={t!r}; give a finite number >= 0 "
                "(0: greedy, 1: the model's distribution)."
            )
        if not _integer(k) or k < 0:
            raise InputError(f"SamplingParams: top_k={k!r}; give an int >= 0 (0: every token).")
        if not _real(p) or not 0 < p <= 1:
            raise InputError(
                f"SamplingParams: top_p={p!r}; give a number in (0, 1] (1: every token)."
            )
        if not _integer(self.seed):
            raise InputError(f"SamplingParams: seed={self.seed!r}; give an int.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class Sampler:
    """Picks one token per row of [rows, vocab] logits, on the logits' device."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        if not isinstance(params, SamplingParams):
            raise InputError(
                f"sampling={params!r}; give a SamplingParams(temperature=..., top_k=..., "
                "top_p=..., seed=...)."
            )
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> list[int]:
        p = self.params
        if p.greedy:
            return logits.argmax(-1).tolist()  # one host read per step, outside the forward
        x = logits.float() / p.temperature
        if p.top_k and p.top_k < x.shape[-1]:
            kth = x.topk(p.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1:
            x = _nucleus(x, p.top_p)
        probs = x.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1).tolist()


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, the most likely tokens until their probabilities reach top_p (the
    most likely one always)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    before = sorted_x.softmax(-1).cumsum(-1) - sorted_x.softmax(-1)  # mass ahead of each
    drop = before >= top_p
    drop[:, 0] = False
    return x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
