"""Choosing the next token from a step's last-token logits, on the device: greedy, or
sampled with temperature, top-k and top-p from a seeded generator.

`Sampler` takes the logits of the rows that sample and each row's SamplingParams, and
returns the chosen ids as one device tensor: rows that share their params are chosen
together (argmax, or one `torch.multinomial` drawn from the generator of their seed), so
a batch of one kind of request costs a handful of kernels whatever its size. `HostTokens`
brings them to the host with one non-blocking copy into pinned memory and an event: the
one host sync of a step, which the loop waits on only once it has done its own host work.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
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
    """Picks one token per row of [rows, vocab] logits, on the logits' device.

    Each seed has one generator, made at its first use and kept: the draws of a run are
    reproducible for the same prompts, parameters and order of arrival.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[int, torch.Generator] = {}

    def generator(self, seed: int) -> torch.Generator:
        g = self.generators.get(seed)
        if g is None:
            g = self.generators[seed] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    def __call__(
        self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]
    ) -> torch.Tensor:
        """Token ids [rows] (int64, on the logits' device); `params`: one for every row, or
        one per row."""
        if isinstance(params, SamplingParams):
            return self._choose(logits, params)
        groups: dict[SamplingParams, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(check_params(p), []).append(i)
        if len(groups) == 1:
            return self._choose(logits, next(iter(groups)))
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for p, rows in groups.items():
            index = device_index(rows, logits.device)
            out.index_copy_(0, index, self._choose(logits.index_select(0, index), p))
        return out

    def _choose(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        if p.greedy:
            return logits.argmax(-1)
        x = logits.float() / p.temperature
        if p.top_k and p.top_k < x.shape[-1]:
            kth = x.topk(p.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1:
            x = _nucleus(x, p.top_p)
        probs = x.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator(p.seed)).squeeze(1)


def check_params(params: object) -> SamplingParams:
    """`params` if it is a SamplingParams, else an InputError saying what to pass."""
    if not isinstance(params, SamplingParams):
        raise InputError(
            f"sampling={params!r}; give a SamplingParams(temperature=..., top_k=..., "
            "top_p=..., seed=...)."
        )
    return params


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on `device` without a host sync: a pinned copy, sent non-blocking (a
    pageable one would wait for the device to finish everything queued before it)."""
    index = torch.tensor(rows, dtype=torch.int64, device="cpu")
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


class HostTokens:
    """Token ids on their way to the host: one non-blocking copy into pinned memory and an
    event, started at once; `get()` waits for it (the step's one host sync)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(
                tokens.shape, dtype=tokens.dtype, device="cpu", pin_memory=True
            )
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # the CPU backend, or a device whose copies torch orders itself
            self._host = tokens.to("cpu")

    def get(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, the most likely tokens until their probabilities reach top_p (the
    most likely one always)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    before = sorted_x.softmax(-1).cumsum(-1) - sorted_x.softmax(-1)  # mass ahead of each
    drop = before >= top_p
    drop[:, 0] = False
    return x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
