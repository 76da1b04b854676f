"""`LayerCompiled`: a decoder's layers under torch.compile, one compile serving all of them
(regional compilation), its attention calls between the compiled pieces.

    compiled = LayerCompiled(forward, decoder.layers, name="qwen3")
    ex = GraphExecutor(compiled, compiled=True, ...)

The layers of a decoder share their code and their shapes, so Dynamo compiles the first
layer's call and every later layer's call passes that code's guards: compile time is one
layer's, where compiling the whole forward (`xgraph.compiled.TokenCompiled`) traces and
lowers every layer. Measured on this repository's CPU host with Inductor (transformers'
Qwen3 of 28 layers, hidden 256, cold caches): 87 s for the whole forward, 14 s for its
layers. What a whole-forward compile has that this does not is fusion across a layer's
edges (the residual add that ends one layer with the norm that starts the next, where the
layers do not fuse them into their projections themselves); docs/startup.md has both
measured on a GPU.

Each call of the layer's attention leaves the graph (a graph break, `outside_graph`): the
attention picks its layer's cache by Python state that differs from layer to layer, which
Dynamo would otherwise guard on and compile again for every layer. The pieces around it
are compiled once each; the attention runs as its own op, as it does in a captured graph.

The layers run compiled only inside a call of this object (the executor's forward); every
other call of the model (a probe, an eager check) runs them as they are. One compile serves
the token counts from 2 up (`dynamic=True`) and one more the single token, which Dynamo
specialises. Under a dispatch mode (the capture checks) the layers run uncompiled, as
TokenCompiled's forward does; a compiler failure makes them run uncompiled from then on,
warned once, the failing layer's call run again uncompiled. Unlike the whole forward's, a
layer's compile can fail after some of its pieces ran: before its attention call that is
harmless (the pieces computed tensors and wrote nothing), after it the layer's attention
would run twice, which the GraphModel's count of attention calls refuses with an error
naming it rather than a result. `release()` gives the layers their own forwards back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .compile_cache import CompileCache
from .compiled import _Counted, under_dispatch_mode
from .errors import XGraphWarning

logger = logging.getLogger("xgraph")

# `on`: a LayerCompiled call runs in this thread; `tokens`: its step's token count
_local = threading.local()


def _on() -> bool:
    return getattr(_local, "on", False)


def outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` kept out of any graph Dynamo traces (its call is a graph break there): for the
    attention calls between compiled layer pieces."""
    return torch._dynamo.disable(fn, recursive=True)


RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def _settings() -> Iterator[None]:
    """What the layers compile under (their frames, the pieces after a graph break too, are
    traced inside a call only): no duck sizing, so a token count that equals another size
    at the first trace (a head dim of 128 at 128 tokens) keeps a symbol of its own instead
    of a graph for the two equal and a second for every other count; and a recompile limit
    above Dynamo's 8, which counts per code object, and a decorator shared by many of a
    library's functions (transformers' deprecate_kwarg) shares one count among them all.
    Past the limit Dynamo runs a frame uncompiled without an error."""
    with (
        torch.fx.experimental._config.patch(use_duck_shape=False),
        torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
    ):
        yield


