"""The attention call site models use, the per-step metadata, and the reference runners.

Model code calls `xgraph.attention(q, k, v, kv_cache, scale=...)` at every attention layer.
What that call does depends on the step context the executor has set:

- eager / full-graph capture: the runner runs inline (inside a full graph it is recorded,
  so it must be graph-safe: fixed launch shape, every per-step value read from device);
- piecewise capture: the current piece ends, the call is recorded as a runner instruction
  (q, k, v, the preallocated out and the cache), the next piece begins; replay runs
  piece, runner, piece, ... with the runner planned on this step's metadata.

Calling attention kernels directly instead (bypassing the call site) is detected during a
piecewise capture and refused, because such a kernel would be frozen into a piece with the
batch composition of the capture step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import CaptureError, XGraphError
from .interfaces import AttentionRunner

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_blocks, block_size, kv_heads, dim]


@dataclass
class AttentionMetadata:
    """One step's attention inputs.

    Device tensors (views of the executor's persistent buffers, padded to the bucket in a
    full graph): `slot_mapping` [tokens] int64, the cache slot each token's k/v goes to;
    `seq_lens` [seqs] int32, kv length of each sequence including this step's tokens;
    `query_start_loc` [seqs + 1] int32, cumulative query lengths; `block_tables`
    [seqs, max_blocks] int32. Host values serve runners that plan on the host.
    """

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    num_tokens: int
    num_seqs: int
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_host)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        slot_mapping: torch.Tensor | Sequence[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata in fresh device tensors (eager runs and tests; executors use buffers)."""
        ql, sl = [int(q) for q in query_lens], [int(s) for s in seq_lens]
        qsl = [0]
        for q in ql:
            qsl.append(qsl[-1] + q)
        if isinstance(block_tables, torch.Tensor):
            bt = block_tables.to(device=device, dtype=torch.int32)
        else:
            width = max((len(r) for r in block_tables), default=0)
            bt = (
                torch.tensor(
                    [list(r) + [0] * (width - len(r)) for r in block_tables], dtype=torch.int32
                )
                .reshape(len(ql), width)
                .to(device)
            )
        sm = torch.as_tensor(slot_mapping, dtype=torch.int64).to(device)
        return cls(
            slot_mapping=sm,
            seq_lens=torch.tensor(sl, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            block_tables=bt,
            num_tokens=qsl[-1],
            num_seqs=len(ql),
            query_lens_host=ql,
            seq_lens_host=sl,
        )


# -- step contexts -------------------------------------------------------------------------


class StepContext(Protocol):
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor: ...


_local = threading.local()


def _stack() -> list[StepContext]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make `ctx` answer `xgraph.attention` calls in this thread until the block ends."""
    s = _stack()
    s.append(ctx)
    try:
        yield ctx
    finally:
        s.pop()


class InlineRunner:
    """Context that runs a planned runner inline (eager steps, full-graph capture)."""

    def __init__(self, runner: AttentionRunner, require_graph_safe: bool = False) -> None:
        if require_graph_safe and not runner.graph_safe:
            raise XGraphError(
                f"{type(runner).__name__} is not graph-safe, so it cannot run inside a full "
                "graph. Use a graph-safe runner for decode, or the piecewise mode."
            )
        self.runner = runner

    def attend(self, q, k, v, kv_cache, scale):  # type: ignore[no-untyped-def]
        out = torch.empty_like(q)
        self.runner.run(q, k, v, out, kv_cache, scale)
        return out


@contextmanager
def eager_attention(runner: AttentionRunner, metadata: AttentionMetadata) -> Iterator[None]:
    """Plan `runner` on `metadata` and run every `xgraph.attention` call eagerly with it."""
    runner.plan(metadata)
    with step_context(InlineRunner(runner)):
        yield


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The attention call site: store k, v in the paged cache and attend q over it.

    q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; returns [tokens, heads, dim].
    """
    s = _stack()
    if not s:
        raise XGraphError(
            "xgraph.attention was called outside a step. Run the forward through a "
            "GraphExecutor, or inside `with xgraph.eager_attention(runner, metadata):`."
        )
    return s[-1].attend(q, k, v, kv_cache, scale if scale is not None else q.shape[-1] ** -0.5)


# -- reference runners ---------------------------------------------------------------------


def _store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    n = k.shape[0]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc.index_copy_(0, slots[:n], k)
    vc.index_copy_(0, slots[:n], v)


class PagedDecodeRunner(AttentionRunner):
    """Graph-safe decode attention: one query token per sequence, all data from device.

    Launch shape is fixed by (sequences, block-table width): every sequence gathers its
    whole block-table row and masks positions >= seq_len on the device, so neither the
    sequence lengths nor the block tables ever reach the host.
    """

    graph_safe = True

    def __init__(self) -> None:
        self.md: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self.md = metadata  # device buffers: nothing to compute on the host

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        md = self.md
        if md is None:
            raise XGraphError("PagedDecodeRunner.run before plan(): plan each step first.")
        _store_kv(k, v, kv_cache, md.slot_mapping)
        k_cache, v_cache = kv_cache
        b, hq, d = q.shape
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        bt = md.block_tables[:b].long()  # [b, w]
        w = bt.shape[1]
        keys = k_cache[bt].reshape(b, w * bs, hkv, d)
        vals = v_cache[bt].reshape(b, w * bs, hkv, d)
        # matmuls in the cache dtype (accumulating in float32), softmax in float32
        qg = q.reshape(b, hkv, hq // hkv, d).to(keys.dtype)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, keys).float() * scale
        pos = torch.arange(w * bs, device=q.device)
        masked = pos[None, :] >= md.seq_lens[:b, None]
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(vals.dtype)
        o = torch.einsum("bhgl,blhd->bhgd", probs, vals)
        out.copy_(o.reshape(b, hq, d))


class PagedPrefillRunner(AttentionRunner):
    """Prefill / chunked-prefill / mixed attention, planned on the host (not graph-safe).

    Each sequence attends causally over its cached context plus its new tokens; sequence
    boundaries come from the host plan, so the launch differs with the batch composition.
    Rows past the step's real tokens (bucket padding) are zeroed.
    """

    graph_safe = False

    def __init__(self) -> None:
        self.md: AttentionMetadata | None = None
        self._plan: list[tuple[int, int, int, torch.Tensor]] = []

    def plan(self, metadata: AttentionMetadata) -> None:
        self.md = metadata
        plan, start = [], 0
        for i, (ql, sl) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
            plan.append((start, ql, sl, metadata.block_tables[i]))
            start += ql
        self._plan = plan

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        md = self.md
        if md is None:
            raise XGraphError("PagedPrefillRunner.run before plan(): plan each step first.")
        n = md.num_tokens
        _store_kv(k[:n], v[:n], kv_cache, md.slot_mapping)
        k_cache, v_cache = kv_cache
        bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        hq = q.shape[1]
        for start, ql, sl, row in self._plan:
            nb = -(-sl // bs)
            blocks = row[:nb].long()
            keys = k_cache[blocks].reshape(nb * bs, hkv, d)[:sl]
            vals = v_cache[blocks].reshape(nb * bs, hkv, d)[:sl]
            qi = q[start : start + ql].reshape(ql, hkv, hq // hkv, d).float()
            scores = torch.einsum("qhgd,lhd->hgql", qi, keys.float()) * scale
            # query j sits at position sl - ql + j and sees keys at positions <= its own
            qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
            kpos = torch.arange(sl, device=q.device)[None, :]
            scores = scores.masked_fill((kpos > qpos)[None, None], float("-inf"))
            o = torch.einsum("hgql,lhd->qhgd", scores.softmax(-1), vals.float())
            out[start : start + ql].copy_(o.reshape(ql, hq, d))
        if out.shape[0] > n:
            out[n:].zero_()


def check_no_bypass(func: Any, args: tuple, kwargs: dict, guarded: set[int]) -> None:
    """Refuse, during a piecewise capture, an op that touches a KV cache or runs attention.

    Only runners (outside the pieces) may touch the cache; an attention kernel inside a
    piece would be frozen with the capture step's batch composition.
    """
    name = func._schema.name
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        raise CaptureError(_bypass_message(f"{func} (an attention kernel)"))
    if guarded:
        for a in args:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in guarded:
                raise CaptureError(_bypass_message(f"{func} on a KV cache tensor"))


_sdpa_lock = threading.Lock()
_sdpa_depth = 0
_sdpa_saved: list[Any] = []


@contextmanager
def block_direct_sdpa() -> Iterator[None]:
    """Make torch.nn.functional.scaled_dot_product_attention raise a bypass CaptureError.

    SDPA may read host values before its kernel op is dispatched, so the op-level check in
    `check_no_bypass` alone could report a misleading host read instead of the bypass.
    """
    global _sdpa_depth
    F = torch.nn.functional

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CaptureError(_bypass_message("torch.nn.functional.scaled_dot_product_attention"))

    with _sdpa_lock:
        if _sdpa_depth == 0:
            _sdpa_saved.append(F.scaled_dot_product_attention)
            F.scaled_dot_product_attention = refuse
        _sdpa_depth += 1
    try:
        yield
    finally:
        with _sdpa_lock:
            _sdpa_depth -= 1
            if _sdpa_depth == 0:
                F.scaled_dot_product_attention = _sdpa_saved.pop()


def _bypass_message(what: str) -> str:
    from .safety import model_location

    return (
        f"Capture failed: {what} ran inside a piecewise graph at {model_location()}. "
        "Attention must go through `xgraph.attention(q, k, v, kv_cache)` so it runs between "
        "pieces on each step's metadata; called directly it would be frozen with the batch "
        "composition of the capture step. Route it through the call site."
    )
