"""What `generate` takes as prompts: a list of prompts, each a list of token ids.

Accepted: a list (or tuple) whose items are lists or tuples of ints, or 1-D integer
tensors. Refused with an InputError that says what to pass instead: a string (text is
tokenized first), a tensor as the whole argument (a 2-D batch may hold padding, which
would be generated from), a flat list of ints (one prompt or many one-token prompts?),
ids that are not ints or lie outside the vocabulary.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import InputError

EXPECTED = "prompts must be a list of prompts, each a list of token ids: [[1, 2, 3], [4, 5]]"


def token_lists(prompts: Any, vocab_size: int) -> list[list[int]]:
    """`prompts` as lists of ints within [0, vocab_size), or InputError saying why not."""
    if isinstance(prompts, (str, bytes)):
        raise InputError(
            f"{EXPECTED}; got a string. Tokenize text first (gm.tokenizer.encode(text))."
        )
    if isinstance(prompts, torch.Tensor):
        raise InputError(
            f"{EXPECTED}; got a {prompts.dim()}-D tensor. For rows without padding pass "
            "prompts.tolist() (a 1-D tensor: [prompt.tolist()])."
        )
    if not isinstance(prompts, Sequence):
        raise InputError(f"{EXPECTED}; got {type(prompts).__name__}.")
    if prompts and all(_is_int(x) for x in prompts):
        raise InputError(
            f"{EXPECTED}; got a flat list of {len(prompts)} ints. Wrap one prompt in a "
            f"list: [{list(prompts)[:3]}...]."
        )
    return [_one(i, p, vocab_size) for i, p in enumerate(prompts)]


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _one(i: int, prompt: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise InputError(
                f"prompt {i} is a {prompt.dim()}-D {prompt.dtype} tensor; a prompt tensor "
                "must be 1-D integer token ids."
            )
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)):
        raise InputError(
            f"prompt {i} is a string; {EXPECTED}. Tokenize text first (gm.tokenizer.encode(text))."
        )
    if not isinstance(prompt, Sequence):
        raise InputError(f"prompt {i} is {type(prompt).__name__}; {EXPECTED}.")
    for j, t in enumerate(prompt):
        if not _is_int(t):
            raise InputError(f"prompt {i}, token {j} is {t!r}; token ids are ints.")
        if not 0 <= t < vocab_size:
            raise InputError(
                f"prompt {i}, token {j} is {t}, outside the model's vocabulary [0, {vocab_size})."
            )
    return [int(t) for t in prompt]
