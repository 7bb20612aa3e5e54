"""sparse_aggregate on the cpu backend against the float64 reference (NumPy and torch CPU inputs)."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import fp32_sum_tol, rel_err, requires_torch

FP32_TOL = 1e-5


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,heads,dim", [(1, 1, 1, 1), (19, 7, 3, 5), (113, 200, 7, 19), (1023, 50, 2, 64),
                                                   (64, 64, 8, 113)])
def test_random_graphs(rng, index_dtype, n_dst, n_src, heads, dim):
    args = sample("sparse_aggregate", rng, n_dst=n_dst, n_src=n_src, heads=heads, dim=dim, index_dtype=index_dtype)[0]
    out = qkernels.sparse_aggregate(*args)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n_dst, heads, dim)
    assert rel_err(out, reference("sparse_aggregate", *args)) < FP32_TOL


def test_zero_degree_rows_are_zero(rng):
    degrees = rng.integers(0, 3, size=300) * rng.integers(0, 2, size=300)  # about half the rows empty
    args = sample("sparse_aggregate", rng, n_dst=300, n_src=40, heads=4, dim=8, degrees=degrees)[0]
    out = qkernels.sparse_aggregate(*args)
    empty = np.diff(args[0]) == 0
    assert empty.any() and (out[empty] == 0).all()
    assert rel_err(out, reference("sparse_aggregate", *args)) < FP32_TOL


def test_power_law_one_huge_row(rng):
    degrees = np.ones(5000, dtype=np.int64)
    degrees[1234] = 100_000  # one hub next to thousands of degree-1 rows
    args = sample("sparse_aggregate", rng, n_dst=5000, n_src=3000, heads=2, dim=16, degrees=degrees)[0]
    out = qkernels.sparse_aggregate(*args)
    assert rel_err(out, reference("sparse_aggregate", *args)) < fp32_sum_tol(degrees.max())


def test_no_edges(rng):
    args = sample("sparse_aggregate", rng, n_dst=17, n_src=5, heads=3, dim=4, degrees=np.zeros(17))[0]
    assert len(args[1]) == 0
    out = qkernels.sparse_aggregate(*args)
    assert out.shape == (17, 3, 4) and (out == 0).all()


def test_no_rows_and_no_sources(rng):
    row_ptr = np.zeros(1, np.int64)
    col = np.zeros(0, np.int64)
    out = qkernels.sparse_aggregate(row_ptr, col, np.zeros((0, 2), np.float32), np.zeros((0, 2, 3), np.float32))
    assert out.shape == (0, 2, 3)


def test_row_ptr_not_starting_at_zero(rng):
    # A CSR slice (rows 3.. of a bigger graph) keeps its absolute offsets.
    row_ptr, col_idx, ew, nf = sample("sparse_aggregate", rng, n_dst=50, n_src=20, heads=2, dim=6)[0]
    sub = row_ptr[10:]
    out = qkernels.sparse_aggregate(sub, col_idx, ew, nf)
    assert rel_err(out, reference("sparse_aggregate", sub, col_idx, ew, nf)) < FP32_TOL
    assert (out[np.diff(sub) == 0] == 0).all()


def test_results_do_not_depend_on_thread_count(rng):
    args = sample("sparse_aggregate", rng, n_dst=4000, n_src=500, heads=4, dim=32, avg_degree=20)[0]
    old = qkernels._C._configure(num_threads=1)
    try:
        one = qkernels.sparse_aggregate(*args)
        qkernels._C._configure(num_threads=7)
        seven = qkernels.sparse_aggregate(*args)
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])
    assert np.array_equal(one, seven)


def test_non_contiguous_inputs(rng):
    row_ptr, col_idx, ew, nf = sample("sparse_aggregate", rng, n_dst=40, n_src=30, heads=3, dim=10)[0]
    # every input strided: index arrays with step 2, weights transposed, features with strided last dim
    rp2 = np.zeros(2 * len(row_ptr), row_ptr.dtype)
    rp2[::2] = row_ptr
    ci2 = np.zeros(2 * len(col_idx), col_idx.dtype)
    ci2[::2] = col_idx
    ew_t = np.ascontiguousarray(ew.T).T
    nf_wide = np.zeros((nf.shape[0], nf.shape[1], nf.shape[2] * 3), np.float32)
    nf_wide[:, :, ::3] = nf
    args = (rp2[::2], ci2[::2], ew_t, nf_wide[:, :, ::3])
    assert not args[3].flags.c_contiguous and not args[2].flags.c_contiguous
    out = qkernels.sparse_aggregate(*args)
    assert rel_err(out, reference("sparse_aggregate", row_ptr, col_idx, ew, nf)) < FP32_TOL


def test_broadcast_weights(rng):
    row_ptr, col_idx, ew, nf = sample("sparse_aggregate", rng, n_dst=30, n_src=30, heads=4, dim=8)[0]
    ew_b = np.broadcast_to(np.float32(0.5), ew.shape)  # stride 0, read-only: fine as an input
    out = qkernels.sparse_aggregate(row_ptr, col_idx, ew_b, nf)
    assert rel_err(out, reference("sparse_aggregate", row_ptr, col_idx, ew_b, nf)) < FP32_TOL


def test_out_poisoned_is_fully_written(rng):
    args = sample("sparse_aggregate", rng, n_dst=77, n_src=31, heads=3, dim=9, degrees=rng.integers(0, 4, size=77))[0]
    out = np.full((77, 3, 9), np.nan, np.float32)
    r = qkernels.sparse_aggregate(*args, out=out)
    assert r is out
    assert rel_err(out, reference("sparse_aggregate", *args)) < FP32_TOL


def test_out_strided(rng):
    args = sample("sparse_aggregate", rng, n_dst=21, n_src=13, heads=2, dim=5)[0]
    big = np.full((21, 2, 10), np.nan, np.float32)
    view = big[:, :, ::2]
    qkernels.sparse_aggregate(*args, out=view)
    assert rel_err(view, reference("sparse_aggregate", *args)) < FP32_TOL
    assert np.isnan(big[:, :, 1::2]).all()  # nothing written between the strided elements


@requires_torch
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_torch_cpu_in_torch_out(rng, index_dtype):
    import torch

    args = sample("sparse_aggregate", rng, n_dst=113, n_src=60, heads=5, dim=16, index_dtype=index_dtype)[0]
    t_args = [torch.from_numpy(a) for a in args]
    out = qkernels.sparse_aggregate(*t_args)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (113, 5, 16)
    assert rel_err(out.numpy(), reference("sparse_aggregate", *args)) < FP32_TOL
    poisoned = torch.full((113, 5, 16), float("nan"))
    assert qkernels.sparse_aggregate(*t_args, out=poisoned) is poisoned
    assert rel_err(poisoned.numpy(), reference("sparse_aggregate", *args)) < FP32_TOL


@requires_torch
def test_torch_non_contiguous(rng):
    import torch

    row_ptr, col_idx, ew, nf = sample("sparse_aggregate", rng, n_dst=33, n_src=20, heads=4, dim=12)[0]
    nf_t = torch.from_numpy(nf).transpose(0, 1).contiguous().transpose(0, 1)  # [N,H,D] with H outermost
    ew_t = torch.from_numpy(ew).t().contiguous().t()
    assert not nf_t.is_contiguous() and not ew_t.is_contiguous()
    out = qkernels.sparse_aggregate(torch.from_numpy(row_ptr), torch.from_numpy(col_idx), ew_t, nf_t)
    assert rel_err(out.numpy(), reference("sparse_aggregate", row_ptr, col_idx, ew, nf)) < FP32_TOL


def test_tensor_in_tensor_out(rng):
    args = sample("sparse_aggregate", rng, n_dst=19, n_src=11, heads=2, dim=3)[0]
    t_args = [qkernels.from_dlpack(a) for a in args]
    out = qkernels.sparse_aggregate(*t_args)
    assert isinstance(out, qkernels.Tensor) and out.shape == (19, 2, 3) and out.dtype == "float32"
    assert out.device == "cpu" and out.strides == (6, 3, 1)
    assert rel_err(np.from_dlpack(out), reference("sparse_aggregate", *args)) < FP32_TOL
