"""How far each variant's decode step is from a float32 reference of the same weights.

Per batch, each variant's final hidden states are sampled over `STATES` cache states: the KV
cache refilled from a seeded device generator right before each step (a decode step writes
only its own tokens' slots before reading them, so its output then depends on the weights,
the step and the seed alone, whatever ran before). One state gives a ratio between two
variants that moves by several percent with the seed (a batch-1 step is one row of logits);
the distance pools every state's rows. The reference is a float32 copy of the model
and of that cache state, run eagerly with torch's own ops (no backend kernel) and the
reference attention. Each output goes through the float32 LM head; the distance is
||logits - logits_ref|| / ||logits_ref|| over the step's real rows of every state. The gate
the issue sets: xgraph's distance at most 1.1x reduce-overhead's (torch.compile's bf16
numerics).
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
STATES = 4  # cache states sampled per batch
STATE_STRIDE = 7919  # seeds of a batch's states: seed + batch + STATE_STRIDE * i


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


def distance(
    hidden: list[torch.Tensor], ref_logits: list[torch.Tensor], head: torch.Tensor
) -> float:
    """||logits - ref|| / ||ref|| over the rows of every state together."""
    err = ref = 0.0
    for h, r in zip(hidden, ref_logits, strict=True):
        logits = F.linear(h[: r.shape[0]].float(), head)
        err += float((logits - r).square().sum())
        ref += float(r.square().sum())
    return (err / ref) ** 0.5


class Fidelity:
    """Samples of each variant's step per batch, set against the float32 reference."""

    def __init__(self, w: Workload, seed: int = 1234, states: int = STATES) -> None:
        self.w, self.seed, self.states = w, seed, states
        self.samples: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.steps: dict[int, Step] = {}

    def _seed(self, batch: int, i: int) -> int:
        return self.seed + batch + STATE_STRIDE * i

    def sample(self, name: str, batch: int, step: Step, run: Callable[[], Any]) -> None:
        """A step of a variant over each of the batch's cache states; outputs kept (float32)."""
        outs = []
        for i in range(self.states):
            refill(self.w.cache, self._seed(batch, i))
            outs.append(run()[:batch].float().clone())
        self.samples.setdefault(batch, {})[name] = outs
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
                refs = [self._reference(ref, twin, batch, i) for i in range(self.states)]
                out[batch] = {n: distance(h, refs, head) for n, h in outputs.items()}
        del twin, ref
        self.samples.clear()
        return out

    def _reference(self, ref: Workload, twin: Qwen3Model, batch: int, i: int) -> torch.Tensor:
        """The float32 logits of the batch's step over its cache state i."""
        refill(self.w.model.kv_cache, self._seed(batch, i))
        for dst, src in zip(twin.kv_cache.tensors(), self.w.model.kv_cache.tensors()):
            dst.copy_(src)
        hidden = ref.eager(self.steps[batch], runner=PagedDecodeRunner(), forward=twin.forward)
        return F.linear(hidden[:batch], twin.lm_head.weight)
