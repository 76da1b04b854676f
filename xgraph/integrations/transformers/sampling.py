"""Choosing the next token from a step's last-token logits: greedy, or sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import XGraphError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (argmax); above 0 samples from softmax(logits / temperature),
    restricted to the top_k most likely tokens when top_k > 0; seed makes it repeatable."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0:
            raise XGraphError(f"SamplingParams: temperature and top_k must be >= 0, got {self}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks one token per row of [rows, vocab] logits, on the logits' device."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
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
        probs = x.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1).tolist()
