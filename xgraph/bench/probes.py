"""What `bench decode` reads off a variant's step besides its time: the kernels per step and
their idle share (`kernel_trace`), and the distance of its output from a float32 reference
(`fidelity`). Each probe runs after the variant's timings, isolated like any measurement
(a failure is recorded in the row, not raised)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..interfaces import Backend
from ..models import Step, Workload
from .fidelity import GATE, Fidelity
from .kernel_trace import profile_steps
from .report import attempt


class Probes:
    """Kernel traces and fidelity samples of the variants of one run (`enabled` False: none)."""

    def __init__(self, backend: Backend, w: Workload, enabled: bool = True) -> None:
        self.backend, self.enabled = backend, enabled
        self.fidelity = Fidelity(w)

    def observe(self, row: dict[str, Any], name: str, step: Step, run: Callable[[], Any]) -> None:
        """Trace a few steps of `run` (a variant's step, returning its hidden states) and
        keep one output for the fidelity check."""
        if not self.enabled:
            return
        b = row["batch"]

        def trace() -> dict[str, Any]:
            found = profile_steps(self.backend, run)
            return {} if found is None else {"profile": {**row.get("profile", {}), name: found}}

        attempt(row, f"profile_{name}", trace)
        attempt(row, f"fidelity_{name}", lambda: self.fidelity.sample(name, b, step, run))

    def finish(self, rows: list[dict[str, Any]]) -> None:
        """The float32 reference of every sampled batch, and each variant's distance."""
        if not self.enabled:
            return
        by_batch = {r["batch"]: r for r in rows}
        holder: dict[str, Any] = {}
        if attempt(holder, "fidelity", lambda: {"found": self.fidelity.finish()}):
            for b, found in holder["found"].items():
                by_batch[b]["fidelity"] = found
        elif rows:
            rows[0]["fidelity_error"] = holder.get("fidelity_error")


def fidelity_gate(row: dict[str, Any], best: str | None) -> dict[str, Any] | None:
    """The best xgraph variant's distance, reduce-overhead's and whether the gate holds."""
    found = row.get("fidelity", {})
    if best not in found or "reduce-overhead" not in found:
        return None
    ours, theirs = found[best], found["reduce-overhead"]
    return {
        "xgraph_vs_fp32": ours,
        "reduce_overhead_vs_fp32": theirs,
        "ratio": ours / theirs if theirs else None,
        "ok": ours <= GATE * theirs,
    }
