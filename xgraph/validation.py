"""Validation of a step's token inputs against the executor's declarations. Writes nothing.

Each check names the executor, the input, what was found and what to do: every input is a
tensor of its declared dtype and rank, on the host or the executor's device, its fixed
dims as declared, its symbolic dims agreeing across inputs and within their `max`, and
its values within the declared bounds. One pass over the inputs, no second try: the same
checks serve every step. The attention inputs are checked in `xgraph.step_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .buckets import Dim, Input
from .errors import InputError

NUM_TOKENS = "num_tokens"


# The per-step checks reduce small arrays: through `tobytes` one C call answers where
# np.count_nonzero and ndarray.any pay their Python dispatch (a fifth of a us to a us each,
# several times a step).
def any_true(mask: np.ndarray) -> bool:
    """Whether a bool array holds a True."""
    return 1 in mask.tobytes()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two contiguous arrays of one dtype and shape hold the same values."""
    return a.tobytes() == b.tobytes()


SMALL = 16  # up to this many values, min and max of a list beat a numpy compare
# a dtype object and the ufunc itself: `view` and the compare skip a lookup and the
# operator's dispatch (a tenth of a us each, per input and step)
_U64, _AT_LEAST = np.dtype(np.uint64), np.greater_equal


def outside(a: np.ndarray, high: tuple[np.ndarray, int]) -> bool:
    """Whether an int64 array holds a value outside [0, top), `high` = (top as a 0-d uint64
    array, top): a few values through Python's min and max (one C call each, where a
    ufunc's dispatch costs microseconds), more in one unsigned compare."""
    if a.ndim == 1 and len(a) <= SMALL:
        v = a.tolist()
        return bool(v) and (min(v) < 0 or max(v) >= high[1])
    return any_true(_AT_LEAST(a.view(_U64), high[0]))


@dataclass(frozen=True)
class _Spec:
    """One declared input as the check reads it, worked out once."""

    input: Input
    dims: tuple[tuple[int, str], ...]  # (axis, name) of each symbolic dim
    fixed: tuple[int | None, ...]  # the declared size of each axis (None: symbolic)
    unsigned_high: tuple[np.ndarray, int] | None  # bounds [0, high) of int64 values (`outside`)


