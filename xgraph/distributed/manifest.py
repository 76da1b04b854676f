"""Capture manifests: the ordered collectives a forward issues, seen through torch dispatch.

Every collective of torch.distributed reaches the dispatcher as an op: `dist.all_reduce`,
`all_gather_into_tensor`, `all_to_all_single`, `broadcast`, `barrier`, `send` / `recv`
(and the ProcessGroup methods behind them) as `c10d::*` ops taking the ProcessGroup, and
the functional collectives (`torch.distributed._functional_collectives`, DTensor) as
`_c10d_functional::*` ops taking the group's name. A TorchDispatchMode sees each one
before it is issued, with its tensors, group and reduce op; `CollectiveRecorder` turns them
into `Collective` descriptors, in order, and may check each one with the other ranks
before letting it through.

What it does not see: collectives issued below the dispatcher (a library calling NCCL or
HCCL itself, custom all-reduce kernels, symmetric-memory kernels launched directly), work
of other threads, and code compiled by torch.compile (Dynamo would run the eager forward
under a dispatch mode, so compiled executors record no manifest; see docs/distributed.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# functional collectives' helpers: they wait for or wrap a result, and issue nothing
_HELPERS = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"}
# arguments that say how, not what: they may differ between ranks without a mismatch
_IGNORED = {"async_op", "timeout", "sparse_indices", "tag"}


def is_collective(func: Any) -> bool:
    """Whether a dispatched op is a collective (c10d or functional)."""
    name = func._schema.name
    if name.startswith("c10d::"):
        return any(str(r.type).endswith(".Work") for r in func._schema.returns)
    return name.startswith("_c10d_functional::") and name not in _HELPERS


@dataclass(frozen=True)
class Collective:
    """One collective as ranks compare it: op, group role, tensors and the other arguments."""

    op: str  # e.g. "c10d::allreduce_"
    group: str  # the group's role ("tp", "dp", "ep", "world") or its size
    tensors: tuple[str, ...]  # "float32[8, 64]" per tensor argument, in order
    detail: tuple[str, ...]  # "reduce_op=SUM", "output_split_sizes=[4, 4]", ...

    def __str__(self) -> str:
        args = ", ".join((*self.tensors, *self.detail))
        return f"{self.op}({args}) on {self.group}"

    def digest(self) -> int:
        """A stable 63-bit hash (the same on every rank and every run)."""
        return _digest(str(self))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def manifest_digest(manifest: Sequence[Collective]) -> int:
    """The hash ranks compare after a capture: of every collective, in order."""
    return _digest("\n".join(str(c) for c in manifest))


def _tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _reduce_op(value: Any) -> str:
    if isinstance(value, str):
        return value.upper()
    code = value.op() if isinstance(value, torch.ScriptObject) else value
    try:
        return dist.ReduceOp.RedOpType(int(code)).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(code)


class GroupLabels:
    """Names process groups by role, so ranks of different TP groups compare alike."""

    def __init__(self, roles: Mapping[str, Any]) -> None:
        self.roles = {g.group_name: role for role, g in roles.items() if g is not None}

    def __call__(self, group: Any) -> str:
        if isinstance(group, torch.ScriptObject):
            unbox = getattr(dist.ProcessGroup, "unbox", None)
            if unbox is None:  # a torch without it: groups are told apart by nothing
                return "a group"
            group = unbox(group)
        elif isinstance(group, str):
            name = group
            role = self.roles.get(name)
            if role is not None:
                return role
            group = torch._C._distributed_c10d._resolve_process_group(name)
        role = self.roles.get(group.group_name)
        return role if role is not None else f"a group of {group.size()} ranks"


def describe(func: Any, args: tuple, kwargs: dict, labels: Callable[[Any], str]) -> Collective:
    """The Collective a dispatched collective op stands for."""
    schema = func._schema
    tensors: list[str] = []
    detail: list[str] = []
    group = "?"
    values = list(args) + [
        kwargs.get(a.name, a.default_value) for a in schema.arguments[len(args) :]
    ]
    for a, v in zip(schema.arguments, values):
        kind = str(a.type)
        if a.name in _IGNORED or v is None:
            continue
        if "Tensor" in kind:
            flat = v if isinstance(v, (list, tuple)) else [v]
            for x in flat:
                for t in x if isinstance(x, (list, tuple)) else [x]:
                    tensors.append(_tensor(t))
        elif kind.endswith("ProcessGroup") or a.name in ("group_name", "group"):
            group = labels(v)
        elif kind.endswith("ReduceOp") or a.name == "reduce_op":
            detail.append(f"{a.name}={_reduce_op(v)}")
        else:
            detail.append(f"{a.name}={list(v) if isinstance(v, (list, tuple)) else v}")
    return Collective(schema.name, group, tuple(tensors), tuple(detail))


# called with (the collective, its index) before it is issued; raises to stop it
Announce = Callable[[Collective, int], None]


class CollectiveRecorder(TorchDispatchMode):
    """Records the collectives issued under it, in order; `announce` sees each one first."""

    def __init__(self, labels: Callable[[Any], str], announce: Announce | None = None) -> None:
        super().__init__()
        self.labels = labels
        self.announce = announce
        self.manifest: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if is_collective(func):
            c = describe(func, args, kwargs, self.labels)
            if self.announce is not None:
                self.announce(c, len(self.manifest))
            self.manifest.append(c)
        return func(*args, **kwargs)


def first_difference(manifests: Sequence[Sequence[str]]) -> tuple[int, list[str]]:
    """The index of the first collective on which the ranks' manifests differ, and each
    rank's version of it ("(none: its forward ended)" past the end of a shorter one)."""
    longest = max(len(m) for m in manifests)
    for i in range(longest):
        seen = [m[i] if i < len(m) else "(none: its forward ended)" for m in manifests]
        if len(set(seen)) > 1:
            return i, seen
    return -1, []
