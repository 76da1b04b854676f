"""The command line: one-line errors, help for every option, a narrow `info`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from xgraph.cli import build_parser


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
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1


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


def test_verbose_names_where_the_backend_choice_came_from():
    r = xgraph("-v", "demo", env={"XGRAPH_BACKEND": ""})
    assert "selected (highest priority available)" in r.stderr, r.stderr
    r = xgraph("-v", "demo", "--backend", "cpu")
    assert "selected (argument)" in r.stderr
