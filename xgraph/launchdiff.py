"""Two recordings of one key compared launch by launch, and the report of the check.

`compare` aligns the recordings by (kind, name) (difflib), so a launch that appears, goes or
is replaced is one difference, and compares the config of every aligned pair field by field.
A field that differs between two captures of the same step (`unstable`: an address or
padding bytes the backend could not tell apart) is left out of every other comparison of
that key. `ParameterizationReport` prints what differs, where, under which change of the
step's metadata, and what to do.
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .errors import ParameterizationLeakError
from .interfaces import Launch

STRUCTURE = "launches"  # the field of a difference in which launches there are
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

    def where(self) -> str:
        """'kernel 12 name (in piece 1) (layer)'."""
        s, la = self.site, self.site.launch
        text = f"{la.kind} {s.position} {la.name}".rstrip()
        if s.piece is not None:
            text += f" in piece {s.piece}"
        return f"{text} ({la.layer})" if la.layer else text

    def change(self) -> str:
        """'field: first -> second (what changed)'."""
        when = f" ({', '.join(self.varied)} changed)" if self.varied else ""
        return f"{self.field}: {_short(self.first)} -> {_short(self.second)}{when}"

    def __str__(self) -> str:
        return f"{self.where()}: {self.change()}"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _label(s: Site) -> str:
    return f"{s.launch.kind} {s.launch.name}".strip()


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
            at = (
                first[i1]
                if i1 < len(first)
                else first[-1]
                if first
                else Site(0, None, Launch("", ""))
            )
            got = [_label(s) for s in first[i1:i2][:3]] or ["nothing"]
            new = [_label(s) for s in second[j1:j2][:3]] or ["nothing"]
            out.append(Difference(key, at, STRUCTURE, got, new))
            continue
        for a, b in zip(first[i1:i2], second[j1:j2]):
            if a.launch.updated and b.launch.updated:
                continue  # re-parameterised before every replay: may differ
            fa, fb = dict(a.launch.config), dict(b.launch.config)
            for name in list(fa) + [n for n in fb if n not in fa]:
                if fa.get(name) != fb.get(name):
                    out.append(Difference(key, a, name, fa.get(name), fb.get(name)))
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


@dataclass
class ParameterizationReport:
    """What `GraphExecutor.check_parameterization` found; `ok` when nothing leaks."""

    backend: str
    keys: list[KeyCheck] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    unstable: list[Difference] = field(default_factory=list)  # not compared: see compare

    @property
    def ok(self) -> bool:
        return not self.differences

    def add(
        self, key: tuple, found: list[Difference], noise: set[tuple[int, str]], varied: str
    ) -> None:
        """Add one variation's differences of `key`, merging those already found."""
        known = {_spot(d): d for d in self.differences if d.key == key}
        for d in found:
            spot = _spot(d)
            if spot in noise:
                continue
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
        n = len(self.differences)
        head = f"parameterization check on {self.backend}: " + (
            "no leak." if self.ok else f"{n} launch field(s) follow per-step metadata."
        )
        lines = [head]
        for k in self.keys:
            lines += self._key_lines(k)
        for kind in sorted({str(d.key[0]) for d in self.differences}):
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
        if len(found) > 20:
            lines.append(f"    ... and {len(found) - 20} more (report.differences)")
        shaky = [d for d in self.unstable if d.key == k.key]
        if shaky:
            lines.append(
                f"    {len(shaky)} field(s) differ between two captures of the same step "
                "(addresses, padding bytes) and were not compared (report.unstable)"
            )
        return lines
