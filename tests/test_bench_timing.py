"""xgraph.bench.timing's host timing: calls taken in turn, each after a synchronize."""

import time

from xgraph.bench.timing import host_times
from xgraph.plugins import get_backend


class _Counting:
    def __init__(self, backend):
        self.backend, self.syncs = backend, 0

    def synchronize(self):
        self.syncs += 1


def test_host_times_alternates_the_calls_and_synchronizes_before_each():
    backend = _Counting(get_backend("cpu"))
    order: list[str] = []

    def slow():
        order.append("slow")
        time.sleep(0.002)

    def fast():
        order.append("fast")

    out = host_times(backend, {"slow": slow, "fast": fast}, 5)  # type: ignore[arg-type]
    assert order == ["slow", "fast"] * 5
    assert backend.syncs == 11  # one before every call, one at the end
    assert out["slow"] >= 0.002 > out["fast"]
