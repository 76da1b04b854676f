"""Parallel: the torch.distributed groups one rank's executor runs in.

    tp = dist.new_group(...)                      # the model's own groups (NCCL, HCCL, gloo)
    par = xgraph.Parallel(tp=tp, dp=dp, comm_dims=["num_comm_tokens"], timeout=30)
    ex = xgraph.GraphExecutor(forward, ..., parallel=par)

`group` is the set of ranks that agree each step: every rank whose forward shares a
collective with this one's (default: the default group). Making a Parallel is collective
over it: the side group it agrees on (gloo, host memory only) is created here, once, and
shared by every executor given this Parallel (their steps must then come in the same order
on every rank, as their collectives must anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..errors import XGraphError
from .channel import Channel
from .manifest import GroupLabels

ROLES = ("tp", "dp", "ep")


@dataclass(eq=False)
class Parallel:
    """Process groups of one rank, the ranks that agree with it, and the wait bound.

    Args:
        tp: the tensor-parallel group (ranks running the same batch on shards of the model).
        dp: the data-parallel group (ranks running their own batches; padded to the largest).
        ep: the expert-parallel group of MoE layers (all-to-all dispatch and combine).
        group: the ranks that agree each step; default: the default group.
        comm_dims: declared key dims (Dim with buckets) whose size is the largest token
            count of the group each step, the communication size of an MoE all-to-all
            (read in the forward with `xgraph.distributed.comm_size(name)`).
        timeout: seconds any wait on the side group may take before every rank raises;
            give the model's own groups the same bound (`new_group(timeout=...)`).
    """

    tp: Any = None
    dp: Any = None
    ep: Any = None
    group: Any = None
    comm_dims: Sequence[str] = ()
    timeout: float = 60.0
    channel: Channel | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise XGraphError(
                "xgraph.Parallel needs torch.distributed initialised first "
                "(torch.distributed.init_process_group, e.g. under torchrun)."
            )
        if self.timeout <= 0:
            raise XGraphError(f"Parallel(timeout={self.timeout}): give a positive bound.")
        world = self.group if self.group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(world)
        for role in ROLES:
            sub = getattr(self, role)
            if sub is not None and not set(dist.get_process_group_ranks(sub)) <= set(self.ranks):
                raise XGraphError(
                    f"Parallel: the {role} group has ranks outside the agreeing group "
                    f"{self.ranks}; pass group= holding every rank that shares a collective."
                )
        self.comm_dims = tuple(self.comm_dims)
        self.rank = self.ranks.index(dist.get_rank())
        self.world_size = len(self.ranks)
        self.labels = GroupLabels({"world": world, **{r: getattr(self, r) for r in ROLES}})
        self.tp_leader = min(dist.get_process_group_ranks(self.tp)) if self.tp else -1
        if self.world_size > 1:
            self.channel = Channel(self.ranks, self.timeout)
        self._prepared: set[tuple[str, str]] = set()

    def groups(self) -> list[Any]:
        """The model's groups given here, each once."""
        out: dict[str, Any] = {}
        for role in ROLES:
            g = getattr(self, role)
            if g is not None:
                out.setdefault(g.group_name, g)
        return list(out.values())

    def prepare(self, backend: Any) -> None:
        """Let the backend make the groups capturable (Backend.prepare_collectives), once
        per backend and group; collective over every group."""
        todo = [g for g in self.groups() if (backend.name, g.group_name) not in self._prepared]
        if not todo:
            return
        try:
            backend.prepare_collectives(todo)
        except Exception as exc:
            raise XGraphError(
                f"Backend {backend.name!r} could not prepare collectives on "
                f"{[g.group_name for g in todo]} for capture ({type(exc).__name__}: {exc}). "
                "Check that the groups' backend suits this device (NCCL for cuda, HCCL for "
                "npu, gloo for cpu) and that every rank builds its executor at the same point."
            ) from exc
        self._prepared.update((backend.name, g.group_name) for g in todo)

    def close(self) -> None:
        """Stop using the side group (every executor using this Parallel must be done). The
        group stays registered with torch.distributed until `destroy_process_group()`:
        torch names a group made with local synchronization by its ranks and the number of
        live groups, so destroying this one would hand its name to the next Parallel's,
        whose rendezvous would then read this one's stale addresses from the store."""
        self.channel = None
