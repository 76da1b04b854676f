"""`TokenCompiled`: a forward under torch.compile with the token count dynamic, so one
compile serves every bucket.

    forward = TokenCompiled(model.forward, max_tokens=512)          # Inductor
    ex = GraphExecutor(forward, compiled=True, buckets=vllm_capture_sizes(512), ...)

Every tensor argument whose first dim is the step's token count is marked dynamic on that
dim, bounded to [2, max_tokens] (`torch._dynamo.mark_dynamic(t, 0, min=2, max=...)`): one
graph serves every size from 2 to `max_tokens`, and a single token, which Dynamo
specialises whatever it is told (0/1 specialisation), gets a graph of its own. Two
compiles in all, whatever the number of buckets, where static shapes cost one per bucket
(and past `torch._dynamo.config.recompile_limit` buckets silently run uncompiled). The
bounds let the compiler prove index ranges (32-bit indexing) and keep the symbol from being
unified with any other size. `dynamic=False` compiles once per token count instead (the
comparison the benchmarks make).

Each instance compiles code of its own (a fresh code object), so its graphs and its
recompile budget are not shared with another instance over the same function. Calls that
cannot run the compiled code run `fn` itself:

- under a dispatch mode (a host graph recording ops, the capture checks): Dynamo would run
  the eager code anyway, and a function first reached under a mode is never compiled again
  (pytorch/pytorch#190286), `fullgraph=True` raises there;
- more tokens than `max_tokens` (steps above the largest bucket, which run eagerly);
- a forward whose code branches on the token count (Dynamo's guard contradicts the bounds:
  a ConstraintViolationError) is compiled once per token count from then on, warned once,
  the guard in `stats()["per_size"]`;
- after the compiler failed (warned once, the reason in `stats()`): first a graph break
  under `fullgraph=True` falls back to compiling with graph breaks allowed, then a failure
  of that to `fn` uncompiled. Compiler failures happen while tracing or compiling, before
  any kernel runs, so nothing has been written when the fallback runs.
"""

from __future__ import annotations

import itertools
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import precompiled
from .compile_cache import CompileCache
from .errors import XGraphWarning

logger = logging.getLogger("xgraph")

_serial = itertools.count()

# Inductor inlines a pointwise node into its users only while its body has at most 30 ops.
# With the token count symbolic, the index arithmetic counts too, and a Hugging Face
# decoder layer's rotary embedding (rotate_half of the normed q and k times sin) crosses
# the line: it is written out and read back, 4 more kernels per layer. Measured on an
# H200 (Qwen3-0.6B shape, bf16, a decode step): 1.58 / 2.05 ms at 8 / 64 tokens against
# 1.28 / 1.69 ms compiled per size; with 60, 1.34 / 1.72 ms and the per-size kernel count.
# Symbolic, the token count also tips each layer's q/k norm + rotary (a 128-element
# reduction) to a persistent reduction where a per-size compile loops: on the H200 those
# two kernels took 46 + 114 us per 8-token step against 54 + 54 us per size (one compile
# 1.04-1.09x per size at 8 / 64 tokens over five runs); looped, 1.022 / 1.008.
DYNAMIC_INDUCTOR_CONFIG: dict[str, Any] = {
    "realize_opcount_threshold": 60,
    "triton.persistent_reductions": False,
}


def under_dispatch_mode() -> bool:
    """Whether eager code runs under a TorchDispatchMode (and is not being traced)."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() > 0


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` behind a function whose code object is new: Dynamo keeps its compiled graphs
    (and counts recompiles) per code object, so this instance shares them with nobody."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    code = call.__code__.replace(co_name=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


class _Counted:
    """A compiler backend that counts the graphs it compiles (one per Dynamo compile), under
    `inductor_config` (torch._inductor.config settings) when given."""

    def __init__(
        self, backend: str | Callable[..., Any], inductor_config: dict[str, Any] | None = None
    ) -> None:
        self.backend = backend
        self.inductor_config = dict(inductor_config or {})
        self.graphs = 0
        # torch names a backend by its __name__ in its errors (else this object's repr)
        self.__name__ = backend if isinstance(backend, str) else getattr(backend, "__name__", "?")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        inner = self.backend
        if isinstance(inner, str):
            from torch._dynamo import lookup_backend

            inner = lookup_backend(inner)
        import torch._inductor.config as inductor

        with inductor.patch(self.inductor_config):  # lowering runs inside this call
            return inner(gm, example_inputs)


_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_hint_overrides",
    "_has_dynamo_dim_marking",
)


def _unmark(t: torch.Tensor) -> None:
    """Take torch._dynamo.mark_dynamic's marks off `t` (they are attributes of the tensor)."""
    for name in _MARKS:
        if name in t.__dict__:
            delattr(t, name)


