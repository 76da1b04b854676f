"""How far each variant's decode step is from a float32 reference of the same weights.

Per batch, each variant's final hidden states are sampled over one cache state: the KV cache
refilled from a seeded device generator right before the step (a decode step writes only
its own tokens' slots before reading them, so its output then depends on the weights, the
step and the seed alone, whatever ran before). The reference is a float32 copy of the model
and of that cache state, run eagerly with torch's own ops (no backend kernel) and the
reference attention. Each output goes through the float32 LM head; the distance is
||logits - logits_ref|| / ||logits_ref|| over the step's real rows. The gate the issue sets:
xgraph's distance at most 1.1x reduce-overhead's (torch.compile's bf16 numerics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import linear as core_linear
from ..models import Qwen3Model, Step, Workload
from ..models.qwen3_layers import Rotary
from ..paging import PagedKVCache
from ..runners import PagedDecodeRunner

GATE = 1.1  # xgraph's distance over reduce-overhead's, at most


@torch.no_grad()
def refill(cache: PagedKVCache, seed: int) -> None:
    """Every cache tensor drawn from N(0, 1) with a device generator seeded by `seed`."""
    tensors = cache.tensors()
    g = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        t.normal_(0.0, 1.0, generator=g)


def float32_twin(model: Qwen3Model) -> Qwen3Model:
    """A float32 copy of `model` on its device, with a float32 cache of the same layout."""
    c, src = model.config, model.kv_cache
    dev = src.tensors()[0].device
    shape = (c.num_layers, c.num_kv_heads, c.head_dim, src.num_blocks, src.block_size)
    cache = PagedKVCache(*shape, torch.float32, dev)
    with torch.device("meta"):
        twin = Qwen3Model(c, cache, torch.float32)
    twin = twin.to_empty(device=dev)
    if c.tie_word_embeddings:
        twin.lm_head.weight = twin.model.embed_tokens.weight
    twin.load_state_dict(model.state_dict())
    twin.rotary = Rotary(c.head_dim, c.max_position, c.rope_theta).to(dev)
    return twin.eval().requires_grad_(False)


def distance(hidden: torch.Tensor, ref_logits: torch.Tensor, head: torch.Tensor) -> float:
    logits = F.linear(hidden[: ref_logits.shape[0]].float(), head)
    return float((logits - ref_logits).norm() / ref_logits.norm())


class Fidelity:
    """Samples of each variant's step per batch, set against the float32 reference."""

    def __init__(self, w: Workload, seed: int = 1234) -> None:
        self.w, self.seed = w, seed
        self.samples: dict[int, dict[str, torch.Tensor]] = {}
        self.steps: dict[int, Step] = {}

    def sample(self, name: str, batch: int, step: Step, run: Callable[[], Any]) -> None:
        """One step of a variant over the batch's cache state; its output kept (float32)."""
        refill(self.w.cache, self.seed + batch)
        out = run()
        self.samples.setdefault(batch, {})[name] = out[:batch].float().clone()
        self.steps[batch] = step

    def finish(self) -> dict[int, dict[str, float]]:
        """Each sampled variant's distance from the float32 reference, per batch."""
        if not self.samples:
            return {}
        model = self.w.model
        dev = model.kv_cache.tensors()[0].device
        twin = float32_twin(model)
        ref = Workload(twin, self.w.max_blocks, self.w.max_seqs)
        head = twin.lm_head.weight
        out: dict[int, dict[str, float]] = {}
        with core_linear.kernels_off(dev.type):
            for batch, outputs in self.samples.items():
                refill(model.kv_cache, self.seed + batch)
                for dst, src in zip(twin.kv_cache.tensors(), model.kv_cache.tensors()):
                    dst.copy_(src)
                step = self.steps[batch]
                hidden = ref.eager(step, runner=PagedDecodeRunner(), forward=twin.forward)
                ref_logits = F.linear(hidden[:batch], head)
                out[batch] = {n: distance(h, ref_logits, head) for n, h in outputs.items()}
        del twin, ref
        self.samples.clear()
        return out
