"""The arrival counts of the kernels that finish their own split reductions (`fixup`).

One int32 array per device, zero at rest: a kernel's last program of each tile resets what
its tile counted, so the next kernel on the stream finds zeros again. It is made once, on a
call outside any graph capture (the first eager step or the executor's warm-up), and kept
for the process: captured graphs hold its address. A call made during a capture before the
arena exists gets None and takes the kernels' unsplit or unfused path instead (allocating
here would put the arena in that graph's pool and record its zero fill into the graph).

The counts are shared by every kernel of a device, so two streams must not run these
kernels at the same time (xgraph's steps run on one stream at a time).
"""

from __future__ import annotations

import threading

import torch

SIZE = 1 << 16  # tiles one launch may count: far above any grid the kernels launch

_counts: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counts(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counts (zero at rest), or None during a capture before they exist."""
    t = _counts.get(device)
    if t is not None:
        return t
    if _capturing(device):
        return None
    with _lock:
        if device not in _counts:
            _counts[device] = torch.zeros(SIZE, dtype=torch.int32, device=device)
        return _counts[device]
