"""Sampling on the device whose every draw is a function of (seed, position, token id).

A seeded draw here reads no generator state: the noise of token `v` at position `p` of a
sequence with seed `s` is a hash of (s, p, v), turned into a Gumbel variable, and the token
is the argmax of logits / temperature + noise over the tokens that top-k and top-p keep
(the Gumbel-max trick: that argmax is a draw from softmax(logits / temperature) over
them). So the same request draws the same tokens whether its steps run one per launch or
K per launch, in any batch, in any order of arrival; and the ops are plain tensor ops with
no host read and no generator, so they capture into any backend's graph.

The hash is a 32-bit integer mix computed in int64 with every product below 2**63 (the
multipliers are odd constants below 2**31), so CPU and GPU give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_M1, _M2, _M3 = 0x7FEB352D, 0x68E31DA5, 0x2C1B3C6D  # odd, < 2**31: no int64 overflow
_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    x = x ^ (x >> 16)
    x = (x * _M3) & _MASK
    return x ^ (x >> 15)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Uniform draws in (0, 1), float32 [rows, len(vocab)]: one per (row's seed, row's
    position, token id)."""
    s = _mix((seeds.long() & _MASK)[:, None] ^ 0x5BD1E995)
    p = _mix(s ^ (positions.long() & _MASK)[:, None])
    h = _mix(p ^ vocab.long()[None, :])
    # 24 bits: exact in float32; the half step keeps both ends out of the interval
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


Draws = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def gumbel(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: torch.Tensor, draws: Draws = uniform
) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, len(vocab)] of the draws of `uniform` (or of `draws`, the
    same function compiled: integer ops and exact conversions, so the same bits)."""
    return -torch.log(-torch.log(draws(seeds, positions, vocab)))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row (int64 [rows])."""
    return logits.argmax(-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab: torch.Tensor,
    draws: Draws = uniform,
) -> torch.Tensor:
    """One token per row of [rows, V] logits (int64 [rows]), each row with its own params:
    temperature 0 is greedy; above 0 a draw from softmax(logits / temperature) over the
    row's top_k most likely tokens (0: all) whose probability mass before them is below
    top_p (the most likely one always kept). `vocab` is arange(V) on the logits' device
    (made once by the caller); `positions` are the positions of the tokens being chosen;
    `draws` computes `uniform` (xgraph.loop_step passes it compiled)."""
    x = logits.float()
    hot = temperature > 0
    t = torch.where(hot, temperature, torch.ones_like(temperature)).float()
    x = x / t[:, None]
    ordered, order = x.sort(dim=-1, descending=True, stable=True)
    rank = vocab[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    keep = keep & ((before < top_p[:, None].float()) | (rank == 0))
    noise = gumbel(seeds, positions, vocab, draws).gather(1, order)  # each token keeps its own draw
    scored = torch.where(keep, ordered + noise, torch.full_like(ordered, float("-inf")))
    drawn = order.gather(1, scored.argmax(-1, keepdim=True))[:, 0]
    return torch.where(hot, drawn, greedy(logits))
