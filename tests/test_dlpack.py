"""DLPack in both directions: zero-copy, capsule ownership, refcounts, stride/offset handling,
and round trips with NumPy, PyTorch (CPU) and JAX (CPU)."""

import gc
import sys
import threading

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import rel_err, requires_jax, requires_torch
from dlpack_ctypes import Handmade, capsule_name

_C = qkernels._C


def test_numpy_import_is_zero_copy():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    t = qkernels.from_dlpack(a)
    assert t.data_ptr == a.ctypes.data and t.shape == (2, 3, 4) and t.strides == (12, 4, 1)
    back = np.from_dlpack(t)
    assert back.ctypes.data == a.ctypes.data and np.shares_memory(back, a)


def test_offset_view_import_points_at_the_view():
    a = np.arange(100, dtype=np.float32)
    v = a[7:70:3]
    t = qkernels.from_dlpack(v)
    assert t.data_ptr == v.ctypes.data and t.strides == (3,) and t.shape == (21,)
    assert np.array_equal(np.from_dlpack(t), v)


def test_export_versioned_and_legacy_capsules():
    out = qkernels.sparse_aggregate(np.array([0, 1], np.int32), np.array([0], np.int32),
                                    np.ones((1, 1), np.float32), np.ones((1, 1, 2), np.float32))
    assert isinstance(out, np.ndarray)
    t = qkernels.from_dlpack(out)
    legacy = t.__dlpack__()
    versioned = t.__dlpack__(max_version=(1, 0))
    assert capsule_name(legacy) == "dltensor" and capsule_name(versioned) == "dltensor_versioned"
    assert t.__dlpack_device__() == (1, 0)
    assert np.from_dlpack(t).ctypes.data == t.data_ptr


def test_capsule_is_consumed_once():
    a = np.arange(6, dtype=np.float32)
    cap = a.__dlpack__(max_version=(1, 0))
    t = qkernels.from_dlpack(cap)
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(BufferError, match="already consumed"):
        qkernels.from_dlpack(cap)
    assert np.array_equal(np.from_dlpack(t), a)


def test_our_capsule_is_consumed_once_by_numpy():
    t = qkernels.from_dlpack(np.arange(5, dtype=np.float32))
    cap = t.__dlpack__(max_version=(1, 0))
    np.from_dlpack(_Capsuled(cap))
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(BufferError, match="already consumed"):
        qkernels.from_dlpack(cap)


