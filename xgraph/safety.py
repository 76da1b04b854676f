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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

_LIBRARY_DIRS: list[str] = [
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.abspath(__file__)),
]
_MODEL_DIRS: list[str] = []  # inside library dirs, but model code (xgraph.models, testing)


def register_library_path(path: str) -> None:
    """Treat frames under `path` (an adapter's package) as library code, not model code."""
    path = os.path.abspath(path)
    if path not in _LIBRARY_DIRS:
        _LIBRARY_DIRS.append(path)


def register_model_path(path: str) -> None:
    """Treat frames under `path` as model code even inside a library dir (reference models)."""
    path = os.path.abspath(path)
    if path not in _MODEL_DIRS:
        _MODEL_DIRS.append(path)


def _is_library_frame(filename: str) -> bool:
    if filename.startswith(tuple(_MODEL_DIRS)):
        return False
    if filename.startswith(tuple(_LIBRARY_DIRS)):
        return True
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


_INDEX_OPS = ("aten::index", "aten::index_put", "aten::index_put_")
_COPY_OPS = ("aten::_to_copy", "aten::copy_")
# ops that no check below looks at, learnt by name once per op (the guard sees every op of
# every capture: a name and four lookups per op cost a capture more than the op's launch)
_unchecked: set[Any] = set()


def _checked_name(name: str) -> bool:
    return (
        name in HOST_READ_OPS or name in _SIZE_KWARG_OPS or name in _INDEX_OPS or name in _COPY_OPS
    )


def check_op(func: Any, args: tuple, kwargs: dict, device: torch.device | None = None) -> None:
    """Raise CaptureError if `func` would read device data on the host during capture."""
    if func in _unchecked:
        return
    name = _op_name(func)
    if not _checked_name(name):
        if hasattr(func, "_schema"):  # an OpOverload: its name never changes
            _unchecked.add(func)
        return
    how = HOST_READ_OPS.get(name)
    if how is not None:
        _raise(str(func), how)
    kw = _SIZE_KWARG_OPS.get(name)
    if kw is not None and kwargs.get(kw) is None and any(isinstance(a, torch.Tensor) for a in args):
        _raise(str(func), f"{name.split('::')[1]} with tensor repeats and no {kw}=")
    if name in _INDEX_OPS and len(args) > 1:
        # a boolean mask index makes the result size (or the written count) depend on data
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            _raise(str(func), "t[mask] / t[mask] = v with a boolean mask (size depends on data)")
    if device is not None and device.type != "cpu" and name in _COPY_OPS:
        # a device -> host copy in the middle of a capture is a synchronising host read
        src = args[1] if name == "aten::copy_" else args[0]
        dst_dev = args[0].device if name == "aten::copy_" else kwargs.get("device", src.device)
        if (
            isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
            and (dst_dev is not None and torch.device(dst_dev).type == "cpu")
        ):
            _raise(str(func), "Tensor.cpu() / .to('cpu') / .numpy() of a device tensor")


class ScopedPatch:
    """Attributes of `owner` replaced while any thread is inside `scope()`.

    The replacement acts only in threads inside a scope; every other thread gets the
    original, so a capture in one thread never disturbs a tokenizer or a scheduler in
    another. Installed when the first scope opens, removed when the last one closes.
    """

    def __init__(self, owner: Any, blocked: dict[str, Callable[..., Any]]) -> None:
        self.owner = owner
        self.blocked = blocked
        self._lock = threading.Lock()
        self._scopes = 0
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    def _wrapper(self, name: str, original: Any) -> Callable[..., Any]:
        blocked, local = self.blocked[name], self._local

        def patched(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):
                return blocked(*args, **kwargs)
            return original(*args, **kwargs)

        return patched

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with self._lock:
            if self._scopes == 0:
                for name in self.blocked:
                    self._saved[name] = getattr(self.owner, name)
                    setattr(self.owner, name, self._wrapper(name, self._saved[name]))
            self._scopes += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._scopes -= 1
                if self._scopes == 0:
                    for name, fn in self._saved.items():
                        setattr(self.owner, name, fn)
                    self._saved.clear()

    def active_here(self) -> bool:
        """Whether this thread is inside a scope."""
        return bool(getattr(self._local, "depth", 0))


def _host_conversion(name: str) -> Callable[..., Any]:
    def blocked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _raise(f"Tensor.{name}", f"Tensor.{name}() copies tensor data to the host")

    return blocked


_host_conversions = ScopedPatch(
    torch.Tensor, {n: _host_conversion(n) for n in ("tolist", "numpy", "__array__")}
)


def block_host_conversions() -> contextlib.AbstractContextManager[None]:
    """In this thread, make Tensor.tolist / numpy / __array__ raise CaptureError (they bypass
    torch dispatch); other threads keep the originals."""
    return _host_conversions.scope()


def host_conversions_blocked() -> bool:
    """Whether this thread is inside a capture guard (tests, diagnostics)."""
    return _host_conversions.active_here()


# -- captures without the per-op guard ---------------------------------------------------------

_to, _cpu, _copy = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_


def _host_target(args: tuple, kwargs: dict) -> bool:
    """Whether Tensor.to's arguments name the host as the destination."""
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
    return False


def _blocked_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if self.device.type != "cpu" and _host_target(args, kwargs):
        _raise("Tensor.to", "Tensor.to('cpu') of a device tensor")
    return _to(self, *args, **kwargs)


def _blocked_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if self.device.type != "cpu":
        _raise("Tensor.cpu", "Tensor.cpu() of a device tensor")
    return _cpu(self, *args, **kwargs)


def _blocked_copy(self: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if self.device.type == "cpu" and src.device.type != "cpu":
        _raise("Tensor.copy_", "host_tensor.copy_(device_tensor)")
    return _copy(self, src, *args, **kwargs)


_host_copies = ScopedPatch(
    torch.Tensor, {"to": _blocked_to, "cpu": _blocked_cpu, "copy_": _blocked_copy}
)


def block_host_copies() -> contextlib.AbstractContextManager[None]:
    """In this thread, make a device -> host copy by Tensor.to / cpu / copy_ raise
    CaptureError. A capture without the per-op guard needs it: the runtime refuses a
    synchronising read, but a non-blocking copy into pinned memory records without error,
    and host code reading it would see the value of the capture."""
    return _host_copies.scope()


class HostReadCheck(TorchDispatchMode):
    """`check_op` on every op, recording nothing: an unguarded capture's diagnosis (the
    forward run once more, eagerly, to name the op and the model line that failed it)."""

    def __init__(self, device: torch.device | None) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        check_op(func, args, kwargs, self.device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def checking_host_reads(device: torch.device | None) -> Iterator[None]:
    """Every check a guarded capture makes, around eager code (see HostReadCheck)."""
    with block_host_conversions(), block_host_copies(), HostReadCheck(device):
        yield
