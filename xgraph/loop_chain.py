"""Queued multi-step launches: the next launch starts from the state the last one left on
the device, so the host reads one launch's tokens back while the next one runs.

    first = loop.launch(ids, pos, attn, budget=[64], stop_ids=[[eos]])
    second = first.then()          # queued behind it: no host read in between
    tokens = first.result().tokens  # the host waits for the first launch only
    tokens += second.result().tokens

A launch of xgraph.decode_loop ends with every sequence's state as its feedback left it:
the next input id (the last chosen token), position, seq_len, cache slot and block-table
row, and the budget it has left (0 once it finished). `then()` stages those device tensors
as the next launch's inputs, through the same executor and graphs, without reading them on
the host: two chained launches of K steps give the tokens one launch of 2K steps would.
A sequence that finished in an earlier launch of the chain starts finished (budget 0) and
writes only the dummy slot; its result reports no tokens and the reason it finished with.

The launch's outputs are copied into a tensor of its own right after the replay (graph
memory is shared, so a later replay may overwrite the graph's outputs), and from there,
without blocking, into pinned host memory: `result()` waits for that copy only.

The state metadata is the launch's own, derived on the device from metadata the executor
checked and blocks the host checked (xgraph.metadata.LaunchState): it is staged as given.
What the host cannot read without waiting it bounds instead: the positions a chained
launch can feed (at most K more per launch, never past the first launch's budget) are
checked against the model's bound before it is queued, and its free blocks must be new to
the chain. Chained launches run full graphs only (`mode="full"`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .errors import InputError, XGraphError
from .loop_launch import LoopResult, unpack
from .metadata import LaunchState

# the columns of a launch's state output, [n, 5] int64 (xgraph.decode_loop)
STATE = ("input_ids", "positions", "budget", "seq_lens", "slot_mapping")


@dataclass(frozen=True)
class Chain:
    """What the host knows of a launch without reading it back: its sequences, the chain's
    first positions and budgets (what bounds every later launch), how deep in the chain it
    is, and the host inputs every launch of the chain reuses."""

    n: int
    steps: int
    first_pos: np.ndarray
    first_budget: np.ndarray
    depth: int
    reused: dict[str, torch.Tensor]  # stop ids, sampling parameters: host tensors
    free: frozenset[int]  # every block handed to a launch of the chain so far

    def worst_position(self) -> int:
        """The highest position a launch at this depth can feed."""
        fed = np.minimum(self.first_budget, (self.depth + 1) * self.steps)
        return int((self.first_pos + fed - 1).max())


def pack(out: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """A launch's outputs as one int64 tensor of its own: tokens, generated, reasons, block
    tables, then the state (n x 5), each cut to the n real sequences."""
    tokens, generated, reasons, tables, state = out
    parts = [tokens[:n], generated[:n], reasons[:n], tables[:n], state[:n]]
    return torch.cat([p.reshape(-1).long() for p in parts])


def _host_copy(flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The flat outputs on their way to the host: (host tensor, event to wait on or None)."""
    if flat.device.type == "cpu":
        return flat, None
    try:
        host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=True)
    except RuntimeError:  # no pinned memory on this platform: the copy blocks instead
        host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu")
    host.copy_(flat, non_blocking=True)
    event = torch.Event(device=flat.device)
    event.record()
    return host, event


class Launch:
    """One queued launch of a DecodeLoop: `result()` reads it back, `then()` queues the next.

    Made by `DecodeLoop.launch` and `Launch.then`; see the module docstring."""

    def __init__(
        self,
        queue: Callable[..., Launch],
        out: tuple[torch.Tensor, ...],
        chain: Chain,
        before: Sequence[Sequence[int]] | Launch,
        dummy_block: int,
        width: int,
    ) -> None:
        self._queue, self.chain = queue, chain
        self._flat = pack(out, chain.n)
        self._host, self._event = _host_copy(self._flat)
        self._before = before
        self._dummy, self._width = dummy_block, width
        self._result: LoopResult | None = None
        self._followed = False

    def result(self) -> LoopResult:
        """The launch's tokens on the host (waits for this launch only; read once, kept)."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            before, prior = self._before, None
            if isinstance(before, Launch):
                prior = before.result()
                before = prior.tables
            c = self.chain
            r = unpack(self._host, c.n, c.steps, self._width, before, self._dummy)
            if prior is not None:  # finished earlier in the chain: say why, as then
                r.reasons = [p if p is not None else w for p, w in zip(prior.reasons, r.reasons)]
            self._result, self._before = r, []  # the chain's earlier launches can go
        return self._result

    def then(self, free_blocks: Sequence[int] = ()) -> Launch:
        """Queue the next launch of these sequences from the state this one leaves on the
        device; `free_blocks` are blocks it may give, none handed to the chain before."""
        c = self.chain
        if self._followed:  # two launches from one state could give one block twice
            raise XGraphError(
                "DecodeLoop: this launch was followed already (Launch.then); queue the next "
                "launch behind the one that call returned."
            )
        free = [int(b) for b in free_blocks]
        reused = sorted(c.free.intersection(free))
        if reused:
            raise InputError(
                f"DecodeLoop: free_blocks {reused} were handed to an earlier launch of this "
                "chain, which may have given them; give blocks new to the chain."
            )
        nxt = replace(c, depth=c.depth + 1, free=c.free | frozenset(free))
        state = self._flat[-5 * c.n :].view(c.n, 5)  # a launch has one sequence at least
        tables = self._flat[-(5 + self._width) * c.n : -5 * c.n]
        col = {name: state[:, i] for i, name in enumerate(STATE)}
        attn = LaunchState(
            [1] * c.n,
            col["seq_lens"],
            tables.view(c.n, self._width).to(torch.int32),
            col["slot_mapping"],
        )
        x = {"input_ids": col["input_ids"], "positions": col["positions"], "budget": col["budget"]}
        launch = self._queue(nxt, attn, x, free, self)
        self._followed = True
        return launch


def refuse_eager(name: str) -> XGraphError:
    return XGraphError(
        f"{name}: chained launches (Launch.then) run full graphs; this loop has mode='eager'. "
        "Read the launch back (result()) and start the next with DecodeLoop.launch."
    )
