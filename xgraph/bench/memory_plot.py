"""The plot of `xgraph bench memory`: graph memory against graphs captured, one panel per
model family and graph kind.

Every drawn line is in its panel's legend, under its own label. Lines often coincide (an
order that reaches the limit early runs flat along it, and shared-physical memory is the
limit in every order), so none may hide another: the limit is a wide pale band under the
runs, each order has its own hollow marker (of its own size, so markers on the same points
nest), the driver's reading is solid and the pool's dashed (drawn only where the backend has
a driver reading; otherwise the two are one curve, labelled as the pool's).
"""

from __future__ import annotations

from typing import Any

from .readings import MiB

MARKERS = {"ascending": ("o", 6), "random": ("s", 4.5), "largest-first": ("^", 3)}
LIMIT_STYLE = {"color": "0.6", "lw": 5, "alpha": 0.45, "zorder": 1, "solid_capstyle": "butt"}


def _run_lines(ax: Any, run: dict[str, Any]) -> None:
    """The run's curves: the driver's (solid) where there is one, the pool's (dashed)."""
    marker, size = MARKERS.get(run["order"], ("D", 4))
    xs = list(range(1, len(run["curve_bytes"]) + 1))
    style = {"marker": marker, "ms": size, "mfc": "none", "mew": 0.9, "zorder": 3}
    name = f"{run['mode']}, {run['order']}"
    color = None
    if run.get("driver_bytes") is not None:
        (line,) = ax.plot(
            xs, [b / MiB for b in run["curve_bytes"]], "-", lw=1.3, label=f"{name}: driver", **style
        )
        color = line.get_color()
    ax.plot(
        xs,
        [b / MiB for b in run["pool_curve_bytes"]],
        "--" if color else "-",
        color=color,
        lw=0.9 if color else 1.3,
        label=f"{name}: pool",
        **style,
    )


def _limit_lines(ax: Any, limit: dict[str, Any]) -> None:
    """The largest size alone: the driver's reading and the pool's, where they differ."""
    if limit.get("driver_bytes") is not None:
        ax.axhline(limit["driver_bytes"] / MiB, label="largest alone: driver", **LIMIT_STYLE)
        if limit["pool_bytes"] != limit["driver_bytes"]:
            pool = {**LIMIT_STYLE, "color": "0.8", "ls": (0, (2, 1))}
            ax.axhline(limit["pool_bytes"] / MiB, label="largest alone: pool", **pool)
    else:
        ax.axhline(limit["pool_bytes"] / MiB, label="largest alone: pool", **LIMIT_STYLE)


def figure(data: dict[str, Any]) -> Any:
    """The matplotlib Figure (Agg), or None when no section has a run to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sections = [s for s in data["sections"] if any("curve_bytes" in r for r in s.get("runs", []))]
    if not sections:
        return None
    cols = min(2, len(sections))  # one row per family when both kinds ran
    rows = -(-len(sections) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(sections) :]:
        ax.set_visible(False)
    for ax, s in zip(axes.flat, sections):
        if s.get("limit"):
            _limit_lines(ax, s["limit"])
        for r in s["runs"]:
            if "curve_bytes" in r:
                _run_lines(ax, r)
        ax.set_title(f"{s['model']}: {s['kind']} graphs", fontsize=9)
        ax.set_xlabel("graphs captured")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("graph memory (MiB)")
        ax.legend(fontsize=6.5)
    fig.suptitle(f"graph memory on {data['device']}", fontsize=10)
    fig.tight_layout()
    return fig


def plot(data: dict[str, Any], path: str) -> None:
    """Write the figure to `path` as a PNG (nothing when there is no run to draw)."""
    fig = figure(data)
    if fig is None:
        return
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
