"""The memory plot: one legend entry per drawn line, under its own style, and no line hidden.

Drawn with matplotlib's Agg backend from results shaped like `xgraph bench memory`'s: an
accelerator's (a driver reading and the pool's, which differ) and the CPU backend's (the
pool's only), with the lines that used to vanish: an order that runs flat along the limit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba

from xgraph.bench import memory_plot
from xgraph.bench.readings import MiB


def run(mode: str, order: str, pool: list[float], driver: list[float] | None) -> dict:
    return {
        "mode": mode,
        "order": order,
        "graphs": len(pool),
        "driver_bytes": None if driver is None else driver[-1] * MiB,
        "pool_bytes": pool[-1] * MiB,
        "curve_bytes": [b * MiB for b in (driver or pool)],
        "pool_curve_bytes": [b * MiB for b in pool],
    }


def results(with_driver: bool) -> dict:
    limit_pool, limit_driver = 48.0, 50.0
    curves = {
        "ascending": [2.0, 6.0, 20.0, 48.0],
        "random": [30.0, 48.0, 48.0, 48.0],
        "largest-first": [48.0, 48.0, 48.0, 48.0],  # flat along the limit
    }
    runs = [
        run("shared-physical", o, c, [b + 2 for b in c] if with_driver else None)
        for o, c in curves.items()
    ]
    runs.append({"mode": "private", "order": "ascending", "run_error": "failed: no memory"})
    section = {
        "family": "reference",
        "model": "tiny",
        "kind": "full",
        "sizes": [1, 2, 4, 8],
        "limit": {
            "driver_bytes": limit_driver * MiB if with_driver else None,
            "pool_bytes": limit_pool * MiB,
        },
        "runs": runs,
    }
    return {"device": "test device", "sections": [section, {**section, "kind": "piecewise"}]}


def same_style(handle, line) -> bool:
    return (
        handle.get_linestyle() == line.get_linestyle()
        and handle.get_marker() == line.get_marker()
        and to_rgba(handle.get_color()) == to_rgba(line.get_color())
    )


@pytest.mark.parametrize("with_driver", [True, False], ids=["driver-and-pool", "pool-only"])
def test_every_drawn_line_has_its_own_legend_entry(with_driver):
    fig = memory_plot.figure(results(with_driver))
    try:
        for ax in fig.axes:
            lines = ax.get_lines()
            legend = ax.get_legend()
            labels = [t.get_text() for t in legend.get_texts()]
            assert labels == [line.get_label() for line in lines]
            assert len(set(labels)) == len(labels)
            for handle, line in zip(legend.legend_handles, lines):
                assert same_style(handle, line), line.get_label()
            # 3 runs, twice with a driver reading; the limit once per reading
            assert len(lines) == (3 * 2 + 2 if with_driver else 3 + 1)
            assert ax.get_ylabel() == "graph memory (MiB)"  # no style promised off the legend
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_no_line_hides_another():
    fig = memory_plot.figure(results(with_driver=True))
    try:
        ax = fig.axes[0]
        runs = [ln for ln in ax.get_lines() if not ln.get_label().startswith("largest alone")]
        limits = [ln for ln in ax.get_lines() if ln.get_label().startswith("largest alone")]
        # the limit lies under every run, so a run flat along it stays in sight
        assert max(ln.get_zorder() for ln in limits) < min(ln.get_zorder() for ln in runs)
        # runs on the same points are told apart by hollow markers of their own shape and size
        seen = {(ln.get_marker(), ln.get_markersize(), ln.get_linestyle()) for ln in runs}
        assert len(seen) == len(runs)
        assert all(ln.get_markerfacecolor() == "none" for ln in runs)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_plot_is_written_and_nothing_is_drawn_without_runs(tmp_path):
    path = tmp_path / "memory.png"
    memory_plot.plot(results(with_driver=False), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert memory_plot.figure({"device": "x", "sections": [{"runs": []}]}) is None
