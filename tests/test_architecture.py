"""The shape of the code: no import cycles, small files and functions, no CPU/CUDA copies.

These read the source (no imports of the modules under test), so they run anywhere.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {
    "xgraph": os.path.join(ROOT, "xgraph"),
    "xgraph_cuda": os.path.join(ROOT, "adapters", "cuda", "xgraph_cuda"),
    "xgraph_ascend": os.path.join(ROOT, "adapters", "ascend", "xgraph_ascend"),
}


def _modules(package: str) -> dict[str, str]:
    """Module name -> file, for every .py file of a package."""
    base = PACKAGES[package]
    out = {}
    for folder, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(base))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only: never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Modules of `known` that `module` imports anywhere (function-level imports included,
    imports for annotations only left out)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    typing_only = _typing_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_pkg else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            if n in known and n != module:
                found.add(n)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", ["xgraph", "xgraph_cuda", "xgraph_ascend"])
def test_no_import_cycle(package):
    mods = _modules(package)
    # a package's __init__ importing its own submodules is how packages are built; what
    # must not happen is a module importing back into something that imports it
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    for m in graph:
        graph[m] = {
            d for d in graph[m] if not (m.startswith(d + ".") and mods[d].endswith("__init__.py"))
        }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("package", ["xgraph", "xgraph_cuda", "xgraph_ascend"])
def test_files_and_functions_stay_small(package):
    too_long = []
    for mod, path in _modules(package).items():
        source = open(path).read()
        lines = source.count("\n")
        if lines > 500:
            too_long.append(f"{mod}: {lines} lines (> 500)")
        for fn in _functions(ast.parse(source, path)):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > 60:
                too_long.append(f"{mod}.{fn.name} at line {fn.lineno}: {n} lines (> 60)")
    assert not too_long, "\n".join(too_long)


def _signature_lines(source: str, path: str) -> set[int]:
    """Lines of function signatures: a contract's method signature repeats by design."""
    lines: set[int] = set()
    for fn in _functions(ast.parse(source, path)):
        first_body = fn.body[0]
        end = max(fn.lineno, first_body.lineno - 1)
        if isinstance(first_body, ast.Expr) and isinstance(first_body.value, ast.Constant):
            end = first_body.end_lineno or first_body.lineno  # the docstring too
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        lines.update(range(start, end + 1))
    return lines


def _windows(path: str, size: int = 6) -> dict[tuple[str, ...], int]:
    """Every run of `size` code lines (comments, blank, import, docstring-only and
    signature lines dropped, whitespace folded) -> the line it starts at."""
    source = open(path).read()
    signatures = _signature_lines(source, path)
    keep = []
    for i, raw in enumerate(source.split("\n"), 1):
        line = " ".join(raw.split())
        if (
            i in signatures
            or not line
            or line.startswith(("#", "import ", "from ", '"""', "'''"))
            or line in (")", "]", "}", "):", "],", "),", "else:", "try:", "finally:", "pass")
        ):
            continue
        keep.append((i, line))
    return {
        tuple(t for _, t in keep[j : j + size]): keep[j][0] for j in range(len(keep) - size + 1)
    }


# the places that would copy each other's device code: each pair must share no block
COPY_GROUPS = {
    "cpu backend": os.path.join(PACKAGES["xgraph"], "backends", "cpu"),
    "device layer": os.path.join(PACKAGES["xgraph"], "device"),
    "simulated runtime": os.path.join(PACKAGES["xgraph"], "testing", "sim"),
    "cuda adapter": PACKAGES["xgraph_cuda"],
    "ascend adapter": PACKAGES["xgraph_ascend"],
    "dummy adapter": os.path.join(ROOT, "tests", "dummy_adapter", "xgraph_dummy"),
}


def _group_runs(folder: str) -> dict[tuple[str, ...], str]:
    """Every six-line run of the group's .py files -> where it first stands."""
    runs: dict[tuple[str, ...], str] = {}
    for path in sorted(
        os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(".py")
    ):
        for run, at in _windows(path).items():
            runs.setdefault(run, f"{os.path.relpath(path, ROOT)}:{at}")
    return runs


def _pairs() -> list[tuple[str, str]]:
    names = sorted(COPY_GROUPS)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]


def test_the_window_scan_finds_a_copy(tmp_path):
    block = "".join(f"x{i} = f({i}, y)\n" for i in range(7))
    (tmp_path / "a.py").write_text("def a():\n    pass\n\n\n" + block)
    (tmp_path / "b.py").write_text("z = 1\n" + block)
    assert set(_windows(str(tmp_path / "a.py"))) & set(_windows(str(tmp_path / "b.py")))


@pytest.mark.parametrize("pair", _pairs(), ids=" ~ ".join)
def test_no_six_line_block_repeated_between_two_device_codes(pair):
    a, b = (_group_runs(COPY_GROUPS[name]) for name in pair)
    shared = sorted(f"{a[run]} = {b[run]}" for run in set(a) & set(b))
    assert not shared, "\n".join(shared)