def _branches_on_shape(exc: BaseException) -> bool:
    """Whether `exc` is Dynamo refusing the dynamic bounds (a guard contradicts them)."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return isinstance(exc, ConstraintViolationError)


class TokenCompiled:
    """`fn(*tensors)` compiled once for every token count up to `max_tokens` (module doc).

    Args:
        fn: the forward; its first tensor argument's dim 0 is the token count, and every
            tensor argument with that dim 0 gets it dynamic.
        max_tokens: the largest token count compiled (the executor's largest bucket).
        backend: a torch.compile backend: "inductor" (the default), or "eager" /
            "aot_eager" (CPU tests), or a callable.
        dynamic: True: one compile for every size from 2 to max_tokens, one for 1 token;
            False: one compile per size, each specialised to it.
        fullgraph: require one graph (no graph break); a graph break falls back to
            compiling with breaks allowed, with a warning.
        inductor_config: torch._inductor.config settings the compiles run under (for
            example DYNAMIC_INDUCTOR_CONFIG); none by default.
        hint: the token count the dynamic graph's kernels are chosen for (the size hint
            Inductor's heuristics and tile choices read, mark_dynamic's `hint_override`),
            clamped to [2, max_tokens]; None: the count it is first traced at.
        cache: a CompileCache (xgraph.compile_cache): loaded before the first compile, and
            saved after each call that compiled a graph, so the next process on this machine
            loads what this one compiled instead of compiling it.
        static: tensors the forward reads whose sizes never change (the KV cache): marked
            static for Dynamo, so it never unifies their sizes with the token count.
        ahead: with a cache and Inductor, compile each token class ahead of time and keep
            it whole beside the cache's artifacts (xgraph.precompiled), so a later process
            loads it without tracing; where torch cannot, compile as before (warned once).
        options: further torch.compile keyword arguments (`options=`, `mode=`).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        max_tokens: int,
        *,
        backend: str | Callable[..., Any] = "inductor",
        dynamic: bool = True,
        fullgraph: bool = True,
        name: str = "forward",
        inductor_config: dict[str, Any] | None = None,
        hint: int | None = None,
        cache: CompileCache | None = None,
        ahead: bool = True,
        static: Sequence[torch.Tensor] = (),
        **options: Any,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"TokenCompiled: max_tokens must be >= 1, got {max_tokens}")
        self.fn, self.max_tokens, self.dynamic, self.name = fn, max_tokens, dynamic, name
        self.hint = None if hint is None else min(max(hint, 2), max(max_tokens, 2))
        self.backend = _Counted(backend, inductor_config)
        self.options = options
        self.fullgraph = fullgraph
        self.fallback: str | None = None  # why calls run `fn` uncompiled, if they do
        self.graph_breaks: str | None = None  # why the graph may break, if it may
        self.per_size: str | None = None  # why a dynamic compile became per-size, if it did
        self.sizes: set[int] = set()  # token counts the compiled code has run
        # only Inductor's artifacts are what the cache keeps; another backend compiles nothing
        # of its own, and saving would write whatever else this process compiled
        self.cache = cache if backend == "inductor" else None
        if self.cache is not None:
            self.cache.load()  # before any compile: the compiler's caches then hold its results
        self._saved_at = 0  # graphs compiled when the cache was last written
        self._compile(fullgraph)
        self.static = list(static)
        self.hold_static(True)
        wanted = ahead and not options and self.cache is not None and self.cache.directory
        self.ahead = Ahead(self) if wanted and precompiled.supported() else None

    def _compile(self, fullgraph: bool) -> None:
        """Compile afresh: new code (so no earlier graph or recompile count carries over)."""
        self._code = _own_code(self.fn, f"xgraph_{self.name}_{next(_serial)}")
        self._compiled = torch.compile(
            self._code,
            backend=self.backend,
            fullgraph=fullgraph,
            dynamic=None if self.dynamic else False,
            **self.options,
        )

    def hold_static(self, on: bool) -> None:
        """Put the static marks on `static` (Dynamo's path) or take them off (a loaded
        ahead-of-time function: its guards were rebuilt without them and refuse marks)."""
        if getattr(self, "_static_on", None) is on:
            return
        self._static_on = on
        for t in self.static:
            if on:
                torch._dynamo.mark_static(t)
            else:
                for name in ("_dynamo_static_indices", "_has_dynamo_dim_marking"):
                    t.__dict__.pop(name, None)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled only inside a snapshot of an object that holds it (torch's ahead-of-time
        # compile records the state of the arguments its guards read): compiled code is
        # this process's and never travels
        return (Detached, (self.name,))

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (each recompile counts one)."""
        return self.backend.graphs

    def stats(self) -> dict[str, Any]:
        return {
            "compiles": self.compiles,
            "dynamic": self.dynamic,
            "hint": self.hint if self.dynamic else None,
            "fullgraph": self.fullgraph and self.graph_breaks is None,
            "graph_breaks": self.graph_breaks,
            "per_size": self.per_size,
            "fallback": self.fallback,
            "sizes": sorted(self.sizes),
            "cache": None if self.cache is None else self.cache.stats(),
            "ahead": None if self.ahead is None else self.ahead.stats(),
        }

    def _mark(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The token count, with its dim marked on every tensor that has it; None where the
        call should run `fn` itself (no tensor, or above max_tokens)."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0:
            return None
        n = tensors[0].shape[0]
        if n > self.max_tokens or n < 1:
            return None
        for t in tensors:  # another instance's marks (its own bounds) would contradict these
            _unmark(t)
        if self.dynamic and n >= 2:
            for t in tensors:
                if t.dim() and t.shape[0] == n:
                    torch._dynamo.mark_dynamic(
                        t, 0, min=2, max=max(self.max_tokens, 2), hint_override=self.hint
                    )
        return n

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fallback is not None or under_dispatch_mode():
            return self.fn(*args, **kwargs)
        n = self._mark(args, kwargs)
        if n is None:
            return self.fn(*args, **kwargs)
        if self.ahead is not None:
            got = self.ahead(n, args, kwargs)
            if got is not MISS:
                self._done(n)
                return got
            self.hold_static(True)
        try:
            out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            return self._failed(exc, args, kwargs)
        except RuntimeError as exc:
            if not (self.dynamic and _branches_on_shape(exc)):
                raise
            return self._static(exc, args, kwargs)
        self._done(n)
        return out

    def _done(self, n: int) -> None:
        self.sizes.add(n)
        if self.cache is not None and self.backend.graphs != self._saved_at:
            self._saved_at = self.backend.graphs  # a new graph: the next process loads it
            self.cache.save()

    def _static(self, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward branches on the token count: compile once per count from now on."""
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("-")]
        self.per_size = lines[0].lstrip("- ") if lines else type(exc).__name__
        self._warn(
            f"depends on the token count in Python ({self.per_size}), so one compile cannot "
            "serve every size; it is compiled once per token count instead"
        )
        self.dynamic = False
        for t in (*args, *kwargs.values()):  # this call's tensors carry the marks still
            if isinstance(t, torch.Tensor):
                _unmark(t)
        self._compile(self.fullgraph and self.graph_breaks is None)
        return self(*args, **kwargs)

    def _failed(self, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A compiler failure: allow graph breaks once, then run uncompiled; warn each time."""
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        if self.fullgraph and self.graph_breaks is None:
            self.graph_breaks = reason
            self._warn(f"does not compile as one graph ({reason}); compiling it with graph breaks")
            self._compile(False)
            return self(*args, **kwargs)
        self.fallback = reason
        self._warn(f"does not compile ({reason}); it runs uncompiled from now on")
        return self.fn(*args, **kwargs)

    def _warn(self, what: str) -> None:
        msg = f"{self.name}: torch.compile of the forward {what}."
        warnings.warn(msg, XGraphWarning, stacklevel=3)
        logger.warning(msg)


class Detached:
    """What a TokenCompiled pickles to: its name, and nothing it compiled."""

    def __init__(self, name: str) -> None:
        self.name = name


MISS = object()  # Ahead's answer where the ordinary compiled path must run the call


class Ahead:
    """A TokenCompiled's forwards compiled ahead of time, one per token class, loaded from
    or kept in its compile cache (xgraph.precompiled)."""

    def __init__(self, owner: TokenCompiled) -> None:
        self.owner = owner
        self.fn, self.prefix = precompiled.target(owner.fn)
        self.functions: dict[str, Any] = {}
        self.loaded: list[str] = []
        self.compiled: list[str] = []
        self.refused = 0  # calls whose guards the function refused (they ran the other path)
        self.refusal: str | None = None  # the first refusal's failing guard
        self.off: str | None = None  # why it stopped, if it did
        self.unsaved: str | None = None  # why a compiled function could not be kept, if so

    def stats(self) -> dict[str, Any]:
        return {
            "loaded": sorted(self.loaded),
            "compiled": sorted(self.compiled),
            "refused_calls": self.refused,
            "refusal": self.refusal,
            "off": self.off,
            "unsaved": self.unsaved,
        }

    def tag(self, n: int) -> str:
        return "one" if n == 1 else ("many" if self.owner.dynamic else f"n{n}")

    def __call__(self, n: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.off is not None:
            return MISS
        self.owner.hold_static(False)
        tag = self.tag(n)
        fn = self.functions.get(tag)
        if fn is None and self.unsaved is None:  # unsaved: later classes compile as before
            fn = self._get(tag, args, kwargs)
        if fn is None:
            return MISS
        full = (*self.prefix, *args)
        for t in (*args, *kwargs.values()):  # marks steer tracing; the function has its shapes
            if isinstance(t, torch.Tensor):
                _unmark(t)
        if not fn.guard_check(*full, **kwargs):
            self.refused += 1
            if self.refusal is None:
                self.refusal = precompiled.why_refused(fn, full, kwargs)
            return MISS
        return fn(*full, **kwargs)

    def _get(self, tag: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cache, part = self.owner.cache, f"ahead-{tag}"
        assert cache is not None
        payload = cache.read(part)
        if payload is not None:
            try:
                fn = precompiled.load(payload, getattr(self.fn, "__globals__", None))
            except Exception as exc:  # unusable here: compiled again below, warned once
                cache.ignore(part, exc)
            else:
                self.loaded.append(tag)
                self.functions[tag] = fn
                return fn
        backend = self.owner.backend
        try:
            fn = precompiled.compile_ahead(
                self.fn,
                (*self.prefix, *args),
                kwargs,
                dynamic=self.owner.dynamic,
                options=backend.inductor_config,
            )
        except Exception as exc:  # torch cannot here: the ordinary path compiles instead
            self._stop(exc)
            return None
        backend.graphs += 1
        self.compiled.append(tag)
        self.functions[tag] = fn
        try:
            cache.write(precompiled.dump(fn), part)
        except Exception as exc:  # this process keeps it; later ones compile again
            self._stop(exc, keep=True)
        return fn

    def _stop(self, exc: BaseException, keep: bool = False) -> None:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        if keep:
            self.unsaved = reason
        else:
            self.off = reason
        self.owner._warn(
            f"cannot be kept compiled ahead of time ({reason}); "
            + (
                "this process uses it, later ones compile again"
                if keep
                else "compiling it as before"
            )
        )
