"""The command line: every mistake one line and exit status 2, Ctrl-C one line and exit
status 130, -v anywhere, --version, help for every option and command, a narrow `info`."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import xgraph as xg
from xgraph.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def xgraph(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xgraph.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["demo", "--backend", "nope"], "Unknown backend 'nope'"),
        (["bench", "decode", "--backend", "cuda"], "'cuda' (from the argument) is not available"),
        (["bench", "decode", "--model", "nope"], "invalid choice: 'nope'"),
        (["bench", "decode", "--sizes", "1,abc"], "'1,abc' is not a comma-separated list of sizes"),
        (["conformance", "--backend", "npu"], "Unknown backend 'npu'"),
    ],
)
def test_errors_are_one_line_without_a_traceback(args, needle):
    r = xgraph(*args)
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_every_option_has_help():
    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "xgraph")
    assert not missing, missing


def test_info_fits_100_columns_and_hides_test_adapters_unless_asked():
    r = xgraph("info")
    assert r.returncode == 0 and max(len(line) for line in r.stdout.splitlines()) <= 100
    names = {line.split()[0] for line in r.stdout.splitlines() if line and not line[0].isspace()}
    assert {"cpu", "cuda", "ascend"} <= names and "dummy" not in names
    assert "dummy" in xgraph("info", "--all").stdout


@pytest.mark.slow
def test_verbose_names_where_the_backend_choice_came_from():
    r = xgraph("-v", "demo", env={"XGRAPH_BACKEND": ""})
    assert "selected (highest priority available)" in r.stderr, r.stderr
    r = xgraph("-v", "demo", "--backend", "cpu")
    assert "selected (argument)" in r.stderr


# -- every mistake: one line on stderr, exit status 2 ------------------------------------


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`xgraph ARGV` in this process: its exit status and its stderr lines."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help, --version, a bad option
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.splitlines()


def assert_one_line(code: int, err: list[str], needle: str) -> None:
    assert code == 2, err
    assert len(err) == 1 and needle in err[0], err
    assert "Traceback" not in err[0]


GEN = ["generate", "--model", "folder", "--prompt", "1 2"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        ([*GEN, "--block-size", "0"], "argument --block-size: '0': give a whole number of at"),
        ([*GEN, "--max-new-tokens", "0"], "argument --max-new-tokens: '0'"),
        ([*GEN, "--max-num-tokens", "-3"], "argument --max-num-tokens: '-3'"),
        ([*GEN, "--top-k", "-1"], "argument --top-k: '-1': give a whole number of at least 0"),
        ([*GEN, "--temperature", "nan"], "argument --temperature: 'nan': give a finite number"),
        ([*GEN, "--temperature", "-1"], "argument --temperature: '-1'"),
        (["bench", "decode", "--iters", "-5"], "argument --iters: '-5'"),
        (["bench", "decode", "--iters", "0"], "argument --iters: '0'"),
        (["bench", "decode", "--iters", "2.5"], "'2.5' is not a whole number"),
        (["bench", "memory", "--max-size", "0"], "argument --max-size: '0'"),
        (["bench", "memory", "--piecewise-max", "0"], "argument --piecewise-max: '0'"),
        (["bench", "memory", "--sizes", ""], "'' is not a comma-separated list of sizes"),
        (["bench", "memory", "--sizes", "4,0"], "'4,0': sizes must be positive"),
        (["bench", "decode", "--compile", ""], "argument --compile: '' is not a comma-separated"),
        (["bench", "decode", "--table-check", "0"], "argument --table-check: '0'"),
        (["bench", "soak", "--steps", "0"], "argument --steps: '0'"),
        (["bench", "memory", "--iters", "3"], "--iters does not apply to bench memory"),
        (["bench", "soak", "--iters", "3"], "--iters does not apply to bench soak"),
        (["bench", "decode", "--steps", "3"], "--steps does not apply to bench decode"),
        (["bench", "decode", "--plot", "x.png"], "--plot does not apply to bench decode"),
        (["bench", "all", "--sizes", "1,2"], "--sizes does not apply to bench all"),
        # refused while parsed, the valid range named: never a default or a later failure
        (["bench", "sleep", "--kv-cache-gib", "0"], "'0': give a finite number above 0"),
        (["bench", "sleep", "--kv-cache-gib", "-1"], "'-1': give a finite number above 0"),
        (["bench", "sleep", "--kv-cache-gib", "inf"], "'inf': give a finite number above 0"),
        (["bench", "sleep", "--kv-cache-gib", "x"], "'x' is not a number; give a finite"),
        (["bench", "sleep", "--piecewise-max", "3"], "'3': give a whole number of at least 4"),
        (["bench", "prefill", "--max-size", "3"], "--max-size 3: bench prefill measures"),
        ([*GEN, "--top-p", "0"], "argument --top-p: '0': give a number above 0 and at most 1"),
        ([*GEN, "--top-p", "1.5"], "argument --top-p: '1.5': give a number above 0 and at"),
        ([*GEN, "--seed", "-1"], "argument --seed: '-1': give a whole number from 0 to 2**64"),
        ([*GEN, "--seed", str(2**64)], f"'{2**64}': give a whole number from 0 to 2**64 - 1"),
        ([*GEN, "--compile", "nope"], "argument --compile: invalid choice: 'nope' (choose from"),
        (["bench", "nope"], "argument which: invalid choice: 'nope'"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(argv, needle, capsys):
    assert_one_line(*run_main(argv, capsys), needle)


def test_a_library_error_is_one_line_and_exit_2(capsys, tmp_path):
    code, err = run_main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "1"], capsys)
    assert_one_line(code, err, "xgraph: error: ")
    assert "is not a folder" in err[0]


def test_verbose_is_accepted_anywhere_and_prints_the_traceback(capsys):
    for argv in (
        ["-v", "info", "--backend", "nope"],
        ["info", "-v", "--backend", "nope"],
        ["info", "--backend", "nope", "--verbose"],
    ):
        code, err = run_main(argv, capsys)
        assert code == 2, err
        assert err[0] == "Traceback (most recent call last):", err
        assert err[-1].startswith("xgraph: error: Unknown backend 'nope'"), err
    code, err = run_main(["info", "--backend", "nope"], capsys)  # without -v: the line only
    assert_one_line(code, err, "xgraph: error: Unknown backend 'nope'")


def test_version_names_xgraph_its_adapters_and_torch(capsys):
    from importlib import metadata

    code = None
    try:
        main(["--version"])
    except SystemExit as exc:
        code = exc.code
    lines = capsys.readouterr().out.splitlines()
    assert code in (0, None)
    assert lines[0] == f"xgraph {xg.__version__}"
    for dist in ("xgraph-cuda", "xgraph-ascend"):
        assert f"{dist} {metadata.version(dist)}" in lines
    assert f"torch {metadata.version('torch')}" in lines


def test_help_names_every_command():
    parser = build_parser()
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summary = parser.format_help()
    for name in commands:
        assert name in parser.description, (name, parser.description)
        assert re.search(rf"^\s+{name}\s+\S", summary, re.M), summary


def test_an_xgraph_warning_is_shown_once(capsys):
    """The library warns (warnings.warn) and logs the same text; the command line shows it
    once, as a log line."""
    from xgraph.cli import _output

    ex = xg.GraphExecutor(
        lambda x: x * 2,
        backend="cpu",
        buckets=[1, 2],
        inputs=[xg.Input("x", torch.float32, ("num_tokens", 4))],
        name="overflow",
    )
    with warnings.catch_warnings(), _output(verbose=False):
        warnings.simplefilter("default")
        out = ex(x=torch.ones(3, 4))  # above the largest bucket: eager, warned once
    ex.close()
    assert torch.equal(out, torch.full((3, 4), 2.0))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING xgraph: overflow: num_tokens=3"), err


# -- Ctrl-C: one line, exit status 130 ---------------------------------------------------


def _outside_xdist() -> dict[str, str]:
    """This process's environment without xdist's worker variables: the child runs as a
    user would run it (pytest-benchmark warns on stderr inside an xdist worker)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}


