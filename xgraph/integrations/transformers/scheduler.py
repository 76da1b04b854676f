"""Sequences, admission and step building: what an engine's scheduler does, kept small.

Each step has a token budget (max_num_tokens). Sequences that are decoding get one token
each first, so decode latency does not wait behind long prompts; prompts then fill the rest
of the budget in admission order, a long prompt in chunks over several steps (chunked
prefill). A step where every sequence adds one token is a decode step (a full graph);
any other runs piecewise.

A sequence reserves every block it can need when it is admitted (its prompt plus its
token budget), so a running sequence never waits for memory and nothing is preempted;
sequences that do not fit wait until others finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ...metadata import AttentionInputs
from .allocator import BlockAllocator
from .cache import PagedCache
from .sampling import SamplingParams


@dataclass
class SeqState:
    """One request: its tokens so far, how many are in the cache, and its blocks."""

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    done: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)  # recorded rows, when asked
    # counted[i]: tokens before token i that are not `skip` (for models that skip padding)
    counted: list[int] = field(default_factory=lambda: [0])
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: frozenset[int] = frozenset()  # token ids that end it (end of sequence, ...)
    arrival: float = 0.0  # when it was added (host clock)
    token_times: list[float] = field(default_factory=list)  # when each token reached the host
    finish_reason: str = ""  # "stop" (a stop token) or "length" (max_new_tokens)

    @property
    def pending(self) -> int:
        """Tokens not yet run through the model (the prompt's rest, or the last sampled)."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def max_kv_len(self) -> int:
        """Cache slots it can need: the last generated token is never run through the model."""
        return self.prompt_len + self.max_new_tokens - 1

    def blocks_needed(self, block_size: int) -> int:
        return -(-self.max_kv_len // block_size)

    def positions(self, start: int, n: int, skip: int | None) -> list[int]:
        """Position inputs of tokens [start, start + n): their indices, or, with `skip` (a
        padding id that the model's positions do not count), the tokens before each that
        are not padding."""
        if skip is None:
            return list(range(start, start + n))
        while len(self.counted) < start + n:
            i = len(self.counted) - 1
            self.counted.append(self.counted[i] + (self.tokens[i] != skip))
        return self.counted[start : start + n]


@dataclass
class Chunk:
    """The tokens a sequence runs in one step: rows [start, start + length) of the step."""

    seq: SeqState
    start: int
    length: int


@dataclass
class Batch:
    chunks: list[Chunk]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionInputs

    @property
    def is_decode(self) -> bool:
        return self.attn.is_decode


def admit(
    waiting: deque[SeqState],
    running: list[SeqState],
    allocator: BlockAllocator,
    max_seqs: int,
    block_size: int,
) -> None:
    """Move waiting sequences to running, in order, while seats and blocks last."""
    while waiting and len(running) < max_seqs:
        need = waiting[0].blocks_needed(block_size)
        if need > allocator.free:
            return
        seq = waiting.popleft()
        seq.blocks = allocator.allocate(need)
        running.append(seq)


def schedule(running: list[SeqState], budget: int) -> list[tuple[SeqState, int]]:
    """(sequence, tokens to run) for this step: decoding sequences first, then prompts."""
    plan: list[tuple[SeqState, int]] = []
    for seq in running:
        if budget and seq.computed >= seq.prompt_len and seq.pending == 1:
            plan.append((seq, 1))
            budget -= 1
    for seq in running:
        if budget and seq.computed < seq.prompt_len:
            n = min(seq.pending, budget)
            plan.append((seq, n))
            budget -= n
    return plan


def build_batch(
    plan: list[tuple[SeqState, int]], cache: PagedCache, skip: int | None = None
) -> Batch:
    """The step's flattened token ids and positions, and its paged attention inputs.

    Slots follow the block tables: token p of a sequence lives in block row[p // bs] at
    offset p % bs (the executor checks this). Positions are token indices, or with `skip`
    the count of earlier tokens that are not `skip` (see SeqState.positions)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    chunks: list[Chunk] = []
    for seq, n in plan:
        chunks.append(Chunk(seq, len(ids), n))
        span = range(seq.computed, seq.computed + n)
        ids.extend(seq.tokens[seq.computed : seq.computed + n])
        positions.extend(seq.positions(seq.computed, n, skip))
        slots.extend(cache.slot(seq.blocks, p) for p in span)
    attn = AttentionInputs(
        query_lens=[n for _, n in plan],
        seq_lens=[seq.computed + n for seq, n in plan],
        block_tables=[seq.blocks for seq, _ in plan],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cpu"),
    )
    return Batch(
        chunks,
        torch.tensor(ids, dtype=torch.int64, device="cpu"),
        torch.tensor(positions, dtype=torch.int64, device="cpu"),
        attn,
    )
