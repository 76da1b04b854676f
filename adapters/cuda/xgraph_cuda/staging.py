"""The CUDA backend's HostCopier: a step's inputs go to the device in two driver calls.

A torch copy from pinned memory costs a dispatch, a copy-kernel choice and a booking with
the caching host allocator (an event per copy) before its cudaMemcpyAsync; the executor
keeps its host twin alive itself and waits on its own event before rewriting it, so none
of that is needed. `DriverCopier` queues cuMemcpyHtoDAsync and cuEventRecord on the current
torch stream (the stream the graph then replays on), and `wait` synchronizes that event.
XGRAPH_CUDA_STAGING=torch picks the core's torch copy instead (for comparison).
"""

from __future__ import annotations

import os

import torch
from cuda.bindings import driver as cu

from xgraph.errors import XGraphError
from xgraph.interfaces import HostCopier

from .vmm import error_name

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NO_CONTEXT = cu.CUresult.CUDA_ERROR_INVALID_CONTEXT


class StagingCopyError(XGraphError, RuntimeError):
    """A driver call of the staging copy failed."""


def _check(call: str, err: cu.CUresult) -> None:
    if err != _SUCCESS:
        raise StagingCopyError(
            f"{call} failed with {error_name(err)} while sending a step's inputs to the "
            "device. The device may have hit an earlier error (run with CUDA_LAUNCH_BLOCKING=1 "
            "to find it), or set XGRAPH_CUDA_STAGING=torch to stage through torch's copy."
        )


class DriverCopier(HostCopier):
    """cuMemcpyHtoDAsync of a prefix of the pinned twin, and one event, per step."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self._buffers = (device, host)  # kept alive: the driver gets raw addresses
        self._dst, self._src = device.data_ptr(), host.data_ptr()
        self._index = device.device.index if device.device.index is not None else 0
        # the current stream's handle without a Stream object: what Inductor's code calls
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        with torch.cuda.device(self._index):
            torch.cuda.init()
            err, self._event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            _check("cuEventCreate", err)
            err, self._context = cu.cuCtxGetCurrent()
            _check("cuCtxGetCurrent", err)
        self._pending = False

    def send(self, nbytes: int) -> None:
        stream = self._raw_stream(self._index)
        (err,) = cu.cuMemcpyHtoDAsync(self._dst, self._src, nbytes, stream)
        if err == _NO_CONTEXT:  # a thread that has made no CUDA call yet: give it ours
            _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._context)[0])
            (err,) = cu.cuMemcpyHtoDAsync(self._dst, self._src, nbytes, stream)
        _check("cuMemcpyHtoDAsync", err)
        _check("cuEventRecord", cu.cuEventRecord(self._event, stream)[0])
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            _check("cuEventSynchronize", cu.cuEventSynchronize(self._event)[0])
            self._pending = False

    def __del__(self) -> None:
        event = getattr(self, "_event", None)
        if event is not None:
            try:
                cu.cuEventDestroy(event)  # the driver waits for a pending record itself
            except Exception:  # interpreter teardown: the context may be gone already
                pass


def host_copier(device: torch.Tensor, host: torch.Tensor) -> HostCopier | None:
    """The copier the CUDA backend offers (None under XGRAPH_CUDA_STAGING=torch)."""
    choice = os.environ.get("XGRAPH_CUDA_STAGING", "driver")
    if choice == "torch":
        return None
    if choice != "driver":
        raise XGraphError(
            f"XGRAPH_CUDA_STAGING={choice!r}: choose 'driver' (the default) or 'torch'."
        )
    if not host.is_pinned():  # a pageable twin: torch's copy handles it (synchronously)
        return None
    return DriverCopier(device, host)
