"""Where the Python paths of two captures of one key part, for the parameterization check.

A launch that one capture issues and the other does not, or issues from another line,
comes from Python control flow that follows a per-step value. Each launch of a host
recorder carries the model code's stack that issued it (xgraph.launches.TracedLaunch).
Two stacks part in one function, at two lines of it; the branch is the innermost `if`,
loop, `try` or `match` of that file whose arms hold the two lines apart, found in its
source (ast). Without stacks (launches read from a device graph) only the lines the
launches name are known, or nothing.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from dataclasses import dataclass

from .interfaces import Launch
from .launches import Frame

_AT = re.compile(r" at (.+?):(\d+)(?: \(`|$)")  # 'layer at FILE:LINE (`src`)' of Launch.layer


@dataclass(frozen=True)
class Branch:
    """Where two captures' paths part: the branch line (None where it is not found), the
    line both ran last before the parting, and the first line of each side."""

    line: str | None
    shared: str
    first: str
    second: str

    def path(self) -> str:
        """'both ran X last; then the first ran Y, the second Z'."""
        text = f"both ran {self.shared} last; then " if self.shared else ""
        return f"{text}the first ran {self.first}, the second {self.second}"

    def __str__(self) -> str:
        return f"the paths part at {self.line or 'a line not found'}; {self.path()}"


def where(file: str, line: int) -> str:
    """'file:line (`source`)'."""
    src = linecache.getline(file, line).strip()
    shown = file if file.startswith("/") else os.path.relpath(file)
    return f"{shown}:{line} (`{src}`)" if src else f"{shown}:{line}"


def frames(la: Launch | None) -> tuple[Frame, ...]:
    """The stack that issued a launch: its recorded frames, else the line its layer names
    (as a frame of an unknown function), else ()."""
    if la is None:
        return ()
    got = getattr(la, "frames", ())
    if got:
        return got
    m = _AT.search(la.layer)
    return ((m.group(1), int(m.group(2)), "", 0),) if m else ()


def _line(la: Launch) -> str:
    f = frames(la)
    return where(f[-1][0], f[-1][1]) if f else f"{la.kind} {la.name}".strip()


def _side(la: Launch | None, after: Launch | None) -> str:
    if la is not None:
        return _line(la)
    return f"nothing, going on to {_line(after)}" if after is not None else "nothing more"


def parting(a: tuple[Frame, ...], b: tuple[Frame, ...]) -> tuple[str, int, int] | None:
    """(file, line in a, line in b) of the function where two stacks part: the outermost
    frame of one function that the two stacks run at different lines."""
    for fa, fb in zip(a, b):
        if (fa[0], fa[2], fa[3]) != (fb[0], fb[2], fb[3]):
            return None  # different functions called from one line: no branch in view
        if fa[1] != fb[1]:
            return fa[0], fa[1], fb[1]
    return None


def branch(
    shared: Launch | None, first: Launch | None, second: Launch | None, after: Launch | None
) -> Branch:
    """Where the paths part: `first` and `second` are each side's first launch past the
    last shared one (`shared`); a side that issued nothing more is None, and `after` is the
    launch it went on with (the next shared one, or None at the end)."""
    a = first or after or shared
    b = second or after or shared
    line = None
    at = parting(frames(a), frames(b))
    if at is not None:
        n = statement(*at)
        line = where(at[0], n) if n is not None else None
    shared_line = _line(shared) if shared is not None else ""
    return Branch(line, shared_line, _side(first, after), _side(second, after))


# -- the branch in the source ----------------------------------------------------------------

_ARMS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Match)


@functools.lru_cache(maxsize=64)
def _tree(file: str, stamp: float) -> ast.AST | None:
    try:
        return ast.parse("".join(linecache.getlines(file)))
    except (OSError, SyntaxError, ValueError):
        return None


def _arms(node: ast.AST) -> list[list[ast.stmt]]:
    if isinstance(node, ast.Try):
        return [node.body, *[h.body for h in node.handlers], node.orelse, node.finalbody]
    if isinstance(node, ast.Match):
        return [c.body for c in node.cases]
    return [node.body, node.orelse]  # type: ignore[attr-defined]


def _arm(node: ast.AST, line: int) -> int | None:
    """Which arm of `node` holds `line`: its index, -1 for the node's own header (a test,
    a loop's target), None outside the node."""
    if not node.lineno <= line <= (node.end_lineno or node.lineno):  # type: ignore[attr-defined]
        return None
    for i, body in enumerate(_arms(node)):
        if body and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno):
            return i
    return -1


def statement(file: str, la: int, lb: int) -> int | None:
    """The line of the innermost branch statement of `file` whose arms hold lines `la` and
    `lb` apart (one inside an arm, the other in another arm, its header, or outside)."""
    linecache.checkcache(file)
    try:
        stamp = os.stat(file).st_mtime
    except OSError:
        return None
    tree = _tree(file, stamp)
    if tree is None:
        return None
    best: ast.AST | None = None
    for node in ast.walk(tree):
        if not isinstance(node, _ARMS):
            continue
        x, y = _arm(node, la), _arm(node, lb)
        if x == y or (x in (None, -1) and y in (None, -1)):
            continue
        span = (node.end_lineno or node.lineno) - node.lineno
        if best is None or span < (best.end_lineno or best.lineno) - best.lineno:  # type: ignore[attr-defined]
            best = node
    return best.lineno if best is not None else None  # type: ignore[attr-defined]
