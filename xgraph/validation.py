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
) -> AttentionInputs:
    """The attention inputs normalized (int lists, an int32 table, int64 slots) and checked."""
    ql, sl = [int(x) for x in attn.query_lens], [int(x) for x in attn.seq_lens]
    n = len(ql)
    if len(sl) != n:
        raise InputError(f"{name}: {n} query_lens but {len(sl)} seq_lens.")
    if sum(ql) != num_tokens:
        raise InputError(
            f"{name}: query_lens sum to {sum(ql)}, but the inputs have {num_tokens} tokens."
        )
    if any(q < 1 or q > s for q, s in zip(ql, sl)):
        raise InputError(
            f"{name}: every sequence needs 1 <= query_len <= seq_len; got query_lens={ql}, "
            f"seq_lens={sl}."
        )
    if n > max_seqs:
        raise InputError(f"{name}: {n} sequences, above max_seqs={max_seqs}.")
    for field, want in (("block_tables", torch.int32), ("slot_mapping", torch.int64)):
        value = getattr(attn, field)
        if isinstance(value, torch.Tensor) and value.dtype != want:
            raise InputError(f"{name}: {field} must be {want}; got {value.dtype}.")
    bt = attn.table(layout.dummy_block)
    if bt.dim() != 2 or bt.shape[0] != n:
        raise InputError(
            f"{name}: block_tables must be int32 [num_seqs={n}, width]; got {tuple(bt.shape)}."
        )
    if bt.shape[1] > layout.max_blocks_per_seq:
        raise InputError(
            f"{name}: block_tables width {bt.shape[1]} is above "
            f"max_blocks_per_seq={layout.max_blocks_per_seq}."
        )
    sm = attn.slots()
    if tuple(sm.shape) != (num_tokens,):
        raise InputError(f"{name}: slot_mapping must be [{num_tokens}]; got {tuple(sm.shape)}.")
    for t in (bt, sm):
        if t.device.type != "cpu" and t.device != device:
            raise InputError(
                f"{name}: attention inputs must be on the host or on {device}; got {t.device}."
            )
    return AttentionInputs(ql, sl, bt, sm)
