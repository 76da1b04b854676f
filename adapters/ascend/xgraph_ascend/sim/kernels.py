"""Reference bodies of the simulated torch_npu kernels, computed with aten on the host.

`fused_infer_attention` is what npu_fused_infer_attention_score computes for paged decode
(query [b, hq, d], caches [blocks, block_size, hkv, d], block table, host kv lengths): each
sequence attends over its first `seq_lens[i]` cached tokens, in float32. Like the NPU kernel
its launch is fixed by host values, so a captured launch keeps the capture's lengths until a
graph task update replaces them. Its numerics are this reference's, not the NPU's (see
docs/ascend.md: fused-attention numerics are for hardware to check).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import AclRuntimeError

INVALID_PARAM = 100000
WORKSPACE_BYTES = 256  # the simulated op's workspace: fixed, like the max-workspace answer


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise AclRuntimeError(INVALID_PARAM, "aclnnFusedInferAttentionScore", why)


def fused_infer_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    out: torch.Tensor,
    lse: torch.Tensor,
    workspace: torch.Tensor | None,
    scale: float,
) -> None:
    b, hq, d = query.shape
    _blocks, bs, hkv, _ = key_cache.shape
    _check(len(seq_lens) == b, f"{len(seq_lens)} sequence lengths for a batch of {b}")
    _check(hq % hkv == 0, f"{hq} query heads are not a multiple of {hkv} kv heads")
    _check(tuple(out.shape) == (b, hq, d), f"out {tuple(out.shape)} is not {(b, hq, d)}")
    _check(workspace is None or workspace.numel() >= WORKSPACE_BYTES, "workspace too small")
    g = hq // hkv
    for i, n in enumerate(seq_lens):
        nb = -(-int(n) // bs)
        _check(0 < nb <= block_table.shape[1], f"sequence {i}: length {n} exceeds its blocks")
        ids = block_table[i, :nb].long()
        keys = key_cache[ids].reshape(nb * bs, hkv, d)[:n].float()
        vals = value_cache[ids].reshape(nb * bs, hkv, d)[:n].float()
        qi = query[i].reshape(hkv, g, d).float()
        scores = torch.einsum("hgd,lhd->hgl", qi, keys) * scale
        o = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), vals)
        out[i].copy_(o.reshape(hq, d))
    if lse.numel():
        lse.zero_()  # softmax_lse_flag is off: the op leaves a placeholder
