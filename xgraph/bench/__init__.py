"""`xgraph bench`: memory modes and capture orders, prefill pieces, decode against anchors.

Every benchmark measures its anchors side by side in the same process and prints ratios.
Nothing here is specific to one accelerator: times are device times where the backend can
measure them (the `time_on_device` benchmark hook; CUDA events on CUDA) and host wall times
otherwise (the CPU backend's prove correctness, not speed); the raw-graph anchor comes from
the `native_graph` hook and is left out where the runtime has no graph API of its own.

Modules: `cli` (options and dispatch), `decode`, `prefill`, `memory` (one benchmark each),
`soak` (random mixed steps checked against eager, memory sampled), `host` (the executor's
host overhead by phase), `anchors` (raw graph, reduce-overhead, the compiled twin),
`roofline` (weight bytes against measured bandwidth), `table_check` (block-table width),
`targets` (the reference model's target and the target contract), `memory_plot` (its PNG),
`timing` (device or host time), `readings` (graph memory), `report` (workload, JSON,
tables, isolated measurements).

This module is the registry of the model families `bench memory` captures (its targets),
and of the models `bench startup` starts.
The bench registers its own (`reference`); an integration registers its models when it is
imported (the transformers integration: `hf-llama`), so the bench imports no integration
and reads the registry only when it runs or builds its command line. Importing this module
imports none of the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (backend, the reference shape's name, largest full-graph size, largest piecewise size) ->
# a target (targets.Target); ImportError (MissingExtraError) when its library is missing
TargetBuilder = Callable[[Any, str, int, int], Any]
# graph kind -> the largest size `bench memory` captures by default (accelerator, CPU)
Largest = dict[str, tuple[int, int]]
REFERENCE_LARGEST: Largest = {"full": (512, 128), "piecewise": (2048, 128)}


@dataclass(frozen=True)
class _Family:
    build: TargetBuilder
    largest: Largest


_families: dict[str, _Family] = {}


def register_target(family: str, build: TargetBuilder, largest: Largest | None = None) -> None:
    """Offer `family` to `xgraph bench memory`: `build` makes its target when it runs;
    `largest` its default largest sizes per graph kind (the reference's when None).
    Registering a family again replaces it."""
    _families[family] = _Family(build, dict(largest or REFERENCE_LARGEST))


def target_families() -> tuple[str, ...]:
    """The registered families, the bench's own first, then in the order registered."""
    return tuple(_families)


def _family(family: str) -> _Family:
    found = _families.get(family)
    if found is None:
        raise ValueError(
            f"unknown model family {family!r}; registered: {', '.join(_families)} (an "
            "integration registers its families when it is imported)"
        )
    return found


def build_target(family: str, backend: Any, model: str, full_max: int, piecewise_max: int) -> Any:
    """A target of `family` for the reference shape `model`."""
    return _family(family).build(backend, model, full_max, piecewise_max)


def default_largest(family: str, kind: str, accelerator: bool) -> int:
    """The largest size of `kind` graphs `bench memory` captures for `family` by default."""
    return _family(family).largest[kind][0 if accelerator else 1]


def _reference(backend: Any, model: str, full_max: int, piecewise_max: int) -> Any:
    from .targets import Reference  # the benchmarks load when one runs

    return Reference(backend, model, full_max, piecewise_max)


register_target("reference", _reference)

# -- the models `xgraph bench startup` starts ------------------------------------------------

# (backend, the shape's name, decode sizes, piecewise sizes) -> one process's results: its
# "parts" (seconds), "graphs", "predicted_bytes", "measured_bytes" and "tokens"
StartupRun = Callable[[Any, str, list[int], list[int]], dict]
_startup: dict[str, tuple[StartupRun, bool]] = {}  # target -> (run, run without --targets)


def register_startup(target: str, run: StartupRun, default: bool = True) -> None:
    """Offer `target` to `xgraph bench startup`: `run` is one process of it, from building
    the model to its first token (xgraph.bench.startup_run); `default` False: it runs only
    when named. Registering again replaces it."""
    _startup[target] = (run, default)


def startup_targets() -> tuple[str, ...]:
    """The start-up targets a run without `--targets` starts, the bench's own first."""
    return tuple(t for t, (_, default) in _startup.items() if default)


def startup_runner(target: str) -> StartupRun:
    found = _startup.get(target, (None, False))[0]
    if found is None:
        raise ValueError(
            f"unknown start-up target {target!r}; registered: {', '.join(_startup)} (an "
            "integration registers its targets when it is imported)"
        )
    return found


def _reference_startup(backend: Any, model: str, decode: list[int], pieces: list[int]) -> dict:
    from .startup_run import reference  # the benchmarks load when one runs

    return reference(backend, model, decode, pieces)


register_startup("reference", _reference_startup)

__all__ = [
    "Largest",
    "StartupRun",
    "TargetBuilder",
    "build_target",
    "default_largest",
    "register_startup",
    "register_target",
    "startup_runner",
    "startup_targets",
    "target_families",
]
