"""A DLPack v0.8 capsule over raw memory: how `as_tensor` reaches torch_npu without a copy.

torch_npu has no `__cuda_array_interface__` counterpart; it takes DLPack capsules
(`torch_npu._C._npu_from_dlpack`, device type kDLExtDev -> PrivateUse1). The capsule
describes `nbytes` of uint8 at an address; the memory stays the caller's (the deleter only
drops this module's reference to the struct). Built with ctypes so the same code yields a
CPU capsule that `torch.utils.dlpack.from_dlpack` accepts: the layout is tested on any host.
"""

from __future__ import annotations

import ctypes
import threading

KDL_CPU = 1
KDL_EXT_DEV = 12  # torch_npu's device type in DLPack (aten DLConvertor: kDLExtDev -> PrivateUse1)
_UINT = 1  # kDLUInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# structs handed out and not yet deleted by their consumer (keeps their memory valid)
_live: dict[int, tuple[_DLManagedTensor, ctypes.Array]] = {}
_lock = threading.Lock()


def _delete(ptr: ctypes._Pointer) -> None:  # type: ignore[type-arg]
    try:
        with _lock:
            _live.pop(ctypes.addressof(ptr.contents), None)
    except BaseException:  # called from C: never raise
        pass


_DELETE = _DELETER(_delete)  # module global: must outlive every capsule


def capsule(address: int, nbytes: int, device_type: int, device_id: int) -> object:
    """A 'dltensor' PyCapsule: a 1-D uint8 tensor of `nbytes` at `address` on the device."""
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = int(address)
    t.device = _DLDevice(device_type, device_id)
    t.ndim = 1
    t.dtype = _DLDataType(_UINT, 8, 1)
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # compact row-major
    t.byte_offset = 0
    managed.deleter = _DELETE
    with _lock:
        _live[ctypes.addressof(managed)] = (managed, shape)
    return _PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)


def live_capsules() -> int:
    """Structs not yet released by their consumer (tests: no leak per tensor)."""
    with _lock:
        return len(_live)
