"""What a multi-step launch does after each decode step: choose the tokens, advance the step
feedback; eagerly, or compiled into a few kernels where the caller compiled the model.

Eagerly, the choice and the feedback (xgraph.feedback.advance) are a few dozen small tensor
ops per step, each its own kernel inside the launch's graph. With a compiler (a torch.compile
backend: "inductor" where the model's decoder runs under Inductor), `StepTail` runs them as
one compiled function over the launch's static buffers (xgraph.compiled.TokenCompiled: the
sequence count dynamic, one compile for every bucket of 2 or more, one for 1):

- greedy: the argmax of the logits (in two stages, xgraph.row_argmax: a compiled argmax
  reduces each row in one program) and the feedback, one compiled function;
- seeded sampling: the draws' integer hash (device_sampling.uniform) compiled, the float
  part of the draw (temperature, top-k / top-p over the sorted logits, the Gumbel noise)
  eager, then the feedback compiled. The float part stays eager so the tokens are the
  single-step sampler's on every device: a compiled softmax, cumsum or log may round
  differently from the eager kernels, and a draw at a near-tie would then change.

The compiled code computes the same bits: integer ops, an argmax whose ties go to the lowest
index (torch's rule), and the uniform draw's exact conversions. Under a dispatch mode (the
CPU backend's recordings) TokenCompiled runs the eager functions, the same ops. A compiler
failure falls back to the eager function with a warning (TokenCompiled).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .compiled import TokenCompiled
from .device_sampling import greedy, sample, uniform
from .feedback import Feedback, advance
from .row_argmax import row_argmax


def choose_greedy(
    logits: torch.Tensor, *state: torch.Tensor, split: bool = False, **layout: int
) -> Any:
    """The argmax of each row (in two stages where `split`: xgraph.row_argmax, the same
    bits), then the feedback (`advance` on the rest)."""
    return advance(row_argmax(logits) if split else greedy(logits), *state, **layout)


class StepTail:
    """The choice and the feedback after each step of a launch (module docstring).

    Args:
        block_size, dummy_block, dummy_slot: the cache's paging layout (PagedAttention).
        compiler: None (eager), or the torch.compile backend to run them under.
        max_seqs: the most sequences of a launch (the loop's largest bucket).
        name: names the compiled functions (and their warnings).
    """

    def __init__(
        self,
        *,
        block_size: int,
        dummy_block: int,
        dummy_slot: int,
        compiler: str | Callable[..., Any] | None = None,
        max_seqs: int = 256,
        name: str = "decode-loop",
    ) -> None:
        self.layout = (block_size, dummy_block, dummy_slot)
        layout = dict(block_size=block_size, dummy_block=dummy_block, dummy_slot=dummy_slot)
        # compiled, a row's argmax is one program: split it (xgraph.row_argmax)
        split = compiler is not None
        self.greedy: Callable[..., Any] = functools.partial(choose_greedy, split=split, **layout)
        self.advance: Callable[..., Any] = functools.partial(advance, **layout)
        self.draws: Callable[..., Any] = uniform
        self.compiled: dict[str, TokenCompiled] = {}
        if compiler is not None:
            for part in ("greedy", "advance", "draws"):
                fn = TokenCompiled(
                    getattr(self, part), max_seqs, backend=compiler, name=f"{name}-{part}"
                )
                self.compiled[part] = fn
                setattr(self, part, fn)

    def choose_greedy(self, logits: torch.Tensor, fb: Feedback) -> torch.Tensor:
        """The step's greedy tokens, the feedback advanced; the tokens as reported."""
        return fb.advance(logits, self.greedy)

    def choose_sampled(
        self,
        logits: torch.Tensor,
        fb: Feedback,
        params: tuple[torch.Tensor, ...],
        vocab: torch.Tensor,
    ) -> torch.Tensor:
        """The step's drawn tokens (params: temperature, top_k, top_p, seeds), the feedback
        advanced; the tokens as reported."""
        positions = fb.buf.positions + 1  # where the chosen tokens will stand
        tokens = sample(logits, *params, positions, vocab, self.draws)
        return fb.advance(tokens, self.advance)

    def stats(self) -> dict[str, Any] | None:
        """Each compiled part's stats (TokenCompiled.stats), or None when eager."""
        if not self.compiled:
            return None
        return {part: fn.stats() for part, fn in self.compiled.items()}
