"""Graphs across ranks: tensor, data and expert parallelism through torch.distributed.

`GraphExecutor(..., parallel=xgraph.Parallel(tp=..., dp=...))` makes the ranks agree on
every step's path and key in one small exchange on a side group, capture each key together
with its collectives checked before they are issued (a capture manifest), and raise on
every rank, within a timeout, instead of hanging. docs/distributed.md tells the whole story.
"""

from .errors import (
    CollectiveMismatchError,
    DistributedError,
    OutOfStepError,
    PeerCaptureError,
    PeerStepError,
)
from .lockstep import SINGLE, Lockstep, SingleRank, attach, comm_size, comm_sizes, group_stats
from .manifest import Collective, CollectiveRecorder
from .parallel import Parallel

__all__ = [
    "SINGLE",
    "Collective",
    "CollectiveMismatchError",
    "CollectiveRecorder",
    "DistributedError",
    "Lockstep",
    "OutOfStepError",
    "Parallel",
    "PeerCaptureError",
    "PeerStepError",
    "SingleRank",
    "attach",
    "comm_size",
    "comm_sizes",
    "group_stats",
]
