"""Graph memory on the CPU backend (memfd pool): shared-physical is max(shape) in any order."""

from __future__ import annotations

import itertools

import pytest

import xgraph
from xgraph.bench import memory as bench_memory

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]


@pytest.fixture(scope="module")
def data():
    return bench_memory.run(xgraph.get_backend("cpu"), "tiny", SIZES, seed=3)


def run_of(data, mode, order):
    return next(r for r in data["runs"] if r["mode"] == mode and r["order"] == order)


@pytest.mark.parametrize("order", ["ascending", "random", "largest-first"])
def test_shared_physical_equals_the_largest_bucket_alone(data, order):
    r = run_of(data, "shared-physical", order)
    chunk = r["physical"]["chunk_size"]
    assert r["captures"] == len(SIZES)
    assert abs(r["graph_bytes"] - data["limit_bytes"]) <= chunk, (
        r["graph_bytes"],
        data["limit_bytes"],
    )
    # physical memory never exceeded the limit on the way either
    assert max(r["curve_bytes"]) <= data["limit_bytes"] + chunk
    # every capture had its own address range over the same chunks
    assert r["physical"]["spaces"] == len(SIZES)


def test_private_grows_as_the_sum(data):
    r = run_of(data, "private", "ascending")
    curve = r["curve_bytes"]
    assert all(b > a for a, b in itertools.pairwise(curve)), "private memory must grow per capture"
    assert r["graph_bytes"] > 3 * data["limit_bytes"]


def test_shared_pool_depends_on_order_and_physical_does_not(data):
    best = run_of(data, "shared-pool", "largest-first")["graph_bytes"]
    asc = run_of(data, "shared-pool", "ascending")["graph_bytes"]
    assert asc > best
    for order in ("ascending", "random", "largest-first"):
        assert run_of(data, "shared-physical", order)["graph_bytes"] <= best


def test_resident_memory_follows_the_pool(data):
    """Pss (pages counted once however many spaces map them) stays near the limit."""
    r = run_of(data, "shared-physical", "ascending")
    p = run_of(data, "private", "ascending")
    assert r["resident_bytes"] < p["resident_bytes"]
    assert r["resident_bytes"] < 2 * data["limit_bytes"] + (8 << 20)


def test_plot_is_written(data, tmp_path):
    path = tmp_path / "memory.png"
    bench_memory.plot(data, str(path))
    assert path.stat().st_size > 10_000
