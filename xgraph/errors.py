"""The one exception family of xgraph: every message says what happened and what to do."""

from __future__ import annotations


class XGraphError(Exception):
    """Base of every error xgraph raises on purpose."""


class BackendNotFoundError(XGraphError, LookupError):
    """A backend name that no installed plugin registers."""


class BackendUnavailableError(XGraphError):
    """A registered backend that cannot run on this machine."""


class IncompleteBackendError(XGraphError, TypeError):
    """An adapter class that leaves abstract methods of the contract unimplemented."""


class CaptureError(XGraphError):
    """Model code did something a graph cannot record (a host read of device data, ...)."""


class InputError(XGraphError, ValueError):
    """A step's inputs do not match the executor's declarations (dtype, device, shape)."""


class BucketOverflowError(XGraphError):
    """A step larger than the largest bucket, under the strict overflow policy."""


class VirtualMemoryError(XGraphError):
    """A virtual-memory call of the device runtime failed; carries the runtime's error name."""

    def __init__(self, call: str, error: str, hint: str = "") -> None:
        self.call = call
        self.error = error
        msg = f"{call} failed: {error}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


class ConcurrentStepError(XGraphError, RuntimeError):
    """A second thread called an executor while a step of it was running."""


class PoolClosedError(XGraphError):
    """Use of a memory pool (or of a graph captured on it) after the pool was closed."""


class MemoryInUseError(XGraphError):
    """Closing graph memory (a GraphMemory, a SharedPhysicalPool) that open executors use."""


class AsleepError(XGraphError, RuntimeError):
    """A step, capture or allocation over memory that sleep() gave back; wake() first."""


class ParameterizationLeakError(XGraphError):
    """A recorded launch follows per-step metadata (GraphExecutor.check_parameterization)."""


class ReplayError(XGraphError, RuntimeError):
    """An op of a replayed graph failed (an index outside its table, on the CPU backend)."""


class XGraphWarning(UserWarning):
    """Warnings about work that runs differently from what was asked (eagerly, another mode)."""
