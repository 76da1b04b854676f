"""`generate`: many prompts to the end through the Engine (engine.py), in one call.

Prefill (chunked when long), then greedy or sampled decode of many sequences at once,
over the executor, with a simple block allocator: decode steps replay full graphs, prefill
and mixed steps piecewise graphs (each key captured on its first step). The LM head runs
after each step on the rows that sample; sampling runs on the device, never inside the
captured forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ...errors import InputError
from .engine import Engine, TokenEvent
from .errors import CapacityError
from .prompts import token_lists
from .results import GenerationResult, StepModel, graph_step_counts
from .sampling import SamplingParams, check_params

__all__ = ["GenerationResult", "generate", "graph_step_counts", "stream"]


def _budgets(max_new_tokens: object, n: int) -> list[int]:
    """max_new_tokens per prompt: one int for all, or one int each."""
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
        return [max_new_tokens] * n
    items = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [None]
    if any(not isinstance(b, int) or isinstance(b, bool) for b in items):
        raise InputError(f"max_new_tokens={max_new_tokens!r}; give one int or one int per prompt.")
    return items


def _engine(
    gm: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams | None,
    **engine: Any,
) -> Engine:
    """An Engine holding every prompt; anything that could never run is refused first."""
    prompts = token_lists(prompts, gm.spec.vocab_size)
    budgets = _budgets(max_new_tokens, len(prompts))
    if len(budgets) != len(prompts) or min(budgets, default=1) < 1:
        raise CapacityError(
            f"max_new_tokens must be >= 1, one int or one per prompt; got "
            f"{max_new_tokens} for {len(prompts)} prompts."
        )
    params = check_params(sampling if sampling is not None else SamplingParams())
    e = Engine(gm, **engine)
    for p, new in zip(prompts, budgets):
        e.add(p, new, sampling=params)
    return e


def generate(
    gm: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 16,
    *,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    record_logits: bool = False,
    on_token: Callable[[TokenEvent], Any] | None = None,
    progress: bool = False,
    max_num_tokens: int | None = None,
    steps_per_launch: int = 1,
) -> GenerationResult:
    """Generate up to max_new_tokens (one int, or one per prompt) for every prompt (token
    ids); a sequence stops early at eos_token_id (one id or several) when given. Runs
    max_seqs sequences at once; the rest wait for a seat and blocks. `on_token` sees each
    token as it is chosen (streaming), `progress` shows a bar, `max_num_tokens` lowers the
    step's token budget (longer prompts then prefill in more chunks), `steps_per_launch`
    K > 1 runs decode as launches of K steps (Engine; the same tokens)."""
    e = _engine(
        gm,
        prompts,
        max_new_tokens,
        sampling,
        record_logits=record_logits,
        eos_token_id=eos_token_id,
        max_num_tokens=max_num_tokens,
        steps_per_launch=steps_per_launch,
    )
    return e.run(on_token, progress)


def stream(
    gm: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 16,
    *,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    steps_per_launch: int = 1,
) -> Iterator[TokenEvent]:
    """The tokens of `generate`, yielded as they are chosen: TokenEvent(index, token,
    finished); with `steps_per_launch` K > 1, K at a time."""
    e = _engine(
        gm,
        prompts,
        max_new_tokens,
        sampling,
        eos_token_id=eos_token_id,
        steps_per_launch=steps_per_launch,
    )
    yield from e.events()
