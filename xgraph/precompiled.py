"""A forward compiled ahead of time and kept whole: Dynamo's trace, its guards and
Inductor's code in one file, so a later process loads it without tracing.

The compile cache (xgraph.compile_cache) keeps Inductor's artifacts, and a warm process
still runs Dynamo over the forward to find them: seconds for a 28-layer model. torch's
`torch.compile(fn).aot_compile((args, kwargs))` traces and compiles once and returns a
function that serializes as a whole (`torch.compiler.load_compiled_function` reads it
back); `TokenCompiled` keeps one per token class (a single token; every count from 2 up,
dynamic) under the compile cache's key, beside its artifacts.

What keeps a loaded function honest:

- The key (the model's class and config, dtype, device, compile settings, and the
  versions of torch, Triton, Python and xgraph) names the file; a file of another key is
  ignored.
- Every source Dynamo inlined is recorded with a digest of its lines; a process whose
  model code differs (an edited file, another transformers) ignores the file, warned once,
  and compiles.
- The guards that torch can serialize are kept and checked on every call (tensor dtypes,
  shapes and strides, constants, the lengths of the sequences it walked); a call they
  refuse runs the ordinary compiled path, which traces for it. Guards on object identity
  (`ID_MATCH` and its kin) cannot be serialized and are dropped: a loaded function reads
  the live objects (parameters, the KV cache) by their paths from its arguments and the
  module globals, never copies kept in the file.

Where torch lacks the feature, or tracing it fails (a closure over unpicklable state, a
backend that does not serialize), `TokenCompiled` warns once and compiles as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import io
import json
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import XGraphError

FORMAT = 2


def _enabled() -> Any:
    """Where torch gates the feature behind a flag (torch 2.11:
    torch._dynamo.config.enable_aot_compile), the flag set for what is compiled inside."""
    config = torch._dynamo.config
    if hasattr(config, "enable_aot_compile"):
        return config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


@functools.cache
def supported() -> bool:
    """Whether this torch can compile ahead of time and load the result."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    with _enabled():
        return hasattr(torch.compile(_probe, backend="eager"), "aot_compile")  # nothing traced


def _probe() -> None:
    return None


def _unserializable() -> frozenset[str]:
    from torch._dynamo.guards import CheckFunctionManager

    return frozenset(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ()))


def keep_guards(entries: Sequence[Any]) -> list[bool]:
    """torch.compile's guard filter: keep every guard torch can serialize (see the module
    docstring for what is dropped)."""
    bad = _unserializable()
    keep = []
    for e in entries:
        kinds = {e.guard_type, *(getattr(e, "derived_guard_types", None) or ())}
        local_type = getattr(getattr(e, "orig_guard", None), "_unserializable", False)
        # a function's closure cells do not survive the snapshot (a loaded guard would
        # read None there); they hold code, which the source digests cover
        closure = "__closure__" in str(getattr(e, "name", ""))
        keep.append(not (kinds & bad or local_type or closure))
    return keep


