"""Build the API reference (HTML, from the docstrings) with pdoc; fail on any pdoc warning.

    python tools/build_api_docs.py OUT_DIR

Documents every public module of xgraph and of the two device adapters. The adapter modules
that need Triton (the CUDA attention kernels and their runners) are documented where Triton
is installed and left out, said so, where it is not: importing them needs it. Nothing here
needs a device: importing an adapter module loads no CUDA or NPU library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {
    "xgraph": ROOT,
    "xgraph_cuda": os.path.join(ROOT, "adapters", "cuda"),
    "xgraph_ascend": os.path.join(ROOT, "adapters", "ascend"),
}
NEEDS_TRITON = ("xgraph_cuda.kernels", "xgraph_cuda.triton_runners")


def modules(package: str, base: str) -> list[str]:
    """Every public module of `package` under `base`, found from its files (no imports)."""
    names = []
    for folder, dirs, files in os.walk(os.path.join(base, package)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        for f in sorted(files):
            if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_")):
                rel = os.path.relpath(os.path.join(folder, f), base)[:-3]
                names.append(rel.replace(os.sep, ".").removesuffix(".__init__"))
    return names


def left_out() -> tuple[str, ...]:
    return () if importlib.util.find_spec("triton") else NEEDS_TRITON


def _expected(message: str, skipped: tuple[str, ...]) -> bool:
    """pdoc's notes on what this script asks for on purpose: a left-out module that does not
    import (pdoc lists a package's submodules), a module named after its package (every
    module is named, as pdoc walks no package whose `__all__` leaves its modules out)."""
    return message.startswith("The module specification") or any(
        message.startswith(f"Couldn't import {m}") for m in skipped
    )


def build(out: str) -> list[str]:
    """Write the reference into `out`; the pdoc warnings (empty when it built cleanly)."""
    import pdoc

    skipped = left_out()
    names = [
        m
        for package, base in PACKAGES.items()
        for m in modules(package, base)
        if not any(m == s or m.startswith(s + ".") for s in skipped)
    ]
    import xgraph.testing

    for name in xgraph.testing.__all__:  # the suite's lazy names, resolved for pdoc to see
        getattr(xgraph.testing, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a package name makes pdoc walk its submodules too: the left-out ones are excluded
        pdoc.pdoc(*names, *(f"!{s}" for s in skipped), output_directory=Path(out))
    problems = [str(w.message) for w in caught if not _expected(str(w.message), skipped)]
    if skipped:
        print(f"left out (they need Triton): {', '.join(skipped)}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    problems = build(argv[0])
    for p in problems:
        print(f"pdoc: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
