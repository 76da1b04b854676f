"""The host's side of a multi-step launch (xgraph.decode_loop): the per-sequence requests
checked and packed into the loop's inputs, and the outputs read back in one copy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .feedback import BUDGET, NO_BLOCKS, RUNNING, STOPPED
from .metadata import AttentionInputs
from .paging import PagedAttention

REASONS: dict[int, str | None] = {
    RUNNING: None,
    STOPPED: "stop",
    BUDGET: "length",
    NO_BLOCKS: "blocks",
}


@dataclass
class Sampling:
    """Per-sequence sampling of a launch: temperature 0 is greedy; seeds make draws
    repeatable (xgraph.device_sampling)."""

    temperature: Sequence[float]
    top_k: Sequence[int]
    top_p: Sequence[float]
    seeds: Sequence[int]

    @property
    def greedy(self) -> bool:
        return all(t == 0 for t in self.temperature)


@dataclass
class LoopResult:
    """One launch's outcome per sequence: its new tokens (a stop token included), why it
    finished (None: still running; "stop", "length" or "blocks": it needs a cache block the
    launch was not given), its block-table row as the launch left it, and the blocks it took
    from `free_blocks`, in order."""

    tokens: list[list[int]]
    reasons: list[str | None]
    tables: list[list[int]]
    given: list[list[int]]


def _per_seq(name: str, values: object, n: int) -> list:
    out = list(values) if isinstance(values, (list, tuple, torch.Tensor)) else [values] * n
    if len(out) != n:
        raise InputError(f"DecodeLoop: {name} has {len(out)} entries for {n} sequences.")
    return [v.item() if isinstance(v, torch.Tensor) else v for v in out]


def launch_inputs(
    a: PagedAttention,
    attn: AttentionInputs,
    positions: Sequence[int] | torch.Tensor,
    budget: object,
    stop_ids: Sequence[Sequence[int]] | None,
    free_blocks: Sequence[int],
    sizes: Mapping[str, int],
) -> dict[str, torch.Tensor]:
    """The loop's own inputs, checked: budget, stop tokens, free blocks."""
    n = len(attn.query_lens)
    if not attn.is_decode:
        raise InputError(
            "DecodeLoop: every sequence of a launch adds one token (a decode step); run "
            "prefill through the model's GraphExecutor first."
        )
    spent = _per_seq("budget", budget, n)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in spent):
        raise InputError(f"DecodeLoop: budget={spent}; give each sequence an int >= 1.")
    stops = [list(s) for s in stop_ids] if stop_ids is not None else [[] for _ in range(n)]
    if len(stops) != n or any(len(s) > sizes["stop"] for s in stops):
        raise InputError(
            f"DecodeLoop: stop_ids needs one list per sequence ({n}) of at most "
            f"{sizes['stop']} ids (max_stop_ids)."
        )
    stop_t = torch.full((n, sizes["stop"]), -1, dtype=torch.int64, device="cpu")
    for i, s in enumerate(stops):
        stop_t[i, : len(s)] = torch.tensor(s, dtype=torch.int64, device="cpu")
    return {
        "budget": torch.tensor(spent, dtype=torch.int64, device="cpu"),
        "stop_ids": stop_t,
        **launch_free(free_blocks, a, sizes["free"]),
    }


def launch_free(
    free_blocks: Sequence[int], a: PagedAttention, most: int
) -> dict[str, torch.Tensor]:
    """The blocks a launch may give, checked: at most `most` distinct real cache blocks."""
    free = [int(b) for b in free_blocks]
    bad = [b for b in free if not 0 <= b < a.num_blocks or b == a.dummy_block]
    if bad or len(free) > most or len(set(free)) != len(free):
        raise InputError(
            f"DecodeLoop: free_blocks must be at most {most} distinct real cache blocks (0 to "
            f"{a.num_blocks - 1}, not the dummy block {a.dummy_block}); got {free}."
        )
    host = dict(dtype=torch.int64, device="cpu")  # host values, whatever the default device
    free_t = torch.zeros(most, **host)
    free_t[: len(free)] = torch.tensor(free, **host)
    return {"free_blocks": free_t, "free_count": torch.tensor([len(free)], **host)}


SAMPLING = ("seeds", "temperature", "top_k", "top_p")  # a sampling launch's own inputs


def sampling_inputs(s: Sampling, n: int) -> dict[str, torch.Tensor]:
    return {
        "seeds": torch.tensor(_per_seq("seeds", s.seeds, n), dtype=torch.int64, device="cpu"),
        "temperature": torch.tensor(
            _per_seq("temperature", s.temperature, n), device="cpu"
        ).float(),
        "top_k": torch.tensor(_per_seq("top_k", s.top_k, n), dtype=torch.int64, device="cpu"),
        "top_p": torch.tensor(_per_seq("top_p", s.top_p, n), device="cpu").float(),
    }


def unpack(
    flat: torch.Tensor,
    n: int,
    k: int,
    width: int,
    before: torch.Tensor | Sequence[Sequence[int]],
    dummy_block: int,
) -> LoopResult:
    """A launch's outputs on the host (xgraph.loop_chain.pack: tokens [n, k], generated,
    reasons, block-table rows [n, width], then the state), cut to each sequence's new
    tokens; `before`: the rows as the launch started, to find the blocks it gave."""
    tok = flat[: n * k].view(n, k)
    gen = flat[n * k : n * k + n].tolist()
    why = flat[n * k + n : n * k + 2 * n].tolist()
    rows = flat[n * k + 2 * n : n * k + 2 * n + n * width].view(n, width).tolist()
    old_rows = before.tolist() if isinstance(before, torch.Tensor) else [list(r) for r in before]
    given = []
    for row, old in zip(rows, old_rows):
        empty = [c >= len(old) or old[c] < 0 or old[c] == dummy_block for c in range(len(row))]
        given.append([b for b, e in zip(row, empty) if e and 0 <= b != dummy_block])
    return LoopResult(
        tokens=[tok[i, : gen[i]].tolist() for i in range(n)],
        reasons=[REASONS[r] for r in why],
        tables=rows,
        given=given,
    )
