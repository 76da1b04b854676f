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

This module is the registry of the model families `bench memory` captures (its targets).
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

__all__ = [
    "Largest",
    "TargetBuilder",
    "build_target",
    "default_largest",
    "register_target",
    "target_families",
]
