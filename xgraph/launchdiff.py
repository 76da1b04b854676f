"""Two recordings of one key compared launch by launch, and the report of the check.

`compare` aligns the recordings by (kind, name) (difflib), so a launch that appears, goes or
is replaced is one difference, named by where the Python paths part (xgraph.branchpoint),
and compares the config of every aligned pair field by field. What a backend cannot compare
it marks as it reads the launches (xgraph.launches.Unchecked: a pointer argument's address,
a by-value struct compared by size): those fields are equal by their marks, and each key
counts them. Everything else that differs is a leak: between two captures of the same step
(the same key, the same metadata) a per-call value (a counter, the time, state the forward
updates), between a step and its variation the metadata that changed.
`ParameterizationReport` prints what differs, where, under which change, and what to do.
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .branchpoint import Branch, branch, frames
from .errors import ParameterizationLeakError
from .interfaces import Launch
from .launches import Unchecked

STRUCTURE = "launches"  # the field of a difference in which launches there are
PER_CALL = "nothing (the same step again)"  # the 'variation' of the second base capture
WIDTH = 100  # the report's advice is wrapped to this width


@dataclass(frozen=True)
class Site:
    """A launch at its place in a recording: position overall, piece (piecewise graphs)."""

    position: int
    piece: int | None
    launch: Launch


@dataclass
class Difference:
    """One launch field that differs between two recordings of a key."""

    key: tuple
    site: Site
    field: str
    first: Any
    second: Any
    varied: list[str] = field(default_factory=list)  # the metadata whose change shows it
    branch: Branch | None = None  # where the two captures' Python paths part, if they do

    @property
    def per_call(self) -> bool:
        """Whether two captures of the same step differ here (a per-call value)."""
        return PER_CALL in self.varied

    def where(self) -> str:
        """'kernel 12 name (in piece 1) (layer)', or for launches that part, 'op 12 (in
        piece 1) at the branch file:line (`source`)'."""
        s, la = self.site, self.site.launch
        if self.field == STRUCTURE and self.branch is not None and self.branch.line:
            text = f"{la.kind} {s.position}" + (
                f" in piece {s.piece}" if s.piece is not None else ""
            )
            return f"{text} at the branch {self.branch.line}"
        text = f"{la.kind} {s.position} {la.name}".rstrip()
        if s.piece is not None:
            text += f" in piece {s.piece}"
        return f"{text} ({la.layer})" if la.layer else text

    def change(self) -> str:
        """'field: first -> second (what changed)'."""
        others = [v for v in self.varied if v != PER_CALL]
        if self.per_call:
            also = f"; also under changed {', '.join(others)}" if others else ""
            when = f" (per call: two captures of the same step differ{also})"
        else:
            when = f" ({', '.join(others)} changed)" if others else ""
        return f"{self.field}: {_short(self.first)} -> {_short(self.second)}{when}"

    def __str__(self) -> str:
        text = f"{self.where()}: {self.change()}"
        return f"{text}; {self.branch}" if self.branch is not None else text


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _label(s: Site) -> str:
    return f"{s.launch.kind} {s.launch.name}".strip()


def _parted(a: Site, b: Site) -> Branch | None:
    """Where two aligned launches' stacks part, if they were issued from different lines."""
    fa, fb = frames(a.launch), frames(b.launch)
    if fa and fb and fa[-1][:2] != fb[-1][:2]:
        return branch(None, a.launch, b.launch, None)
    return None


def _same(a: Site, b: Site) -> bool:
    """The same launch from the same line."""
    fa, fb = frames(a.launch), frames(b.launch)
    return _label(a) == _label(b) and (fa[-1][:2] if fa else 0) == (fb[-1][:2] if fb else 0)


