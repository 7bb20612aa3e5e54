"""Hand-built DLPack capsules (ctypes) for cases no framework produces on demand: NULL strides,
byte_offset, vector lanes, foreign devices, future major versions."""

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def capsule_name(cap):
    return _capsule_name(cap).decode()


# Every Handmade that handed out a capsule, kept for the process: a capsule made from a
# temporary (Handmade(...).capsule()) would otherwise point at freed ctypes memory, and its
# deleter at a freed callback, by the time qkernels reads it.
_ALIVE = []


class Handmade:
    """Owns a buffer and a managed tensor describing it; counts deleter calls."""

    def __init__(self, array, *, null_strides=False, byte_offset=0, versioned=True, major=1, flags=0,
                 device_type=1, device_id=0, lanes=1, dtype_code=None, bits=None):
        self.array = array  # keeps the memory alive
        self.deleted = 0
        n = array.ndim
        self.shape = (ctypes.c_int64 * max(n, 1))(*array.shape)
        self.strides = (ctypes.c_int64 * max(n, 1))(*[s // array.itemsize for s in array.strides])
        kind = {"f": 2, "i": 0, "u": 1, "b": 6}[array.dtype.kind]
        t = DLTensor()
        t.data = array.ctypes.data - byte_offset
        t.byte_offset = byte_offset
        t.device = DLDevice(device_type, device_id)
        t.ndim = n
        t.dtype = DLDataType(dtype_code if dtype_code is not None else kind,
                             bits if bits is not None else array.itemsize * 8, lanes)
        t.shape = self.shape
        t.strides = None if null_strides else self.strides
        self._deleter = DELETER(self._on_delete)
        if versioned:
            self.managed = DLManagedTensorVersioned(DLPackVersion(major, 0), None, self._deleter, flags, t)
            self.name = b"dltensor_versioned"
        else:
            self.managed = DLManagedTensor(t, None, self._deleter)
            self.name = b"dltensor"

    def _on_delete(self, ptr):
        self.deleted += 1

    def capsule(self):
        _ALIVE.append(self)
        return _capsule_new(ctypes.addressof(self.managed), self.name, None)


def handmade_like(array, **kw):
    return Handmade(np.ascontiguousarray(array), **kw)
