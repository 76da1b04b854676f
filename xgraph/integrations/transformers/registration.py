"""Switching a model to the "xgraph" attention, once per model object, counted.

Several GraphModels may wrap one model object (each with its own cache: a step binds its
own). The first switches the model to "xgraph" and remembers the implementation it had;
the others count on it; the last one to close gives that implementation back. Closing
one GraphModel therefore never changes what another one's forward calls.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .attention import IMPLEMENTATION, attention_forward
from .deps import require
from .errors import UnsupportedModelError
from .spec import model_name

# what makes a module an attention layer, as transformers writes them (rotary embeddings
# and other helpers may keep a config of their own: they never call attention)
_ATTENTION_ATTRS = ("layer_idx", "is_causal", "scaling", "num_key_value_groups")


@dataclass
class _Hold:
    previous: str  # the implementation the model had before the first GraphModel
    count: int


_lock = threading.Lock()
_holds: weakref.WeakKeyDictionary[Any, _Hold] = weakref.WeakKeyDictionary()


def register() -> None:
    """Register "xgraph" in transformers' AttentionInterface (idempotent)."""
    require().AttentionInterface.register(IMPLEMENTATION, attention_forward)


def holders(model: Any) -> int:
    """How many GraphModels hold `model` switched to "xgraph"."""
    with _lock:
        hold = _holds.get(model)
        return hold.count if hold else 0


def acquire(model: Any) -> None:
    """Switch `model` to "xgraph" (the first holder) or count one more holder."""
    with _lock:
        hold = _holds.get(model)
        if hold is not None and model.config._attn_implementation == IMPLEMENTATION:
            hold.count += 1
            return
        previous = _switch(model)
        if hold is not None:  # switched away behind the holders' backs: switched back
            hold.count += 1
        else:
            _holds[model] = _Hold(previous, 1)


def release(model: Any) -> None:
    """One holder less; the last one gives the model back the implementation it had."""
    with _lock:
        hold = _holds.get(model)
        if hold is None:
            return
        hold.count -= 1
        if hold.count > 0:
            return
        del _holds[model]
        if model.config._attn_implementation == IMPLEMENTATION != hold.previous:
            model.set_attn_implementation(hold.previous)


def _switch(model: Any) -> str:
    """Switch `model` to the "xgraph" implementation; returns the one it had."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise UnsupportedModelError(
            model_name(model),
            "its attention does not go through transformers' AttentionInterface: it did "
            "not switch to the 'xgraph' attention implementation (transformers could not "
            "set it dynamically), so its attention would bypass xgraph's paged cache",
        )
    # an attention layer with a config of its own (swapped in from another model) keeps
    # that config's implementation and would call its own attention directly
    stray = [
        n
        for n, m in model.named_modules()
        if getattr(getattr(m, "config", None), "_attn_implementation", IMPLEMENTATION)
        != IMPLEMENTATION
        and any(hasattr(m, a) for a in _ATTENTION_ATTRS)
    ]
    if stray:
        if previous != IMPLEMENTATION:
            model.set_attn_implementation(previous)
        raise UnsupportedModelError(
            model_name(model),
            f"modules {stray[:4]} have a config of their own whose attention "
            "implementation is not 'xgraph', so they would bypass xgraph's paged cache",
            "Give them the model's config (module.config = model.config).",
        )
    return previous
