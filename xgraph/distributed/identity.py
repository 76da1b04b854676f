"""What tells the ranks they run the same executor and the same step.

- The configuration: every setting that decides a step's kind, key, padding or capture
  (mode, buckets, key dims, declared inputs, the paging layout, the KV cache's dtypes, the
  overflow and capture-error policies, compiled). Its digest rides in every agreement
  message; where the ranks' digests differ, the settings are swapped (on that error path
  only) and the error names each one that differs.
- The step: its ordinal among the executor's agreements, and for ranks of one tensor-
  parallel group (which must run the same batch) a digest of the step's host inputs
  (the token inputs staged from the host, query and sequence lengths, slots): a rank that
  skipped, repeated or reordered a call then meets its peers with another batch.

Digests are crc32 of the bytes (a few microseconds for a decode step's inputs); device
tensors are left out (reading them would stall the host).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..steps import Checked

_MASK = (1 << 62) - 1  # a digest fits an int64 field


def config_of(executor: Any) -> dict[str, str]:
    """The settings of an executor that every agreeing rank must share, in words."""
    planner = executor.planner
    out = {
        "backend": repr(executor.backend.name),
        "mode": repr(executor.mode.value),
        "buckets": repr(list(executor.buckets.sizes)),
        "key dims": repr(
            [(d.name, d.max, list(d.buckets or ()), d.pad_like) for d in planner.dims.values()]
        ),
        "inputs": repr([(i.name, str(i.dtype), tuple(i.shape)) for i in planner.inputs]),
        "on_overflow": repr(planner.on_overflow.value),
        "on_capture_error": repr(executor.on_capture_error.value),
        "compiled": repr(executor.compiled),
    }
    a = executor.attention
    if a is not None:
        out["attention"] = repr(
            {
                "max_seqs": a.max_seqs,
                "max_blocks_per_seq": a.max_blocks_per_seq,
                "block_size": a.block_size,
                "max_query_len": a.max_query_len,
                "validate": a.validate,
            }
        )
        out["KV cache dtypes"] = repr(sorted({str(t.dtype) for t in a.kv_tensors}))
    return out


def digest(config: dict[str, str]) -> int:
    return zlib.crc32(repr(sorted(config.items())).encode()) & _MASK


def differences(configs: list[dict[str, str]]) -> str:
    """Each setting the ranks differ in, with every rank's value."""
    names = sorted({k for c in configs for k in c})
    parts = []
    for k in names:
        values = [c.get(k, "(none)") for c in configs]
        if len(set(values)) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            parts.append(f"{k} ({each})")
    return "; ".join(parts)


def inputs_digest(checked: Checked) -> int:
    """A digest of a checked step's host inputs (0 where none is on the host)."""
    crc = 0
    for a in checked.arrays:
        if a is not None:
            crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    h = checked.attn
    if h is not None:
        crc = zlib.crc32(np.ascontiguousarray(h.query_lens).view(np.uint8), crc)
        if not h.on_device:
            for a in (h.seq_lens, h.slots):
                crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    return crc & _MASK
