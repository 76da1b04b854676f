"""A step's attention fields as integer numpy arrays: the usual form (host tensors of the
fields' dtypes) viewed at once, every other form converted and checked here.

Tensors must have the field's dtype where it has one (an int32 slot mapping is widened to
int64: exact); lengths take int32 and int64 tensors. Lists and arrays of integers are
converted; floats, bools and other types are refused (a truncated length would be silently
wrong). Each refusal is an InputError naming the field and what to pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InputError
from .validation import same

_LENGTHS = frozenset((torch.int64, torch.int32))  # tensor dtypes lengths are used in
_T, _I32, _I64 = torch.Tensor, torch.int32, torch.int64


def host_fields(
    seq_lens: Any, table: Any, slots: Any, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The usual form at once: host tensors, int32 or int64 seq_lens [n], an int32 table
    [n', w <= width], int64 slots [t], viewed as they are (what `ints` and the table's
    normalization return for them, in fewer calls); None for any other form, which takes
    the field-by-field path and its errors. The counts are checked after."""
    if not (
        type(seq_lens) is _T
        and type(table) is _T
        and type(slots) is _T
        and table.dtype is _I32
        and slots.dtype is _I64
        and seq_lens.dtype in _LENGTHS
        and seq_lens.is_cpu
        and table.is_cpu
        and slots.is_cpu
    ):
        return None
    sl, t, s = seq_lens.numpy(), table.numpy(), slots.numpy()
    if sl.ndim != 1 or t.ndim != 2 or s.ndim != 1 or t.shape[1] > width:
        return None
    return sl, t, s


def ints(
    name: str, value: Any, field: str, ndim: int, dtype: torch.dtype | None = None
) -> np.ndarray:
    """A field as an integer numpy array (int64, or int32 for the table; lengths given as
    int32 tensors stay int32) of rank `ndim` (0: any shape, flattened), by the rules of the
    module doc; `dtype`: the field's tensor dtype, None for the lengths (int32 or int64)."""
    if type(value) is torch.Tensor:
        dt = value.dtype
        if (dt is dtype or (dtype is None and dt in _LENGTHS)) and value.is_cpu:
            a = value.numpy()  # the usual form, a host tensor: no copy (int32 lengths stay)
            if a.ndim == ndim:
                return a
            if not ndim:
                return a if a.ndim == 1 else a.reshape(-1)
        elif _widens(dt, dtype) and value.is_cpu and not ndim:
            return value.numpy().reshape(-1).astype(np.int64)  # int32 slots: widened, exact
    elif type(value) is list and dtype is None:
        a = np.asarray(value)  # Python ints: int64
        if a.dtype == np.int64 and a.ndim == ndim:
            return a
    return _convert(name, value, field, ndim, dtype)


def _widens(given: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a tensor of `given` converts to `dtype` exactly, whatever its values: int32
    slot mappings to int64."""
    return given is torch.int32 and dtype is torch.int64


def _convert(name: str, value: Any, field: str, ndim: int, dtype: torch.dtype | None) -> np.ndarray:
    """`ints` for every other form, and its errors."""
    want = np.int32 if dtype is torch.int32 else np.int64
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.dtype is not dtype and not _widens(value.dtype, dtype):
            also = " or torch.int32" if dtype is torch.int64 else ""
            raise InputError(
                f"{name}: {field} must be {dtype}{also}; got {value.dtype}. Pass "
                f"{field}.to({dtype})."
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype is torch.bool:
            raise InputError(f"{name}: {field} must hold integers; got {value.dtype}.")
        a = (value if value.is_cpu else value.cpu()).numpy()  # on a device: one copy (a sync)
    else:
        try:
            a = np.asarray(value)
        except (TypeError, ValueError):
            a = np.asarray(value, dtype=object)
        if a.dtype.kind not in "iu" and a.size:  # (an empty list is float64)
            raise InputError(
                f"{name}: {field} must hold integers (a list, array or tensor); got "
                f"{type(value).__name__} of {a.dtype}."
            )
    if not ndim:
        a = a.reshape(-1)
    elif a.ndim != ndim:
        shape = "one int per sequence" if ndim == 1 else "[seqs, width]"
        raise InputError(f"{name}: {field} must be {shape}; got shape {a.shape}.")
    if a.dtype != want:
        b = a.astype(want)
        if not a.size:
            return b
        if not same(b.astype(a.dtype), a):  # a value changed: it does not fit `want`
            raise InputError(f"{name}: {field} holds values outside {np.dtype(want).name}.")
        a = b
    return a