class TokenCheck:
    """The declared inputs of one executor, checked in one pass per step."""

    def __init__(
        self,
        name: str,
        declared: Sequence[Input],
        dims: Mapping[str, Dim],
        device: torch.device,
        numpy_ok: Sequence[bool],
    ) -> None:
        """`numpy_ok[i]`: input i is staged through numpy (`check` returns its host view)."""
        self.name, self.device, self.dims = name, device, dims
        self.names = {i.name for i in declared}
        self.specs = [_spec(i) for i in declared]
        # per input, what the loop reads: [num_tokens, fixed...] inputs take their size from
        # shape[0] with no lookup (`tail` is their fixed dims; None for any other shape);
        # int64 bounds [0, high) are `outside`'s, any others go to `_bounds`
        self._loop = [
            (
                s.input.name,
                s.input.dtype,
                len(s.fixed),
                tuple(s.fixed[1:]) if s.dims == ((0, NUM_TOKENS),) else None,
                s.unsigned_high,
                s.input.bounds is not None and s.unsigned_high is None,
                np_ok,
                s,
            )
            for s, np_ok in zip(self.specs, numpy_ok)
        ]

    def check(
        self, inputs: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, int], list[np.ndarray | None]]:
        """(the step's tensors by name, the size of every symbolic dim, a numpy view of each
        host tensor numpy can view, else None); InputError naming the input at the first
        problem. A tuple, not an object: one allocation less per step."""
        if len(inputs) != len(self._loop):
            self._names(inputs)
        sizes: dict[str, int] = {}
        arrays: list[np.ndarray | None] = []
        n = -1
        for name, dtype, ndim, tail, high, other_bounds, np_ok, spec in self._loop:
            v = inputs.get(name)
            if type(v) is not torch.Tensor or v.dtype is not dtype:
                self._tensor(spec.input, v, inputs)
            if np_ok and v.is_cpu:  # the usual form: its numpy view, whose shape is a tuple
                a = v.numpy() if not v.requires_grad else v.detach().numpy()
                shape = a.shape
            else:  # on the device, or a dtype numpy cannot view (bfloat16): staged by torch
                a, shape = None, v.shape
            if tail is None or len(shape) != ndim or (ndim > 1 and shape[1:] != tail):
                self._sizes(spec, shape, sizes)
                n = sizes.get(NUM_TOKENS, -1)
            elif n != shape[0]:
                if n >= 0:
                    self._disagree(spec.input, NUM_TOKENS, n, shape[0])
                n = sizes[NUM_TOKENS] = shape[0]
            if a is not None:
                if high is not None and outside(a, high):
                    self._bounds(spec, v)  # outside [0, high): named there
                elif other_bounds:
                    self._bounds(spec, v)
                arrays.append(a)
                continue
            if not v.is_cpu and v.device != self.device:
                self._device(spec.input, v)
            if spec.input.bounds is not None:
                self._bounds(spec, v)
            arrays.append(None)
        if n < 0:
            raise InputError(f"{self.name}: no input has a 'num_tokens' dim.")
        return inputs if type(inputs) is dict else dict(inputs), sizes, arrays

    # -- the checks, each raising its own message ------------------------------------------

    def _names(self, inputs: Mapping[str, Any]) -> None:
        missing, unknown = self.names - set(inputs), set(inputs) - self.names
        raise InputError(
            f"{self.name}: inputs {sorted(inputs)} do not match the declared inputs "
            f"{sorted(self.names)} (missing {sorted(missing)}, unknown {sorted(unknown)})."
        )

    def _tensor(self, spec: Input, v: Any, inputs: Mapping[str, Any]) -> None:
        if spec.name not in inputs:
            self._names(inputs)
        if not isinstance(v, torch.Tensor):
            raise InputError(
                f"{self.name}: input {spec.name!r} must be a torch.Tensor, got {type(v).__name__}."
            )
        if v.dtype != spec.dtype:
            raise InputError(
                f"{self.name}: input {spec.name!r} has dtype {v.dtype}, declared {spec.dtype}; "
                f"convert it with .to({spec.dtype})."
            )

    def _device(self, spec: Input, v: torch.Tensor) -> None:
        raise InputError(
            f"{self.name}: input {spec.name!r} is on {v.device}; the executor runs on "
            f"{self.device}. Pass host tensors or tensors on {self.device}."
        )

    def _disagree(self, spec: Input, dim: str, first: int, n: int) -> None:
        raise InputError(
            f"{self.name}: dim {dim!r} is {first} in one input and {n} in {spec.name!r}; every "
            "input must agree on it."
        )

    def _sizes(self, spec: _Spec, shape: tuple[int, ...], sizes: dict[str, int]) -> None:
        """Rank, fixed dims, and each symbolic dim's size recorded (agreeing, within max)."""
        i = spec.input
        if len(shape) != len(spec.fixed):
            raise InputError(
                f"{self.name}: input {i.name!r} has shape {tuple(shape)}, declared {i.shape} "
                f"({len(i.shape)} dims)."
            )
        for axis, (n, want) in enumerate(zip(shape, spec.fixed)):
            if want is not None and n != want:
                raise InputError(
                    f"{self.name}: input {i.name!r} dim {axis} is {n}, declared {want}."
                )
        for axis, dim in spec.dims:
            n = shape[axis]
            if sizes.setdefault(dim, n) != n:
                self._disagree(i, dim, sizes[dim], n)
            d = self.dims.get(dim)
            if dim != NUM_TOKENS and d is not None and not d.in_key and n > d.max:
                raise InputError(f"{self.name}: dim {dim!r} is {n}, above its max {d.max}.")

    def _bounds(self, spec: _Spec, v: torch.Tensor) -> None:
        """Bounds other than int64 [0, high), or a value outside them: found and named."""
        low, high = spec.input.bounds  # type: ignore[misc]
        if not v.numel() or (bool((v >= low).all()) and bool((v < high).all())):
            return  # (a device tensor pays one sync here)
        at = tuple(int(i) for i in ((v < low) | (v >= high)).nonzero()[0])
        raise InputError(
            f"{self.name}: input {spec.input.name!r}{list(at)} is {v[at].item()}, outside its "
            f"bounds [{low}, {high})."
        )


def _spec(i: Input) -> _Spec:
    dims = tuple((axis, s) for axis, s in enumerate(i.shape) if isinstance(s, str))
    fixed = tuple(None if isinstance(s, str) else int(s) for s in i.shape)
    b = i.bounds
    unsigned = None
    if b is not None and b[0] == 0 and i.dtype is torch.int64 and b[1] >= 0:
        unsigned = (np.array(b[1], dtype=np.uint64), int(b[1]))
    return _Spec(i, dims, fixed, unsigned)
