"""Every bad-input class of SPEC section 8 raises the documented type with a message naming the
op, the argument and what was expected; nothing is written on failure."""

import numpy as np
import pytest

import qkernels
from dlpack_ctypes import Handmade


def good(rng=None, n_dst=6, n_src=5, e=9, h=2, d=3, idx=np.int64):
    rng = rng or np.random.default_rng(7)
    row_ptr = np.sort(rng.integers(0, e + 1, n_dst + 1)).astype(idx)
    row_ptr[0], row_ptr[-1] = 0, e
    return [row_ptr, rng.integers(0, n_src, e).astype(idx), rng.standard_normal((e, h)).astype(np.float32),
            rng.standard_normal((n_src, h, d)).astype(np.float32)]


def call(args, **kw):
    return qkernels.sparse_aggregate(*args, **kw)


@pytest.mark.parametrize("pos,value,exc,msg", [
    (3, np.ones((5, 2, 3), np.float64), TypeError, "sparse_aggregate: node_feat must be float32, got float64"),
    (2, np.ones((9, 2), np.float64), TypeError, r"edge_weight must have node_feat's dtype \(float32\), got float64"),
    (0, np.zeros(7, np.float32), TypeError, "sparse_aggregate: row_ptr must be int32 or int64, got float32"),
    (1, np.zeros(9, np.int32), TypeError, r"col_idx must have the same dtype as row_ptr \(int64\), got int32"),
    (3, np.ones((5, 2, 3), np.uint8), TypeError, r"node_feat has an unsupported dtype \(DLPack code 1, 8 bits\)"),
    (3, np.ones((5, 2, 3), np.complex64), TypeError, "node_feat has an unsupported dtype"),
    (3, np.ones((5, 6), np.float32), ValueError, r"node_feat must have 3 dimensions \[N_src, H, D\], got shape \[5, 6\]"),
    (2, np.ones((9, 4), np.float32), ValueError, r"edge_weight must have shape \[E, H\] = \[9, 2\] .*got \[9, 4\]"),
    (2, np.ones((8, 2), np.float32), ValueError, r"edge_weight must have shape \[E, H\] = \[9, 2\] .*got \[8, 2\]"),
    (0, np.zeros((2, 3), np.int64), ValueError, r"row_ptr must have 1 dimensions \[N_dst \+ 1\], got shape \[2, 3\]"),
    (0, np.zeros(0, np.int64), ValueError, "row_ptr must have shape \\[N_dst \\+ 1\\] with at least one element"),
    (3, "not a tensor", TypeError, "sparse_aggregate: node_feat must be a tensor supporting DLPack .*got str"),
    (0, [0, 1, 2], TypeError, "sparse_aggregate: row_ptr must be a tensor supporting DLPack .*got list"),
])
def test_bad_argument(pos, value, exc, msg):
    args = good()
    args[pos] = value
    with pytest.raises(exc, match=msg):
        call(args)


def test_bad_indices_are_reported_with_position():
    args = good()
    args[1][4] = 5  # == N_src
    with pytest.raises(ValueError, match=r"col_idx\[4\] = 5 is out of range for node_feat with N_src = 5"):
        call(args)
    args = good()
    args[1][2] = -1
    with pytest.raises(ValueError, match=r"col_idx\[2\] = -1 is out of range"):
        call(args)
    args = good()
    args[0][3], args[0][4] = 8, 2
    with pytest.raises(ValueError, match=r"row_ptr must be non-decreasing .*row_ptr\[4\] = 2"):
        call(args)
    args = good()
    args[0][-1] = 10
    with pytest.raises(ValueError, match=r"0 <= row_ptr\[i\] <= E = 9; row_ptr\[6\] = 10"):
        call(args)
    args = good()
    args[0][0] = -3
    with pytest.raises(ValueError, match=r"row_ptr\[0\] = -3"):
        call(args)


def test_bad_out():
    args = good()
    with pytest.raises(ValueError, match=r"sparse_aggregate: out must have shape \[6, 2, 3\], got \[6, 2, 4\]"):
        call(args, out=np.zeros((6, 2, 4), np.float32))
    with pytest.raises(TypeError, match="sparse_aggregate: out must be float32, got float64"):
        call(args, out=np.zeros((6, 2, 3), np.float64))
    with pytest.raises(TypeError, match="out must be a tensor supporting DLPack"):
        call(args, out=3)
    poisoned = np.full((6, 2, 3), np.nan, np.float32)
    args[1][0] = 99
    with pytest.raises(ValueError):
        call(args, out=poisoned)


def test_stride_zero_out_rejected():
    args = good()
    h = Handmade(np.zeros((6, 2, 1), np.float32))
    h.strides[2] = 0
    h.shape[2] = 3
    from qkernels import from_dlpack
    with pytest.raises(ValueError, match="out has stride 0 in dimension 2"):
        call(args, out=from_dlpack(h.capsule()))


def test_dlpack_protocol_errors():
    args = good()
    a = np.ones((5, 2, 3), np.float32)
    with pytest.raises(BufferError, match="node_feat has 4 vector lanes"):
        args[3] = Handmade(a, lanes=4).capsule()
        call(args)
    with pytest.raises(BufferError, match=r"node_feat lives on dlpack device type 4:0"):
        args[3] = Handmade(a, device_type=4).capsule()  # OpenCL
        call(args)
    with pytest.raises(BufferError, match="DLPack 2.0 tensor; this build reads major version 1"):
        args[3] = Handmade(a, major=2).capsule()
        call(args)
    with pytest.raises(BufferError, match="capsule named 'other'"):
        import ctypes
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        args[3] = new(ctypes.addressof(ctypes.c_int(1)), b"other", None)
        call(args)


def test_mixed_devices_rejected_before_any_device_access():
    # A capsule that claims to live on cuda:0 (never dereferenced: the check comes first).
    args = good()
    args[0] = Handmade(args[0], device_type=2, device_id=0).capsule()
    with pytest.raises(ValueError, match="all tensors must be on one device; node_feat is on cpu but row_ptr is on cuda:0"):
        qkernels._C.sparse_aggregate_raw(*args)


def test_argument_parsing_names_the_function():
    args = good()
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) got an unexpected keyword argument 'outt'"):
        qkernels._C.sparse_aggregate_raw(*args, outt=None)
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) missing required argument 'node_feat'"):
        qkernels._C.sparse_aggregate_raw(*args[:3])
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) takes at most 4 positional arguments"):
        qkernels._C.sparse_aggregate_raw(*args, None)
    with pytest.raises(TypeError, match="stream must be an int CUDA stream handle"):
        qkernels._C.sparse_aggregate_raw(*args, stream="s")


def test_cuda_unavailable_is_a_runtime_error():
    if qkernels.AVAILABLE:
        pytest.skip("CUDA is available here")
    from qkernels import from_dlpack
    args = [from_dlpack(Handmade(a, device_type=2).capsule()) for a in good()]
    with pytest.raises(RuntimeError, match="sparse_aggregate: CUDA kernels are not available"):
        qkernels._C.sparse_aggregate_raw(*args)


def test_tensor_dlpack_arguments():
    t = qkernels.from_dlpack(np.ones(3, np.float32))
    with pytest.raises(BufferError, match="copy=True is not supported"):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"dl_device=\(2, 0\) differs"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError, match="max_version must be a"):
        t.__dlpack__(max_version=1)
    with pytest.raises(TypeError):
        qkernels.Tensor()
