"""What a backend's one-launch device check is handed (`Kernels.metadata_check`), and the
table of the kernels installed per device type (`Backend.activate` fills it; the device
check, `xgraph.device_check`, asks it at each key's check)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import IncompleteBackendError


@dataclass(frozen=True)
class CheckCall:
    """One key's check as a backend's kernel takes it (`Kernels.metadata_check`): the raw
    buffers at the key's sizes (`seqs` sequences of `query_len` tokens), the staged counts,
    the error buffer, the padded metadata to write, and the layout's constants. The kernel
    does what `DeviceCheck._check` does with torch ops: the same writes, the same first
    problem kept (the first by sequence, then by token; an error already kept stays)."""

    seq_lens: torch.Tensor  # int64 [seqs], as given (rows from n on: earlier steps')
    table: torch.Tensor  # int32 [seqs, width], as given (columns from w on: stale)
    slots: torch.Tensor  # int64 [seqs * query_len], as given
    counts: torch.Tensor  # int64 [2]: the step's real sequences n and table width w
    error: torch.Tensor  # int64 [3]: code, index, value of the first problem (0: none)
    out_seq_lens: torch.Tensor  # int32 [seqs]
    out_table: torch.Tensor  # int32 [seqs, width]
    out_slots: torch.Tensor  # int64 [seqs * query_len]
    query_len: int
    block_size: int
    num_blocks: int
    dummy_block: int
    dummy_slot: int


MetadataCheck = Callable[[CheckCall], bool]  # True: issued; False: declined (torch ops run)
_kernels: dict[str, MetadataCheck] = {}  # device type -> the installed kernel


def install(device_type: str, kernel: MetadataCheck | None, backend: str) -> None:
    """Check keys' metadata on `device_type` with `kernel` from now on (None: torch ops)."""
    if kernel is None:
        _kernels.pop(device_type, None)
        return
    if not callable(kernel):
        raise IncompleteBackendError(
            f"Backend {backend!r}: kernels().metadata_check is {kernel!r}, which is not "
            "callable. Give a function of a CheckCall answering whether it issued the check, "
            "or None."
        )
    _kernels[device_type] = kernel


def installed(device_type: str) -> MetadataCheck | None:
    """The check kernel installed for `device_type`, if any."""
    return _kernels.get(device_type)
