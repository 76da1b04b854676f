"""Validation of a step's inputs against the executor's declarations; nothing is written before.

Each check names the executor, the input or field, what was found and what to do. Token
inputs are checked against their declared dtype, device and shape, and the symbolic dims
must agree across inputs; attention inputs are normalized here (ragged block tables become
one int32 table) and checked against the paging layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .buckets import Dim, Input
from .errors import InputError
from .metadata import AttentionInputs
from .paging import PagedAttention

NUM_TOKENS = "num_tokens"


def _check_tensor(name: str, spec: Input, v: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise InputError(
            f"{name}: input {spec.name!r} must be a torch.Tensor, got {type(v).__name__}."
        )
    if v.dtype != spec.dtype:
        raise InputError(
            f"{name}: input {spec.name!r} has dtype {v.dtype}, declared {spec.dtype}; "
            f"convert it with .to({spec.dtype})."
        )
    if v.device.type != "cpu" and v.device != device:
        raise InputError(
            f"{name}: input {spec.name!r} is on {v.device}; the executor runs on {device}. "
            f"Pass host tensors or tensors on {device}."
        )
    if v.dim() != len(spec.shape):
        raise InputError(
            f"{name}: input {spec.name!r} has shape {tuple(v.shape)}, declared {spec.shape} "
            f"({len(spec.shape)} dims)."
        )
    if spec.bounds is not None and v.numel():
        low, high = spec.bounds
        outside = ((v < low) | (v >= high)).nonzero()
        if len(outside):
            at = tuple(int(i) for i in outside[0])
            raise InputError(
                f"{name}: input {spec.name!r}{list(at)} is {v[at].item()}, outside its bounds "
                f"[{low}, {high})."
            )
    return v


def _record_sizes(
    name: str, spec: Input, v: torch.Tensor, dims: Mapping[str, Dim], sizes: dict[str, int]
) -> None:
    for axis, (n, s) in enumerate(zip(v.shape, spec.shape)):
        if isinstance(s, int):
            if n != s:
                raise InputError(f"{name}: input {spec.name!r} dim {axis} is {n}, declared {s}.")
            continue
        if sizes.setdefault(s, n) != n:
            raise InputError(
                f"{name}: dim {s!r} is {sizes[s]} in one input and {n} in {spec.name!r}; every "
                "input must agree on it."
            )
        if s != NUM_TOKENS and not dims[s].in_key and n > dims[s].max:
            raise InputError(f"{name}: dim {s!r} is {n}, above its max {dims[s].max}.")


def validate_inputs(
    name: str,
    declared: Sequence[Input],
    dims: Mapping[str, Dim],
    inputs: Mapping[str, Any],
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The step's tensors by name and the size of every symbolic dim they use."""
    names = {i.name for i in declared}
    missing, unknown = names - set(inputs), set(inputs) - names
    if missing or unknown:
        raise InputError(
            f"{name}: inputs {sorted(inputs)} do not match the declared inputs {sorted(names)} "
            f"(missing {sorted(missing)}, unknown {sorted(unknown)})."
        )
    sizes: dict[str, int] = {}
    tensors: dict[str, torch.Tensor] = {}
    for spec in declared:
        v = _check_tensor(name, spec, inputs[spec.name], device)
        _record_sizes(name, spec, v, dims, sizes)
        tensors[spec.name] = v
    if NUM_TOKENS not in sizes:
        raise InputError(f"{name}: no input has a 'num_tokens' dim.")
    return tensors, sizes


