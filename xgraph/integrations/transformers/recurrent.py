"""Layers that keep a state of their own per sequence, and what a refusal names for them.

Hybrid decoders (Jamba, Bamba, Falcon-H1, Qwen3-Next, Nemotron-H, ...) mix softmax
attention with layers whose memory of a sequence is not keys and values: linear attention
and state-space (Mamba) layers carry a recurrent state, short convolutions the last few
tokens. xgraph's paged cache holds keys and values only, and a step runs the tokens of
many sequences as one row, so such a layer would mix sequences and forget their past.
transformers 5 lists them in `config.layer_types`; their modules carry the state-space
decay `A_log` (Mamba, Mamba2, gated delta rules). Either names the layers and the module
classes in the refusal, so it says what cannot run rather than a symptom of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# layer types of transformers' configs whose state is not keys and values, and what each
# keeps of a sequence
KEEPS = {
    "linear_attention": "a recurrent state (linear attention, or a state-space Mamba layer)",
    "mamba": "a recurrent state (a state-space Mamba layer)",
    "hybrid": "a recurrent state (a state-space Mamba mixer beside the attention)",
    "conv": "the last few tokens (a short convolution over the sequence)",
}
# layer types without attention and without a state (NemotronH's): the probe sees what
# they call, and they keep nothing of a sequence
STATELESS = frozenset({"mlp", "moe"})
# module classes that keep such a state (only to name them: refusals come from
# layer_types and A_log, since a loop of layers (Dory, HRM) is named "recurrent" too)
_STATEFUL_NAME = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|Rglru|Lightning|ForgetGate|Rwkv|LSTM")
_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_TAIL = "xgraph's paged cache holds the keys and values of softmax attention only"
_ROW = ", and a step runs many sequences' tokens as one row"


def _stateful(module: Any) -> bool:
    own = dict(module.named_parameters(recurse=False))
    return "A_log" in own or bool(_STATEFUL_NAME.search(type(module).__name__))


def state_modules(model: Any) -> dict[int, list[tuple[str, str]]]:
    """Layer index -> [(module name, class)] of the modules in the layer stack that keep a
    state (the outermost one of each layer's nested ones)."""
    found: dict[int, list[tuple[str, str]]] = {}
    seen: list[str] = []
    for name, module in model.named_modules():
        index = _INDEX.search(name)
        if index is None or not _stateful(module) or any(name.startswith(p + ".") for p in seen):
            continue
        seen.append(name)
        found.setdefault(int(index.group(1)), []).append((name, type(module).__name__))
    return found


def decay_modules(model: Any) -> list[str]:
    """Modules holding the state-space decay A_log: Mamba mixers, gated delta rules."""
    return [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if "A_log" in dict(m.named_parameters(recurse=False))
    ]


def _short(items: Sequence[Any]) -> str:
    items = list(items)
    return str(items) if len(items) <= 8 else f"{items[:8]}... ({len(items)} in all)"


def describe(model: Any, types: Sequence[str], other: Sequence[str]) -> str:
    """Why a model with layers of the `other` types (of `types`, one per layer) cannot
    run: each type's layers, their module classes, and what they keep."""
    modules = state_modules(model)
    parts, stateful = [], False
    for kind in other:
        layers = [i for i, t in enumerate(types) if t == kind]
        classes = sorted({c for i in layers for _, c in modules.get(i, [])})
        keeps = KEEPS.get(kind) or ("a state of their own" if classes else None)
        stateful |= keeps is not None
        named = f" ({', '.join(classes)})" if classes else ""
        what = f", which keep {keeps} per sequence" if keeps else ""
        parts.append(f"layers {_short(layers)} are {kind} layers{named}{what}")
    return f"{'; '.join(parts)}: {_TAIL}{_ROW if stateful else ''}"


def describe_no_attention(model: Any) -> str | None:
    """Why a model with no attention heads cannot run, when its layers keep a state
    (RWKV, xLSTM); None when none is found."""
    modules = state_modules(model)
    if not modules:
        return None
    classes = sorted({c for found in modules.values() for _, c in found})
    return (
        f"it has no softmax attention: layers {_short(sorted(modules))} are recurrent "
        f"({', '.join(classes)}), which keep a recurrent state per sequence; {_TAIL}{_ROW}"
    )
