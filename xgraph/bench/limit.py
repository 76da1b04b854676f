"""Issue 35's record of a decode-at-the-limit run: docs/results/h200/decode-limit.json.

`python -m xgraph.bench.limit --decode a.json [b.json ...] [--race race.json] --json out`
reads `xgraph bench decode` outputs (one per model) and, optionally, the PDL race check's
(adapters/cuda/tools/pdl_race.py), and writes `rows` of {model, batch, xgraph_ms,
reduce_overhead_ms, floor_ms, kernels_per_step, gap_share, fidelity: {xgraph_vs_fp32,
reduce_overhead_vs_fp32}} with each row's targets, `pdl_race_check` {buckets, replays,
mismatches} and the commit; it prints one table.

Targets (issue 35): Qwen3-0.6B bf16 at batch 1 / 8 / 64 at most 0.5 / 0.6 / 0.9 ms, batch 1
at least 1.5x faster than reduce-overhead and at most 150 kernels a step; Qwen3-8B at batch
1 within 1.25x of its bandwidth floor; in every row xgraph's distance from float32 at most
1.1x reduce-overhead's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from .fidelity import GATE
from .report import table, write_json

MS_TARGET = {("qwen3-0.6b", 1): 0.5, ("qwen3-0.6b", 8): 0.6, ("qwen3-0.6b", 64): 0.9}
SPEEDUP = {("qwen3-0.6b", 1): 1.5}  # over reduce-overhead, at least
KERNELS = {("qwen3-0.6b", 1): 150}  # per step, at most
FLOOR = {("qwen3-8b", 1): 1.25}  # xgraph_ms / floor_ms, at most


def _targets(key: tuple[str, int], r: dict[str, Any]) -> dict[str, Any]:
    """Each target the row has, with whether it is met (None: not measured)."""
    out: dict[str, Any] = {}

    def check(name: str, bound: float, value: float | None, at_most: bool = True) -> None:
        met = None if value is None else (value <= bound if at_most else value >= bound)
        out[name] = {"bound": bound, "value": value, "met": met}

    x, ro, fl = r["xgraph_ms"], r["reduce_overhead_ms"], r["floor_ms"]
    if key in MS_TARGET:
        check("ms", MS_TARGET[key], x)
    if key in SPEEDUP:
        check("speedup_over_reduce_overhead", SPEEDUP[key], ro / x if x and ro else None, False)
    if key in KERNELS:
        check("kernels_per_step", KERNELS[key], r["kernels_per_step"])
    if key in FLOOR:
        check("of_floor", FLOOR[key], x / fl if x and fl else None)
    f = r["fidelity"]
    ours, theirs = f.get("xgraph_vs_fp32"), f.get("reduce_overhead_vs_fp32")
    check("fidelity_ratio", GATE, ours / theirs if ours is not None and theirs else None)
    return out


def _ms(r: dict[str, Any], key: str) -> float | None:
    return r[key] * 1e3 if key in r else None


def rows(decode: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's rows of one `bench decode` output."""
    out = []
    for r in decode["rows"]:
        best = r.get("best_xgraph")
        prof = r.get("profile", {}).get(best, {}) if best else {}
        gate = r.get("fidelity_gate") or {}
        row = {
            "model": decode["model"],
            "batch": r["batch"],
            "xgraph_variant": best,
            "xgraph_ms": _ms(r, "best_xgraph_s"),
            "reduce_overhead_ms": _ms(r, "reduce_overhead_s"),
            "floor_ms": _ms(r, "roofline_s"),
            "kernels_per_step": prof.get("kernels"),
            "gap_share": prof.get("gap_share"),
            "reduce_overhead_kernels_per_step": r.get("profile", {})
            .get("reduce-overhead", {})
            .get("kernels"),
            "fidelity": {
                "xgraph_vs_fp32": gate.get("xgraph_vs_fp32"),
                "reduce_overhead_vs_fp32": gate.get("reduce_overhead_vs_fp32"),
            },
            "host_overhead_us": r["host_overhead_s"] * 1e6 if "host_overhead_s" in r else None,
        }
        row["targets"] = _targets((decode["model"], r["batch"]), row)
        out.append(row)
    return out


def commit() -> str | None:
    """HEAD of the checkout, or $XGRAPH_COMMIT where the tree was copied without git."""
    if os.environ.get("XGRAPH_COMMIT"):
        return os.environ["XGRAPH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def build(decodes: list[dict[str, Any]], race: dict[str, Any] | None) -> dict[str, Any]:
    """The decode-limit record of these runs."""
    out: dict[str, Any] = {"commit": commit(), "rows": [r for d in decodes for r in rows(d)]}
    out["anchor_kernels"] = sorted({d.get("anchor_kernels", "torch") for d in decodes})
    out["devices"] = sorted({d["device"] for d in decodes})
    out["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("XGRAPH_")}
    if race is not None:
        out["pdl_race_check"] = {k: race.get(k) for k in ("buckets", "replays", "mismatches")}
        out["pdl_race_check"]["programmatic_edges"] = race.get("programmatic_edges")
    return out


def summarize(data: dict[str, Any]) -> str:
    lines = []
    for r in data["rows"]:
        line = {k: r[k] for k in ("model", "batch", "xgraph_ms", "reduce_overhead_ms")}
        line.update(floor_ms=r["floor_ms"], kernels=r["kernels_per_step"], idle=r["gap_share"])
        line["xgraph vs fp32"] = r["fidelity"]["xgraph_vs_fp32"]
        line["ro vs fp32"] = r["fidelity"]["reduce_overhead_vs_fp32"]
        failed = [n for n, t in r["targets"].items() if t["met"] is False]
        unknown = [n for n, t in r["targets"].items() if t["met"] is None]
        line["targets"] = "missed: " + ", ".join(failed) if failed else "met"
        if unknown:
            line["targets"] += " (not measured: " + ", ".join(unknown) + ")"
        lines.append(line)
    text = table(lines, list(lines[0]) if lines else ["model"])
    race = data.get("pdl_race_check")
    if race:
        text += f"\n\nPDL race check: {race}"
    return text


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", nargs="+", required=True, help="bench decode JSON files")
    p.add_argument("--race", help="the PDL race check's JSON")
    p.add_argument("--json", help="where to write the record")
    args = p.parse_args(argv)
    missing = [p for p in [*args.decode, args.race] if p and not os.path.exists(p)]
    for path in missing:  # a stage cut short: the record says what it lacks
        print(f"limit: {path} is missing; its rows are left out", file=sys.stderr)
    decodes = [_read(p) for p in args.decode if p not in missing]
    race = _read(args.race) if args.race and args.race not in missing else None
    data = build(decodes, race)
    data["missing"] = missing
    write_json(args.json, data)
    print(summarize(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
