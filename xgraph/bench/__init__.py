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
`targets` (the model families of `memory`), `memory_plot` (its PNG), `timing` (device or
host time), `readings` (graph memory), `report` (workload, JSON, tables, isolated
measurements).
"""

from __future__ import annotations

from . import decode, memory, prefill, soak
from .cli import add_parsers, main

__all__ = ["add_parsers", "decode", "main", "memory", "prefill", "soak"]
