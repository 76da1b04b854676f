"""Reference bodies of the simulated torch_npu kernels, computed with aten on the host.

`fused_infer_attention` is what npu_fused_infer_attention_score computes for paged decode
(query [b, hq, d], caches [blocks, block_size, hkv, d], block table, host kv lengths): each
sequence attends over its first `seq_lens[i]` cached tokens, in float32. Like the NPU kernel
its launch is fixed by host values, so a captured launch keeps the capture's lengths until a
graph task update replaces them. Its numerics are this reference's, not the NPU's (see
docs/ascend.md: fused-attention numerics are for hardware to check).

It refuses what the real op refuses (op-plugin's torch_npu-npu_fused_infer_attention_score.md
and the IFA tiling's CheckPABlockSize / CheckInputFormatAndLimits): a query that is not
float16 or bfloat16, a paged-attention block size that is not a multiple of 16 (32 for an
int8 cache), a non-contiguous query or cache, a block table that is not int32. The op
reports bad arguments as 161002 ACLNN_ERR_PARAM_INVALID; which of its checks answer with
another code (a tiling failure) is not documented, so every refusal here uses 161002.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import AclRuntimeError

PARAM_INVALID = 161002  # ACLNN_ERR_PARAM_INVALID
WORKSPACE_BYTES = 256  # the simulated op's workspace: fixed, like the max-workspace answer
QUERY_DTYPES = (torch.float16, torch.bfloat16)


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise AclRuntimeError(PARAM_INVALID, "aclnnFusedInferAttentionScore", why)


def block_multiple(cache_dtype: torch.dtype) -> int:
    """What the paged cache's block size must be a multiple of (IFA CheckPABlockSize)."""
    return 32 if cache_dtype == torch.int8 else 16


def check_limits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """The op's input limits that hold whatever the shapes (see the module docstring)."""
    _check(query.dtype in QUERY_DTYPES, f"query dtype {query.dtype}: only float16/bfloat16")
    bs = key_cache.shape[1]
    need = block_multiple(key_cache.dtype)
    _check(bs % need == 0, f"blocksize {bs} should be {need} aligned ({key_cache.dtype} cache)")
    _check(
        key_cache.dtype != torch.int8,
        "an int8 cache needs antiquant_scale/antiquant_offset, which this launch does not pass",
    )
    _check(key_cache.dtype == query.dtype, f"cache {key_cache.dtype}, query {query.dtype}")
    _check(query.is_contiguous(), "non-contiguous query: not supported")
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    _check(contiguous, "non-contiguous key/value: not supported")
    _check(block_table.dtype == torch.int32, f"block_table dtype {block_table.dtype}: int32")


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
    check_limits(query, key_cache, value_cache, block_table)
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
