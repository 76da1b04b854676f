"""What a backend's kernels serve (`Backend.kernels`): one record of optional duties.

Each duty is optional: the core runs its own reference where a backend leaves one out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .fusion import Fusion
    from .interfaces import AttentionRunner

LinearKernel = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
FusedLinearKernel = Callable[[torch.Tensor, torch.Tensor, "Fusion"], "torch.Tensor | None"]


@dataclass(frozen=True)
class Kernels:
    """A device's faster kernels for the core's ops (`Backend.kernels`).

    `attention`: runners by role, "decode" (graph-safe for full graphs) and "prefill"; the
    core's reference runners fill in a role left out. `linear`: x @ w.T for `xgraph.linear`,
    answering None for calls it does not serve (F.linear runs those). `fused_linear`: a
    projection with the ops around it (`xgraph.fusion.Fusion`: RMSNorm or SiLU-mul before,
    residual add or per-head QK-norm + rotary after) in one kernel, answering None for
    calls it does not serve (`fusion.reference` runs those: the unfused ops around `linear`).
    """

    attention: dict[str, AttentionRunner] = field(default_factory=dict)
    linear: LinearKernel | None = None
    fused_linear: FusedLinearKernel | None = None