def _layer_call(
    owner: LayerCompiled, own: Callable[..., Any], compiled: Any, *args: Any, **kwargs: Any
) -> Any:
    """A layer's forward: compiled inside a LayerCompiled call, its own anywhere else."""
    if not _on() or owner.fallback is not None or under_dispatch_mode():
        return own(*args, **kwargs)
    if getattr(_local, "tokens", 0) > owner.max_tokens:
        return own(*args, **kwargs)
    try:
        return compiled(*args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as exc:
        owner.failed(exc)
        return own(*args, **kwargs)


def _wrapper_of(layer: torch.nn.Module) -> functools.partial | None:
    f = layer.__dict__.get("forward")
    return f if isinstance(f, functools.partial) and f.func is _layer_call else None


class LayerCompiled:
    """`forward(*tensors)` with `layers` compiled (module doc).

    Args:
        forward: the executor's forward; it calls the layers (through their modules).
        layers: the decoder layers, one code for all (a ModuleList's modules).
        max_tokens: the largest token count run compiled (the executor's largest bucket;
            steps above it run the layers as they are); the forward's first tensor
            argument's dim 0 is the step's count.
        backend, dynamic, name, inductor_config, cache, static: as TokenCompiled's
            (`dynamic=False`: a compile per token count; `static`: tensors marked static).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        layers: Sequence[torch.nn.Module],
        max_tokens: int,
        *,
        backend: str | Callable[..., Any] = "inductor",
        dynamic: bool = True,
        name: str = "forward",
        inductor_config: dict[str, Any] | None = None,
        cache: CompileCache | None = None,
        static: Sequence[torch.Tensor] = (),
    ) -> None:
        if not layers:
            raise ValueError(f"{name}: LayerCompiled needs at least one layer")
        self.fn, self.name, self.dynamic = forward, name, dynamic
        self.max_tokens = max(max_tokens, 2)
        self.backend = _Counted(backend, inductor_config)
        self.fallback: str | None = None  # why the layers run uncompiled, if they do
        self.sizes: set[int] = set()
        self.cache = cache if backend == "inductor" else None  # as TokenCompiled's
        if self.cache is not None:
            self.cache.load()
        self._saved_at = 0
        for t in static:
            torch._dynamo.mark_static(t)
        self.layers = list(layers)
        self._own: list[Any] = []  # per layer: its own forward, where it had one of its own
        for layer in self.layers:
            self._install(layer)

    def _install(self, layer: torch.nn.Module) -> None:
        prior = _wrapper_of(layer)  # another LayerCompiled's: wrapped afresh, around its own
        if prior is None:
            own, kept = layer.forward, layer.__dict__.get("forward")
        else:
            own, kept = prior.args[1], prior.args[0].kept(layer)
        self._own.append(kept)
        compiled = torch.compile(
            own, backend=self.backend, dynamic=True if self.dynamic else False, fullgraph=False
        )
        # a partial (not a bound method) over the module: see fusions._install
        layer.forward = functools.partial(_layer_call, self, own, compiled)

    def kept(self, layer: torch.nn.Module) -> Any:
        """What `layer.__dict__` held as its forward before this object wrapped it (None:
        nothing, the class's forward)."""
        return next(k for m, k in zip(self.layers, self._own) if m is layer)

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (a layer's pieces count one each)."""
        return self.backend.graphs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        n = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
        was = _on(), getattr(_local, "tokens", 0)
        _local.on, _local.tokens = True, n
        try:
            with _settings():
                out = self.fn(*args, **kwargs)
        finally:
            _local.on, _local.tokens = was
        if 0 < n <= self.max_tokens and self.fallback is None:
            self.sizes.add(n)  # counts the compiled layers ran
        if self.cache is not None and self.backend.graphs != self._saved_at:
            self._saved_at = self.backend.graphs  # a new graph: the next process loads it
            self.cache.save()
        return out

    def failed(self, exc: BaseException) -> None:
        """A compiler failure: the layers run uncompiled from now on (warned once)."""
        if self.fallback is not None:
            return
        text = str(exc).strip().splitlines()[0] if str(exc) else ""
        self.fallback = f"{type(exc).__name__}: {text}"
        msg = (
            f"{self.name}: torch.compile of the decoder layers does not compile "
            f"({self.fallback}); they run uncompiled from now on."
        )
        warnings.warn(msg, XGraphWarning, stacklevel=3)
        logger.warning(msg)

    def release(self) -> None:
        """Give every layer still wrapped by this object its own forward back."""
        for layer, kept in zip(self.layers, self._own):
            w = _wrapper_of(layer)
            if w is None or w.args[0] is not self:
                continue
            if kept is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = kept

    def stats(self) -> dict[str, Any]:
        return {
            "scope": "layers",
            "layers": len(self.layers),
            "compiles": self.compiles,
            "dynamic": self.dynamic,
            "fallback": self.fallback,
            "sizes": sorted(self.sizes),
            "cache": None if self.cache is None else self.cache.stats(),
        }
