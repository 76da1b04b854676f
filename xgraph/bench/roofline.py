"""The memory roofline of a decode step: the bytes it must read against the device's bandwidth.

A decode step reads every weight of the layers it runs at least once, however small the
batch, so (weight bytes) / (memory bandwidth) is a lower bound on its time; a step near it
is bandwidth-bound, and the fraction says how near. The weights counted are those `forward`
uses: every decoder layer and the final norm. The embedding is left out (a step gathers a
few of its rows), and so is the LM head (the benchmarks time `forward`, whose hidden states
the engine turns into logits outside the graph). The KV cache the step attends over is
reported beside it (`kv_bytes`), not folded into the weight roofline.

The bandwidth is measured in the same run, with the same timer as the steps: a large
device-to-device copy, counted as its bytes read plus its bytes written.
"""

from __future__ import annotations

from typing import Any

import torch

from ..interfaces import Backend
from ..models import Qwen3Model, Step
from ..paging import PagedKVCache
from .timing import Timer

GiB = 1 << 30


def weight_bytes(model: Qwen3Model) -> int:
    """Bytes of the parameters `forward` reads every step: the decoder layers and final norm."""
    params = {id(p): p for m in (model.model.layers, model.model.norm) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def kv_bytes(cache: PagedKVCache, step: Step) -> int:
    """Bytes of the KV cache a step's attention must read: each sequence's context, k and v,
    every layer (what a kernel that reads only the real context reads)."""
    per_token = sum(t[0, 0].numel() * t.element_size() for t in cache.tensors())
    return per_token * sum(int(n) for n in step.attn.seq_lens)


def _copy_time(backend: Backend, timer: Timer, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), iters=10)


def bandwidth(backend: Backend, timer: Timer, nbytes: int | None = None) -> dict[str, Any]:
    """Device memory bandwidth, bytes per second: 2 * nbytes / (median time of one copy).

    1 GiB on accelerators (large enough that launch cost and caches do not count); 64 MiB
    on the CPU backend, whose numbers prove only that the code runs.
    """
    if nbytes is None:
        nbytes = GiB if backend.device.type != "cpu" else 64 << 20
    try:
        seconds = _copy_time(backend, timer, nbytes)
    finally:
        backend.empty_cache()  # the two buffers, gone with _copy_time's frame
    return {"bandwidth_bytes_per_s": 2 * nbytes / seconds, "bandwidth_copy_bytes": nbytes}


def fill(row: dict[str, Any], variants: dict[str, str], weights: int, bw: float | None) -> None:
    """Add the roofline fields to a measured row: the bandwidth-limit step time of the weights
    (and of weights plus the KV cache, when the row has `kv_bytes`), and per variant the
    fraction of the bandwidth its step time reaches on the weights alone."""
    if not bw:
        return
    row["roofline_s"] = weights / bw
    if "kv_bytes" in row:
        row["roofline_with_kv_s"] = (weights + row["kv_bytes"]) / bw
    row["roofline"] = {
        name: row["roofline_s"] / row[key] for name, key in variants.items() if row.get(key)
    }
