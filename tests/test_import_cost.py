"""What `import xgraph`, the command line and the pytest plugin load: only what they use.

Nothing here is timed (timings belong to measurements, not tests): each test checks in a
fresh interpreter that the costly modules (torch._dynamo, transformers, matplotlib) are not
loaded, and that the pytest plugin every pytest run in the environment loads imports
neither torch nor xgraph.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "matplotlib")


def loaded_after(code: str, modules: tuple[str, ...] = HEAVY) -> list[str]:
    """The `modules` a fresh interpreter has loaded after running `code`."""
    probe = textwrap.dedent(code) + (
        f"\nimport sys\nprint([m for m in {modules!r} if m in sys.modules])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])


def test_import_xgraph_loads_no_compiler_and_no_optional_library():
    assert loaded_after("import xgraph") == []


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["info"], ["bench", "--help"]])
def test_the_command_line_loads_only_what_the_command_uses(argv):
    code = f"""
    import contextlib, io
    from xgraph.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main({argv!r})
        except SystemExit:
            pass
    """
    assert loaded_after(code) == []


def test_a_capture_guard_still_keeps_the_compiler_out():
    """The capture guard is kept from Dynamo when the first one is built (loading
    torch._dynamo then, not at import): its code is skipped, with no wrapper to pay per op;
    a compiled function called inside a capture gives its eager result on replay."""
    code = """
    import torch, xgraph
    from xgraph.graphs import _CaptureGuard
    from torch._C._dynamo.eval_frame import set_code_exec_strategy  # the torch in use has it
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    g = xgraph.get_backend("cpu").new_graph()
    x = torch.ones(4)
    with xgraph.graph(g):
        y = f(x)
    x.fill_(3.0)
    g.replay()
    assert torch.equal(y, torch.full((4,), 7.0))
    assert _CaptureGuard.compiler_disabled
    assert not hasattr(_CaptureGuard.__torch_dispatch__, "_torchdynamo_disable")
    assert not hasattr(_CaptureGuard.__torch_dispatch__, "__wrapped__")  # torch's wrapper neither
    """
    assert loaded_after(code, ("torch._dynamo",)) == ["torch._dynamo"]


def test_the_pytest_plugin_imports_neither_torch_nor_xgraph():
    assert loaded_after("import pytest_xgraph", ("torch", "xgraph")) == []


def test_an_unrelated_pytest_run_loads_the_plugin_but_not_xgraph(tmp_path):
    (tmp_path / "test_one.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_one(pytestconfig):
                assert pytestconfig.pluginmanager.has_plugin("xgraph")  # the entry point
                assert "xgraph" not in sys.modules and "torch" not in sys.modules
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
