"""What the ranks agree on each step: one fixed-size message per rank, one rule for all.

Each rank sends what its own decision chose (kind, padded key sizes, or why it runs
eagerly; nothing is staged before the ranks agree: xgraph.steps), its real token count, the
size of its graph cache, its tensor-parallel group and the step's identity
(xgraph.distributed.identity: the executor's configuration digest, the step's ordinal, a
digest of its host inputs); every rank then applies the same rule to the same table, so all
reach the same decision without a second round:

- the path is the least of the ranks' (eager < piecewise < full): one eager rank (overflow,
  `mode`, a forced kind) makes every rank eager; a prefill among decodes makes all piecewise;
- every key dim is padded to the largest size any rank needs (data-parallel ranks pad to the
  group's largest token count);
- a communication dim (`Parallel(comm_dims=...)`) takes the largest real token count of the
  group, padded by its own buckets, and joins the key; above its buckets every rank is eager;
- idle ranks (no tokens) take what the others agree; when every rank is idle nothing runs.

The table also proves the ranks are in step: their executors are configured alike and at
the same step, their graph caches hold as many graphs and eager keys, and the ranks of one
tensor-parallel group were given the same step (sizes and host inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..buckets import Buckets
from ..options import Kind
from ..steps import Checked, Decision
from .channel import STEP

# message fields
F_TAG, F_STATUS, F_KIND, F_REASON, F_TOKENS, F_GRAPHS, F_EAGER_KEYS, F_TP = range(8)
F_CONFIG, F_SEQ, F_INPUTS = 8, 9, 10  # the step's identity
F_DIMS = 11  # the key dims' sizes, in the planner's key order
MAX_DIMS = 8

OK, REFUSED, IDLE = 0, 1, 2
KIND_CODE = {Kind.EAGER: 0, Kind.PIECEWISE: 1, Kind.FULL: 2}
KINDS = {v: k for k, v in KIND_CODE.items()}
REASONS = ["", "mode", "above largest bucket", "not decode (mode='full')", "warm-up"]


def reason_code(reason: str) -> int:
    return REASONS.index(reason) if reason in REASONS else len(REASONS)


def reason_text(code: int) -> str:
    return REASONS[code] if code < len(REASONS) else "another reason"


@dataclass
class Agreed:
    """The step every rank runs: its kind (None: every rank idle) and padding."""

    kind: Kind | None
    pad_to: dict[str, int] = field(default_factory=dict)  # graph kinds: every key dim
    comm: dict[str, int] = field(default_factory=dict)  # comm dims as the forward sees them
    reason: str = ""  # eager: why
    tokens: int = 0  # the largest real token count of the group


@dataclass(frozen=True)
class Stamp:
    """What a message says of the rank besides its step: its graph cache's size, its
    tensor-parallel group's first rank (-1: none) and the step's identity."""

    cache: tuple[int, int] = (0, 0)
    tp: int = -1
    config: int = 0  # the executor's configuration digest
    seq: int = 0  # the step's ordinal among the executor's agreements
    inputs: int = 0  # a digest of the step's host inputs (tensor parallelism only)


def message(
    status: int,
    checked: Checked | None,
    decision: Decision | None,
    dims: Sequence[str],
    stamp: Stamp,
) -> list[int]:
    """This rank's message (`decision` None: refused or idle)."""
    out = [STEP, status, 3, 0, 0, *stamp.cache, stamp.tp, stamp.config, stamp.seq, stamp.inputs]
    out += [-1] * len(dims)
    if checked is not None and decision is not None:
        out[F_KIND] = KIND_CODE[decision.kind]
        out[F_REASON] = reason_code(decision.reason)
        out[F_TOKENS] = checked.num_tokens
        sizes = decision.padded if decision.kind is not Kind.EAGER else checked.sizes
        for i, d in enumerate(dims):
            out[F_DIMS + i] = sizes.get(d, -1)
    return out


def decide(table: list[list[int]], dims: Sequence[str], comm: dict[str, Buckets]) -> Agreed:
    """The agreed step (the table holds no refusal: the caller handles those first)."""
    busy = [(r, m) for r, m in enumerate(table) if m[F_STATUS] == OK]
    if not busy:
        return Agreed(None)
    code = min(m[F_KIND] for _, m in busy)
    kind = KINDS[code]
    tokens = max(m[F_TOKENS] for _, m in busy)
    reason = ""
    if kind is Kind.EAGER:
        r, m = next((r, m) for r, m in busy if m[F_KIND] == code)
        reason = f"rank {r}: {reason_text(m[F_REASON])}"
    sizes: dict[str, int] = {}
    for name, b in comm.items():
        p = b.pad(tokens)
        if p is None and kind is not Kind.EAGER:
            kind, reason = Kind.EAGER, f"{name}={tokens} above its largest bucket {b.max}"
        sizes[name] = tokens if p is None else p
    if kind is Kind.EAGER:
        return Agreed(kind, {}, sizes, reason, tokens)
    pad_to: dict[str, int] = {}
    for i, d in enumerate(dims):
        need = [m[F_DIMS + i] for _, m in busy if m[F_DIMS + i] >= 0]
        if need:
            pad_to[d] = max(need)
    pad_to.update(sizes)
    return Agreed(kind, pad_to, sizes, reason, tokens)


def divergence(table: list[list[int]]) -> str | None:
    """Why the table shows ranks out of step (caches differ), or None."""
    caches = {(m[F_GRAPHS], m[F_EAGER_KEYS]) for m in table}
    if len(caches) > 1:
        seen = ", ".join(
            f"rank {r}: {m[F_GRAPHS]} graphs, {m[F_EAGER_KEYS]} eager keys"
            for r, m in enumerate(table)
        )
        return f"the ranks' graph caches differ ({seen})"
    return None


def configured_alike(table: list[list[int]]) -> bool:
    return len({m[F_CONFIG] for m in table}) == 1


def sequence_mismatch(table: list[list[int]]) -> str | None:
    """The ranks' step ordinals where they differ, or None."""
    if len({m[F_SEQ] for m in table}) == 1:
        return None
    return (
        "the ranks are at different steps ("
        + ", ".join(f"rank {r}: step #{m[F_SEQ]}" for r, m in enumerate(table))
        + ")"
    )


def tp_mismatch(table: list[list[int]]) -> str | None:
    """Ranks of one tensor-parallel group given different steps, named; or None."""
    groups: dict[int, list[int]] = {}
    for r, m in enumerate(table):
        if m[F_TP] >= 0:
            groups.setdefault(m[F_TP], []).append(r)
    for ranks in groups.values():
        sizes = {tuple(table[r][F_STATUS : F_TOKENS + 1]) + tuple(table[r][F_DIMS:]) for r in ranks}
        inputs = {table[r][F_INPUTS] for r in ranks}
        if len(sizes) == 1 and len(inputs) == 1:
            continue
        what = ", ".join(
            f"rank {r}: {table[r][F_TOKENS]} tokens"
            + (" (idle)" if table[r][F_STATUS] == IDLE else "")
            for r in ranks
        )
        how = "different steps" if len(sizes) > 1 else "batches of the same sizes but other inputs"
        return (
            f"ranks {ranks} form one tensor-parallel group but were given {how} at step "
            f"#{table[ranks[0]][F_SEQ]} ({what}); the ranks of a tensor-parallel group must run "
            "the same batch. A rank skipped, repeated or reordered a step, or the engine gave "
            "the ranks different batches"
        )
    return None