def _slide(first: list[Site], second: list[Site], at: tuple) -> tuple:
    """An insertion (or deletion) that starts with the launch following it could as well
    start one later (a loop's extra trip): moved as late as it goes, so the launch both ran
    last is the last one they share and each side's first launch is where they part."""
    i1, i2, j1, j2 = at
    if i1 == i2:
        while (
            j2 < len(second)
            and i1 < len(first)
            and _same(second[j1], first[i1])
            and _same(second[j2], first[i1])
        ):
            i1, i2, j1, j2 = i1 + 1, i2 + 1, j1 + 1, j2 + 1
    elif j1 == j2:
        while (
            i2 < len(first)
            and j1 < len(second)
            and _same(first[i1], second[j1])
            and _same(first[i2], second[j1])
        ):
            i1, i2, j1, j2 = i1 + 1, i2 + 1, j1 + 1, j2 + 1
    return i1, i2, j1, j2


def _structure(key: tuple, first: list[Site], second: list[Site], at: tuple) -> Difference:
    """The launches first[i1:i2] and second[j1:j2] differ: one difference, at the branch."""
    i1, i2, j1, j2 = _slide(first, second, at)
    site = first[i1] if i1 < len(first) else first[-1] if first else Site(0, None, Launch("", ""))
    got = [_label(s) for s in first[i1:i2][:3]] or ["nothing"]
    new = [_label(s) for s in second[j1:j2][:3]] or ["nothing"]
    shared = first[i1 - 1].launch if i1 > 0 else None
    after = first[i2].launch if i2 < len(first) else None
    one = first[i1].launch if i2 > i1 else None
    two = second[j1].launch if j2 > j1 else None
    return Difference(key, site, STRUCTURE, got, new, branch=branch(shared, one, two, after))


def compare(key: tuple, first: list[Site], second: list[Site]) -> list[Difference]:
    """Every difference between two recordings of `key`, in the first one's order."""
    out: list[Difference] = []
    names = difflib.SequenceMatcher(
        None,
        [(s.launch.kind, s.launch.name) for s in first],
        [(s.launch.kind, s.launch.name) for s in second],
        autojunk=False,
    )
    for tag, i1, i2, j1, j2 in names.get_opcodes():
        if tag != "equal":
            out.append(_structure(key, first, second, (i1, i2, j1, j2)))
            continue
        for a, b in zip(first[i1:i2], second[j1:j2]):
            if a.launch.updated and b.launch.updated:
                continue  # re-parameterised before every replay: may differ
            fa, fb = dict(a.launch.config), dict(b.launch.config)
            parted = None
            for name in list(fa) + [n for n in fb if n not in fa]:
                if fa.get(name) != fb.get(name):
                    parted = parted or _parted(a, b)
                    out.append(Difference(key, a, name, fa.get(name), fb.get(name), [], parted))
    return out


def unchecked(sites: list[Site]) -> dict[str, int]:
    """How many fields of a recording its backend left out of the comparison, by kind."""
    out: dict[str, int] = {}
    for s in sites:
        for _, value in s.launch.config:
            if isinstance(value, Unchecked):
                out[value.what] = out.get(value.what, 0) + 1
    return out


def _spot(d: Difference) -> tuple[int, str]:
    return d.site.position, d.field


@dataclass
class KeyCheck:
    """One key checked: its launches, what was varied, what could not be."""

    key: tuple
    launches: int
    recordings: int
    varied: list[str]
    not_varied: list[str] = field(default_factory=list)  # "what: why not"
    unchecked: dict[str, int] = field(default_factory=dict)  # fields not compared, by kind