def test_core_imports_no_device_runtime():
    """Core modules never import torch_npu, cuda-python or an adapter."""
    banned = re.compile(r"^\s*(import|from)\s+(torch_npu|cuda\b|cuda\.|xgraph_cuda|xgraph_ascend)")
    offenders = [
        f"{mod}: {line.strip()}"
        for mod, path in _modules("xgraph").items()
        for line in open(path)
        if banned.match(line)
    ]
    assert not offenders, offenders


INTEGRATIONS = "xgraph.integrations"


def test_bench_imports_no_integration():
    """`xgraph.bench` imports no integration (not even inside a function, nor by name through
    importlib): an integration registers its bench targets (`xgraph.bench.register_target`)."""
    modules = _modules("xgraph")
    known = set(modules)
    found = []
    for mod, path in modules.items():
        if mod != "xgraph.bench" and not mod.startswith("xgraph.bench."):
            continue
        imported = _imports(mod, path, known)
        found += [f"{mod} imports {m}" for m in sorted(imported) if m.startswith(INTEGRATIONS)]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and str(a.value).startswith(INTEGRATIONS)
                for a in node.args
            ):
                found.append(f"{mod}:{node.lineno} imports an integration by name")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["xgraph", "xgraph_cuda", "xgraph_ascend"])
def test_formatter_runs_unhindered(package):
    """`# fmt: skip` / `# fmt: off` are for the few places a formatter would harm (packed
    Triton kernel signatures), each under a comment saying why; never to pass the size rules."""
    found = []
    for mod, path in _modules(package).items():
        lines = open(path).read().split("\n")
        for i, line in enumerate(lines):
            if "# fmt: skip" in line:
                found.append(f"{mod}:{i + 1} fmt: skip")
            elif line.strip() == "# fmt: off" and not lines[i + 1].lstrip().startswith("#"):
                found.append(f"{mod}:{i + 1} fmt: off without a reason below it")
    assert not found, "\n".join(found)


def test_two_public_faces_stay_small():
    """`xgraph` is what an engine needs (at most 25 names, errors included); adapter
    authors import `xgraph.adapter`. Every name listed resolves."""
    import xgraph
    import xgraph.adapter

    assert len(xgraph.__all__) <= 25, sorted(xgraph.__all__)
    for face in (xgraph, xgraph.adapter):
        missing = [n for n in face.__all__ if not hasattr(face, n)]
        assert not missing, (face.__name__, missing)


# an adapter's whole contract is its two faces; a simulator of its device may also build on
# the core's simulated runtime (the dummy adapter's runtime is that simulator)
ADAPTER_FACES = ("xgraph.adapter", "xgraph.hooks")
SIM_FACE = "xgraph.testing.sim"
ADAPTERS = {
    "xgraph_cuda": PACKAGES["xgraph_cuda"],
    "xgraph_ascend": PACKAGES["xgraph_ascend"],
    "xgraph_dummy": os.path.join(ROOT, "tests", "dummy_adapter", "xgraph_dummy"),
}


def _core_imports(source: str, path: str) -> list[tuple[int, str]]:
    """(line, module) of every `xgraph` module a source imports, anywhere in it (typing-only
    imports too: they name the contract as much as any)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:  # `from xgraph import adapter` imports xgraph.adapter
                whole = f"{node.module}.{a.name}"
                face = whole in (*ADAPTER_FACES, SIM_FACE) or node.module == "xgraph"
                found.append((node.lineno, whole if face else node.module))
    return [(line, m) for line, m in found if m == "xgraph" or m.startswith("xgraph.")]


def _past_the_faces(source: str, path: str, simulator: bool) -> list[str]:
    allowed = (*ADAPTER_FACES, SIM_FACE) if simulator else ADAPTER_FACES
    return [
        f"{path}:{line} imports {m}" for line, m in _core_imports(source, path) if m not in allowed
    ]


def test_adapters_import_the_core_only_through_their_faces():
    """Adapter packages import xgraph only through `xgraph.adapter` and `xgraph.hooks` (a
    simulator of the device, `<package>/sim/` or the dummy adapter, also through
    `xgraph.testing.sim`): what an adapter needs is on the face, nothing past it."""
    sample = "from xgraph.runners import store_kv\nfrom xgraph import adapter, errors\n"
    assert _past_the_faces(sample, "x.py", simulator=True) == [
        "x.py:1 imports xgraph.runners",
        "x.py:2 imports xgraph.errors",
    ]
    offenders = []
    for package, base in ADAPTERS.items():
        for folder, _, files in os.walk(base):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)
                simulator = package == "xgraph_dummy" or os.path.join(base, "sim") in path
                offenders += _past_the_faces(open(path).read(), rel, simulator)
    assert not offenders, "\n".join(offenders)
