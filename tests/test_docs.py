"""The README example and every complete program in docs/ run as written (CPU backend).

Each program runs as `python -c` would run it, in a child forked from a process that
imported torch and xgraph once (tests/preloaded.py): what it imports first costs nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def programs():
    for name in [
        "README.md",
        *sorted(f"docs/{f}" for f in os.listdir(f"{ROOT}/docs") if f.endswith(".md")),
    ]:
        with open(os.path.join(ROOT, name)) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        for i, block in enumerate(blocks):
            if block.startswith(("import ", "from ")):  # fragments continue earlier blocks
                yield pytest.param(block, id=f"{name}#{i}")


@pytest.mark.parametrize("code", list(programs()))
def test_program_runs(code):
    from preloaded import run_code  # tests/: `python -c code`, torch imported once

    r = run_code(code, env={**os.environ, "XGRAPH_BACKEND": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_api_reference_builds_without_a_warning(tmp_path):
    """tools/build_api_docs.py: pdoc over every public module, any pdoc warning fails it."""
    pytest.importorskip("pdoc")
    out = tmp_path / "api"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "build_api_docs.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for page in ("xgraph.html", "xgraph/executor.html", "xgraph/interfaces.html"):
        assert (out / page).is_file(), page
    for page in ("xgraph_cuda/backend.html", "xgraph_ascend/backend.html"):
        assert (out / page).is_file(), page
    index = (out / "xgraph.html").read_text()
    assert "GraphExecutor" in index and "get_backend" in index
