"""Choosing the next token from a step's last-token logits, on the device: greedy, or
sampled with temperature, top-k and top-p, seeded.

`Sampler` takes the logits of the rows that sample, each row's SamplingParams and the
position of the token it chooses, and returns the chosen ids as one device tensor: all
greedy, one argmax; otherwise one vectorized draw for every row whose randomness is a
function of (seed, position, token id) (xgraph.device_sampling). `HostTokens`
brings them to the host with one non-blocking copy into pinned memory and an event: the
one host sync of a step, which the loop waits on only once it has done its own host work.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...device_sampling import greedy, sample
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

    Greedy rows take the argmax; sampled rows a draw keyed by (seed, position, token id)
    (xgraph.device_sampling), so a request's tokens depend on its prompt, params and seed
    only: not on the batch it shares, the order of arrival, or how many decode steps run
    per launch (the engine's multi-step launches draw the same tokens).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._vocab: torch.Tensor | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        params: SamplingParams | Sequence[SamplingParams],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Token ids [rows] (int64, on the logits' device); `params`: one for every row, or
        one per row; `positions`: each row's position of the token being chosen (its index
        in its sequence)."""
        rows = logits.shape[0]
        ps = [check_params(params)] * rows if isinstance(params, SamplingParams) else None
        if ps is None:
            ps = [check_params(p) for p in params]
        if all(p.greedy for p in ps):
            return greedy(logits)
        ints = [[p.top_k for p in ps], [p.seed for p in ps], list(positions)]
        floats = [[p.temperature for p in ps], [p.top_p for p in ps]]
        i = device_tensor(ints, torch.int64, logits.device)
        f = device_tensor(floats, torch.float32, logits.device)
        if self._vocab is None or self._vocab.shape[0] != logits.shape[1]:
            self._vocab = torch.arange(logits.shape[1], device=logits.device)
        return sample(logits, f[0], i[0], f[1], i[1], i[2], self._vocab)


def check_params(params: object) -> SamplingParams:
    """`params` if it is a SamplingParams, else an InputError saying what to pass."""
    if not isinstance(params, SamplingParams):
        raise InputError(
            f"sampling={params!r}; give a SamplingParams(temperature=..., top_k=..., "
            "top_p=..., seed=...)."
        )
    return params


def device_tensor(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on `device` without a host sync: a pinned copy, sent non-blocking (a
    pageable one would wait for the device to finish everything queued before it)."""
    host = torch.tensor(values, dtype=dtype, device="cpu")
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on `device` without a host sync (device_tensor)."""
    return device_tensor(rows, torch.int64, device)


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
