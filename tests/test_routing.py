"""Segment routing: the process-wide allocator callbacks every routed native pool shares."""

from __future__ import annotations

from xgraph import routing


class _BumpTarget:
    """A SegmentAllocator stand-in: hands out increasing fake addresses, records frees."""

    def __init__(self, base: int, fail: bool = False) -> None:
        self.next, self.fail, self.freed = base, fail, []

    def alloc(self, nbytes: int) -> int:
        if self.fail:
            raise RuntimeError("target broke")
        address, self.next = self.next, self.next + nbytes
        return address

    def free(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("target broke")
        self.freed.append((address, nbytes))


def test_allocator_callbacks_route_account_and_never_raise() -> None:
    """The ctypes callbacks exactly as a runtime calls them: routed, accounted, never raising."""
    import threading

    alloc, free = routing.ALLOC_CALLBACK, routing.FREE_CALLBACK
    mib = 1 << 20
    a, b = _BumpTarget(1 << 40), _BumpTarget(1 << 41)
    assert not alloc(2 * mib, 0, None)  # no routing: out of memory, not an exception
    with routing.routing(a):
        p1 = alloc(2 * mib, 0, None)
        with routing.routing(b):
            p2 = alloc(20 * mib, 0, None)
        seen = []  # another thread, while only `a` is routed anywhere: goes to `a`
        th = threading.Thread(target=lambda: seen.append(alloc(4 * mib, 0, None)))
        th.start()
        th.join()
    assert (p1, p2, seen) == (1 << 40, 1 << 41, [(1 << 40) + 2 * mib])
    assert routing.handed_out(a) == 6 * mib and routing.handed_out(b) == 20 * mib
    free(p1, 2 * mib, 0, None)  # after routing ended, as empty_cache would
    free(p2, 20 * mib, 0, None)
    free(12345 * mib, mib, 0, None)  # unknown address: ignored
    free(None, 0, 0, None)
    assert a.freed == [(1 << 40, 2 * mib)] and b.freed == [(1 << 41, 20 * mib)]
    assert routing.handed_out(a) == 4 * mib and routing.handed_out(b) == 0
    free(seen[0], 4 * mib, 0, None)
    broken = _BumpTarget(1 << 42, fail=True)
    with routing.routing(broken):
        assert not alloc(2 * mib, 0, None)
    assert routing.router.current() is None and routing.handed_out(broken) == 0
