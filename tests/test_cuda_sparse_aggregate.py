"""CUDA backend: correctness against the float64 reference through torch, CuPy and JAX on the
device, zero-copy exchange, the caller's stream, CUDA-graph capture, index checking and the
staged cpu fallback.  Skipped (with the reason) where no GPU or CUDA kernels are present."""

import gc
import importlib.util
import warnings

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import behind_held_copy, capture_graph, close_to_naive, cuda, f64, fp32_sum_tol, rel_err, requires_cuda

pytestmark = requires_cuda
_C = qkernels._C

torch = pytest.importorskip("torch") if importlib.util.find_spec("torch") else None
needs_torch_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="torch without CUDA")
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")


def _jax_gpu():
    if importlib.util.find_spec("jax") is None:
        return None
    import jax

    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


def raw_tensor(args):
    """_C's own output (a qkernels.Tensor from cudaMalloc), bypassing torch's allocator."""
    old = _C._configure(use_exchange_api=False)
    try:
        return _C.sparse_aggregate_raw(*args, stream=torch.cuda.current_stream().cuda_stream)
    finally:
        qkernels._dispatch.configure(use_exchange_api=old["use_exchange_api"])


def to_cuda(args):
    return [cuda(a) for a in args]


@needs_torch_cuda
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,heads,dim", [(1, 1, 1, 1), (19, 7, 3, 5), (113, 200, 7, 19),
                                                   (1023, 50, 2, 64), (64, 64, 8, 113), (3000, 2000, 4, 128)])
def test_torch_cuda_matches_reference(rng, index_dtype, n_dst, n_src, heads, dim):
    args = sample("sparse_aggregate", rng, n_dst=n_dst, n_src=n_src, heads=heads, dim=dim, index_dtype=index_dtype)[0]
    out = qkernels.sparse_aggregate(*to_cuda(args))
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32
    assert rel_err(out.cpu().numpy(), reference("sparse_aggregate", *args)) < 1e-5


@needs_torch_cuda
def test_power_law_zero_degree_and_empty(rng):
    degrees = rng.integers(0, 2, size=20000)
    degrees[[5, 7000]] = [200_000, 50_000]
    args = sample("sparse_aggregate", rng, n_dst=20000, n_src=9000, heads=2, dim=32, degrees=degrees)[0]
    out = qkernels.sparse_aggregate(*to_cuda(args))
    ref = reference("sparse_aggregate", *args)
    assert rel_err(out.cpu().numpy(), ref) < fp32_sum_tol(degrees.max())
    assert (out[torch.from_numpy(np.diff(args[0]) == 0).cuda()] == 0).all()
    empty = sample("sparse_aggregate", rng, n_dst=17, n_src=5, heads=3, dim=4, degrees=np.zeros(17))[0]
    assert (qkernels.sparse_aggregate(*to_cuda(empty)) == 0).all()


@needs_torch_cuda
def test_poisoned_and_strided_out(rng):
    args = sample("sparse_aggregate", rng, n_dst=77, n_src=31, heads=3, dim=9, degrees=rng.integers(0, 4, size=77))[0]
    big = torch.full((77, 3, 18), float("nan"), device="cuda")
    view = big[:, :, ::2]
    assert qkernels.sparse_aggregate(*to_cuda(args), out=view) is view
    assert rel_err(view.cpu().numpy(), reference("sparse_aggregate", *args)) < 1e-5
    assert torch.isnan(big[:, :, 1::2]).all()


@needs_torch_cuda
def test_non_contiguous_cuda_inputs(rng):
    row_ptr, col_idx, ew, nf = sample("sparse_aggregate", rng, n_dst=50, n_src=40, heads=4, dim=12)[0]
    rp, ci, ew_c, nf_c = to_cuda([row_ptr, col_idx, ew, nf])
    nf_t = nf_c.transpose(0, 1).contiguous().transpose(0, 1)
    ew_t = ew_c.t().contiguous().t()
    rp2 = torch.stack([rp, rp], 1)[:, 0]
    assert not nf_t.is_contiguous() and not rp2.is_contiguous()
    out = qkernels.sparse_aggregate(rp2, ci, ew_t, nf_t)
    assert rel_err(out.cpu().numpy(), reference("sparse_aggregate", row_ptr, col_idx, ew, nf)) < 1e-5


@needs_torch_cuda
@pytest.mark.parametrize("fast_path", [True, False])
def test_torch_zero_copy_both_ways(rng, fast_path):
    old = qkernels._dispatch.configure(use_exchange_api=fast_path)
    try:
        args = to_cuda(sample("sparse_aggregate", rng, n_dst=30, n_src=20, heads=2, dim=8)[0])
        t = qkernels.from_dlpack(args[3])
        assert t.data_ptr == args[3].data_ptr() and t.device == "cuda:0"
        back = torch.from_dlpack(t)
        assert back.data_ptr() == args[3].data_ptr()
        out = qkernels.sparse_aggregate(*args)
        assert isinstance(out, torch.Tensor) and out.is_cuda
        raw = raw_tensor(args)
        assert isinstance(raw, qkernels.Tensor) and raw.device == "cuda:0"
        tt = torch.from_dlpack(raw)
        assert tt.data_ptr() == raw.data_ptr and torch.equal(tt, out)
    finally:
        qkernels._dispatch.configure(use_exchange_api=old["use_exchange_api"])