class _Capsuled:
    """Hands out one pre-made capsule, as a producer would."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def test_producer_deleter_runs_exactly_once_and_refcounts_return():
    a = np.arange(12, dtype=np.float32)
    base = sys.getrefcount(a)
    t = qkernels.from_dlpack(a)
    assert sys.getrefcount(a) > base  # NumPy's capsule holds the array
    views = [np.from_dlpack(t) for _ in range(3)]
    del t
    assert sys.getrefcount(a) > base  # still alive through the exported views
    del views
    gc.collect()
    assert sys.getrefcount(a) == base


def test_handmade_deleter_called_once_and_null_strides_and_byte_offset():
    src = np.arange(30, dtype=np.float32).reshape(5, 6)
    h = Handmade(src, null_strides=True, byte_offset=64)
    t = qkernels.from_dlpack(h.capsule())
    assert t.data_ptr == src.ctypes.data and t.strides == (6, 1)
    assert np.array_equal(np.from_dlpack(t), src)
    assert h.deleted == 0
    del t
    gc.collect()
    assert h.deleted == 1


def imported(rng, **sizes):
    """A sparse_aggregate sample as qkernels.Tensors."""
    return [qkernels.from_dlpack(a) for a in sample("sparse_aggregate", rng, **sizes)[0]]


def test_unconsumed_export_is_freed():
    gc.collect()
    base = _C._live_storages()
    args = imported(np.random.default_rng(0), n_dst=9, n_src=4, heads=2, dim=3)
    out = qkernels.sparse_aggregate(*args)
    assert _C._live_storages() == base + 5  # 4 imported inputs + the output
    del args
    caps = [out.__dlpack__(), out.__dlpack__(max_version=(1, 1))]
    del out
    assert _C._live_storages() >= base + 1
    del caps
    gc.collect()
    assert _C._live_storages() == base


def test_memory_lives_until_last_consumer_and_frees_from_another_thread():
    gc.collect()
    base = _C._live_storages()
    args = imported(np.random.default_rng(1), n_dst=50, n_src=10, heads=2, dim=4)
    out = qkernels.sparse_aggregate(*args)
    expected = np.from_dlpack(out).copy()
    view = np.from_dlpack(out)
    del out, args
    assert np.array_equal(view, expected)  # still valid: the view owns a reference
    holder = [view]
    del view
    th = threading.Thread(target=holder.clear)
    th.start()
    th.join()
    gc.collect()
    assert _C._live_storages() == base


def test_read_only_out_is_rejected():
    args = sample("sparse_aggregate", np.random.default_rng(2), n_dst=4, n_src=4, heads=1, dim=2)[0]
    out = np.zeros((4, 1, 2), np.float32)
    out.flags.writeable = False
    with pytest.raises(BufferError, match="sparse_aggregate: out is read-only"):
        qkernels.sparse_aggregate(*args, out=out)
    assert (out == 0).all()


def test_read_only_flag_survives_import_and_export():
    h = Handmade(np.ones(4, np.float32), flags=1)
    t = qkernels.from_dlpack(h.capsule())
    assert t.readonly
    with pytest.raises(BufferError, match="out is read-only"):
        qkernels.sparse_aggregate(np.array([0, 0, 0, 0, 0]), np.zeros(0, np.int64), np.zeros((0, 1), np.float32),
                                  np.zeros((1, 1, 1), np.float32), out=qkernels.from_dlpack(
                                      Handmade(np.ones((4, 1, 1), np.float32), flags=1).capsule()))


def test_raw_capsules_as_op_inputs(rng):
    args = sample("sparse_aggregate", rng, n_dst=20, n_src=9, heads=3, dim=4)[0]
    caps = [a.__dlpack__() for a in args]
    out = qkernels._C.sparse_aggregate_raw(*caps)
    assert isinstance(out, qkernels.Tensor)
    assert rel_err(np.from_dlpack(out), reference("sparse_aggregate", *args)) < 1e-5


def test_legacy_only_producer_falls_back(rng):
    class LegacyOnly:  # JAX's shape: no max_version keyword
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return (1, 0)

    args = sample("sparse_aggregate", rng, n_dst=15, n_src=6, heads=2, dim=3)[0]
    out = qkernels._C.sparse_aggregate_raw(*[LegacyOnly(a) for a in args])
    assert rel_err(np.from_dlpack(out), reference("sparse_aggregate", *args)) < 1e-5


def test_refcounts_flat_over_many_calls(rng):
    args = sample("sparse_aggregate", rng, n_dst=30, n_src=10, heads=2, dim=4)[0]
    out = np.zeros((30, 2, 4), np.float32)
    before = [sys.getrefcount(a) for a in args] + [sys.getrefcount(out)]
    for _ in range(200):
        qkernels.sparse_aggregate(*args)
        qkernels.sparse_aggregate(*args, out=out)
    after = [sys.getrefcount(a) for a in args] + [sys.getrefcount(out)]
    assert before == after


@requires_torch
@pytest.mark.parametrize("fast_path", [True, False])
def test_torch_round_trip_zero_copy(rng, fast_path):
    import torch

    old = qkernels._dispatch.configure(use_exchange_api=fast_path)
    try:
        args = [torch.from_numpy(a) for a in sample("sparse_aggregate", rng, n_dst=40, n_src=12, heads=3, dim=8)[0]]
        before = [sys.getrefcount(a) for a in args]
        out = qkernels.sparse_aggregate(*args)
        assert isinstance(out, torch.Tensor)
        assert [sys.getrefcount(a) for a in args] == before
        ref = reference("sparse_aggregate", *[a.numpy() for a in args])
        assert rel_err(out.numpy(), ref) < 1e-5
        t = qkernels.from_dlpack(args[3])
        assert t.data_ptr == args[3].data_ptr()
        back = torch.from_dlpack(t)
        assert back.data_ptr() == args[3].data_ptr()
    finally:
        qkernels._dispatch.configure(use_exchange_api=old["use_exchange_api"])


@requires_torch
def test_torch_exchange_api_is_used():
    import torch

    assert hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), "torch >= 2.10 publishes the DLPack C exchange API"
    x = torch.ones(3, 2, 1)
    assert _C.describe(x) == (1 << 8) | 0  # cpu, float32, read without a Python call


@requires_torch
def test_tensor_export_to_torch_is_zero_copy():
    import torch

    out = qkernels._C.sparse_aggregate_raw(np.array([0, 1]), np.array([0]), np.ones((1, 1), np.float32),
                                       np.full((1, 1, 3), 2.0, np.float32))
    tt = torch.from_dlpack(out)
    assert tt.data_ptr() == out.data_ptr and tt.tolist() == [[[2.0, 2.0, 2.0]]]
    gc.collect()
    base = _C._live_storages()
    del out
    assert _C._live_storages() == base  # torch holds it
    del tt
    gc.collect()
    assert _C._live_storages() == base - 1


@requires_jax
def test_jax_round_trip(rng):
    import jax
    import jax.numpy as jnp

    args = sample("sparse_aggregate", rng, n_dst=25, n_src=14, heads=2, dim=8)[0]
    j_args = [jnp.asarray(a) for a in args]
    out = qkernels.sparse_aggregate(*j_args)
    assert isinstance(out, jax.Array) and out.shape == (25, 2, 8)
    assert rel_err(np.asarray(out), reference("sparse_aggregate", *args)) < 1e-5
    with pytest.raises(TypeError, match="JAX arrays"):
        qkernels.sparse_aggregate(*j_args, out=out)


@requires_jax
def test_jax_export_zero_copy():
    import jax

    t = qkernels._C.sparse_aggregate_raw(np.array([0, 2]), np.array([0, 0]), np.ones((2, 1), np.float32),
                                     np.ones((1, 1, 16), np.float32))
    j = jax.dlpack.from_dlpack(t)
    assert j.unsafe_buffer_pointer() == t.data_ptr
    assert np.array_equal(np.asarray(j), np.full((1, 1, 16), 2.0, np.float32))
    ji = jax.numpy.arange(8.0, dtype=jax.numpy.float32)
    assert qkernels.from_dlpack(ji).data_ptr == ji.unsafe_buffer_pointer()  # legacy capsule, zero-copy


def test_interpreter_shutdown_with_live_exports():
    # Exports alive at exit (unconsumed capsules, views held by NumPy/torch, a Tensor over a
    # NumPy buffer) are freed, or left, at shutdown without crashing.
    import subprocess

    code = """
