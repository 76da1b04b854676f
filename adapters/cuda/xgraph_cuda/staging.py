"""The CUDA backend's HostCopier: a step's inputs go to the device in one driver call.

A torch copy from pinned memory costs a dispatch, a copy-kernel choice and a booking with
the caching host allocator (an event per copy) before its cudaMemcpyAsync: on an H200 host
8.4 us for a step's wait and send against 7.5 us for this copier's
(docs/results/h200/gpu-time-pass/host-costs-run2.json; LOG, 2026-11-30, GPU-time pass),
most of the rest being the driver's own call. The executor keeps its host
twin alive itself and waits on its own event before rewriting it, so none of that is
needed. `DriverCopier` calls cuMemcpyHtoDAsync on the current torch stream (the stream the
graph then replays on) through ctypes, whose call costs far less than cuda-python's
argument wrapping on this path, then records a torch event that `wait` synchronizes.
XGRAPH_CUDA_STAGING=torch picks the core's torch copy instead (for comparison).
"""

from __future__ import annotations

import ctypes
import os

import torch
from cuda.bindings import driver as cu

from xgraph.adapter import HostCopier, TorchCopier, XGraphError

from .vmm import error_name

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no context


class StagingCopyError(XGraphError, RuntimeError):
    """A driver call of the staging copy failed."""


def _check(call: str, rc: int) -> None:
    if rc:
        raise StagingCopyError(
            f"{call} failed with {error_name(cu.CUresult(rc))} while sending a step's inputs "
            "to the device. The device may have hit an earlier error (run with "
            "CUDA_LAUNCH_BLOCKING=1 to find it), or set XGRAPH_CUDA_STAGING=torch to stage "
            "through torch's copy."
        )


class _Driver:
    """The three libcuda entry points the copier calls, typed once."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.memcpy = lib.cuMemcpyHtoDAsync_v2
        self.memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.memcpy.restype = ctypes.c_int
        self.ctx_get = lib.cuCtxGetCurrent
        self.ctx_get.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.ctx_get.restype = ctypes.c_int
        self.ctx_set = lib.cuCtxSetCurrent
        self.ctx_set.argtypes = [ctypes.c_void_p]
        self.ctx_set.restype = ctypes.c_int


_driver: _Driver | None = None


class DriverCopier(TorchCopier):
    """cuMemcpyHtoDAsync of a prefix of the pinned twin per step; the event and the wait are
    the core's (TorchCopier)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        global _driver
        if _driver is None:
            _driver = _Driver()
        self._drv = _driver
        self._dst, self._src = device.data_ptr(), host.data_ptr()  # the tensors stay alive
        self._index = device.device.index if device.device.index is not None else 0
        # the current stream's handle without a Stream object: what Inductor's code calls
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        with torch.cuda.device(self._index):
            torch.cuda.init()
            torch.cuda.current_stream().synchronize()  # makes the primary context current
            ctx = ctypes.c_void_p()
            _check("cuCtxGetCurrent", self._drv.ctx_get(ctypes.byref(ctx)))
            self._context = ctx
            super().__init__(device, host)

    def _copy(self, nbytes: int) -> None:
        stream = self._raw_stream(self._index)
        rc = self._drv.memcpy(self._dst, self._src, nbytes, stream)
        if rc == _INVALID_CONTEXT:  # a thread that has made no CUDA call yet: give it ours
            _check("cuCtxSetCurrent", self._drv.ctx_set(self._context))
            rc = self._drv.memcpy(self._dst, self._src, nbytes, stream)
        _check("cuMemcpyHtoDAsync", rc)


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