@needs_torch_cuda
def test_runs_on_the_callers_current_stream(rng):
    args = sample("sparse_aggregate", rng, n_dst=4000, n_src=4000, heads=4, dim=64, avg_degree=16)[0]
    rp, ci, ew, nf = to_cuda(args)
    new_nf = torch.from_numpy(rng.standard_normal(args[3].shape).astype(np.float32)).cuda()
    out = behind_held_copy(nf, new_nf, lambda: qkernels.sparse_aggregate(rp, ci, ew, nf))
    ref = reference("sparse_aggregate", args[0], args[1], args[2], new_nf.cpu().numpy())
    assert rel_err(out.cpu().numpy(), ref) < 1e-5


@needs_torch_cuda
def test_cuda_graph_capture_and_replay(rng):
    args = sample("sparse_aggregate", rng, n_dst=500, n_src=300, heads=4, dim=32)[0]
    static = to_cuda(args)
    qkernels.sparse_aggregate(*static)  # warm-up outside capture
    g, out = capture_graph(lambda: qkernels.sparse_aggregate(*static))
    for _ in range(3):
        fresh = list(sample("sparse_aggregate", rng, n_dst=500, n_src=300, heads=4, dim=32,
                            degrees=np.diff(args[0]))[0])
        fresh[0], fresh[1] = args[0], args[1]  # same graph structure, new weights and features
        static[2].copy_(torch.from_numpy(fresh[2]))
        static[3].copy_(torch.from_numpy(fresh[3]))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out.cpu().numpy(), reference("sparse_aggregate", *fresh)) < 1e-5


@needs_torch_cuda
def test_mixed_devices_rejected(rng):
    args = sample("sparse_aggregate", rng, n_dst=10, n_src=10, heads=2, dim=4)[0]
    cuda_args = to_cuda(args)
    cuda_args[0] = torch.from_numpy(args[0])
    with pytest.raises(ValueError, match="all tensors must be on one device; node_feat is on cuda:0 but row_ptr is on cpu"):
        qkernels.sparse_aggregate(*cuda_args)


@needs_torch_cuda
def test_index_checking_and_safety(rng):
    args = sample("sparse_aggregate", rng, n_dst=200, n_src=50, heads=2, dim=16)[0]
    bad = [a.copy() for a in args]
    bad[1][17] = 50
    cuda_bad = to_cuda(bad)
    old = _C._configure(check_indices=True)
    try:
        with pytest.raises(ValueError, match=r"col_idx\[17\] = 50 is out of range"):
            qkernels.sparse_aggregate(*cuda_bad)
        bad_rp = [a.copy() for a in args]
        bad_rp[0][100] = -5
        with pytest.raises(ValueError, match=r"row_ptr\[100\] = -5"):
            qkernels.sparse_aggregate(*to_cuda(bad_rp))
        assert torch.isfinite(qkernels.sparse_aggregate(*to_cuda(args))).all()
    finally:
        _C._configure(check_indices=old["check_indices"])
    # Unchecked: the bad edge is skipped and nothing outside `out` is written.
    big = torch.full((300, 2, 16), float("nan"), device="cuda")
    view = big[50:250]
    qkernels.sparse_aggregate(*cuda_bad, out=view)
    torch.cuda.synchronize()
    assert torch.isnan(big[:50]).all() and torch.isnan(big[250:]).all() and torch.isfinite(view).all()


@needs_torch_cuda
def test_cpu_backend_stages_device_tensors(rng):
    args = sample("sparse_aggregate", rng, n_dst=40, n_src=30, heads=2, dim=8)[0]
    qkernels._frameworks._staging_warned.clear()
    with pytest.warns(qkernels.FallbackWarning, match="copying them through host memory"):
        out = qkernels.sparse_aggregate(*to_cuda(args), backend="cpu")
    assert out.is_cuda and rel_err(out.cpu().numpy(), reference("sparse_aggregate", *args)) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qkernels.sparse_aggregate(*to_cuda(args), backend="cpu")  # warned once


@needs_torch_cuda
def test_dispatcher_picks_cuda(rng):
    args = to_cuda(sample("sparse_aggregate", rng, n_dst=10, n_src=10, heads=2, dim=4)[0])
    d = qkernels.resolve("sparse_aggregate", *args)
    assert d.winner == "cuda" and d.origin == "chain"
    assert "MATCH" in str(d) and "axes: framework=torch device=cuda dtype=float32" in str(d)


