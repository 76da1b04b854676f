"""What a backend's kernels serve (`Backend.kernels`): one record of optional duties.

Each duty is optional: the core runs its own reference where a backend leaves one out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .check_call import MetadataCheck
    from .fusion import Fusion
    from .interfaces import AttentionRunner

LinearKernel = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
FusedLinearKernel = Callable[[torch.Tensor, torch.Tensor, "Fusion"], "torch.Tensor | None"]


class ProgrammaticLaunch(ABC):
    """Programmatic dependent launch in captured graphs (`xgraph.pdl`).

    `available`: whether this device runs it (False: `capture` records as without PDL; an
    executor's stats say PDL is unsupported here)."""

    available: bool = True

    @abstractmethod
    def capture(self, kind: str, enabled: bool) -> AbstractContextManager[Any]:
        """The context to warm up and record a graph of `kind` in; with `enabled`, kernels
        recorded in a full graph overlap their predecessor's tail (a no-op elsewhere)."""

    @abstractmethod
    def programmatic_edges(self, graph: Any) -> int | None:
        """How many edges of a captured graph are programmatic (None: not readable)."""

    def captured(self, graph: Any) -> int | None:
        """The programmatic edges of a full graph an executor just captured with PDL: the
        backend's `Graph`, kept readable (`keep_launches`) and not yet replayed. Asked once,
        right after capture_end, while the capture's memory is metered: a backend whose
        kept graphs make their executable at the first replay makes it here (CUDA)."""
        return self.programmatic_edges(graph)

    def baseline(self, kind: str) -> AbstractContextManager[Any]:
        """The race check's other capture: the kernels `capture(kind, True)` records, launched
        without PDL (by default an ordinary capture)."""
        return nullcontext()


@dataclass(frozen=True)
class Kernels:
    """A device's faster kernels for the core's ops (`Backend.kernels`).

    `attention`: runners by role, "decode" (graph-safe for full graphs) and "prefill"; the
    core's reference runners fill in a role left out. `linear`: x @ w.T for `xgraph.linear`,
    answering None for calls it does not serve (F.linear runs those). `fused_linear`: a
    projection with the ops around it (`xgraph.fusion.Fusion`: RMSNorm or SiLU-mul before,
    residual add or per-head QK-norm + rotary after) in one kernel, answering None for
    calls it does not serve (`fusion.reference` runs those: the unfused ops around `linear`).
    Having one puts a 16-bit model's residual stream in float32 (`linear.stream_dtype`): it
    is then asked for a float32 input under a norm prologue and a float32 residual, whose
    sum it returns in float32 (`fusion.output_dtype`), and serves or declines those too.
    `pdl`: programmatic dependent launch in captured graphs, where the device has it.
    `metadata_check`: the device check of a key's device metadata in one kernel
    (`xgraph.check_call.CheckCall`), answering False for calls it does not serve (the
    check's torch ops run those).
    """

    attention: dict[str, AttentionRunner] = field(default_factory=dict)
    linear: LinearKernel | None = None
    fused_linear: FusedLinearKernel | None = None
    pdl: ProgrammaticLaunch | None = None
    metadata_check: MetadataCheck | None = None
