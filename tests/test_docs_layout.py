"""The docs and tools stay as laid out: links resolve, every path a docstring or a page names
exists, benchmarks.md is a document (dated runs go to the results log), results folders hold
data (one-off probes live in experiments/), scripts/ holds only the device runner, and no
package imports it."""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = "docs/results/LOG.md"
PRODUCT_SCRIPTS = {"device.sh"}  # the GPU runner: every check and benchmark on a GPU machine
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _documents() -> list[str]:
    names = ["README.md", LOG, "experiments/README.md", *glob.glob("docs/*.md", root_dir=ROOT)]
    return sorted({*names, *glob.glob("adapters/*/README.md", root_dir=ROOT)})


def _unfenced(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def _headings(text: str) -> list[str]:
    return re.findall(r"^#{1,6} +(.+?) *$", _unfenced(text), re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(name: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(_read(name)))


@pytest.mark.parametrize("name", _documents())
def test_every_relative_link_resolves(name):
    bad = []
    for link in _links(name):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
        if not os.path.exists(os.path.join(ROOT, target)):
            bad.append(f"{link}: no file {target}")
        elif anchor and target.endswith(".md"):
            if anchor not in {_anchor(h) for h in _headings(_read(target))}:
                bad.append(f"{link}: no heading #{anchor} in {target}")
    assert not bad, f"{name}: broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", _documents())
def test_every_results_path_named_in_code_spans_exists(name):
    paths = re.findall(r"`(docs/results/[^`\s]*)`", _read(name))
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"{name} names results that are not there: {missing}"


# a path from the repository root: xgraph/...py, or anything under scripts/, adapters/,
# docs/, experiments/ (not part of a longer path, a glob or a placeholder)
NAMED_PATH = re.compile(r"(?<![\w/.$<-])((?:xgraph|scripts|adapters|docs|experiments)/[\w./-]*)")
HISTORY = {LOG, "CHANGELOG.md"}  # what they name may have gone since; their links resolve


def _named_paths(text: str) -> set[str]:
    paths = set()
    for m in NAMED_PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if text[m.end() : m.end() + 1] in "*{<" and m.end() < len(text):
            continue  # a glob or a placeholder, not a file
        if path.startswith("xgraph/") and not path.endswith(".py"):
            continue  # a module named by its folder is not a file path
        paths.add(path)
    return paths


def _missing(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))


def _docstrings(path: str) -> list[str]:
    tree = ast.parse(_read(path), path)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n))]


def test_results_folders_hold_no_python():
    scripts = glob.glob("docs/results/**/*.py", root_dir=ROOT, recursive=True)
    assert not scripts, f"one-off probes go to experiments/ (a README row each): {scripts}"


def test_every_experiment_has_a_readme_row():
    rows = _read("experiments/README.md")
    scripts = sorted(glob.glob("*.py", root_dir=os.path.join(ROOT, "experiments")))
    assert scripts, "experiments/ holds the one-off probes"
    missing = [s for s in scripts if f"| `{s}` |" not in rows]
    assert not missing, f"experiments/README.md has no row for {missing}"


def test_every_path_a_docstring_names_exists():
    roots = ("xgraph", "adapters", "tests", "tools", "experiments")
    files = glob.glob("*.py", root_dir=ROOT) + [
        f for r in roots for f in glob.glob(f"{r}/**/*.py", root_dir=ROOT, recursive=True)
    ]
    missing = [
        f"{name}: {path}"
        for name in sorted(files)
        for doc in _docstrings(name)
        for path in _missing(_named_paths(doc))
    ]
    assert not missing, "docstrings name paths that are not there:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", sorted(set(_documents()) - HISTORY))
def test_every_path_a_page_names_exists(name):
    missing = _missing(_named_paths(_read(name)))
    assert not missing, f"{name} names paths that are not there: {missing}"


def test_the_path_scan_finds_a_path_and_skips_globs_and_modules():
    text = "see scripts/gone.sh, docs/results/h200/*.json, xgraph/bench/ and xgraph/cli.py."
    assert _named_paths(text) == {"scripts/gone.sh", "xgraph/cli.py"}
    assert _missing(_named_paths(text)) == ["scripts/gone.sh"]


def test_benchmarks_md_has_no_dated_pass_headings():
    dated = [
        h
        for h in _headings(_read("docs/benchmarks.md"))
        if DATE.search(h) or re.search(r"\bpass\b|\brun \d", h, re.I)
    ]
    assert not dated, f"dated runs belong in {LOG}, not docs/benchmarks.md: {dated}"


