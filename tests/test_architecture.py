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


# -- the step path: check, decide, agree, stage (docs/executor.md) --------------------------


def _calls_of(tree: ast.AST, name: str) -> list[int]:
    """Lines calling a method or function called `name`."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == name)
            or (isinstance(node.func, ast.Name) and node.func.id == name)
        )
    ]


def test_no_swapped_planner_and_ranks_agree_before_anything_is_staged():
    """Nothing replaces an executor's planner, and the agreement across ranks decides again
    (which writes nothing) instead of staging: a step is staged once, after the ranks
    agree (tests/test_distributed_dp.py counts the stagings per step on each rank)."""
    swapped = []
    for mod, path in _modules("xgraph").items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:  # another object's planner: `executor.planner = ...`
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == "planner"
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    swapped.append(f"{mod}:{node.lineno}")
    assert not swapped, f"a planner assigned outside the executor: {swapped}"
    for mod, path in _modules("xgraph").items():
        if not mod.startswith("xgraph.distributed"):
            continue
        tree = ast.parse(open(path).read(), path)
        staged = _calls_of(tree, "stage") + _calls_of(tree, "plan")
        assert not staged, f"{mod} stages a step (lines {staged}); it may only decide"
    assert not any(
        isinstance(n, ast.ClassDef) and n.name == "AgreedPlanner"
        for n in ast.walk(ast.parse(open(_modules("xgraph")["xgraph.distributed.lockstep"]).read()))
    )


# -- one capture path: the capture transaction (xgraph/capture.py) ---------------------------

# the graph layer itself, the suites that test it, and code that captures outside an
# executor on purpose (the public `xgraph.graph()` demo, a benchmark's hand-captured anchor,
# the PDL race check's pair of graphs over static inputs)
GRAPH_LAYER = ("xgraph.graphs", "xgraph.device", "xgraph.backends", "xgraph.testing")
OUTSIDE_AN_EXECUTOR = ("xgraph.demo", "xgraph.bench.distributed", "xgraph.pdl_check")


def _begins_a_capture(node: ast.Call) -> bool:
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in ("capture_begin", "record_check"):
        return True
    if isinstance(f, ast.Name) and f.id in ("graph", "FullGraph", "PiecewiseGraph"):
        return True
    return (
        isinstance(f, ast.Attribute)
        and f.attr == "graph"
        and isinstance(f.value, ast.Name)
        and f.value.id in ("xgraph", "graphs", "cuda")
    )


def test_no_module_but_the_capture_transaction_begins_a_capture():
    """Captures (`capture_begin`, `xgraph.graph()`, a recording made or its device check
    recorded) happen in the capture transaction, or in the recordings it drives
    (xgraph.piecewise); the planner, the device check, staging and the parameterization
    check begin none."""
    found = []
    for mod, path in _modules("xgraph").items():
        if mod in ("xgraph.capture", "xgraph.piecewise") or mod.startswith(
            GRAPH_LAYER + OUTSIDE_AN_EXECUTOR
        ):
            continue
        tree = ast.parse(open(path).read(), path)
        found += [
            f"{mod}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _begins_a_capture(n)
        ]
    assert not found, found


def test_every_capture_of_an_executor_passes_through_the_transaction(monkeypatch):
    """At run time: every graph capture of misses, pre-capture, device-metadata checks and
    the parameterization check starts in xgraph/capture.py, and the planner's three moves
    make no graph at all (device metadata included)."""
    import inspect
    import random

    import torch

    import xgraph
    from xgraph import AttentionInputs
    from xgraph.graphs import CheckedGraph
    from xgraph.models import Workload

    backend = xgraph.get_backend("cpu")
    transaction = os.path.join(PACKAGES["xgraph"], "capture.py")
    outside, made = [], []
    begin, new_graph = CheckedGraph.capture_begin, type(backend).new_graph

    def counted_begin(self, *args, **kw):  # type: ignore[no-untyped-def]
        files = [f.filename for f in inspect.stack()]
        if transaction not in files:
            outside.append(files[1:4])
        return begin(self, *args, **kw)

    monkeypatch.setattr(CheckedGraph, "capture_begin", counted_begin)
    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=8)
    ex = w.executor(backend=backend, buckets=[1, 2, 4, 8])
    ex.planner.attn_check.cpu_is_device = True  # tensors take the device-metadata path
    rng = random.Random(3)
    ex.capture([2], progress=False)
    for n in (3, 3, 5):
        a = w.decode_step(rng, n)
        tens = AttentionInputs(
            a.attn.query_lens, torch.tensor(a.attn.seq_lens), a.attn.table(0, 6), a.attn.slots()
        )
        inputs = {"input_ids": a.input_ids, "positions": a.positions}
        monkeypatch.setattr(type(backend), "new_graph", lambda b: made.append(1) or new_graph(b))
        checked = ex.planner.check(inputs, tens)
        step = ex.planner.stage(checked, ex.planner.decide(checked))
        monkeypatch.setattr(type(backend), "new_graph", new_graph)
        assert not made and step.device_check is not None, "the planner made a graph"
        ex(attn=tens, **inputs)
    ex.check_parameterization(sizes=[4], kind="full")
    assert [sq for sq, g in ex.cache.checks() if g is not None] == [(4, 1), (8, 1)]
    ex.close()
    assert not outside, outside


# -- the executor by responsibility: engine API, key cache, capture transaction -------------

EXECUTOR_MODULES = ("xgraph.executor", "xgraph.keycache", "xgraph.capture")


def test_no_mixin_base_on_the_graph_executor():
    tree = ast.parse(open(_modules("xgraph")["xgraph.executor"]).read())
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GraphExecutor"
    )
    assert not cls.bases, [ast.unparse(b) for b in cls.bases]
    assert "xgraph.release" not in _modules("xgraph")


def _private_names(paths: list[str]) -> set[str]:
    """`self._x` attributes assigned in these modules' classes."""
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name):
                        if e.value.id == "self" and e.attr.startswith("_"):
                            out.add(e.attr)
    return out


