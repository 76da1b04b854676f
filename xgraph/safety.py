"""Capture safety: find model code that reads device data on the host while a graph records.

Such code cannot be recorded: a graph replays device work only, so the value read at
capture would be baked in (or, on CUDA, the capture is invalidated). Every backend uses
the same check so a model that is unsafe on a GPU already fails on the CPU backend, with
the op and the model line named.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .errors import CaptureError

# aten op -> how model code usually spells it
HOST_READ_OPS: dict[str, str] = {
    "aten::_local_scalar_dense": "Tensor.item() / int(t) / float(t) / bool(t) / `if t:`",
    "aten::is_nonzero": "bool(t) / `if t:`",
    "aten::nonzero": "torch.nonzero / Tensor.nonzero (output size depends on data)",
    "aten::nonzero_static": None,  # type: ignore[dict-item]  # fixed size: safe
    "aten::_unique": "torch.unique (output size depends on data)",
    "aten::_unique2": "torch.unique (output size depends on data)",
    "aten::unique_dim": "torch.unique(dim=...) (output size depends on data)",
    "aten::unique_consecutive": "torch.unique_consecutive (output size depends on data)",
    "aten::masked_select": "torch.masked_select / t[mask] (output size depends on data)",
    "aten::equal": "torch.equal (returns a host bool)",
    "aten::allclose": "torch.allclose (returns a host bool)",
}
HOST_READ_OPS = {k: v for k, v in HOST_READ_OPS.items() if v}

# ops whose output size depends on data unless the caller passes it
_SIZE_KWARG_OPS = {"aten::repeat_interleave": "output_size"}

_TORCH_DIR = os.path.dirname(torch.__file__)
_XGRAPH_DIR = os.path.dirname(os.path.abspath(__file__))
_USER_DIRS_IN_XGRAPH = tuple(os.path.join(_XGRAPH_DIR, d) for d in ("models", "testing"))


_LIBRARY_DIRS: list[str] = [_TORCH_DIR]


def register_library_path(path: str) -> None:
    """Treat frames under `path` (an adapter's package) as library code, not model code."""
    path = os.path.abspath(path)
    if path not in _LIBRARY_DIRS:
        _LIBRARY_DIRS.append(path)


def _is_library_frame(filename: str) -> bool:
    if filename.startswith(tuple(_LIBRARY_DIRS)):
        return True
    if filename.startswith(_XGRAPH_DIR):
        return not filename.startswith(_USER_DIRS_IN_XGRAPH)
    return filename.startswith("<frozen") or filename.endswith(("contextlib.py", "weakref.py"))


def model_location() -> str:
    """'file:line (`source`)' of the innermost stack frame that belongs to model code."""
    frame = sys._getframe(1)
    while frame is not None:
        fn = frame.f_code.co_filename
        if not _is_library_frame(fn):
            src = linecache.getline(fn, frame.f_lineno).strip()
            where = f"{os.path.relpath(fn) if not fn.startswith('/') else fn}:{frame.f_lineno}"
            return f"{where} (`{src}`)" if src else where
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown location>"


def _op_name(func: Any) -> str:
    return func._schema.name if hasattr(func, "_schema") else str(func)


def _raise(what: str, how: str) -> None:
    raise CaptureError(
        f"Capture failed: {what} ({how}) reads device data on the host at {model_location()}. "
        "A graph records device work only, so this value would be frozen at capture. Keep it on "
        "the device (torch.where, clamp, masks), compute it before the forward and pass it as a "
        "declared input, or leave this code out of the captured forward. Until then the "
        "executor runs this bucket eagerly (on_capture_error='eager') or raises ('raise')."
    )


def check_op(func: Any, args: tuple, kwargs: dict, device: torch.device | None = None) -> None:
    """Raise CaptureError if `func` would read device data on the host during capture."""
    name = _op_name(func)
    how = HOST_READ_OPS.get(name)
    if how is not None:
        _raise(str(func), how)
    kw = _SIZE_KWARG_OPS.get(name)
    if kw is not None and kwargs.get(kw) is None and any(isinstance(a, torch.Tensor) for a in args):
        _raise(str(func), f"{name.split('::')[1]} with tensor repeats and no {kw}=")
    if name in ("aten::index", "aten::index_put", "aten::index_put_") and len(args) > 1:
        # a boolean mask index makes the result size (or the written count) depend on data
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            _raise(str(func), "t[mask] / t[mask] = v with a boolean mask (size depends on data)")
    if device is not None and device.type != "cpu" and name in ("aten::_to_copy", "aten::copy_"):
        # a device -> host copy in the middle of a capture is a synchronising host read
        src = args[1] if name == "aten::copy_" else args[0]
        dst_dev = args[0].device if name == "aten::copy_" else kwargs.get("device", src.device)
        if (
            isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
            and (dst_dev is not None and torch.device(dst_dev).type == "cpu")
        ):
            _raise(str(func), "Tensor.cpu() / .to('cpu') / .numpy() of a device tensor")


_patch_lock = threading.Lock()
_patch_depth = 0
_saved: dict[str, Any] = {}


def _host_conversion(name: str):
    def blocked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _raise(f"Tensor.{name}", f"Tensor.{name}() copies tensor data to the host")

    return blocked


@contextlib.contextmanager
def block_host_conversions() -> Iterator[None]:
    """Make Tensor.tolist / numpy / __array__ raise CaptureError (they bypass torch dispatch)."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            for name in ("tolist", "numpy", "__array__"):
                _saved[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _host_conversion(name))
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name, fn in _saved.items():
                    setattr(torch.Tensor, name, fn)
                _saved.clear()