_ADVICE = {
    "full": (
        "A full graph replays the launches it recorded, so each launch above follows a "
        "per-step value that the key does not hold. Put that dim in the key (declare it as a "
        "Dim with buckets: each padded size gets its own graph), or run that op between "
        "pieces (attention: a runner with graph_safe = False, under mode='piecewise'), or "
        "have the kernel read the value from a device buffer so that its launch stays fixed "
        "(docs/model-adaptation.md, section 4)."
    ),
    "piecewise": (
        "A piece replays the launches it recorded, so each launch above follows a per-step "
        "value that the key (num_tokens) does not hold. Run that op between pieces (route it "
        "through xgraph.attention: its runner runs between the pieces, planned on each "
        "step's metadata), or put that dim in the key (a Dim with buckets), or have the "
        "kernel read the value from a device buffer (docs/model-adaptation.md, section 4)."
    ),
}
_PER_CALL_ADVICE = (
    "A launch marked 'per call' differs between two captures of the same step, with the "
    "same key and the same metadata: it follows a value that changes from call to call (a "
    "counter, the time, a random draw, state the forward updates), which a graph replays as "
    "it was at capture. Compute that value on the device from a declared input, keep it "
    "fixed across calls, or move the code that reads it out of the captured forward."
)
_UNCHECKED = {
    "address": "pointer argument(s) (each recording's own addresses)",
    "struct": "by-value struct argument(s), compared by size (their padding and unused slots "
    "hold host stack bytes; the scalars inside are compared on the CPU backend)",
}


@dataclass
class ParameterizationReport:
    """What `GraphExecutor.check_parameterization` found; `ok` when nothing leaks."""

    backend: str
    keys: list[KeyCheck] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    @property
    def unstable(self) -> list[Difference]:
        """The differences between two captures of the same step (per-call leaks; each is
        in `differences` too)."""
        return [d for d in self.differences if d.per_call]

    def add(self, key: tuple, found: list[Difference], varied: str) -> None:
        """Add one variation's differences of `key` (PER_CALL: the base captured again),
        merging those already found."""
        known = {_spot(d): d for d in self.differences if d.key == key}
        for d in found:
            spot = _spot(d)
            if spot not in known:
                known[spot] = d
                self.differences.append(d)
            if varied not in known[spot].varied:
                known[spot].varied.append(varied)

    def raise_for_leaks(self) -> None:
        """Raise ParameterizationLeakError (the report as its message) unless `ok`."""
        if not self.ok:
            raise ParameterizationLeakError(str(self))

    def __str__(self) -> str:
        n, calls = len(self.differences), len(self.unstable)
        what = "per-step metadata"
        if calls:
            what = (
                "per-call values" if calls == n else f"{what} or per-call values ({calls} per call)"
            )
        head = f"parameterization check on {self.backend}: " + (
            "no leak." if self.ok else f"{n} launch field(s) follow {what}."
        )
        lines = [head]
        for k in self.keys:
            lines += self._key_lines(k)
        if calls:
            lines += textwrap.wrap(
                f"What to do (per call): {_PER_CALL_ADVICE}", WIDTH, subsequent_indent="  "
            )
        metadata = {str(d.key[0]) for d in self.differences if not d.per_call}
        for kind in sorted(metadata):
            advice = f"What to do ({kind} graphs): {_ADVICE.get(kind, _ADVICE['full'])}"
            lines += textwrap.wrap(advice, WIDTH, subsequent_indent="  ")
        return "\n".join(lines)

    def _key_lines(self, k: KeyCheck) -> list[str]:
        found = [d for d in self.differences if d.key == k.key]
        varied = ", ".join(k.varied) or "nothing"
        verdict = "identical" if not found else f"{len(found)} difference(s)"
        lines = [
            f"  {k.key}: {k.recordings} recordings of {k.launches} launches, {verdict} "
            f"under changed {varied}"
        ]
        lines += [f"    not varied: {why}" for why in k.not_varied]
        for d in found[:20]:
            lines += [f"    {d.where()}", f"      {d.change()}"]
            if d.branch is not None:  # the branch line is in where() for launches that part
                named = d.field == STRUCTURE and d.branch.line
                lines += textwrap.wrap(
                    d.branch.path() if named else str(d.branch),
                    WIDTH,
                    initial_indent="      ",
                    subsequent_indent="        ",
                )
        if len(found) > 20:
            lines.append(f"    ... and {len(found) - 20} more (report.differences)")
        if k.unchecked:
            left = "; ".join(f"{n} {_UNCHECKED.get(w, w)}" for w, n in sorted(k.unchecked.items()))
            lines += textwrap.wrap(
                f"not compared (per recording): {left}",
                WIDTH,
                initial_indent="    ",
                subsequent_indent="      ",
            )
        return lines