@needs_torch_cuda
def test_direct_path_still_honours_context_and_env(rng, env):
    args = sample("sparse_aggregate", rng, n_dst=40, n_src=30, heads=2, dim=8)[0]
    cuda_args = to_cuda(args)
    qkernels.sparse_aggregate(*cuda_args)  # takes the zero-lookup path from now on
    assert type(cuda_args[3]) in qkernels._dispatch.direct_types
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        with qkernels.use_backend(sparse_aggregate="cpu"):
            assert qkernels.resolve("sparse_aggregate", *cuda_args).staged
            out = qkernels.sparse_aggregate(*cuda_args)
        assert rel_err(out.cpu().numpy(), reference("sparse_aggregate", *args)) < 1e-5
        env(QECDEC_BACKEND="flash")
        with pytest.raises(qkernels.ExplicitSelectionError, match="env QECDEC_BACKEND"):
            qkernels.sparse_aggregate(*cuda_args)


@needs_torch_cuda
def test_export_handshake_and_lifetime(rng):
    gc.collect()
    base = _C._live_storages()
    raw = raw_tensor(to_cuda(sample("sparse_aggregate", rng, n_dst=64, n_src=64, heads=2, dim=8)[0]))
    assert _C._live_storages() == base + 1
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        tt = torch.from_dlpack(raw)  # torch passes its stream: we record/wait an event, no device sync
        total = tt.sum().item()
    assert np.isfinite(total)
    del raw
    assert _C._live_storages() == base + 1
    del tt
    gc.collect()
    assert _C._live_storages() == base


@needs_cupy
def test_cupy_round_trip(rng):
    import cupy

    args = sample("sparse_aggregate", rng, n_dst=113, n_src=60, heads=5, dim=16)[0]
    c_args = [cupy.asarray(a) for a in args]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        out = qkernels.sparse_aggregate(*c_args)
        s.synchronize()
    assert isinstance(out, cupy.ndarray)
    assert rel_err(cupy.asnumpy(out), reference("sparse_aggregate", *args)) < 1e-5
    t = qkernels.from_dlpack(c_args[3])
    assert t.data_ptr == c_args[3].data.ptr
    raw = _C.sparse_aggregate_raw(*c_args)
    assert cupy.from_dlpack(raw).data.ptr == raw.data_ptr
    poisoned = cupy.full((113, 5, 16), cupy.nan, dtype=cupy.float32)
    assert qkernels.sparse_aggregate(*c_args, out=poisoned) is poisoned
    assert rel_err(cupy.asnumpy(poisoned), reference("sparse_aggregate", *args)) < 1e-5


def test_jax_gpu_round_trip(rng):
    dev = _jax_gpu()
    if dev is None:
        pytest.skip("jax has no GPU here")
    import jax

    args = sample("sparse_aggregate", rng, n_dst=90, n_src=40, heads=3, dim=8)[0]
    j_args = [jax.device_put(a, dev) for a in args]
    out = qkernels.sparse_aggregate(*j_args)
    assert isinstance(out, jax.Array) and out.devices() == {dev}
    assert rel_err(np.asarray(out), reference("sparse_aggregate", *args)) < 1e-5
    t = qkernels.from_dlpack(j_args[3])
    assert t.data_ptr == j_args[3].unsafe_buffer_pointer()
    raw = _C.sparse_aggregate_raw(*j_args)
    assert jax.dlpack.from_dlpack(raw).unsafe_buffer_pointer() == raw.data_ptr


@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads,dim", [(8, 32), (4, 64), (3, 5)])
def test_half_precision(rng, dtype, heads, dim):
    args = sample("sparse_aggregate", rng, n_dst=2000, n_src=1500, heads=heads, dim=dim)[0]
    t = to_cuda(args)
    t[2], t[3] = t[2].to(getattr(torch, dtype)), t[3].to(getattr(torch, dtype))
    out = qkernels.sparse_aggregate(*t)
    assert out.dtype == t[3].dtype
    ref = reference("sparse_aggregate", args[0], args[1], f64(t[2]), f64(t[3]))
    # naive same precision: messages and their sum in the storage dtype
    naive = torch.zeros_like(out).index_add_(0, torch.repeat_interleave(torch.arange(2000, device="cuda"),
                                                                          torch.diff(t[0])),
                                             t[2][:, :, None] * t[3][t[1]])
    close_to_naive(out, naive, ref)


@needs_torch_cuda
def test_long_rows_split_deterministically(rng):
    degrees = rng.integers(0, 3, size=30000)
    degrees[[0, 1, 7, 29999]] = [513, 5000, 1_000_000, 1200]  # just over the split, and hubs
    args = sample("sparse_aggregate", rng, n_dst=30000, n_src=20000, heads=2, dim=64, degrees=degrees)[0]
    t = to_cuda(args)
    a = qkernels.sparse_aggregate(*t)
    b = qkernels.sparse_aggregate(*t)
    assert torch.equal(a, b)
    assert rel_err(a.cpu().numpy(), reference("sparse_aggregate", *args)) < 4 * float(np.sqrt(1e6)) * 2.0**-24
