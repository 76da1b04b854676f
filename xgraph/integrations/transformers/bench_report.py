"""The transformers benchmark's printed report: one section per part, from its JSON."""

from __future__ import annotations

from typing import Any

from ...bench.report import table


def _check(c: dict[str, Any]) -> list[str]:
    lines = [
        f"check: max |xgraph - transformers| = {c['max_abs_diff']:.3g} (largest logit "
        f"{c['max_abs_logit']:.3g}), argmax agreement {c['argmax_agreement']:.4f} over "
        f"{c['rows']} rows: {'pass' if c['passed'] else 'FAIL'}"
    ]
    if "xgraph_vs_float32" in c:
        lines.append(
            f"distance from float32 logits: xgraph {c['xgraph_vs_float32']:.3g}, "
            f"transformers {c['transformers_vs_float32']:.3g}"
        )
    return lines


def _decode(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        x, t = r["xgraph"], r["transformers"]
        out.append(
            {
                "batch": r["batch"],
                "xgraph tok/s": x.get("decode_tokens_per_second", ""),
                "transformers tok/s": t.get("decode_tokens_per_second", ""),
                "xgraph / transformers": r.get("speedup") or "",
                "xgraph per-token p50 ms": x.get("per_token_p50_s", 0) * 1e3,
                "p99 ms": x.get("per_token_p99_s", 0) * 1e3,
            }
        )
        k = r.get("xgraph_k")
        if k:  # the same batch with K steps a launch
            out[-1].update(
                {
                    "K a launch tok/s": k["decode_tokens_per_second"],
                    "K a launch / transformers": r.get("speedup_k") or "",
                    "K": k["steps_per_launch"],
                    "tokens equal": k["tokens_equal"],
                }
            )
    cols = list(dict.fromkeys(c for row in out for c in row))
    return "decode (same weights, same run):\n" + table(out, cols)


def _ttft(rows: list[dict[str, Any]]) -> str:
    out = [
        {
            "prompts": r["case"],
            "xgraph ms": r["xgraph"].get("ttft_s", 0) * 1e3,
            "transformers ms": r["transformers"].get("ttft_s", 0) * 1e3,
            "transformers / xgraph": r.get("speedup") or "",
        }
        for r in rows
    ]
    return "time to first token:\n" + table(out, list(out[0]) if out else [])


def _compile(c: dict[str, Any]) -> list[str]:
    lines = [f"compile ({c['compiler']}): {len(c['sizes'])} decode sizes, compare {c['compare']}"]
    out = []
    for model in ("hf", "reference"):
        for variant, row in c.get(model, {}).items():
            if not isinstance(row, dict):
                out.append({"model": model, "variant": variant, "error": row})
                continue
            line: dict[str, Any] = {"model": model, "variant": variant}
            if "compile_capture_s" in row:
                line["all sizes s"] = row["compile_capture_s"]
            if "first_step_s" in row:
                line["per size s"] = ", ".join(f"{v:.1f}" for v in row["first_step_s"].values())
            line["compiles"] = (row.get("compile") or {}).get("compiles", 0)
            for b, t in row.get("step_s", {}).items():
                line[f"step {b} ms"] = t * 1e3
            out.append(line)
    cols = list(dict.fromkeys(k for line in out for k in line))
    lines.append(table(out, cols))
    for name, ratios in c.get("ratios", {}).items():
        shown = ", ".join(f"{b}: {v:.3f}" for b, v in ratios.items())
        lines.append(f"{name.replace('_', ' ')}: {shown}")
    return lines


def _compiler(data: dict[str, Any]) -> str:
    """What xgraph's forward ran under: the compiler asked, or why the GraphModel left it
    uncompiled (the default scope over fused layers)."""
    compiled = (data.get("graph_model") or {}).get("compile") or {}
    skipped = compiled.get("skipped")
    return f"none ({skipped})" if skipped else str(data.get("compiler"))


def report(data: dict[str, Any]) -> str:
    lines = [
        f"{data.get('model')} ({data.get('model_class')}, {data.get('dtype')}) on "
        f"{data.get('backend')} ({data.get('device')}); xgraph compiles with "
        f"{_compiler(data)}; transformers compiled: {data.get('transformers_compile')}"
    ]
    if "check" in data:
        lines += _check(data["check"])
    if data.get("decode"):
        lines.append(_decode(data["decode"]))
    if data.get("ttft"):
        lines.append(_ttft(data["ttft"]))
    if "compile" in data:
        lines += _compile(data["compile"])
    if data.get("seconds"):
        lines.append(
            "seconds per part: " + str({k: round(v, 1) for k, v in data["seconds"].items()})
        )
    return "\n".join(lines)
