"""The side group the ranks agree on: one small all-gather per exchange, on the host.

A gloo group over the agreeing ranks, created once, whatever the backend of the model's
own groups (NCCL, HCCL, gloo): it moves a few int64 per rank through host memory, so it
never waits on, or enters, a device stream. Every message has the same length (gloo aborts
the process on a size mismatch, so sizes never depend on what a rank sends); its first
field says what it is (a step, a collective of a capture, a capture's result), and a rank
that finds another kind of message in the same exchange knows the ranks fell out of step.

Every exchange is bounded by the group's timeout; a dead peer or a timeout raises
DistributedError on every survivor. Failures carry their text in a second exchange
(`gather_objects`), made only on the error path.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import DistributedError

logger = logging.getLogger("xgraph")

MESSAGE = 20  # int64 fields per rank and exchange (agreement: 11 + 8 key dims)

# what a message is (field 0)
STEP, ANNOUNCE, RESULT, OBJECTS = 1, 2, 3, 4
TAGS = {
    STEP: "step agreement",
    ANNOUNCE: "a collective of a capture",
    RESULT: "a capture's end",
    OBJECTS: "an error's details",
}

# all_gather_into_tensor under its newer name where torch has it (2.13 deprecates the old one)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Channel:
    """Fixed-size int64 all-gathers over a gloo side group (see the module docstring)."""

    def __init__(self, ranks: list[int], timeout: float) -> None:
        self.ranks = ranks
        self.timeout = timeout
        try:
            self.group = dist.new_group(
                ranks,
                backend="gloo",
                timeout=datetime.timedelta(seconds=timeout),
                use_local_synchronization=True,  # only these ranks take part in creating it
            )
        except Exception as exc:
            raise DistributedError(
                f"Parallel: the side group over ranks {ranks} could not be created "
                f"({type(exc).__name__}: {exc}). Every rank of the group makes its Parallel "
                "at the same point; check that each one got there within the timeout and "
                "that the default group's store is reachable from every rank."
            ) from exc
        self.rank = dist.get_rank(self.group)
        self.size = len(ranks)
        self._send = torch.zeros(MESSAGE, dtype=torch.int64, device="cpu")
        self._recv = torch.zeros(self.size * MESSAGE, dtype=torch.int64, device="cpu")
        # numpy views made once: Tensor.numpy is blocked while a graph captures, and an
        # exchange may happen in the middle of a capture (a collective checked before it runs)
        self._send_np = self._send.numpy()
        self._recv_np = self._recv.numpy().reshape(self.size, MESSAGE)
        self.exchanges = 0
        self.seconds = 0.0  # host time spent in exchanges
        self.broken: str | None = None

    def exchange(self, message: list[int], what: str) -> list[list[int]]:
        """Send this rank's message, return every rank's (indexed by rank in the group)."""
        if self.broken is not None:
            raise DistributedError(self.broken)
        send = self._send_np
        send[:] = 0
        send[: len(message)] = message
        t0 = time.perf_counter()
        try:
            all_gather_single(self._recv, self._send, group=self.group)
        except Exception as exc:
            raise self.fail(what, exc) from exc
        self.seconds += time.perf_counter() - t0
        self.exchanges += 1
        return self._recv_np.tolist()

    def gather_objects(self, obj: Any, what: str) -> list[Any]:
        """Every rank's `obj` (picklable): the error path's texts and manifests. Pickled bytes
        go through uint8 tensors read with ctypes: no Tensor.numpy or tolist, which a capture
        in progress blocks (torch's all_gather_object uses them)."""
        data = pickle.dumps(obj)
        sizes = [m[1] for m in self.exchange([OBJECTS, len(data)], what)]
        width = max(sizes)
        out = torch.zeros(self.size * width, dtype=torch.uint8, device="cpu")
        mine = torch.zeros(width, dtype=torch.uint8, device="cpu")
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            all_gather_single(out, mine, group=self.group)
        except Exception as exc:
            raise self.fail(what, exc) from exc
        base = out.data_ptr()
        return [pickle.loads(ctypes.string_at(base + r * width, n)) for r, n in enumerate(sizes)]

    def fail(self, what: str, exc: BaseException) -> DistributedError:
        """Mark the channel unusable and say so, with the cause."""
        self.broken = (
            f"rank {self.rank} of {self.size}: the ranks did not meet at {what} within "
            f"{self.timeout:g} s, or a rank is gone ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}). A peer "
            "died, hangs, or runs other code; nothing more can be agreed on this group. Close "
            "the executor (its memory is freed as usual) and restart the process group."
        )
        logger.error("xgraph: %s", self.broken)
        return DistributedError(self.broken)

    def out_of_step(self, table: list[list[int]], what: str) -> DistributedError:
        """The ranks sent different kinds of message in one exchange."""
        seen = ", ".join(
            f"rank {r}: {TAGS.get(m[0], f'message {m[0]}')}" for r, m in enumerate(table)
        )
        self.broken = (
            f"rank {self.rank}: the ranks are out of lockstep at {what} ({seen}). A rank "
            "raised, skipped or repeated a step or capture the others ran. Close the executor "
            "and restart the process group; make every rank call the executor alike."
        )
        logger.error("xgraph: %s", self.broken)
        return DistributedError(self.broken)
