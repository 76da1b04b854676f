"""transformers' Qwen3 decoder layers over xgraph's fused projections, where a backend has
a fused kernel.

The linear swap (linears.py) gives a transformers model the backend's projection kernel, but
a layer's norms, QK-norm, rotary and residual adds stay its own code: under torch.compile,
Inductor's kernels between the projections (a Qwen3-0.6B decode step of 284 kernels on an
H100, against the reference model's 147). `fuse_layers` gives each Qwen3 decoder layer the
reference model's form instead: four `xgraph.linear` calls with their fusions
(xgraph.fusion) around the attention call, the residual stream in float32 between layers
(`xgraph.linear.stream_dtype`), the last layer handing back the model's dtype. The rotary
module answers, once per forward, a float32 table of [cos, cos] and [-sin, sin] rows
(`xgraph.fusion.apply_rotary`'s) that every layer's qkv epilogue reads.

On by default (`GraphModel(fuse_layers=False)` or XGRAPH_FUSE_LAYERS=0 turn it off), and
applied only where every decoder layer is transformers' Qwen3 layer
(`Qwen3DecoderLayer` over merged q/k/v and gate/up projections without biases, a SiLU MLP,
`Qwen3RMSNorm`s) and the backend has a fused kernel; anywhere else nothing changes. The math
is the fusions' (docs/kernels.md): norms and rotary in float32, each rounded once, and the
stream unrounded, which took the reference model's logits to 0.80-0.83x reduce-overhead's
distance from float32; through transformers on an H100 the bench's check passes, its logits
0.0289 from float32 against transformers' own 0.0491 (docs/transformers.md).
`unfuse_layers` undoes it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from ...errors import XGraphError
from ...fusion import Fusion, HeadNorm
from ...linear import linear, stream_dtype
from ...models.qwen3_layers import fused_mlp
from ...options import switch
from .attention import attention_forward
from .probe import Probe

logger = logging.getLogger("xgraph")

ENV = "XGRAPH_FUSE_LAYERS"  # GraphModel(fuse_layers=None) asks it: 0 / off keeps; unset, on
TABLE = "xgraph-rotary-table"  # position_embeddings[1] when [0] is the fused layers' table
_HF_CACHE = ("cache", "past_key_values")  # transformers' cache keyword, by version


def _merged(first: Any, size: int) -> torch.Tensor | None:
    """The merged weight a projection heads (linears.py's group of `size`), or None."""
    part = getattr(first, "_xgraph_part", None)
    if part is None or part[1] != 0 or part[0].size != size or part[0].bias is not None:
        return None
    return part[0].weight


def _norm(m: Any, width: int) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__ == "Qwen3RMSNorm"
        and hasattr(m, "variance_epsilon")
        and isinstance(w, torch.Tensor)
        and tuple(w.shape) == (width,)
    )


def _silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _fits(layer: Any) -> bool:
    """Whether `layer` is transformers' Qwen3 decoder layer over merged projections."""
    a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ != "Qwen3DecoderLayer" or a is None or mlp is None:
        return False
    hidden, d = a.o_proj.out_features, a.head_dim
    hq, hkv = a.config.num_attention_heads, a.config.num_key_value_heads
    return all(
        (
            (a.q_proj.out_features, a.k_proj.out_features) == (hq * d, hkv * d),
            a.v_proj.out_features == hkv * d,
            _merged(a.q_proj, 3) is not None,
            _merged(mlp.gate_proj, 2) is not None,
            a.o_proj.bias is None and mlp.down_proj.bias is None,
            _silu(getattr(mlp, "act_fn", None)),
            _norm(a.q_norm, d) and _norm(a.k_norm, d),
            a.q_norm.variance_epsilon == a.k_norm.variance_epsilon,  # one eps in the epilogue
            _norm(layer.input_layernorm, hidden) and _norm(layer.post_attention_layernorm, hidden),
            getattr(a, "sliding_window", None) is None,
        )
    )


def table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[tokens, 2, dim] float32 rows [cos, cos] and [-sin, sin] from transformers' cos and
    sin [1, tokens, dim] (each [c, c] / [s, s] over the halves of dim)."""
    half = cos.shape[-1] // 2
    s = sin[0].float()
    return torch.stack([cos[0].float(), torch.cat([-s[:, :half], s[:, half:]], -1)], 1)


def _rotary(module: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, str]:
    cos, sin = type(module).forward(module, *args, **kwargs)  # its own forward
    return table(cos, sin), TABLE


def _refuse(what: str) -> XGraphError:
    return XGraphError(
        f"a fused Qwen3 layer (xgraph.integrations.transformers.fusions) was called {what}; "
        "it runs inside a GraphModel's forward only. Call unfuse_layers(model) to use the "
        "model outside it."
    )


def _attend(layer: Any, qkv: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The layer's attention call (xgraph's attention function) on the fused qkv rows."""
    a = layer.self_attn
    t, d = qkv.shape[0], a.head_dim
    hq, hkv = a.config.num_attention_heads, a.config.num_key_value_heads
    heads = qkv.view(1, t, hq + 2 * hkv, d).transpose(1, 2)  # transformers' [1, h, t, d]
    q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
    rest = {n: x for n, x in kwargs.items() if n not in ("position_embeddings", "use_cache")}
    out, _ = attention_forward(a, q, k, v, mask, scaling=a.scaling, **rest)
    return out.reshape(t, hq * d)