def interrupt(
    args: list[str], ready: str, stream: str, after_s: float = 0.5
) -> tuple[int, list[str]]:
    """Start `xgraph ARGS`, wait for a line containing `ready` on `stream`, send SIGINT
    `after_s` later; the exit status and the stderr lines written after the interrupt."""
    p = subprocess.Popen(
        [sys.executable, "-m", "xgraph.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_outside_xdist(), "XGRAPH_BACKEND": "cpu"},
    )
    try:
        watched = p.stderr if stream == "stderr" else p.stdout
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = watched.readline()
            assert line, f"xgraph {args} ended before {ready!r}: {p.communicate()}"
            if ready in line:
                break
        time.sleep(after_s)  # well inside the work, not at its first line
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, [x for x in err.splitlines() if not x.startswith("[bench] ")]


@pytest.mark.slow
def test_ctrl_c_in_bench_memory_is_one_line_and_exit_130():
    args = ["bench", "memory", "--backend", "cpu", "--models", "reference", "--kinds", "full"]
    # two more orders' captures of the default nineteen sizes follow the first order's line
    # (about a second on the development host): the interrupt lands in them at once, not
    # in the interpreter's exit
    code, err = interrupt(args, "[bench] memory", "stderr", after_s=0.05)
    assert code == 130 and err == ["xgraph: interrupted"], err


@pytest.mark.slow
def test_ctrl_c_in_the_conformance_suite_is_one_line_and_exit_130():
    args = ["conformance", "--backend", "cpu", "--", "-q", "-k", "Executor or Piecewise"]
    code, err = interrupt(args, "xgraph conformance: backend", "stdout")
    assert code == 130 and err == ["xgraph: interrupted"], err


# -- model folders transformers cannot load: the library's error, one line ---------------


def test_a_corrupted_safetensors_file_is_one_line_and_exit_2(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    code, err = run_main(["generate", "--model", str(tmp_path), "--prompt", "1 2"], capsys)
    assert_one_line(code, err, "xgraph: error: ")
    assert str(tmp_path) in err[0] and "safetensors" in err[0].lower(), err


def test_an_encoder_decoder_folder_is_one_line_and_exit_2(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from safetensors.torch import save_file

    transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2
    ).save_pretrained(tmp_path)
    save_file({"shared.weight": torch.zeros(64, 16)}, str(tmp_path / "model.safetensors"))
    code, err = run_main(["generate", "--model", str(tmp_path), "--prompt", "1 2"], capsys)
    assert_one_line(code, err, "xgraph: error: ")
    assert "t5" in err[0].lower(), err


# -- --compile: a name torch does not know is refused, a failing one named ---------------


def test_graph_model_refuses_a_compile_backend_torch_does_not_know():
    pytest.importorskip("transformers", minversion="5.0")
    from hf_tiny import LIMITS, tiny

    from xgraph.integrations.transformers import GraphModel

    with pytest.raises(xg.XGraphError, match=r"compile='nope'; give True \(Inductor\)"):
        GraphModel(tiny("llama"), backend="cpu", compile="nope", **LIMITS)


def test_a_failed_compile_warns_naming_its_backend_not_an_internal_object():
    from xgraph.compiled import TokenCompiled

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no kernels today")

    torch._dynamo.reset()
    fn = TokenCompiled(lambda x: x * 2, 4, backend=broken_backend, name="fwd")
    with pytest.warns(xg.XGraphWarning) as caught:
        out = fn(torch.ones(3))
    torch._dynamo.reset()
    assert torch.equal(out, torch.full((3,), 2.0))  # uncompiled, the right result
    text = " ".join(str(w.message) for w in caught)
    assert "backend='broken_backend'" in text and "_Counted" not in text, text


# -- python run from the folder that holds the clone ------------------------------------


@pytest.mark.slow
def test_python_beside_an_editable_clone_imports_the_package(tmp_path):
    """`pip install -e` of a clone named xgraph, then python run from the folder that holds
    it: `import xgraph` is the package, not the clone's top folder taken for an empty
    namespace package (AttributeError: module 'xgraph' has no attribute 'get_backend')."""
    pytest.importorskip("setuptools", minversion="64")  # builds the editable wheel, offline
    pytest.importorskip("pip")
    clone = tmp_path / "xgraph"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "pytest_xgraph.py"):
        shutil.copy(os.path.join(ROOT, name), clone / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "xgraph"), clone / "xgraph", ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"  # sees this environment's torch, installs the clone apart

    def run(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
        assert r.returncode == 0, r.stderr
        return r

    run(sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv))
    python = str(venv / "bin" / "python")
    offline = ("-q", "--no-build-isolation", "--no-deps", "--no-index")
    run(python, "-m", "pip", "install", *offline, "-e", str(clone))
    r = run(python, "-c", "import xgraph; xgraph.get_backend('cpu'); print(xgraph.__file__)")
    assert r.stdout.strip() == str(clone / "xgraph" / "__init__.py"), r.stdout


def test_a_ctrl_c_that_pytest_turns_into_an_error_is_still_an_interrupt(monkeypatch, capsys):
    """A Ctrl-C landing in pytest's own start-up can come out of pytest.main as another
    error (seen once in CI: a TypeError of its session timing); it is still the user's
    interrupt: one line and 130."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal handler is only set on the main thread")

    def interrupted_main(argv: list[str]) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here
        except KeyboardInterrupt:
            pass
        raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'int'")

    monkeypatch.setattr(pytest, "main", interrupted_main)
    assert main(["conformance", "--backend", "cpu"]) == 130
    assert capsys.readouterr().err.splitlines() == ["xgraph: interrupted"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_ctrl_c_swallowed_by_a_finalizer_still_ends_the_command_with_130(monkeypatch, capsys):
    """Python prints a KeyboardInterrupt raised inside a finalizer as "Exception ignored"
    and runs on; the command line still answers the Ctrl-C: one line, status 130."""
    import os
    import weakref

    from xgraph import cli

    def command(args) -> int:
        class Held:
            pass

        def interrupted_here() -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between these bytecodes
                pass

        held = Held()
        weakref.finalize(held, interrupted_here)
        del held  # the finalizer runs, the KeyboardInterrupt inside it is swallowed
        return 0

    monkeypatch.setattr(cli, "cmd_info", command)
    code = cli.main(["info"])
    err = capsys.readouterr().err.splitlines()
    assert code == 130 and err == ["xgraph: interrupted"], err
