"""sparse_aggregate on the cpu backend against the float64 reference (NumPy and torch CPU inputs)."""

import numpy as np
import pytest

import qkernels
from conftest import fp32_sum_tol, random_inputs, rel_err, requires_torch, sparse_aggregate_ref

FP32_TOL = 1e-5


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,heads,dim", [(1, 1, 1, 1), (19, 7, 3, 5), (113, 200, 7, 19), (1023, 50, 2, 64),
                                                   (64, 64, 8, 113)])
def test_random_graphs(rng, index_dtype, n_dst, n_src, heads, dim):
    args = random_inputs(rng, n_dst, n_src, heads, dim, index_dtype)
    out = qkernels.sparse_aggregate(*args)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n_dst, heads, dim)
    assert rel_err(out, sparse_aggregate_ref(*args)) < FP32_TOL


def test_zero_degree_rows_are_zero(rng):
    degrees = rng.integers(0, 3, size=300) * rng.integers(0, 2, size=300)  # about half the rows empty
    args = random_inputs(rng, 300, 40, 4, 8, degrees=degrees)
    out = qkernels.sparse_aggregate(*args)
    empty = np.diff(args[0]) == 0
    assert empty.any() and (out[empty] == 0).all()
    assert rel_err(out, sparse_aggregate_ref(*args)) < FP32_TOL


def test_power_law_one_huge_row(rng):
    degrees = np.ones(5000, dtype=np.int64)
    degrees[1234] = 100_000  # one hub next to thousands of degree-1 rows
    args = random_inputs(rng, 5000, 3000, 2, 16, degrees=degrees)
    out = qkernels.sparse_aggregate(*args)
    assert rel_err(out, sparse_aggregate_ref(*args)) < fp32_sum_tol(degrees.max())


def test_no_edges(rng):
    args = random_inputs(rng, 17, 5, 3, 4, degrees=np.zeros(17))
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
    row_ptr, col_idx, ew, nf = random_inputs(rng, 50, 20, 2, 6)
    sub = row_ptr[10:]
    out = qkernels.sparse_aggregate(sub, col_idx, ew, nf)
    assert rel_err(out, sparse_aggregate_ref(sub, col_idx, ew, nf)) < FP32_TOL
    assert (out[np.diff(sub) == 0] == 0).all()


def test_results_do_not_depend_on_thread_count(rng):
    args = random_inputs(rng, 4000, 500, 4, 32, avg_degree=20)
    old = qkernels._C._configure(num_threads=1)
    try:
        one = qkernels.sparse_aggregate(*args)
        qkernels._C._configure(num_threads=7)
        seven = qkernels.sparse_aggregate(*args)
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])
    assert np.array_equal(one, seven)


def test_non_contiguous_inputs(rng):
    row_ptr, col_idx, ew, nf = random_inputs(rng, 40, 30, 3, 10)
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
    assert rel_err(out, sparse_aggregate_ref(row_ptr, col_idx, ew, nf)) < FP32_TOL


def test_broadcast_weights(rng):
    row_ptr, col_idx, ew, nf = random_inputs(rng, 30, 30, 4, 8)
    ew_b = np.broadcast_to(np.float32(0.5), ew.shape)  # stride 0, read-only: fine as an input
    out = qkernels.sparse_aggregate(row_ptr, col_idx, ew_b, nf)
    assert rel_err(out, sparse_aggregate_ref(row_ptr, col_idx, ew_b, nf)) < FP32_TOL


def test_out_poisoned_is_fully_written(rng):
    args = random_inputs(rng, 77, 31, 3, 9, degrees=rng.integers(0, 4, size=77))
    out = np.full((77, 3, 9), np.nan, np.float32)
    r = qkernels.sparse_aggregate(*args, out=out)
    assert r is out
    assert rel_err(out, sparse_aggregate_ref(*args)) < FP32_TOL


def test_out_strided(rng):
    args = random_inputs(rng, 21, 13, 2, 5)
    big = np.full((21, 2, 10), np.nan, np.float32)
    view = big[:, :, ::2]
    qkernels.sparse_aggregate(*args, out=view)
    assert rel_err(view, sparse_aggregate_ref(*args)) < FP32_TOL
    assert np.isnan(big[:, :, 1::2]).all()  # nothing written between the strided elements


@requires_torch
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_torch_cpu_in_torch_out(rng, index_dtype):
    import torch

    args = random_inputs(rng, 113, 60, 5, 16, index_dtype)
    t_args = [torch.from_numpy(a) for a in args]
    out = qkernels.sparse_aggregate(*t_args)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (113, 5, 16)
    assert rel_err(out.numpy(), sparse_aggregate_ref(*args)) < FP32_TOL
    poisoned = torch.full((113, 5, 16), float("nan"))
    assert qkernels.sparse_aggregate(*t_args, out=poisoned) is poisoned
    assert rel_err(poisoned.numpy(), sparse_aggregate_ref(*args)) < FP32_TOL


@requires_torch
def test_torch_non_contiguous(rng):
    import torch

    row_ptr, col_idx, ew, nf = random_inputs(rng, 33, 20, 4, 12)
    nf_t = torch.from_numpy(nf).transpose(0, 1).contiguous().transpose(0, 1)  # [N,H,D] with H outermost
    ew_t = torch.from_numpy(ew).t().contiguous().t()
    assert not nf_t.is_contiguous() and not ew_t.is_contiguous()
    out = qkernels.sparse_aggregate(torch.from_numpy(row_ptr), torch.from_numpy(col_idx), ew_t, nf_t)
    assert rel_err(out.numpy(), sparse_aggregate_ref(row_ptr, col_idx, ew, nf)) < FP32_TOL


def test_tensor_in_tensor_out(rng):
    args = random_inputs(rng, 19, 11, 2, 3)
    t_args = [qkernels.from_dlpack(a) for a in args]
    out = qkernels.sparse_aggregate(*t_args)
    assert isinstance(out, qkernels.Tensor) and out.shape == (19, 2, 3) and out.dtype == "float32"
    assert out.device == "cpu" and out.strides == (6, 3, 1)
    assert rel_err(np.from_dlpack(out), sparse_aggregate_ref(*args)) < FP32_TOL
