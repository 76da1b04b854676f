"""Sleep and wake: device memory given back between uses and restored in place, every
captured graph kept (docs/sleep.md).

- `ex.sleep()` / `ex.wake()`: the executor's graph memory (every physical chunk of its
  SharedPhysicalPool) and persistent buffers. Every capture keeps its address range, so
  every captured key replays after wake without a recapture. Executors that share graph
  memory share its sleep: sleeping one sleeps all of them.
- `xgraph.sleep(*executors, tags=None, offload=None)` / `xgraph.wake(*executors, tags=None)`:
  the executors given, and the memory regions (`memory_region`) of their backend with those
  tags (None: every region; no executors: the regions of `backend`). `offload` names the
  regions copied to host memory and restored on wake (default: "weights", where that region
  exists); the others are dropped and come back zeroed.

Sleep waits for the steps in flight over what it gives back (each executor's step lock) and
for the device's queued work. While anything an executor's graphs use is asleep, its steps
raise AsleepError naming what to wake. Sleep and wake are idempotent. A wake that fails
midway (a create or a map the driver refuses) undoes what it did and raises: everything is
asleep again, the books exact, and the next wake starts over.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .backends.cpu.vmm import resident_in
from .errors import AsleepError, ConcurrentStepError, XGraphError
from .interfaces import Backend
from .lifetime import Holdings
from .memory import settled_reading
from .plugins import get_backend
from .pool import SharedPhysicalPool
from .pool_sleep import is_asleep, sleep_pool, wake_pool
from .regions import Region, region, regions
from .restorable import RestorableSegments

logger = logging.getLogger("xgraph")

GRAPHS = "graph memory and persistent buffers"
_open: weakref.WeakSet[Holdings] = weakref.WeakSet()  # every executor's, for region sleep


@dataclass(frozen=True)
class SleepReport:
    """What a sleep gave back, by the books."""

    released_bytes: int  # physical device memory given back
    offloaded_bytes: int  # of it, copied to host memory first
    seconds: float


@dataclass(frozen=True)
class WakeReport:
    restored_bytes: int  # physical device memory created and mapped again
    seconds: float


def memory_region(tag: str, backend: str | Backend | None = None) -> Any:
    """Allocate the block's device tensors in the memory region `tag` (xgraph.regions).

    `backend`: a name or Backend (default: XGRAPH_BACKEND, else the best available one).
    A context manager: `with xgraph.memory_region("kv_cache") as region: ...`."""
    return region(tag, get_backend(backend)).allocating()


def join(holdings: Holdings) -> None:
    """A new executor's holdings: asleep at once if what its graphs use is asleep."""
    _open.add(holdings)
    physical = holdings.memory.physical
    if physical is not None and physical.asleep:
        holdings.asleep.add(GRAPHS)
    holdings.asleep.update(_reason(r) for r in regions(holdings.backend) if r.asleep)


def asleep_error(name: str, reasons: set[str]) -> AsleepError:
    what = "; ".join(sorted(reasons))
    return AsleepError(
        f"{name} is asleep: sleep() gave back memory its graphs use ({what}). Call wake() on "
        "the executor for its graph memory, or xgraph.wake() for memory regions, before the "
        "next step."
    )


def _reason(r: Region) -> str:
    return f"memory region {r.tag!r}"


# -- what a call puts to sleep -----------------------------------------------------------


def _holdings(executor: Any) -> Holdings:
    held = getattr(executor, "holdings", None)
    if not isinstance(held, Holdings):
        raise XGraphError(f"sleep/wake take GraphExecutors; got {type(executor).__name__}.")
    if held.closed:
        raise XGraphError(f"{held.name} is closed; there is nothing to put to sleep or wake.")
    return held


def _pools(held: list[Holdings]) -> list[SharedPhysicalPool]:
    out: list[SharedPhysicalPool] = []
    for h in held:
        p = h.memory.physical
        if p is None:
            raise XGraphError(
                f"{h.name}: sleep needs 'shared-physical' graph memory (the default where the "
                f"backend has virtual memory); its memory is {h.memory.mode.value!r}, whose "
                "native pools cannot be given back at the same addresses."
            )
        if p not in out:
            out.append(p)
    return out


def _group(pools: list[SharedPhysicalPool]) -> list[Holdings]:
    """Every executor over the pools: they share the graph memory being put to sleep."""
    out: list[Holdings] = []
    for p in pools:
        for memory in p.memories():
            out.extend(h for h in memory.holdings() if h not in out)
    return out


def _chosen(
    executors: tuple[Any, ...], tags: Iterable[str] | str | None, backend: Any
) -> list[Region]:
    backs = list(dict.fromkeys(e.backend for e in executors)) or [get_backend(backend)]
    wanted = None if tags is None else [tags] if isinstance(tags, str) else list(tags)
    found = [r for b in backs for r in regions(b, wanted)]
    missing = set(wanted or ()) - {r.tag for r in found}
    if missing:
        known = sorted({r.tag for b in backs for r in regions(b)})
        raise XGraphError(
            f"no memory region has the tag(s) {sorted(missing)}; the regions are {known}."
        )
    return found


def _offloaded(rs: list[Region], offload: Iterable[str] | str | None) -> set[str]:
    tags = {r.tag for r in rs}
    if offload is None:
        return {"weights"} & tags
    keep = {offload} if isinstance(offload, str) else set(offload)
    if keep - tags:
        raise XGraphError(
            f"offload names {sorted(keep - tags)}, which is not among the regions being put "
            f"to sleep ({sorted(tags)}); a region left out of offload is dropped, not kept."
        )
    return keep