def test_results_log_entries_are_dated_oldest_first():
    entries = re.findall(r"^## +(.+)$", _read(LOG), re.M)
    assert entries, f"{LOG} has no entries"
    undated = [e for e in entries if not re.match(r"\d{4}-\d{2}-\d{2}: ", e)]
    assert not undated, f"every entry of {LOG} starts with its date: {undated}"
    dates = [e[:10] for e in entries]
    assert dates == sorted(dates), f"{LOG} is append-only, oldest first: {dates}"


def test_hardware_md_is_a_table_without_history():
    text = _read("docs/hardware.md")
    assert "| backend | machine |" in text
    prose = [p for p in re.split(r"\n\s*\n", text) if not p.lstrip().startswith(("|", "#", "-"))]
    narrated = [p for p in prose if DATE.search(p) or re.search(r"\b[0-9a-f]{7}\b", p)]
    assert not narrated, f"dates and commits go in the table or the log: {narrated}"


def test_scripts_holds_only_the_device_runner():
    assert set(os.listdir(os.path.join(ROOT, "scripts"))) == PRODUCT_SCRIPTS


def test_device_runner_parses_and_calls_files_that_exist():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts/device.sh")], check=True)
    called = re.findall(r"python3 +\\?\s*([\w/.-]+\.py)", _read("scripts/device.sh"))
    assert called, "device.sh runs the CUDA adapter's tools"
    missing = [p for p in called if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"device.sh calls files that are not there: {missing}"


def test_every_device_runner_stage_is_documented():
    stages = set(re.findall(r"\bhas ([\w-]+) *(?:&&|\|\|)", _read("scripts/device.sh")))
    table = _read("docs/benchmarks.md")
    undocumented = sorted(s for s in stages if f"| `{s}` |" not in table)
    assert not undocumented, f"stages missing from docs/benchmarks.md's stage table: {undocumented}"


def _python_files() -> list[str]:
    return sorted(
        glob.glob("xgraph/**/*.py", root_dir=ROOT, recursive=True)
        + glob.glob("adapters/**/*.py", root_dir=ROOT, recursive=True)
    )


def test_no_package_imports_from_scripts():
    importers = []
    for name in _python_files():
        for node in ast.walk(ast.parse(_read(name), name)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            if any(m == "scripts" or m.startswith("scripts.") for m in modules):
                importers.append(f"{name}:{node.lineno}")
    assert not importers, f"product code imports from scripts/: {importers}"


# -- the names that left xgraph's top namespace: each in the CHANGELOG with where it went --


def _changelog_moves() -> dict[str, str]:
    """name -> module, from the `### Removed` section of CHANGELOG.md's unreleased part:
    lines `- \\`module\\` ...: \\`Name\\`, \\`Name\\`;`."""
    unreleased = _read("CHANGELOG.md").split("\n## [", 2)[1]
    removed = unreleased.partition("### Removed")[2].split("\n### ")[0]
    moves = {}
    for module, names in re.findall(
        r"^\s+- `(xgraph[\w.]*)`[^:\n]*: (.+(?:\n\s{4}\S.*)*)", removed, re.M
    ):
        moves.update({name: module for name in re.findall(r"`(\w+)`", names)})
    return moves


def _public_imports(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names if not a.name.startswith("_")}
    return names


def test_every_name_that_left_xgraph_is_importable_where_the_changelog_says():
    import importlib

    import xgraph

    moves = _changelog_moves()
    assert moves, "CHANGELOG.md's unreleased section lists no names under ### Removed"
    wrong = [
        f"{module}.{name}"
        for name, module in moves.items()
        if hasattr(xgraph, name) or not hasattr(importlib.import_module(module), name)
    ]
    assert not wrong, f"still in xgraph, or not where the CHANGELOG sends them: {wrong}"


def test_the_changelog_names_every_name_that_ever_left_xgraph():
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, check=True
        ).stdout

    try:
        if git("rev-parse", "--is-shallow-repository").strip() != "false":
            pytest.skip("a shallow clone: the history of xgraph/__init__.py is not all here")
        commits = git("log", "--format=%H", "--", "xgraph/__init__.py").split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    ever = set().union(*(_public_imports(git("show", f"{c}:xgraph/__init__.py")) for c in commits))
    gone = ever - _public_imports(_read("xgraph/__init__.py"))
    missing = sorted(gone - set(_changelog_moves()))
    assert not missing, f"names that left xgraph, missing from the CHANGELOG: {missing}"
