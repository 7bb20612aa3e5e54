"""The CUDA shared object's contract, checked without a GPU: it loads, answers only its own ABI
version, and its table's first entries work (the CUDA runtime answers these without a driver)."""

import ctypes
import pathlib
import re

import pytest

import qkernels

lib_path = qkernels._C.CUDA_LIBRARY
pytestmark = pytest.mark.skipif(lib_path is None, reason="built without CUDA kernels")


HEADER = (pathlib.Path(__file__).parents[1] / "include" / "qkernels" / "launch.h").read_text()
ABI = int(re.search(r"#define QK_CUDA_ABI (\d+)", HEADER).group(1))
# the function pointers declared in the table's struct: written out, and one per QK_LAUNCHERS row
_TABLE = HEADER.split("} qk_cuda_api;")[0].rsplit("typedef struct {", 1)[1]
_LAUNCHERS = re.search(r"#define QK_LAUNCHERS\(X\)(.*?)\n\n", HEADER, re.S).group(1)
ENTRIES = (len(re.findall(r"^    int \(\*\w+\)\(", _TABLE, re.M)) +
           len(re.findall(r"X\(\w+, \w+\)", _LAUNCHERS)) * _TABLE.count("QK_LAUNCHERS(QK_CUDA_ENTRY)"))


def test_table_by_abi_version():
    lib = ctypes.CDLL(lib_path)
    lib.qk_cuda_get_api.restype = ctypes.c_void_p
    lib.qk_cuda_get_api.argtypes = [ctypes.c_int]
    assert lib.qk_cuda_get_api(ABI - 1) is None and lib.qk_cuda_get_api(ABI + 1) is None
    table = lib.qk_cuda_get_api(ABI)
    assert table
    abi = ctypes.c_int.from_address(table).value
    words = (ctypes.c_void_p * (2 + ENTRIES)).from_address(table)  # abi (padded), archs, entries
    archs = ctypes.cast(words[1], ctypes.c_char_p).value.decode()
    assert abi == ABI and "sm_" in archs and ENTRIES >= 15
    assert all(words[2:]), "every entry of the table is filled"
    runtime_version = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(words[2])
    v = ctypes.c_int()
    assert runtime_version(ctypes.byref(v)) == 0 and v.value >= 12000
    error_string = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_int)(words[8])
    assert error_string(2) == b"out of memory"
    if not qkernels.AVAILABLE:
        assert qkernels.info()["cuda_reason"]  # and the reason is reported, never an import error