@contextlib.contextmanager
def _quiet(holdings: list[Holdings]) -> Iterator[None]:
    """Hold each executor's step lock: wait for the steps in flight and keep new ones out."""
    for h in holdings:
        if h.memory.steps.held_here():
            raise ConcurrentStepError(
                "sleep() or wake() was called inside a step over the memory it would give "
                "back (a forward calling it); call it between steps."
            )
    with contextlib.ExitStack() as stack:
        for h in sorted(holdings, key=id):  # one order, so two sleepers never deadlock
            h.busy.acquire()
            stack.callback(h.busy.release)
        yield


def _readers(backends: set[Backend], also: list[Holdings]) -> list[Holdings]:
    """Every open executor on the backends (their graphs may read the regions)."""
    out = list(also)
    out.extend(h for h in list(_open) if h.backend in backends and not h.closed and h not in out)
    return out


# -- sleep and wake ----------------------------------------------------------------------


def sleep(
    *executors: Any,
    tags: Iterable[str] | str | None = None,
    offload: Iterable[str] | str | None = None,
    backend: str | Backend | None = None,
) -> SleepReport:
    """Give back the executors' graph memory and persistent buffers, and the memory regions
    `tags` (offloading `offload` to host memory); see the module docstring."""
    t0 = time.perf_counter()
    pools = _pools([_holdings(e) for e in executors])
    group = _group(pools)
    rs = _chosen(executors, tags, backend)
    keep = _offloaded(rs, offload)
    backs = {h.backend for h in group} | {r.backend for r in rs}
    readers = _readers({r.backend for r in rs}, group)
    released = copied = 0
    with _quiet(readers):
        for b in backs:
            b.synchronize()  # queued replays may still use what goes away
        for h in group:
            h.asleep.add(GRAPHS)
        for h in readers:
            h.asleep.update(_reason(r) for r in rs)
        for h in group:
            if h.arena is not None:
                gone, saved = h.arena.sleep()
                released, copied = released + gone, copied + saved
        for p in pools:
            released += sleep_pool(p)
        for r in rs:
            gone, saved = r.sleep(r.tag in keep)
            released, copied = released + gone, copied + saved
    return SleepReport(released, copied, time.perf_counter() - t0)


def wake(
    *executors: Any,
    tags: Iterable[str] | str | None = None,
    backend: str | Backend | None = None,
) -> WakeReport:
    """Map fresh memory at the same addresses for the executors given and the memory regions
    `tags`, restoring what was offloaded; see the module docstring."""
    t0 = time.perf_counter()
    pools = _pools([_holdings(e) for e in executors])
    group = _group(pools)
    rs = _chosen(executors, tags, backend)
    readers = _readers({r.backend for r in rs}, group)
    with _quiet(readers):
        restored = _wake_all(rs, pools, group)
        for h in group:
            h.asleep.discard(GRAPHS)
        for h in readers:
            h.asleep.difference_update(_reason(r) for r in rs)
    return WakeReport(restored, time.perf_counter() - t0)


def _wake_all(rs: list[Region], pools: list[SharedPhysicalPool], group: list[Holdings]) -> int:
    """Regions, graph memory, then buffers; a failure puts back to sleep what woke."""
    sets = [r.segments for r in rs] + [h.arena.segments for h in group if h.arena is not None]
    woke: list[RestorableSegments] = []
    woke_pools: list[SharedPhysicalPool] = []
    restored = 0
    try:
        for s in sets[: len(rs)]:
            if s.asleep:
                restored += s.restore(commit=False)
                woke.append(s)
        for p in pools:
            if is_asleep(p):
                restored += wake_pool(p)
                woke_pools.append(p)
        for s in sets[len(rs) :]:
            if s.asleep:
                restored += s.restore(commit=False)
                woke.append(s)
    except BaseException:
        _back_to_sleep(woke, woke_pools)
        raise
    for s in woke:
        s.commit()
    return restored


def _back_to_sleep(woke: list[RestorableSegments], pools: list[SharedPhysicalPool]) -> None:
    for s in reversed(woke):
        try:
            s.undo_restore()
        except Exception:  # the wake's own failure is the one raised; this one is logged
            logger.exception("putting %s back to sleep after a failed wake failed", s.what)
    for p in reversed(pools):
        try:
            sleep_pool(p)
        except Exception:
            logger.exception("putting graph memory back to sleep after a failed wake failed")


# -- readings ----------------------------------------------------------------------------


def address_ranges(
    *executors: Any, tags: Iterable[str] | str | None = None, backend: Any = None
) -> list[tuple[int, int]]:
    """(start, size) of every reservation that sleep keeps for the executors (their graph
    memory and persistent buffers) and the memory regions `tags`."""
    out: list[tuple[int, int]] = []
    group = _group(_pools([_holdings(e) for e in executors]))
    for h in group:
        out.extend((s.base, s.size) for s in h.memory.physical.spaces if not s.closed)  # type: ignore[union-attr]
        if h.arena is not None:
            out.extend(h.arena.segments.ranges())
    for r in _chosen(executors, tags, backend):
        out.extend(r.segments.ranges())
    return list(dict.fromkeys(out))


def memory_reading(backend: Backend, ranges: list[tuple[int, int]]) -> int | None:
    """The driver's reading of device memory in use, for sleep's before and after: on a
    backend whose device is the host, the kernel's resident pages of `ranges` (offloaded
    copies are host memory too, so the process's total would not drop); elsewhere the
    device's memory in use once queued work is done and cached memory returned."""
    if backend.device.type == "cpu":
        return resident_in(ranges)
    return settled_reading(backend)
