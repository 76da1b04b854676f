"""The CUDA adapter's attention runners: which ones run, and the SDPA prefill runner.

`attention_runners()` picks the Triton runners (xgraph_cuda.triton_runners: paged decode
and varlen prefill kernels) when Triton imports, else the SDPA prefill runner below with the
core's reference decode; XGRAPH_CUDA_ATTENTION=triton|torch forces one side.

SDPAPrefillRunner has the semantics of xgraph.runners.PagedPrefillRunner (the reference):
store the step's k/v at their slots, then each sequence attends causally over its cached
context, query j of a sequence sitting at position seq_len - query_len + j; rows past the
real tokens are zeroed. SDPA picks a fused kernel where it can, and computes in the input
dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from xgraph.adapter import (
    AttentionMetadata,
    AttentionRunner,
    KVCache,
    PlannedRunner,
    SeqSpan,
    XGraphError,
    XGraphWarning,
    context_kv,
    sequence_spans,
)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    groups: int,
) -> torch.Tensor:
    """q [1, hq, ql, d], k/v [1, hkv, sl, d] -> [1, hq, ql, d]; mask None means square causal."""
    kwargs: dict = {"scale": scale, "enable_gqa": groups > 1}
    # fused float32 kernels on the GPU may round through TF32; the math path keeps float32
    # numerics (its matmuls follow torch.backends.cuda.matmul), like the reference runner
    exact = q.dtype == torch.float32 and q.is_cuda
    with sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext():
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


class SDPAPrefillRunner(PlannedRunner):
    """Prefill / chunked-prefill / mixed attention through SDPA, planned on the host."""

    graph_safe = False

    def __init__(self) -> None:
        super().__init__()
        self._plan: list[tuple[SeqSpan, torch.Tensor | None]] = []  # (span, mask or None)
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}  # (seq, block size) -> ids

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._blocks = {}
        device = metadata.block_tables.device
        self._plan = []
        for s in sequence_spans(metadata):
            mask = None
            if s.query_len != s.seq_len:
                # once per step, not per layer: query j at position sl - ql + j sees keys <= it
                qpos = torch.arange(s.seq_len - s.query_len, s.seq_len, device=device)[:, None]
                mask = torch.arange(s.seq_len, device=device)[None, :] <= qpos
            self._plan.append((s, mask))

    def _block_ids(self, i: int, s: SeqSpan, bs: int) -> torch.Tensor:
        ids = self._blocks.get((i, bs))
        if ids is None:
            ids = self._blocks[(i, bs)] = s.row[: -(-s.seq_len // bs)].long()
        return ids

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> None:
        n = self.store_step(k, v, kv_cache).num_tokens
        bs, hkv = kv_cache[0].shape[1], kv_cache[0].shape[2]
        hq = q.shape[1]
        for i, (s, mask) in enumerate(self._plan):
            start, ql, sl = s.start, s.query_len, s.seq_len
            keys, vals = context_kv(kv_cache, self._block_ids(i, s, bs), sl)
            keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
            qi = q[start : start + ql].transpose(0, 1).unsqueeze(0)
            if keys.dtype != qi.dtype:
                keys, vals = keys.to(qi.dtype), vals.to(qi.dtype)
            o = _sdpa(qi, keys, vals, mask, scale, hq // hkv)
            out[start : start + ql].copy_(o[0].transpose(0, 1))
        if out.shape[0] > n:
            out[n:].zero_()


ATTENTION_ENV = "XGRAPH_CUDA_ATTENTION"
CHOICES = ("auto", "triton", "torch")


def attention_choice() -> str:
    """'triton' or 'torch': what XGRAPH_CUDA_ATTENTION asks, 'auto' meaning Triton if present."""
    asked = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if asked not in CHOICES:
        raise XGraphError(
            f"{ATTENTION_ENV}={asked!r}; use one of {', '.join(CHOICES)} (auto: Triton "
            "kernels when triton imports, else SDPA prefill and the reference decode)."
        )
    have = importlib.util.find_spec("triton") is not None
    if asked == "triton" and not have:
        raise XGraphError(
            f"{ATTENTION_ENV}=triton but triton is not installed. Install the CUDA build "
            "of torch (it brings triton) or `pip install xgraph-cuda[triton]`."
        )
    if asked == "torch" or not have:
        return "torch"
    return "triton"


def attention_runners() -> dict[str, AttentionRunner]:
    """Fresh runners by role for a CUDA device (decode left out: the core's reference)."""
    choice = attention_choice()
    if choice == "triton":
        try:
            from .triton_runners import TritonPagedDecodeRunner, TritonVarlenPrefillRunner
        except ImportError as exc:  # a triton that does not fit this torch: say so, go on
            if os.environ.get(ATTENTION_ENV, "auto").strip().lower() == "triton":
                raise XGraphError(
                    f"{ATTENTION_ENV}=triton but the Triton runners do not import ({exc}). "
                    "Install the triton that matches this torch build."
                ) from exc
            warnings.warn(
                f"xgraph-cuda: the Triton attention runners do not import ({exc}); using SDPA "
                f"prefill and the reference decode. Set {ATTENTION_ENV}=torch to silence this.",
                XGraphWarning,
                stacklevel=2,
            )
        else:
            return {"decode": TritonPagedDecodeRunner(), "prefill": TritonVarlenPrefillRunner()}
    return {"prefill": SDPAPrefillRunner()}
