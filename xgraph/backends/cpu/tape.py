"""OpTape: the aten ops a capture actually ran, recorded for replay on the host.

A host graph's driver hands every op of a capture to `record` (CheckedGraph's guard has
checked it for host reads and run it). Fresh outputs are moved into blocks of the capture
pool, so intermediates live in pool memory exactly as on a GPU, and
blocks freed during the capture are reused by later ops of it. The tape keeps pool tensors
as (address, layout) records rather than objects, so freeing works; at capture_end the
records become tensors over the same addresses (`seal`). Replay re-executes each op on the recorded
tensors and writes its result into the recorded output: results follow new input values
while the op sequence and every address stay fixed. Python control flow, host scalars and
host reads are frozen at capture, which is what makes this a faithful stand-in for a GPU graph.

What is fresh is decided by storage, not schema: an output over no input's storage is moved
into the pool and replayed, whatever its schema says (under inference mode `to`,
`contiguous`, `reshape` arrive undecomposed and may copy where their schema allows an
alias), and one over an input's storage stays that input's view. Replay runs under
inference mode with every TorchFunctionMode off, so neither the caller's grad mode nor a
`torch.set_default_device` changes it.

Collectives (torch.distributed's c10d ops and functional collectives, on gloo) are recorded
like any op and issued again on replay, so every rank must replay together, as with NCCL in
a CUDA graph. They run asynchronously, so replay waits for each one before the next op, as
the capture did: a c10d op returns a Work (waited), a functional collective a tensor
(`wait_tensor`). c10d schemas declare no aliasing, so their tensor arguments, written in
place, are never taken for fresh outputs.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import ReplayError
from ...interfaces import Launch
from ...launches import op_launch
from .pool import HostCachingPool

_EMPTY_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
}

_buffer_types: dict[int, type] = {}

Wait = Callable[[Any], None]

# functional collectives' helpers: they wait for or wrap a collective's result, no device work
_FUNCTIONAL_WRAPPERS = {
    "_c10d_functional::wait_tensor",
    "_c10d_functional::_wrap_tensor_autograd",
}


def _wait_work(index: int | None) -> Wait:
    def wait(res: Any) -> None:
        (res if index is None else res[index]).wait()

    return wait


def _wait_tensors(res: Any) -> None:
    for t in res if isinstance(res, (list, tuple)) else [res]:
        torch.ops._c10d_functional.wait_tensor(t)


def collective_wait(func: Any) -> Wait | None:
    """How to wait for `func`'s result if it is a collective: None for every other op."""
    schema = func._schema
    ns = schema.name.split("::")[0]
    if ns == "c10d":
        works = [i for i, r in enumerate(schema.returns) if str(r.type).endswith(".Work")]
        if works:
            return _wait_work(works[0] if len(schema.returns) > 1 else None)
    elif ns == "_c10d_functional" and schema.name not in _FUNCTIONAL_WRAPPERS:
        return _wait_tensors
    return None


def _buffer(address: int, nbytes: int) -> ctypes.Array:
    """A ctypes view of host memory; a subclass so it can carry a weakref finalizer."""
    t = _buffer_types.get(nbytes)
    if t is None:
        t = _buffer_types[nbytes] = type(f"_Block{nbytes}", (ctypes.c_char * nbytes,), {})
    return t.from_address(address)


