"""Run a function on several fresh processes joined in a process group, bounded in time.

    outcomes = run_ranks(fn, world_size=2, args=(...,), timeout=60)

For tests, CPU benchmarks and dry runs; deployments launch with torchrun (or any launcher)
and xgraph uses the groups they made. Each rank runs `fn(rank, world_size, *args)` after
`init_process_group` (gloo by default; the TCP store on a free local port); its return
value comes back pickled. Nothing can hang: past `timeout` every process still running is
killed, and the outcome of each rank says what happened (returned, raised, died with a
signal or exit code, or killed at the deadline). Processes end with os._exit once their
result is sent, so no process-group teardown at interpreter exit can hang or abort them.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import XGraphError


@dataclass
class Outcome:
    """What one rank did: status "ok" (value), "raised" (error), "died" or "killed"."""

    rank: int
    status: str
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    seconds: float = 0.0

    def __str__(self) -> str:
        if self.status == "ok":
            return f"rank {self.rank}: ok in {self.seconds:.1f} s"
        if self.status == "raised":
            return f"rank {self.rank}: raised after {self.seconds:.1f} s\n{self.error}"
        return f"rank {self.rank}: {self.status} (exit code {self.exitcode})"


class RanksFailed(XGraphError):
    """A rank of run_ranks did not return normally (see `outcomes`)."""

    def __init__(self, outcomes: list[Outcome]) -> None:
        self.outcomes = outcomes
        super().__init__("\n".join(str(o) for o in outcomes if o.status != "ok"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    args: tuple,
    port: int,
    backend: str,
    group_timeout: float,
    results: Any,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    t0 = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # several ranks share few cores
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per process
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        value = fn(rank, world, *args)
        results.put((rank, "ok", value, "", time.perf_counter() - t0))
    except BaseException:
        results.put((rank, "raised", None, traceback.format_exc(), time.perf_counter() - t0))
    results.close()
    results.join_thread()  # the result is on its way before the process ends
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 30.0,
    check: bool = True,
) -> list[Outcome]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes (module docstring).

    `fn` and `args` must be picklable (a module-level function). `group_timeout` bounds the
    default group's collectives. With `check`, any rank that does not return raises
    RanksFailed listing every rank's outcome.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, args, port, backend, group_timeout, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = _collect(procs, results, time.monotonic() + timeout)
    if check and any(o.status != "ok" for o in outcomes):
        raise RanksFailed(outcomes)
    return outcomes


def _collect(procs: list[Any], results: Any, deadline: float) -> list[Outcome]:
    got: dict[int, Outcome] = {}
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value, error, seconds = results.get(timeout=0.1)
            got[rank] = Outcome(rank, status, value, error, seconds=seconds)
        except queue.Empty:
            for r, p in enumerate(procs):  # a rank that died sends nothing
                if r not in got and not p.is_alive() and p.exitcode not in (None, 0):
                    got[r] = Outcome(r, "died", exitcode=p.exitcode)
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(5)
            got.setdefault(r, Outcome(r, "killed", exitcode=p.exitcode))
        got.setdefault(r, Outcome(r, "died", exitcode=p.exitcode))
        got[r].exitcode = p.exitcode
    results.close()
    return [got[r] for r in range(len(procs))]
