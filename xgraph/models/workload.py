"""Step generators and eager references shared by the benchmarks, the conformance suite and tests.

A `Workload` holds a reference model and its executor settings; `decode_step` and
`prefill_step` draw random batches over disjoint cache blocks; `eager` runs the model
without graphs on the same (optionally padded) batch, the reference the executor must match.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..attention import eager_attention
from ..buckets import Buckets, Input
from ..executor import GraphExecutor
from ..interfaces import AttentionRunner
from ..metadata import AttentionInputs
from ..paging import PagedAttention
from ..runners import PagedDecodeRunner, PagedPrefillRunner
from .qwen3 import Qwen3Model

# the token inputs without bounds; `Qwen3Model.inputs()` (what executors here use) adds them
TOKEN_INPUTS = [
    Input("input_ids", torch.int64, ("num_tokens",), fill=0),
    Input("positions", torch.int64, ("num_tokens",), fill=0),
]


@dataclass
class Step:
    """One step on the host: token inputs and attention inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionInputs

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def kwargs(self) -> dict:
        return {"input_ids": self.input_ids, "positions": self.positions, "attn": self.attn}

    def with_tensor_tables(self, width: int, fill: int) -> Step:
        """The same step with block tables as one int32 tensor and sequence lengths as an
        int32 tensor, the way engines keep them (slots are an int64 tensor already)."""
        a = self.attn
        seq_lens = torch.as_tensor(a.seq_lens, dtype=torch.int32)
        return Step(
            self.input_ids,
            self.positions,
            AttentionInputs(
                a.query_lens,
                seq_lens,
                a.table(fill, width),  # type: ignore[arg-type]
                a.slot_mapping,
            ),
        )


class Workload:
    """A model plus the paging layout its steps use (block tables of `max_blocks` columns)."""

    def __init__(self, model: Qwen3Model, max_blocks: int, max_seqs: int) -> None:
        self.model = model
        self.cache = model.kv_cache
        self.block_size = self.cache.block_size
        self.max_blocks = max_blocks
        self.max_seqs = max_seqs
        self.vocab = model.config.vocab_size

    @classmethod
    def tiny(
        cls,
        device: torch.device | str = "cpu",
        num_blocks: int = 128,
        block_size: int = 4,
        max_blocks: int = 8,
        max_seqs: int = 32,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> Workload:
        model = Qwen3Model.build(
            "tiny",
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
            seed=seed,
        )
        return cls(model, max_blocks, max_seqs)

    def attention(self, **kw: object) -> PagedAttention:
        return PagedAttention.for_cache(self.cache, self.max_seqs, self.max_blocks, **kw)

    def inputs(self) -> list[Input]:
        """The model's inputs with their bounds (`Qwen3Model.inputs`)."""
        return self.model.inputs()

    def executor(self, forward=None, **kw: object) -> GraphExecutor:  # type: ignore[no-untyped-def]
        kw.setdefault("attention", self.attention())
        return GraphExecutor(forward or self.model.forward_logits, inputs=self.inputs(), **kw)

    def randomize_cache(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.cache.tensors():
            t.copy_(
                torch.randn(t.shape, generator=g, dtype=torch.float32, device="cpu").to(t.dtype)
            )

    # -- steps -----------------------------------------------------------------------------

    def _layout(self, rng: random.Random, kv_lens: list[int]) -> list[list[int]]:
        """Disjoint random blocks for each sequence (no two sequences share a slot)."""
        need = [-(-n // self.block_size) for n in kv_lens]
        pool = list(range(self.cache.num_blocks))
        rng.shuffle(pool)
        if sum(need) > len(pool):
            raise ValueError("not enough cache blocks for this batch")
        rows, at = [], 0
        for n in need:
            rows.append(pool[at : at + n])
            at += n
        return rows

    def step(self, rng: random.Random, query_lens: list[int], kv_lens: list[int]) -> Step:
        """A batch where sequence i appends query_lens[i] tokens, ending at kv_lens[i]."""
        bs = self.block_size
        rows = self._layout(rng, kv_lens)
        ids, pos, slots = [], [], []
        for q, n, row in zip(query_lens, kv_lens, rows):
            for p in range(n - q, n):
                ids.append(rng.randrange(self.vocab))
                pos.append(p)
                slots.append(row[p // bs] * bs + p % bs)
        return Step(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(pos, dtype=torch.int64),
            AttentionInputs(
                list(query_lens), list(kv_lens), rows, torch.tensor(slots, dtype=torch.int64)
            ),
        )

    def decode_step(self, rng: random.Random, batch: int, max_context: int | None = None) -> Step:
        ctx = min(self.max_blocks * self.block_size, max_context or 1 << 30)
        return self.step(rng, [1] * batch, [rng.randint(1, ctx) for _ in range(batch)])

    def prefill_step(
        self, rng: random.Random, query_lens: list[int], kv_extra: list[int] | None = None
    ) -> Step:
        """Chunked prefill: each sequence adds query_lens[i] tokens after kv_extra[i] cached."""
        extra = kv_extra or [0] * len(query_lens)
        return self.step(rng, query_lens, [q + e for q, e in zip(query_lens, extra)])

    # -- references ------------------------------------------------------------------------

    def padded(self, step: Step, buckets: Buckets, full: bool) -> Step:
        """The step as the executor stages it: padded to the bucket, declared fills."""
        t = step.num_tokens
        tb = buckets.pad(t) or t
        a = step.attn
        b = tb if full else len(a.query_lens)
        pad = torch.zeros(tb - t, dtype=torch.int64)
        return Step(
            torch.cat([step.input_ids, pad]),
            torch.cat([step.positions, pad]),
            a.padded(b, tb, self.cache.dummy_slot, self.cache.dummy_block, self.max_blocks),
        )

    def eager(
        self,
        step: Step,
        runner: AttentionRunner | None = None,
        forward=None,  # type: ignore[no-untyped-def]
        num_tokens: int | None = None,
    ) -> torch.Tensor:
        """The forward without graphs; `num_tokens` tells the runner how many rows are real."""
        dev = self.cache.tensors()[0].device
        a = step.attn
        runner = runner or (PagedDecodeRunner() if a.is_decode else PagedPrefillRunner())
        md = a.metadata(dev)
        if num_tokens is not None:
            md.num_tokens = num_tokens
        with torch.no_grad(), eager_attention(runner, md):
            return (forward or self.model.forward_logits)(
                step.input_ids.to(dev), step.positions.to(dev)
            )
