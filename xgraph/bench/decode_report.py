"""The tables of `xgraph bench decode`: step times per variant against the bandwidth limit,
and per batch the best executor row against the anchors, the limits, the host overhead, the
kernels per step, the idle share and the distance from a float32 reference."""

from __future__ import annotations

from typing import Any

from . import table_check
from .readings import MiB
from .report import table

VARIANTS = {  # printed name -> the row's key
    "eager": "eager_s",
    "xgraph": "xgraph_s",
    "raw graph": "raw_graph_s",
    "raw graph + inputs": "raw_graph_inputs_s",
    "reduce-overhead": "reduce_overhead_s",
    "reduce-overhead + inputs": "reduce_overhead_inputs_s",
    "xgraph over compile": "xgraph_compiled_s",
    "xgraph over per-size compile": "xgraph_per_size_s",
}
XGRAPH = ("xgraph", "xgraph over compile", "xgraph over per-size compile")
# replays of static inputs, and the same as engine steps (`+ inputs`: the step sent first)
ANCHORS = ("reduce-overhead", "raw graph", "reduce-overhead + inputs", "raw graph + inputs")


def _ms(row: dict[str, Any], key: str, name: str) -> Any:
    """Milliseconds of a measured key, "failed" where its attempt failed, else blank."""
    if key in row:
        return row[key] * 1e3
    return "failed" if f"{name}_error" in row else ""


ERROR_NAMES = {
    "eager_s": "eager",
    "xgraph_s": "xgraph",
    "raw_graph_s": "raw_graph",
    "raw_graph_inputs_s": "raw_graph",
    "reduce_overhead_s": "reduce_overhead",
    "reduce_overhead_inputs_s": "reduce_overhead",
    "xgraph_compiled_s": "xgraph_compiled",
    "xgraph_per_size_s": "xgraph_per_size",
}


def _step_table(data: dict[str, Any]) -> str:
    """One line per batch and variant: step time and its place against the roofline."""
    out = []
    bw = data.get("bandwidth_bytes_per_s")
    for r in data["rows"]:
        for name, key in VARIANTS.items():
            ms = _ms(r, key, ERROR_NAMES[key])
            if ms == "":
                continue
            line: dict[str, Any] = {"batch": r["batch"], "variant": name, "ms": ms}
            if isinstance(ms, float) and bw:
                line["weight GB/s"] = data["weight_bytes"] / (ms / 1e3) / 1e9
                line["% of bandwidth"] = 100 * r["roofline"][name]
                line["bw-limit ms"] = r["roofline_s"] * 1e3
            out.append(line)
    cols = ["batch", "variant", "ms", "weight GB/s", "% of bandwidth", "bw-limit ms"]
    return table(out, cols if bw else cols[:3])


def _batch_table(data: dict[str, Any]) -> str:
    """Per batch: the best executor row against each anchor, the limits, host overhead."""
    out = []
    for r in data["rows"]:
        line: dict[str, Any] = {"batch": r["batch"], "best xgraph": r.get("best_xgraph", "")}
        if "best_xgraph_s" in r:
            line["best ms"] = r["best_xgraph_s"] * 1e3
        for a, ratio in r.get("best_xgraph_vs", {}).items():
            line[f"best / {a}"] = ratio
        if "eager/xgraph" in r:
            line["eager / xgraph"] = r["eager/xgraph"]
        if "eager_wall_s" in r:
            line["eager wall ms"] = r["eager_wall_s"] * 1e3
        if "roofline_s" in r:
            line["bw-limit ms"] = r["roofline_s"] * 1e3
            line["bw-limit ms (+kv)"] = r["roofline_with_kv_s"] * 1e3
        if "host_overhead_s" in r:
            line["host us/step"] = r["xgraph_host_s"] * 1e6
            line["raw replay host us"] = r["raw_replay_host_s"] * 1e6
            line["overhead us"] = r["host_overhead_s"] * 1e6
        if "xgraph_compiled_first_step_s" in r:
            line["compile+capture s"] = r["xgraph_compiled_first_step_s"]
        if "xgraph_compiled_compiles" in r:
            line["compiles so far"] = r["xgraph_compiled_compiles"]
        if "xgraph_per_size_first_step_s" in r:
            line["per-size compile+capture s"] = r["xgraph_per_size_first_step_s"]
        if "xgraph_compiled_s" in r and "xgraph_per_size_s" in r:
            line["one / per-size compile"] = r["xgraph_compiled_s"] / r["xgraph_per_size_s"]
        out.append(line)
    cols = list(dict.fromkeys(k for line in out for k in line))
    return table(out, cols)


def _limit_table(data: dict[str, Any]) -> str | None:
    """Per batch and traced variant: kernels per step, idle share of the step's span, the
    fraction of the bandwidth limit, the distance from float32 (and the gate)."""
    out = []
    for r in data["rows"]:
        gate = r.get("fidelity_gate") or {}
        for name, p in r.get("profile", {}).items():
            line: dict[str, Any] = {"batch": r["batch"], "variant": name}
            line["kernels/step"] = p["kernels"]
            line["idle share"] = p["gap_share"]
            line["busy us"] = p["busy_us"]
            line["span us"] = p["span_us"]
            if name in r.get("roofline", {}):
                line["of bw limit"] = r["roofline"][name]
            if name in r.get("fidelity", {}):
                line["vs fp32"] = r["fidelity"][name]
            if name == r.get("best_xgraph") and gate:
                line["fidelity gate"] = "ok" if gate["ok"] else f"FAILS ({gate['ratio']:.3g}x)"
            out.append(line)
    if not out:
        return None
    cols = ["batch", "variant", "kernels/step", "idle share", "busy us", "span us"]
    cols += ["of bw limit", "vs fp32", "fidelity gate"]
    return table(out, cols)


def _buckets_note(buckets: str) -> str:
    return {
        "one": "once for every batch size",
        "per-size": "once per batch size",
        "both": "once for every batch size (per-size compiles in their own row)",
        "none": "not at all (reduce-overhead alone is compiled)",
    }.get(buckets, buckets)


def summarize(data: dict[str, Any]) -> str:
    bw = data.get("bandwidth_bytes_per_s")
    measured = f"{bw / 1e9:.0f} GB/s" if bw else f"not measured ({data.get('bandwidth_error')})"
    head = (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}); "
        f"times: median {data['timing']}; memory bandwidth {measured} (copy of "
        f"{data.get('bandwidth_copy_bytes', 0) / MiB:.0f} MiB); weights read per step "
        f"{data['weight_bytes'] / MiB:.1f} MiB (layers + final norm); xgraph over compile "
        f"compiles: {data.get('compile_scope', 'layers')}, "
        f"{_buckets_note(data.get('compile_buckets', 'per-size'))}"
    )
    parts = [head, _step_table(data), _batch_table(data)]
    limits = _limit_table(data)
    if limits is not None:
        parts.append(
            "kernels per step, idle share of the step's span (device trace), fraction of the "
            "bandwidth limit, distance of the logits from a float32 reference (reduce-overhead "
            f"runs {data.get('anchor_kernels', 'torch')} kernels):\n" + limits
        )
    errors = [
        f"- batch {r['batch']} {k[:-6]}: {v}"
        for r in data["rows"]
        for k, v in r.items()
        if k.endswith("_error")
    ]
    if errors:
        parts.append("failures:\n" + "\n".join(errors))
    if "table_check" in data:
        parts.append(table_check.summarize(data["table_check"]))
    return "\n\n".join(parts)