def _forward(layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Qwen3DecoderLayer.forward over fused projections (see the module doc)."""
    pe = kwargs.get("position_embeddings")
    if args or not (isinstance(pe, tuple) and len(pe) == 2 and pe[1] == TABLE):
        raise _refuse("without the fused rotary table or with positional arguments")
    if any(kwargs.get(n) is not None for n in _HF_CACHE):
        raise _refuse("with a transformers cache")
    a, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    hq, hkv = a.config.num_attention_heads, a.config.num_key_value_heads
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    h = h.to(stream_dtype(h))
    heads = HeadNorm(a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon, pe[0], hq, hkv)
    qkv = linear(h, _merged(a.q_proj, 3), Fusion(n1.weight, n1.variance_epsilon, heads=heads))
    o = _attend(layer, qkv, kwargs.pop("attention_mask", None), kwargs)
    h = linear(o, a.o_proj.weight, Fusion(residual=h))
    h = fused_mlp(
        h, _merged(mlp.gate_proj, 2), mlp.down_proj.weight, n2.weight, n2.variance_epsilon
    )
    if layer._xgraph_last:
        h = h.to(a.o_proj.weight.dtype)  # the model's final norm and head read its dtype
    return h.view(*shape[:-1], h.shape[-1])


def requested(fuse: bool | None) -> bool:
    """GraphModel's `fuse_layers` as given, or, for None, XGRAPH_FUSE_LAYERS's (on unless
    0 / false / off; it applies only where the backend has a fused kernel)."""
    return switch(fuse, "fuse_layers", ENV, default=True)


def _decoder(model: Any) -> Any:
    try:
        return model.get_decoder()
    except Exception:
        return getattr(model, "model", None)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder's layers (its `layers` ModuleList), or [] where it has none."""
    return list(getattr(_decoder(model), "layers", None) or [])


def fuse_layers(model: Any) -> bool:
    """Give every decoder layer of a Qwen3 model the fused form (module doc), in place;
    False (nothing changed) where the model is not one, or its projections are not merged
    (GraphModel merges them where the backend has a kernel)."""
    layers = decoder_layers(model)
    rotary = getattr(_decoder(model), "rotary_emb", None)
    if not layers or rotary is None or not all(_fits(layer) for layer in layers):
        return False
    for i, layer in enumerate(layers):
        layer._xgraph_last = i == len(layers) - 1
        _install(layer, _forward)
    _install(rotary, _rotary)
    return True


def _install(module: nn.Module, fn: Any) -> None:
    """module.forward = fn with the module as its first argument, as a functools.partial
    rather than a bound method: torch's ahead-of-time compile snapshots the modules its
    guards read by pickling them, and a bound method kept in a module unpickles as a
    lookup on the half-restored module (an AttributeError, which made every later process
    compile the forward again instead of loading it)."""
    module.forward = functools.partial(fn, module)


def _fused(module: Any) -> bool:
    """Whether `_install` gave this module its fused forward."""
    f = module.__dict__.get("forward")
    return isinstance(f, functools.partial) and f.func in (_forward, _rotary)


def unfuse_layers(model: Any) -> None:
    """Undo fuse_layers (the modules' own forwards again)."""
    for m in [*decoder_layers(model), getattr(_decoder(model), "rotary_emb", None)]:
        if m is not None and _fused(m):
            for name in ("forward", "_xgraph_last"):
                m.__dict__.pop(name, None)


def fuse_checked(forward: Any, spec: Any, model: Any, max_model_len: int) -> bool:
    """fuse_layers, kept only where the fused model's logits on a few probe tokens are its
    own model's (`forward`: the GraphModel's ModelForward): what a transformers version
    that calls its layers differently would break shows there, not in a later step. The
    bound is loose for 16-bit models (the fused math rounds differently), tight in float32."""
    n = min(4, max_model_len)
    weight = next(model.parameters())
    device = weight.device
    ids = torch.arange(1, n + 1, device=device) % spec.vocab_size
    positions = torch.arange(n, device=device)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return forward.run(Probe(spec, model, max_model_len, n), ids, positions).float()

    want = logits()
    if not fuse_layers(model):
        return False
    try:
        got = logits()
        far = float((got - want).norm() / want.norm().clamp_min(1e-12))
    except Exception as exc:  # the fused form does not run here: the model keeps its own
        far, why = float("inf"), f"{type(exc).__name__}: {exc}"
    else:
        why = f"logits {far:.3g} apart (relative norm)"
    bound = 1e-4 if weight.dtype == torch.float32 else 0.25
    if far <= bound:
        return True
    unfuse_layers(model)
    logger.warning("%s: the fused Qwen3 layers were not kept (%s)", spec.name, why)
    return False