def test_no_module_reads_the_executors_private_state():
    """Parameterization, sleep, the lockstep, the benchmarks and the testing kits use the
    executor's public methods: no `ex._x` read, and none of the executor's, key cache's or
    capture transaction's private names read on another object, outside those modules."""
    mods = _modules("xgraph")
    private = _private_names([mods[m] for m in EXECUTOR_MODULES])
    assert {"_busy", "_bufs"} <= private  # the scan sees them
    found = []
    for mod, path in mods.items():
        if mod in EXECUTOR_MODULES:
            continue
        for n in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                owner, name = n.value.id, n.attr
                if owner == "self" or not name.startswith("_") or name.startswith("__"):
                    continue
                if name in private or owner in ("ex", "executor"):
                    found.append(f"{mod}:{n.lineno} {owner}.{name}")
            elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr":
                args = n.args
                if len(args) > 1 and isinstance(args[1], ast.Constant) and args[1].value in private:
                    found.append(f"{mod}:{n.lineno} getattr(..., {args[1].value!r})")
    assert not found, found


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


def test_a_miss_costs_one_synchronize_and_no_empty_cache(monkeypatch):
    """After the first capture (whose warm-up's cached memory goes back before the output
    buffers are allocated, for good), a miss synchronizes the device at most once (the
    backend's, at capture begin; the CPU backend's needs none) and never empties the
    allocator's cache; a hit does neither."""
    import random

    import xgraph
    from xgraph.models import Workload

    backend = xgraph.get_backend("cpu")
    calls: list[str] = []
    cls = type(backend)
    sync, empty = cls.synchronize, cls.empty_cache
    monkeypatch.setattr(cls, "synchronize", lambda b: calls.append("sync") or sync(b))
    monkeypatch.setattr(cls, "empty_cache", lambda b: calls.append("empty") or empty(b))
    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=8)
    ex = w.executor(backend=backend, buckets=[1, 2, 4, 8])
    rng = random.Random(5)
    ex(**w.decode_step(rng, 1).kwargs())  # the first capture
    assert calls.count("empty") == 1, calls
    for n, misses in ((2, 1), (3, 1), (4, 0), (7, 1), (8, 0)):  # 4 and 8: hits
        calls.clear()
        ex(**w.decode_step(rng, n).kwargs())
        assert calls.count("sync") <= misses and "empty" not in calls, (n, calls)
    assert ex.stats()["captures"] == 4
    ex.close()
