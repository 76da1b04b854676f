"""How close the tensor-parallel path's outputs are to the truth, for the multi-rank bench
and the GPU tool (adapters/cuda/tools/tp_graphs.py); docs/distributed.md states the rule.

In bf16 two correct kernel paths of a 28-layer model differ by a few percent of the output's
norm (each rounds differently, and the layers carry the difference on), so "the executor
against eager" has no honest fixed bound. Each step is also run on a float32 copy of the
same weights (the bf16 weights upcast, the same KV cache contents upcast, eager with the
reference runners), and every path is measured against it by the relative norm of the
difference, ||out - fp32|| / ||fp32||. The criterion of a bf16 row:

    executor_vs_fp32 <= RATIO * eager_vs_fp32 + EPSILON      (RATIO 1.25, EPSILON 1e-3)

the executor no further from float32 than the eager bf16 forward is, within the spread of
two correct bf16 kernels: on the Qwen3-0.6B shape (CPU, bf16, 12 decode steps) the reference
decode runner (scores rounded to bf16) and one keeping scores in float32 were 0.014-0.045
from float32 each, 0.018-0.056 from each other, and either's distance over the other's
reached 1.18. A path error (a wrong shard, a missing all-reduce, stale metadata) is of the
order of the output itself. In float32 (the CPU)
the executor must equal eager bit for bit. Over a group of one, the TP executor must also
equal the single-rank model's executor bit for bit (the same kernels run). The numbers of
every path (executor, eager, the hand-captured graph where there is one, the single-rank
executor) go into the row, whether or not they count.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models import Workload
from ..models.qwen3_tp import Qwen3TPModel

RATIO = 1.25  # the executor's distance to float32 over eager bf16's, at most
EPSILON = 1e-3  # plus this much (relative norm): rounding of a near-zero distance


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def fp32_twin(w: Workload) -> Workload | None:
    """A float32 copy of a TP workload's model (its weights upcast, one tensor at a time)
    with a float32 KV cache, or None when the model is float32 already."""
    m = w.model
    if m.model.embed_tokens.weight.dtype == torch.float32:
        return None
    cache = w.cache
    twin = Qwen3TPModel.build(
        m.config,
        m.shard.group,
        num_blocks=cache.num_blocks,
        block_size=cache.block_size,
        dtype=torch.float32,
        device=cache.tensors()[0].device,
        random_shards=True,  # drawn on the device, then overwritten: no host copy
    )
    mine = dict(twin.named_parameters())
    for name, p in m.named_parameters():
        mine[name].copy_(p)
    return Workload(twin, w.max_blocks, w.max_seqs)


def copy_cache(src: Workload, dst: Workload) -> None:
    """dst's KV cache holds src's values (cast to dst's dtype)."""
    for a, b in zip(dst.cache.tensors(), src.cache.tensors()):
        a.copy_(b)


def fill_cache(w: Workload, seed: int) -> None:
    """Seeded normal values in every cache slot, drawn on the cache's device."""
    dev = w.cache.tensors()[0].device
    g = torch.Generator(device=dev).manual_seed(seed)
    for t in w.cache.tensors():
        t.copy_(torch.randn(t.shape, generator=g, device=dev, dtype=torch.float32))


class Fidelity:
    """The references of one TP workload: its float32 twin and, over a group of one, the
    single-rank workload whose executor must equal the TP executor bit for bit."""

    def __init__(self, w: Workload, single: Workload | None, world: int) -> None:
        self.w, self.world = w, world
        self.twin = fp32_twin(w)
        self.single = single if world == 1 else None  # same kv heads, same weights

    def start(self) -> None:
        """Before a step: the single-rank cache holds the TP cache's values."""
        if self.single is not None:
            copy_cache(self.w, self.single)

    def fp32(self, step: Any, runner: Any = None, num_tokens: int | None = None) -> Any:
        """The float32 twin's eager output of a (padded) step, its cache the TP cache's."""
        if self.twin is None:
            return None
        copy_cache(self.w, self.twin)
        return self.twin.eager(step, runner, num_tokens=num_tokens)

    def row(self, out: torch.Tensor, eager: torch.Tensor, **others: Any) -> dict[str, Any]:
        """distances(out, eager, **others) of one step."""
        return distances(out, eager, **others)


def distances(
    out: torch.Tensor,
    eager: torch.Tensor,
    fp32: torch.Tensor | None = None,
    hand: torch.Tensor | None = None,
    single: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every distance of one step's executor output `out`, and whether the criterion holds
    (`equal`): against eager, the float32 twin's output, the hand-captured graph's and the
    single-rank executor's, each where given."""
    row: dict[str, Any] = {"exec_vs_eager": rel(out, eager)}
    row["exec_vs_eager_max_abs"] = float((out.float() - eager.float()).abs().max())
    if fp32 is not None:
        row["exec_vs_fp32"], row["eager_vs_fp32"] = rel(out, fp32), rel(eager, fp32)
        row["hand_vs_fp32"] = rel(hand, fp32) if hand is not None else None
        row["bound"] = RATIO * row["eager_vs_fp32"] + EPSILON
        row["within_fp32_bound"] = row["exec_vs_fp32"] <= row["bound"]
    else:  # float32 already: bit for bit
        row["exec_equals_eager"] = torch.equal(out, eager)
    if hand is not None:
        row["hand_vs_eager"] = rel(hand, eager)
        row["exec_equals_hand"] = torch.equal(out, hand)
    if single is not None:
        row["exec_equals_single"] = torch.equal(out, single)
        row["exec_vs_single_max_abs"] = float((out.float() - single.float()).abs().max())
    row["equal"] = criterion(row)
    return row


def criterion(row: dict[str, Any]) -> bool:
    """Whether a row holds the rule: within the float32 bound (bf16) or equal to eager
    (float32), and equal to the single-rank executor where it was compared."""
    ok = row["within_fp32_bound"] if "within_fp32_bound" in row else row["exec_equals_eager"]
    return bool(ok and row.get("exec_equals_single", True))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over a stage's rows: how many, which fail the criterion, and the largest executor
    distance to float32 over eager's (bf16) and to eager."""
    rows = [r for r in rows if "equal" in r]
    ratios = [r["exec_vs_fp32"] / r["eager_vs_fp32"] for r in rows if r.get("eager_vs_fp32")]
    return {
        "rows": len(rows),
        "failing": [r.get("batch", r.get("tokens")) for r in rows if not r["equal"]],
        "worst_exec_over_eager_vs_fp32": max(ratios, default=None),
        "max_exec_vs_eager": max((r["exec_vs_eager"] for r in rows), default=None),
    }