def _lines_digest(module_name: str, first: int, last: int) -> str | None:
    """A digest of lines [first, last) of an imported module's source; None where the
    module or its source is gone."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        lines = inspect.getsourcelines(module)[0]
    except (OSError, TypeError):
        return None
    return hashlib.sha256("".join(lines[first - 1 : last - 1]).encode()).hexdigest()


def _sources(compiled: Any) -> list[list[Any]]:
    """[module, first line, last line, digest, name] of every source the trace inlined;
    name: the module-level function or method whose code it is (None for nested code)."""
    out, defined = [], {}
    for s in compiled.source_info().inlined_sources:
        m, a, b = s.module, s.firstlineno, s.lastlineno
        if m not in defined:
            defined[m] = _defined_at(m)
        out.append([m, a, b, _lines_digest(m, a, b), defined[m].get(a)])
    return sorted(out, key=lambda r: (r[0], r[1]))


def _code_of(obj: Any) -> Any:
    """The code object behind a function, method or decorated function; None otherwise."""
    obj = getattr(obj, "__func__", obj)  # staticmethod, classmethod
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return getattr(obj, "__code__", None)


def _defined_at(module_name: str) -> dict[int, str]:
    """First line -> qualified name of the module's own functions and its classes' methods."""
    module = sys.modules.get(module_name)
    out: dict[int, str] = {}
    if module is None:
        return out
    for name, obj in vars(module).items():
        if inspect.isclass(obj) and obj.__module__ == module_name:
            members = [(f"{name}.{k}", v) for k, v in vars(obj).items()]
        else:
            members = [(name, obj)]
        for qual, member in members:
            code = _code_of(member)
            if code is not None and code.co_filename == getattr(module, "__file__", None):
                out.setdefault(code.co_firstlineno, qual)
    return out


def _still_bound(module_name: str, qual: str | None, first: int) -> bool:
    """Whether `qual` in the live module is still the code starting at line `first` (not
    replaced at run time: a patched method runs other code than its file's)."""
    if qual is None:
        return True
    obj: Any = sys.modules.get(module_name)
    for part in qual.split("."):
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    code = _code_of(obj)
    return code is not None and code.co_firstlineno == first


def stale_sources(sources: list[list[Any]]) -> list[str]:
    """The recorded sources whose lines differ in this process (or cannot be read), or
    whose function was replaced at run time."""
    out = []
    for module, first, last, digest, qual in sources:
        if digest is None or digest != _lines_digest(module, first, last):
            out.append(f"{module}:{first}-{last}")
        elif not _still_bound(module, qual, first):
            out.append(f"{module}.{qual} (replaced at run time)")
    return out


def target(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """What to compile ahead of time for `fn`, and the arguments put before a call's own:
    a bound method compiles its function with the instance as the first argument, so the
    file never holds the instance (the model and its weights)."""
    if inspect.ismethod(fn):
        return fn.__func__, (fn.__self__,)
    return fn, ()


def compile_ahead(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    dynamic: bool,
    options: dict[str, Any],
) -> Any:
    """`fn` traced and compiled by Inductor for calls like (args, kwargs), their marks
    (mark_dynamic) included; the result is callable and serializable."""
    with _enabled():
        compiled = torch.compile(
            fn,
            backend="inductor",
            fullgraph=True,
            dynamic=None if dynamic else False,
            options={**options, "guard_filter_fn": keep_guards},
        )
        out = compiled.aot_compile((args, kwargs))
    out.disable_guard_check()  # the caller checks, so a refusal falls back, not raises
    return out


def why_refused(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The guard a call failed, in torch's words (for stats and logs)."""
    try:
        f_locals = compiled.prepare_f_locals(*args, **kwargs)
        return str(compiled._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)
    except Exception as exc:  # a diagnosis only: never the call's failure
        return f"unknown ({type(exc).__name__})"


def dump(compiled: Any) -> bytes:
    """The file's payload: a JSON header (format, sources) and torch's serialization."""
    header = json.dumps({"format": FORMAT, "sources": _sources(compiled)}).encode()
    body = type(compiled).serialize(compiled).serialized_data
    return struct.pack("<I", len(header)) + header + body


def load(payload: bytes, f_globals: dict[str, Any] | None = None) -> Any:
    """A function from `dump`'s payload; XGraphError where the file cannot serve this
    process (another format, changed sources), torch's own error where it cannot read it.
    `f_globals`: the globals of the function compiled (what its global guards read)."""
    (n,) = struct.unpack("<I", payload[:4])
    header = json.loads(payload[4 : 4 + n])
    if header.get("format") != FORMAT:
        raise XGraphError(f"its format is {header.get('format')!r}, not {FORMAT}")
    stale = stale_sources(header["sources"])
    if stale:
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        raise XGraphError(
            f"the model's code changed since it was written ({', '.join(stale[:3])}{more})"
        )
    # the traced function's module globals: its global guards and bytecode read them
    with _enabled():
        out = torch.compiler.load_compiled_function(
            io.BytesIO(payload[4 + n :]), f_globals=f_globals
        )
    out.disable_guard_check()
    return out


__all__ = ["compile_ahead", "dump", "keep_guards", "load", "stale_sources", "supported", "target"]