import numpy as np, qkernels
args = [np.array([0, 2, 3]), np.array([0, 1, 0]), np.ones((3, 2), np.float32), np.ones((2, 2, 4), np.float32)]
out = qkernels._C.sparse_aggregate_raw(*args)
cap_legacy = out.__dlpack__()
cap_versioned = out.__dlpack__(max_version=(1, 0))
view = np.from_dlpack(out)
wrapped = qkernels.from_dlpack(np.arange(10.0))
try:
    import torch
    tview = torch.from_dlpack(out)
except ImportError:
    pass
cycle = [out, view]
cycle.append(cycle)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_cpu_kernel_releases_the_gil(rng):
    # While one thread runs a large CPU sparse_aggregate, another keeps executing Python.
    import time

    args = sample("sparse_aggregate", rng, n_dst=20000, n_src=20000, heads=4, dim=64, avg_degree=96)[0]
    inside = threading.Event()
    span = []

    def work():
        inside.set()
        t0 = time.perf_counter()
        qkernels.sparse_aggregate(*args)
        span.append((t0, time.perf_counter()))

    old = qkernels._C._configure(num_threads=1)  # leave a core for this thread
    try:
        t = threading.Thread(target=work)
        t.start()
        inside.wait()
        stamps = []
        while t.is_alive():
            stamps.append(time.perf_counter())
        t.join()
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])
    t0, t1 = span[0]
    points = [t0] + [s for s in stamps if t0 < s < t1] + [t1]
    largest_gap = max(b - a for a, b in zip(points, points[1:]))
    # Holding the GIL for the call would leave one gap as long as the call itself.
    assert t1 - t0 > 0.03 and largest_gap < 0.5 * (t1 - t0), (t1 - t0, largest_gap)