def host_tensor(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over memory the caller keeps alive."""
    return torch.frombuffer(_buffer(address, nbytes), dtype=torch.uint8)


@dataclass(frozen=True)
class _PoolRef:
    """A pool tensor as the tape stores it: where its storage is and how it is laid out."""

    address: int
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _storages(leaves: list[Any]) -> set[int]:
    """The addresses of the host storages of the tensors among an op's argument leaves."""
    found = set()
    for x in leaves:
        if type(x).__name__ == "AsyncCollectiveTensor":  # see _leaf
            x = x.elem
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            found.add(x.untyped_storage().data_ptr())
    return found


def _ref(t: torch.Tensor) -> _PoolRef:
    st = t.untyped_storage()
    return _PoolRef(
        st.data_ptr(), st.nbytes(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset()
    )


@dataclass
class _TapeOp:
    func: Any
    flat: list[Any]  # args/kwargs leaves, pool tensors as _PoolRef
    spec: Any
    outs: list[tuple[int, int | None, _PoolRef]]  # (return index, list index, destination)
    multi: bool  # several returns (a tuple)
    wait: Wait | None = None  # a collective: wait for its result on replay


class OpTape:
    """Records a capture's ops into pool memory and replays them (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: HostCachingPool | None = None
        self._tape: list[_TapeOp] = []
        self._program: list[tuple[Callable, tuple, dict, list, bool, Wait | None]] = []
        self._launches: list[Launch] | None = None  # kept for the parameterization check

    def begin(self, pool: HostCachingPool) -> None:
        """Start a recording whose fresh tensors live in `pool`."""
        self._pool = pool

    def keep_launches(self) -> None:
        """Describe every op recorded from now on (`launches`), until `clear`."""
        self._launches = []

    def launches(self) -> list[Launch]:
        """The recorded ops, in order: op, tensor layouts, non-tensor arguments, layer."""
        return list(self._launches or ())

    def replay(self) -> None:
        """Re-execute every op; an op that raises (an index outside its table) ends the
        replay with a ReplayError naming it. The tape itself is unchanged and replays again.
        It runs under inference mode whatever the caller's mode, as a GPU graph replays: in
        place writes to inference tensors (a capture under inference mode makes them) are
        allowed only there, and to normal tensors there too. The tape holds aten ops, below
        `__torch_function__`: replay runs with every TorchFunctionMode off (what
        `torch.set_default_device` installs would make each op a Python call, about 2x)."""
        func = None
        with torch.inference_mode(), torch._C.DisableTorchFunction():
            try:
                for func, args, kwargs, outs, multi, wait in self._program:
                    res = func(*args, **kwargs)
                    if wait is not None:
                        wait(res)
                    for i, j, dst in outs:
                        r = res[i] if multi else res
                        dst.copy_(r if j is None else r[j])
            except Exception as exc:  # costs nothing until an op raises
                raise ReplayError(
                    f"replaying {func} failed: {type(exc).__name__}: {exc}".rstrip()
                ) from exc

    def clear(self) -> None:
        self._tape = []
        self._program = []
        self._pool = None
        self._launches = None

    def _to_pool(
        self, t: torch.Tensor, moved: dict[int, torch.UntypedStorage] | None = None
    ) -> torch.Tensor:
        """Copy a fresh op output into a pool block; the block is freed when the tensor dies.
        Outputs over one fresh storage (`moved`, per op) share one block, as they did."""
        pool = self._pool
        assert pool is not None
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0:
            return t
        pst = None if moved is None else moved.get(st.data_ptr())
        if pst is None:
            address = pool.alloc(n)
            buf = _buffer(address, n)
            weakref.finalize(buf, pool.free, address)
            pst = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
            pst.copy_(st)
            if moved is not None:
                moved[st.data_ptr()] = pst
        return torch.empty(0, dtype=t.dtype, device="cpu").set_(
            pst, t.storage_offset(), t.shape, t.stride()
        )

    def _leaf(self, x: Any) -> Any:
        if type(x).__name__ == "AsyncCollectiveTensor":  # a functional collective's result,
            x = x.elem  # already waited for: the plain tensor, in the pool
        if isinstance(x, torch.Tensor):
            pool = self._pool
            assert pool is not None
            if (
                x.device.type == "cpu"
                and x.untyped_storage().nbytes()
                and pool.owns(x.untyped_storage().data_ptr())
            ):
                return _ref(x)
        return x

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Record one op that ran; its fresh outputs move into the pool (returned instead)."""
        schema = func._schema
        multi = len(schema.returns) > 1
        wait = collective_wait(func)
        if schema.name in _FUNCTIONAL_WRAPPERS:
            return out  # the collective's own record waits (at capture and on replay)
        if wait is not None and schema.name.startswith("c10d::"):
            return self._record_in_place(func, args, kwargs, out, multi, wait)
        if wait is not None:
            wait(out)  # complete before it is copied into the pool
        flat, spec = tree_flatten((args, kwargs))
        rets = list(out) if multi else [out]
        outs, undeclared = self._move_fresh(rets, schema, _storages(flat))
        name = schema.name
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        pure_view = not outs and not mutates and not undeclared
        if name not in _EMPTY_OPS and not pure_view:
            flat = [self._leaf(x) for x in flat]
            self._tape.append(_TapeOp(func, flat, spec, outs, multi, wait))
            if self._launches is not None:
                self._launches.append(op_launch(func, args, kwargs))
        return tuple(rets) if multi else rets[0]

    def _move_fresh(
        self, rets: list[Any], schema: Any, inputs: set[int]
    ) -> tuple[list[tuple[int, int | None, _PoolRef]], bool]:
        """Move the fresh tensors of `rets` into the pool, in place; returns their records
        and whether a return the schema calls fresh is over an input's storage.

        Fresh means "over no input's storage", whatever the schema says: under inference
        mode composite ops arrive undecomposed, and `to`, `contiguous`, `reshape` ... may
        alias by schema yet copy; such a copy taken for a view would replay stale data.
        Conversely `type_as` (fresh by schema) returns `self` when nothing changes: it stays
        the input's tensor, as in eager, and the op is still replayed (it may do work)."""
        outs: list[tuple[int, int | None, _PoolRef]] = []
        undeclared = False
        moved: dict[int, torch.UntypedStorage] = {}  # a fresh storage's pool copy, made once
        for i, (r, rs) in enumerate(zip(rets, schema.returns)):
            nested = isinstance(r, (list, tuple))
            items = list(r) if nested else [r]
            for j, x in enumerate(items):
                if not isinstance(x, torch.Tensor) or not x.untyped_storage().nbytes():
                    continue
                if x.untyped_storage().data_ptr() in inputs:  # a view or the mutated input
                    undeclared = undeclared or rs.alias_info is None
                    continue
                items[j] = self._to_pool(x, moved)
                outs.append((i, j if nested else None, _ref(items[j])))
            rets[i] = type(r)(items) if nested else items[0]
        return outs, undeclared

    def _record_in_place(
        self, func: Any, args: tuple, kwargs: dict, out: Any, multi: bool, wait: Wait
    ) -> Any:
        """A c10d collective: it writes its tensor arguments; the caller waits on its Work."""
        flat, spec = tree_flatten((args, kwargs))
        self._tape.append(_TapeOp(func, [self._leaf(x) for x in flat], spec, [], multi, wait))
        if self._launches is not None:
            self._launches.append(op_launch(func, args, kwargs))
        return out

    def seal(self) -> None:
        """Turn the tape's address records into tensors over the same (still mapped) memory."""
        storages: dict[tuple[int, int], torch.UntypedStorage] = {}

        def tensor(r: _PoolRef) -> torch.Tensor:
            key = (r.address, r.nbytes)
            st = storages.get(key)
            if st is None:
                st = storages[key] = host_tensor(r.address, r.nbytes).untyped_storage()
            return torch.empty(0, dtype=r.dtype, device="cpu").set_(st, r.offset, r.size, r.stride)

        program = []
        for e in self._tape:
            leaves = [tensor(x) if isinstance(x, _PoolRef) else x for x in e.flat]
            args, kwargs = tree_unflatten(leaves, e.spec)
            outs = [(i, j, tensor(r)) for i, j, r in e.outs]
            program.append((e.func, tuple(args), dict(kwargs), outs, e.multi, e.wait))
        self._tape = []
        self._program = program
