"""A profile run: the forward of an engine's largest batch, before its KV cache exists.

Engines size the KV cache from the memory left after a warm-up of their largest batch, run
before the cache is allocated: the peak of that step's activations is what the cache must
leave free. `xgraph.attention` answers only inside a step, and an executor needs the cache
at its addresses before it is built; `profile_step` is the step for that run:

    with xgraph.profile_step([512, 512], backend="cuda") as prof:
        model(input_ids, positions)  # eagerly; its attention layers may pass kv_cache=None
    prof.peak_bytes  # the device allocator's peak over the step (None on the CPU)

Inside it every `xgraph.attention` call runs the prefill runner an executor on that backend
runs (`xgraph.runners_for`; or the `runner=` given), over a scratch cache that holds this
step's tokens only. The attention is the runner's and so is its cost (its launches, its
workspace, its output); no cache of the engine is read or written, whatever the call's
`kv_cache` is. The scratch cache is made at the first call, from the call's k (kv heads,
head dim, dtype, device): one per distinct layout, shared by every layer, since each layer
writes its tokens' keys and values and reads them back before the next layer runs. Its
block size and dtype are, in this order: `block_size=` / `cache_dtype=`; the call's
`kv_cache` where it is a pair of 4-d tensors laid out as the cache will be
(`[blocks, block_size, kv_heads, head_dim]`; placeholders on the meta device will do);
else 16 and k's dtype. `scratch_bytes` is what it holds, so the step's own peak is
`peak_bytes - scratch_bytes`.

Every sequence is a prefill from position 0 (its seq_len is its query_len): a token that
needs earlier context would read keys no cache holds yet, so such a step is refused, as is
a profile step inside another step. The forward runs eagerly: nothing is captured.

The step context (`ProfileStep`) is what a later capture before the KV cache can stand on:
it answers `xgraph.attention` with the backend's runner over its own scratch cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .attention import current_context, step_context
from .errors import InputError, XGraphError
from .interfaces import AttentionRunner, Backend
from .metadata import AttentionMetadata, KVCache, ragged_rows
from .plugins import get_backend
from .runners import runners_for

logger = logging.getLogger("xgraph")

DEFAULT_BLOCK_SIZE = 16


class ProfileStep:
    """The step context of a profile run (see the module docstring): what it ran over."""

    def __init__(
        self,
        query_lens: list[int],
        runner: AttentionRunner,
        block_size: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.query_lens, self.runner = query_lens, runner
        self.num_tokens = sum(query_lens)
        self.block_size, self.cache_dtype = block_size, cache_dtype
        self.scratch: dict[tuple, KVCache] = {}  # (kv_heads, dim, dtype, device, bs) ->
        self._metadata: dict[tuple[int, torch.device], AttentionMetadata] = {}
        self._planned: AttentionMetadata | None = None
        self.peak_bytes: int | None = None  # set when the step ends, where measurable

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch caches the step made."""
        return sum(t.nbytes for kv in self.scratch.values() for t in kv)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, scale: float
    ) -> torch.Tensor:
        """The runner's attention of q over this call's own k and v (its scratch cache)."""
        if q.shape[0] != self.num_tokens or k.shape[0] != self.num_tokens:
            raise InputError(
                f"profile_step: xgraph.attention got q of {q.shape[0]} rows and k of "
                f"{k.shape[0]}, but the step has {self.num_tokens} tokens (the sum of its "
                "query_lens). Run the forward over exactly those tokens, unpadded."
            )
        bs, dtype = self._layout(k, kv_cache)
        scratch = self._scratch(k, bs, dtype)
        md = self._metadata_for(bs, k.device)
        if md is not self._planned:  # once per step (per block size), not per layer
            self.runner.plan(md)
            self._planned = md
        out = torch.empty_like(q)
        self.runner.run(q, k, v, out, scratch, scale)
        return out

    def _layout(self, k: torch.Tensor, kv_cache: Any) -> tuple[int, torch.dtype]:
        """(block size, cache dtype): as given, else the placeholder's, else the defaults."""
        bs, dtype = self.block_size, self.cache_dtype
        if _is_layout(kv_cache):
            placeholder = kv_cache[0]
            if tuple(placeholder.shape[2:]) != tuple(k.shape[1:]):
                raise XGraphError(
                    f"profile_step: the kv_cache passed to xgraph.attention is laid out "
                    f"{tuple(placeholder.shape)}, but k is {tuple(k.shape)}: a cache is "
                    "[blocks, block_size, kv_heads, head_dim]. Pass a placeholder of that "
                    "layout, or None."
                )
            bs = bs or int(placeholder.shape[1])
            dtype = dtype or placeholder.dtype
        return bs or DEFAULT_BLOCK_SIZE, dtype or k.dtype

    def _scratch(self, k: torch.Tensor, bs: int, dtype: torch.dtype) -> KVCache:
        """The scratch cache of this layout: the step's blocks and one dummy, zeroed."""
        key = (*k.shape[1:], dtype, k.device, bs)
        got = self.scratch.get(key)
        if got is None:
            blocks = sum(-(-n // bs) for n in self.query_lens) + 1
            shape = (blocks, bs, *k.shape[1:])
            got = self.scratch[key] = (
                torch.zeros(shape, dtype=dtype, device=k.device),
                torch.zeros(shape, dtype=dtype, device=k.device),
            )
            logger.debug("profile_step: a scratch cache %s of %s", shape, dtype)
        return got

    def _metadata_for(self, bs: int, device: torch.device) -> AttentionMetadata:
        """Each sequence in its own consecutive blocks of the scratch cache, the dummy last."""
        md = self._metadata.get((bs, device))
        if md is None:
            rows, slots, at = [], [], 0
            for n in self.query_lens:
                need = -(-n // bs)
                rows.append(list(range(at, at + need)))
                slots.extend(range(at * bs, at * bs + n))
                at += need
            table = ragged_rows(rows, fill=at)  # block `at`: the dummy
            md = AttentionMetadata.build(self.query_lens, self.query_lens, table, slots, device)
            self._metadata[(bs, device)] = md
        return md


def _is_layout(kv_cache: Any) -> bool:
    """Whether `kv_cache` is a (k, v) pair of 4-d tensors, whose layout the scratch follows."""
    return (
        isinstance(kv_cache, (tuple, list))
        and len(kv_cache) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in kv_cache)
    )


def _lengths(query_lens: Sequence[int], seq_lens: Sequence[int] | None) -> list[int]:
    """The query lengths, checked: at least one sequence, each a prefill from position 0."""
    try:
        ql = [int(q) for q in query_lens]
        sl = ql if seq_lens is None else [int(s) for s in seq_lens]
    except (TypeError, ValueError):
        raise InputError(
            "profile_step: query_lens (and seq_lens) must be integers, one per sequence; got "
            f"{query_lens!r}."
        ) from None
    if not ql or min(ql) < 1:
        raise InputError(
            f"profile_step: query_lens {ql} must hold at least one sequence, each of at least "
            "one token."
        )
    if len(sl) != len(ql):
        raise InputError(f"profile_step: {len(ql)} query_lens but {len(sl)} seq_lens.")
    for i, (q, s) in enumerate(zip(ql, sl)):
        if q != s:
            raise InputError(
                f"profile_step: sequence {i} adds {q} tokens to a seq_len of {s}: its first "
                f"{s - q} keys would come from a KV cache, and a profile run has none. Profile "
                "prefills from position 0 (seq_lens equal to query_lens; a decode batch is "
                "one-token prefills)."
            )
    return ql


def _peak_stats(device: torch.device) -> Any:
    """torch's module for the device where it keeps allocator peaks (cuda, npu), else None."""
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    if mod is None or not all(
        hasattr(mod, f) for f in ("memory_allocated", "max_memory_allocated")
    ):
        return None
    return mod if hasattr(mod, "reset_peak_memory_stats") else None


@contextmanager
def profile_step(
    query_lens: Sequence[int],
    *,
    seq_lens: Sequence[int] | None = None,
    backend: str | Backend | None = None,
    runner: AttentionRunner | None = None,
    block_size: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> Iterator[ProfileStep]:
    """A step for a profile run before the KV cache exists (see `xgraph.profile_run`).

    `query_lens`: the tokens of each sequence, in the order of the forward's rows; every
    sequence a prefill from position 0 (`seq_lens`, if given, must equal them: InputError
    otherwise). `backend` (a name, a Backend, or None as for an executor) is activated, as
    building an executor activates it, and gives the prefill runner unless `runner` is
    given. The block runs under `torch.no_grad()`. On backends whose torch module keeps
    allocator peaks (CUDA, NPU) the step resets them, and `peak_bytes` is the peak above
    what was allocated when it began; None elsewhere.
    """
    if current_context() is not None:
        raise XGraphError(
            "profile_step inside another step (an executor's step, capture or eager "
            "reference): run the profile before building the executor, outside any step."
        )
    ql = _lengths(query_lens, seq_lens)
    b = get_backend(backend)
    b.activate()  # its kernels serve the core's ops (xgraph.linear), as under an executor
    ctx = ProfileStep(ql, runner or runners_for(b)[1], block_size, cache_dtype)
    stats = _peak_stats(b.device)
    base = 0
    if stats is not None:
        b.synchronize()
        base = stats.memory_allocated(b.device)
        stats.reset_peak_memory_stats(b.device)
    with torch.no_grad(), step_context(ctx):  # as the executor's eager forward runs
        yield ctx
    if stats is not None:
        b.synchronize()
        ctx.peak_bytes = int(stats.max_memory_allocated(b.device)) - base