def validate_attention(
    name: str,
    layout: PagedAttention,
    attn: AttentionInputs,
    num_tokens: int,
    max_seqs: int,
    device: torch.device,
    synthetic: bool = False,
) -> AttentionInputs:
    """The attention inputs normalized (int lists, an int32 table, int64 slots) and checked
    against the cache: a step that passes cannot read or write outside its own blocks.
    `synthetic` steps (pre-capture) use only the dummy block, so its layout is not checked."""
    ql, sl = [int(x) for x in attn.query_lens], [int(x) for x in attn.seq_lens]
    _check_lengths(name, ql, sl, num_tokens, max_seqs)
    for field, want in (("block_tables", torch.int32), ("slot_mapping", torch.int64)):
        value = getattr(attn, field)
        if isinstance(value, torch.Tensor) and value.dtype != want:
            raise InputError(f"{name}: {field} must be {want}; got {value.dtype}.")
    bt, sm = attn.table(layout.dummy_block), attn.slots()
    for t in (bt, sm):
        if t.device.type != "cpu" and t.device != device:
            raise InputError(
                f"{name}: attention inputs must be on the host or on {device}; got {t.device}."
            )
    n = len(ql)
    if bt.dim() != 2 or bt.shape[0] != n:
        raise InputError(
            f"{name}: block_tables must be int32 [num_seqs={n}, width]; got {tuple(bt.shape)}."
        )
    if bt.shape[1] > layout.max_blocks_per_seq:
        raise InputError(
            f"{name}: block_tables width {bt.shape[1]} is above "
            f"max_blocks_per_seq={layout.max_blocks_per_seq}."
        )
    if tuple(sm.shape) != (num_tokens,):
        raise InputError(f"{name}: slot_mapping must be [{num_tokens}]; got {tuple(sm.shape)}.")
    if not synthetic:
        rows = _row_lengths(attn.block_tables, bt)
        check_cache_layout(name, layout, ql, sl, bt.cpu(), rows, sm.cpu())
    return AttentionInputs(ql, sl, bt, sm)


def _check_lengths(name: str, ql: list[int], sl: list[int], num_tokens: int, max_seqs: int) -> None:
    n = len(ql)
    if n == 0 or num_tokens == 0:
        raise InputError(f"{name}: a step needs at least one sequence and one token; got none.")
    if len(sl) != n:
        raise InputError(f"{name}: {n} query_lens but {len(sl)} seq_lens.")
    if sum(ql) != num_tokens:
        raise InputError(
            f"{name}: query_lens sum to {sum(ql)}, but the inputs have {num_tokens} tokens."
        )
    bad = [i for i, (q, s) in enumerate(zip(ql, sl)) if q < 1 or q > s]
    if bad:
        i = bad[0]
        raise InputError(
            f"{name}: sequence {i} has query_len {ql[i]} and seq_len {sl[i]}; every sequence "
            "needs 1 <= query_len <= seq_len."
        )
    if n > max_seqs:
        raise InputError(f"{name}: {n} sequences, above max_seqs={max_seqs}.")


def _row_lengths(given: Any, table: torch.Tensor) -> torch.Tensor:
    """How many block ids each row really has (ragged lists), or the table width (a tensor)."""
    if isinstance(given, torch.Tensor):
        return torch.full((table.shape[0],), table.shape[1], dtype=torch.int64)
    return torch.tensor([len(r) for r in given], dtype=torch.int64)


def check_cache_layout(
    name: str,
    layout: PagedAttention,
    ql: list[int],
    sl: list[int],
    bt: torch.Tensor,
    rows: torch.Tensor,
    sm: torch.Tensor,
) -> None:
    """Each sequence's blocks exist, are its own to use, and hold every position up to its
    seq_len; each token's slot is the one its sequence's table gives its position. Vectorized:
    no Python loop over tokens or blocks."""
    bs, dummy = layout.block_size, layout.dummy_block
    seq_lens = torch.tensor(sl, dtype=torch.int64)
    need = (seq_lens + bs - 1) // bs
    short = (need > rows).nonzero()
    if len(short):
        i = int(short[0])
        raise InputError(
            f"{name}: block_tables: sequence {i} needs {int(need[i])} blocks for seq_len {sl[i]} "
            f"(block_size {bs}) but its row holds {int(rows[i])}. Give it enough blocks."
        )
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    ids = bt.long()
    wrong = used & ((ids < 0) | (ids >= layout.num_blocks) | (ids == dummy))
    if wrong.any():
        i, j = (int(x) for x in wrong.nonzero()[0])
        raise InputError(
            f"{name}: block_tables: sequence {i} uses block id {int(ids[i, j])} at column {j}; "
            f"block ids run from 0 to {layout.num_blocks - 1}, and {dummy} is the reserved "
            "dummy block."
        )
    q = torch.tensor(ql, dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(len(ql)), q, output_size=int(q.sum()))
    starts = torch.cumsum(q, 0) - q
    pos = (seq_lens - q)[seq_of] + torch.arange(len(seq_of)) - starts[seq_of]
    expected = ids[seq_of, pos // bs] * bs + pos % bs
    off = (sm != expected).nonzero()
    if len(off):
        t = int(off[0])
        i = int(seq_of[t])
        raise InputError(
            f"{name}: slot_mapping[{t}] is {int(sm[t])}, but sequence {i} keeps position "
            f"{int(pos[t])} at slot {int(expected[t])} (its block table row, block_size {bs}). "
            "Slots must follow the block tables."
        )
