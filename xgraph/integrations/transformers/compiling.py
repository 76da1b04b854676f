"""A GraphModel's decoder under torch.compile: the whole forward as one graph, or its
layers one by one.

`compile=` names the compiler (True: Inductor; a torch.compile backend name or callable);
`compile_scope=` what one compile covers:

- "forward" (the default): the decoder's whole forward, one graph for every bucket of two
  tokens or more and one for the single token (xgraph.compiled.TokenCompiled), kept whole
  ahead of time in the compile cache where torch can;
- "auto": "forward", unless the decoder's layers run over xgraph's fused projections
  (fusions.py); there the decoder runs uncompiled and the GraphModel's stats say why. It
  saves a cold process the compile (35.8 s on an H100) at a cost per step: measured on one
  H100 on 2026-12-07 (the transformers Qwen3-0.6B, fused layers, PDL; docs/transformers.md),
  the forward compiled whole decoded 880 / 1,020 tokens/s at one / eight steps a launch
  against 856-861 / 895 uncompiled (an earlier pair on another H100 had read the other way
  at one step a launch, 762 against 858);
- "layers": one decoder layer, whose compiled code every layer runs (xgraph.compiled_layers:
  regional compilation); the attention calls run between its compiled pieces. A fraction
  of the compile time (docs/startup.md), fusion across the layers' edges given up.

Both keep what they compile in the per-machine compile cache (xgraph.compile_cache), keyed
by the scope among the other settings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from ...compile_cache import CompileCache
from ...compiled import DYNAMIC_INDUCTOR_CONFIG, TokenCompiled
from ...compiled_layers import LayerCompiled
from ...errors import XGraphError
from .attention import leave_graphs
from .fusions import decoder_layers

logger = logging.getLogger("xgraph")

SCOPES = ("auto", "forward", "layers")
ENV = "XGRAPH_COMPILE_SCOPE"  # GraphModel(compile_scope=None) reads it; unset: "forward"
# why "auto" leaves a decoder uncompiled (GraphModel.stats()["compile"]["skipped"])
FUSED = (
    "compile_scope='auto' leaves a decoder over xgraph's fused kernels uncompiled (no "
    "compile time, slower steps); compile_scope='forward' or 'layers' compiles it"
)


def compile_backend(compile: Any) -> Any:
    """None (not compiled), or the torch.compile backend (True: Inductor; a name, or a
    backend callable)."""
    if compile is True:
        return "inductor"
    if compile is False or compile is None:
        return None
    if callable(compile):
        return compile
    from torch._dynamo import list_backends

    if not isinstance(compile, str) or compile not in list_backends(exclude_tags=()):
        raise XGraphError(
            f"GraphModel: compile={compile!r}; give True (Inductor), False, or a "
            "torch.compile backend name such as 'inductor', 'aot_eager' or 'eager' "
            "(torch._dynamo.list_backends(exclude_tags=()) lists them all)."
        )
    return compile


def check_scope(scope: str | None, model: Any, compiled: bool, dynamic: bool = True) -> str:
    """`scope` (None: $XGRAPH_COMPILE_SCOPE, unset "forward") where it is one of SCOPES and
    the model has what it needs; else XGraphError (before the GraphModel builds anything)."""
    if scope is None:
        scope = os.environ.get(ENV, "").strip().lower() or "forward"
        where = f"{ENV}={scope!r}"
    else:
        where = f"GraphModel: compile_scope={scope!r}"
    if scope not in SCOPES:
        raise XGraphError(
            f"{where}; give 'forward' (the whole decoder as one graph), 'auto' (the same, none "
            "over fused layers) or 'layers' (one layer's compile serving every layer)."
        )
    if compiled and scope == "layers" and not dynamic:
        raise XGraphError(
            "GraphModel: compile_scope='layers' compiles one graph for every token count "
            "(compile_dynamic=True); a compile per count needs compile_scope='forward'."
        )
    if compiled and scope == "layers" and not decoder_layers(model):
        raise XGraphError(
            "GraphModel: compile_scope='layers' needs the decoder's layers as a `layers` "
            f"ModuleList, which {type(model).__name__} does not have; use "
            "compile_scope='forward'."
        )
    return scope


def settle(compiler: Any, scope: str, fused: bool) -> tuple[Any, str, str | None]:
    """(the compiler or None, the scope compiled, why not compiled) once the layers are
    known fused or not: "auto" is "forward", or no compile over fused layers."""
    if compiler is None or scope != "auto":
        return compiler, scope, None
    if fused:
        logger.info("GraphModel: not compiled: %s.", FUSED)
        return None, scope, FUSED
    return compiler, "forward", None


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def compile_decoder(
    gm: Any, compiler: Any, dynamic: bool, name: str, where: Any, scope: str
) -> TokenCompiled | LayerCompiled | None:
    """The GraphModel `gm`'s decoder under `compiler` (None: not compiled), set as its
    forward's compiled code."""
    if compiler is None:
        return None
    inductor = DYNAMIC_INDUCTOR_CONFIG if dynamic else None
    settings = {
        "backend": compiler if isinstance(compiler, str) else getattr(compiler, "__name__", ""),
        "dynamic": dynamic,
        "scope": scope,
        "max_tokens": gm.executor.buckets.max,
        "inductor": inductor,
        "linears": sorted({type(m).__name__ for m in gm.model.modules()}),
        "fused_layers": gm.fused,  # another traced forward (fusions.py)
        "limits": dataclasses.asdict(gm.limits),
        "transformers": _transformers_version(),
    }
    cache = CompileCache.for_model(
        model_class=f"{type(gm.model).__module__}.{type(gm.model).__qualname__}",
        config=gm.model.config.to_dict(),
        dtype=gm.model.dtype,
        device=gm.device,
        settings=settings,
        directory=where,
    )
    options = dict(
        backend=compiler,
        dynamic=dynamic,
        name=name,
        inductor_config=inductor,
        cache=cache,
        static=list(gm.cache.tensors()),  # fixed sizes: never unified with the token count
    )
    body, top = gm._forward.body, gm.executor.buckets.max
    compiled: TokenCompiled | LayerCompiled
    if scope == "layers":
        leave_graphs(gm.binding)  # its attention calls leave the layers' graphs
        compiled = LayerCompiled(body, decoder_layers(gm.model), top, **options)
    else:
        compiled = TokenCompiled(body, top, **options)
    gm._forward.compiled = compiled
    return compiled
