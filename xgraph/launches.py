"""What a recording launches, described for the parameterization check (xgraph.parameterization).

Backends that record ops on the host (the CPU backend, the simulators) describe each op they
record with `op_launch`: the aten op, its tensor layouts (dtype, shape, strides, offset; never
an address) and its non-tensor arguments, and the layer that issued it. The layer comes from
`tracking(root)`, entered by the check around a capture: global module hooks keep a stack of
the model's modules running in this thread, and `current_layer()` names the innermost with
the model line that issued the op, and `current_frames()` the model code's stack (where two
captures' Python paths part: xgraph.branchpoint). Outside `tracking` both answer empty at no
cost.

Backends that read launches after the fact (CUDA's graph nodes) mark what they cannot
compare with `Unchecked`: the words of an argument that are device addresses (each
recording has its own pool) and by-value struct arguments, compared by size only.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .interfaces import Launch
from .safety import _is_library_frame, model_location

_local = threading.local()
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a default repr's object address

Frame = tuple[str, int, str, int]  # file, line, function, the function's first line


class Unchecked(str):
    """A launch field value the backend leaves out of the comparison, in words ("pointer",
    "struct of 16 bytes"); `what` is "address" or "struct" (counted in the report)."""

    what: str

    def __new__(cls, text: str, what: str) -> Unchecked:
        out = super().__new__(cls, text)
        out.what = what
        return out


ADDRESS = Unchecked("pointer", "address")


def by_value(size: int) -> Unchecked:
    """A by-value struct argument of `size` bytes, compared by its size only."""
    return Unchecked(f"struct of {size} bytes", "struct")


@dataclass(frozen=True)
class TracedLaunch(Launch):
    """A Launch with the model code's stack that issued it (outermost first)."""

    frames: tuple[Frame, ...] = field(default=(), compare=False)


def describe(value: Any) -> Any:
    """A printable, comparable stand-in for one argument: tensors by layout, not address."""
    if isinstance(value, torch.Tensor):
        text = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if value.dim() and not value.is_contiguous():
            text += f" stride {tuple(value.stride())}"
        if value.storage_offset():
            text += f" offset {value.storage_offset()}"
        return text
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # dtypes, devices, layouts, memory formats; a generator or a process group by its type
    # (its repr's address differs between captures and is no launch parameter)
    return _ADDRESS.sub("", str(value))


def op_config(func: Any, args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...]:
    """(argument name, description) of every argument of an aten op call."""
    names = [a.name for a in func._schema.arguments]
    out = [(names[i] if i < len(names) else f"arg {i}", describe(a)) for i, a in enumerate(args)]
    out += [(k, describe(v)) for k, v in kwargs.items()]
    return tuple(out)


def op_launch(func: Any, args: tuple, kwargs: dict) -> Launch:
    """One recorded aten op as a Launch, with the layer and the stack that issued it when
    tracked."""
    config = op_config(func, args, kwargs)
    if getattr(_local, "stack", None) is None:
        return Launch("op", func._schema.name, config)
    return TracedLaunch("op", func._schema.name, config, current_layer(), frames=current_frames())


def _names(root: torch.nn.Module | None) -> dict[int, str]:
    if root is None:
        return {}
    return {id(m): name or type(m).__name__ for name, m in root.named_modules()}


@contextlib.contextmanager
def tracking(root: torch.nn.Module | None) -> Iterator[None]:
    """Within the block, `current_layer()` in this thread names the module running now
    (its path under `root`, else its class name)."""
    names, stack, me = _names(root), [], threading.get_ident()

    def enter(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == me:
            stack.append(names.get(id(module)) or type(module).__name__)

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() == me and stack:
            stack.pop()

    hooks = torch.nn.modules.module
    pre = hooks.register_module_forward_pre_hook(enter)
    post = hooks.register_module_forward_hook(leave, always_call=True)
    outer = getattr(_local, "stack", None)
    _local.stack = stack
    try:
        yield
    finally:
        _local.stack = outer
        pre.remove()
        post.remove()


def current_layer() -> str:
    """'module path at file:line (`source`)' of the code issuing an op now; "" untracked."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        return ""
    where = model_location()
    return f"{stack[-1]} at {where}" if stack else where


def current_frames() -> tuple[Frame, ...]:
    """The model code's frames running now, outermost first; () untracked."""
    if getattr(_local, "stack", None) is None:
        return ()
    out: list[Frame] = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _is_library_frame(code.co_filename):
            out.append((code.co_filename, frame.f_lineno, code.co_name, code.co_firstlineno))
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(reversed(out))


def root_module(forward: Any) -> torch.nn.Module | None:
    """The module a forward belongs to: itself, the owner of a bound method, or its `model`."""
    for candidate in (forward, getattr(forward, "__self__", None), getattr(forward, "model", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None
