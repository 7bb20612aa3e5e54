"""sparse_aggregate_backward and fused_edge_features_backward on the cpu backend: against the float64
references of qkernels.testing and against torch.autograd of a float64 torch formulation of each forward
op, on random graphs of awkward sizes, int32 and int64 indices, strided views, skewed degrees, ties in
|x[src] - x[dst]|, and bad input."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import fp32_sum_tol, rel_err, requires_torch

FP32_TOL = 1e-5


def check(got, ref, tol=FP32_TOL):
    """A backward op's tuple against the reference's: None in the same places, each gradient close."""
    assert isinstance(got, tuple) and len(got) == len(ref)
    for g, r in zip(got, ref):
        assert (g is None) == (r is None)
        if r is not None:
            g = np.asarray(g)
            assert g.dtype == np.float32 and g.shape == r.shape
            assert rel_err(g, r) < tol


def thread_counts(fn):
    """fn() with 1 and with 7 CPU threads."""
    old = qkernels._C._configure(num_threads=1)
    try:
        one = fn()
        qkernels._C._configure(num_threads=7)
        seven = fn()
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])
    return one, seven


# ---- sparse_aggregate_backward ----------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,heads,dim", [(1, 1, 1, 1), (19, 7, 3, 5), (113, 200, 7, 19), (1023, 50, 2, 64),
                                                   (64, 64, 8, 113), (300, 3000, 1, 9)])
def test_sa_random_graphs(rng, index_dtype, n_dst, n_src, heads, dim):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=n_dst, n_src=n_src, heads=heads, dim=dim,
                     index_dtype=index_dtype)
    check(qkernels.sparse_aggregate_backward(*args), reference("sparse_aggregate_backward", *args))


@pytest.mark.parametrize("ew_grad,nf_grad", [(True, False), (False, True), (False, False)])
def test_sa_flags(rng, ew_grad, nf_grad):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=40, n_src=30, heads=3, dim=8)
    both = qkernels.sparse_aggregate_backward(*args)
    got = qkernels.sparse_aggregate_backward(*args, edge_weight_grad=ew_grad, node_feat_grad=nf_grad)
    assert (got[0] is None) != ew_grad and (got[1] is None) != nf_grad
    for g, b in zip(got, both):  # each gradient the same bits whichever others are computed with it
        if g is not None:
            np.testing.assert_array_equal(g, b)


def test_sa_deterministic_keyword_and_repeats(rng):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=500, n_src=40, heads=4, dim=16, avg_degree=12)
    first = qkernels.sparse_aggregate_backward(*args)
    for kw in ({}, {"deterministic": True}, {"deterministic": False}):  # cpu ignores it: always in order
        again = qkernels.sparse_aggregate_backward(*args, **kw)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


def test_sa_skewed_degrees(rng):
    """A row and a source each with 50k edges next to thousands of degree-0/1 ones."""
    degrees = rng.integers(0, 2, size=4000)
    degrees[17] = 50_000
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=4000, n_src=3000, heads=2, dim=16, degrees=degrees)
    col = args[2]
    col[rng.random(len(col)) < 0.6] = 2999  # one hub source
    col[col == 0] = 1  # and source 0 without edges
    ref = reference("sparse_aggregate_backward", *args)
    check(qkernels.sparse_aggregate_backward(*args), ref, fp32_sum_tol(np.bincount(col).max()))
    assert (np.diff(args[1]) == 0).any() and (np.bincount(col, minlength=3000) == 0).any()


def test_sa_empty_rows_and_sources_give_zeros(rng):
    degrees = rng.integers(0, 3, size=200) * rng.integers(0, 2, size=200)
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=200, n_src=500, heads=3, dim=4, degrees=degrees)
    gew, gnf = qkernels.sparse_aggregate_backward(*args)
    unused = np.bincount(args[2], minlength=500) == 0
    assert unused.any() and (gnf[unused] == 0).all()
    check((gew, gnf), reference("sparse_aggregate_backward", *args))


def test_sa_csr_slice_zeroes_edges_outside_the_rows(rng):
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=60, n_src=20, heads=2, dim=6)[0]
    sub = row_ptr[10:50]  # rows 10..48 of a bigger graph: edges before and after are not this call's
    args = (go[10:49], sub, col, ew, nf)
    gew, gnf = qkernels.sparse_aggregate_backward(*args)
    assert sub[0] > 0 and sub[-1] < len(col)
    assert (gew[:sub[0]] == 0).all() and (gew[sub[-1]:] == 0).all()
    check((gew, gnf), reference("sparse_aggregate_backward", *args))


@pytest.mark.parametrize("shape", [(0, 5, 2, 3), (6, 0, 2, 3), (6, 5, 0, 3), (6, 5, 2, 0)])
def test_sa_empty_dimensions(rng, shape):
    n_dst, n_src, heads, dim = shape
    degrees = np.zeros(n_dst, np.int64) if n_src == 0 else None
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=n_dst, n_src=n_src, heads=heads, dim=dim, degrees=degrees)
    gew, gnf = qkernels.sparse_aggregate_backward(*args)
    assert gew.shape == (len(args[2]), heads) and gnf.shape == (n_src, heads, dim)
    assert (gew == 0).all() and (gnf == 0).all()


def test_sa_no_edges(rng):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=9, n_src=5, heads=2, dim=3, degrees=np.zeros(9))
    gew, gnf = qkernels.sparse_aggregate_backward(*args)
    assert gew.shape == (0, 2) and gnf.shape == (5, 2, 3) and (gnf == 0).all()


def test_sa_results_do_not_depend_on_thread_count(rng):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=3000, n_src=800, heads=4, dim=32, avg_degree=20)
    one, seven = thread_counts(lambda: qkernels.sparse_aggregate_backward(*args))
    for a, b in zip(one, seven):
        np.testing.assert_array_equal(a, b)
    check(one, reference("sparse_aggregate_backward", *args))


def strided(a, step=2):
    """a as every step-th element of a larger array, in its first dimension."""
    big = np.zeros((a.shape[0] * step,) + a.shape[1:], a.dtype)
    big[::step] = a
    return big[::step]


def test_sa_non_contiguous_inputs(rng):
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=40, n_src=30, heads=3, dim=10)[0]
    go_wide = np.zeros(go.shape[:2] + (3 * go.shape[2],), np.float32)
    go_wide[:, :, ::3] = go
    views = (go_wide[:, :, ::3], strided(row_ptr), strided(col), np.ascontiguousarray(ew.T).T,
             np.ascontiguousarray(nf.transpose(1, 0, 2)).transpose(1, 0, 2))
    assert not any(v.flags.c_contiguous for v in views)
    check(qkernels.sparse_aggregate_backward(*views), reference("sparse_aggregate_backward", go, row_ptr, col, ew, nf))
    ew_b = np.broadcast_to(np.float32(0.5), ew.shape)  # a stride-0 weight
    check(qkernels.sparse_aggregate_backward(go, row_ptr, col, ew_b, nf),
          reference("sparse_aggregate_backward", go, row_ptr, col, ew_b, nf))


def test_sa_bad_input():
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", np.random.default_rng(4), n_dst=6, n_src=5)[0]
    fn = qkernels.sparse_aggregate_backward
    bad = col.copy()
    bad[len(bad) // 2] = 5
    with pytest.raises(ValueError, match=rf"^sparse_aggregate_backward: col_idx\[{len(bad) // 2}\] = 5 is out of "
                                         r"range for node_feat with N_src = 5"):
        fn(go, row_ptr, bad, ew, nf)
    with pytest.raises(ValueError, match=r"^sparse_aggregate_backward: col_idx\[\d+\] = -1 is out of range"):
        fn(go, row_ptr, np.full_like(col, -1), ew, nf, node_feat_grad=False)  # also without the grouping
    rp = row_ptr.copy()
    rp[3] = rp[2] - 1
    with pytest.raises(ValueError, match=r"^sparse_aggregate_backward: row_ptr must be non-decreasing"):
        fn(go, rp, col, ew, nf)
    with pytest.raises(ValueError, match=r"^sparse_aggregate_backward: grad_out must have shape \[N_dst, H, D\] = "
                                         r"\[6, 2, 3\]"):
        fn(go[:5], row_ptr, col, ew, nf)
    with pytest.raises(TypeError, match=r"^sparse_aggregate_backward: grad_out must have node_feat's dtype"):
        fn(go.astype(np.float64), row_ptr, col, ew, nf)
    with pytest.raises(TypeError, match=r"^sparse_aggregate_backward: deterministic must be a bool"):
        fn(go, row_ptr, col, ew, nf, deterministic=np.ones(3))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'out'"):
        fn(go, row_ptr, col, ew, nf, out=nf)


@requires_torch
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_sa_matches_torch_autograd(rng, index_dtype):
    import torch

    degrees = rng.integers(0, 9, size=70)
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=70, n_src=45, heads=3, dim=7,
                                      degrees=degrees, index_dtype=index_dtype)[0]
    lo, hi = int(row_ptr[5]), int(row_ptr[60])
    sub = row_ptr[5:61]  # a slice, so some edges lie outside the rows
    t_ew = torch.from_numpy(ew).double().requires_grad_()
    t_nf = torch.from_numpy(nf).double().requires_grad_()
    rows = torch.repeat_interleave(torch.arange(55), torch.from_numpy(np.diff(sub).astype(np.int64)))
    msg = t_ew[lo:hi, :, None] * t_nf[torch.from_numpy(col[lo:hi].astype(np.int64))]
    out = torch.zeros(55, 3, 7, dtype=torch.float64).index_add(0, rows, msg)
    out.backward(torch.from_numpy(go[5:60]).double())
    t_go, t_rp, t_col, t_ewf, t_nff = (torch.from_numpy(a) for a in (go[5:60], sub, col, ew, nf))
    gew, gnf = qkernels.sparse_aggregate_backward(t_go, t_rp, t_col, t_ewf, t_nff)
    assert isinstance(gew, torch.Tensor) and isinstance(gnf, torch.Tensor) and gew.dtype == torch.float32
    assert rel_err(gew.numpy(), t_ew.grad.numpy()) < FP32_TOL
    assert rel_err(gnf.numpy(), t_nf.grad.numpy()) < FP32_TOL


def test_sa_tensor_in_tensor_out(rng):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=19, n_src=11, heads=2, dim=3)
    got = qkernels.sparse_aggregate_backward(*[qkernels.from_dlpack(a) for a in args], edge_weight_grad=False)
    assert got[0] is None and isinstance(got[1], qkernels.Tensor) and got[1].shape == (11, 2, 3)
    check((None, np.from_dlpack(got[1])), reference("sparse_aggregate_backward", *args, edge_weight_grad=False))


# ---- fused_edge_features_backward ---------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n,e,h", [(1, 1, 1), (6, 11, 4), (7, 19, 7), (1000, 4096, 32), (300, 1023, 64), (50, 113, 19)])
@pytest.mark.parametrize("attr", [True, False])
def test_ef_random_graphs(rng, index_dtype, n, e, h, attr):
    args, _ = sample("fused_edge_features_backward", rng, n=n, e=e, h=h, edge_attr=attr, index_dtype=index_dtype)
    got = qkernels.fused_edge_features_backward(*args)
    check(got, reference("fused_edge_features_backward", *args))
    if attr:  # a new tensor holding grad_out's last H columns
        np.testing.assert_array_equal(got[1], args[0][:, 2 * h:])
        assert not np.shares_memory(got[1], args[0])


def test_ef_ties_take_the_zero_subgradient(rng):
    """x[src] == x[dst] in many elements (small integers, self-loops): those get sign 0."""
    n, e, h = 20, 400, 9
    go = rng.standard_normal((e, 3 * h)).astype(np.float32)
    x = rng.integers(-1, 2, (n, h)).astype(np.float32)
    ei = rng.integers(0, n, (2, e))
    ei[1, :40] = ei[0, :40]
    assert (x[ei[0]] == x[ei[1]]).mean() > 0.3
    gx, _ = qkernels.fused_edge_features_backward(go, x, ei)
    check((gx, go[:, 2 * h:]), reference("fused_edge_features_backward", go, x, ei))
    # a self-loop alone: g_sum from both sides, nothing from the |.| term
    one = qkernels.fused_edge_features_backward(go[:1, :2 * h], x[:1], np.zeros((2, 1), np.int64))[0]
    np.testing.assert_array_equal(one[0], go[0, :h] + go[0, :h])


def test_ef_hub_and_isolated_nodes(rng):
    n, e, h = 5000, 60_000, 8
    ei = rng.integers(0, n // 2, (2, e))  # nodes n/2 .. n-1 have no edges
    ei[rng.random((2, e)) < 0.4] = 7  # a hub at both ends
    go = rng.standard_normal((e, 2 * h)).astype(np.float32)
    x = rng.standard_normal((n, h)).astype(np.float32)
    gx, gea = qkernels.fused_edge_features_backward(go, x, ei)
    assert gea is None and (gx[n // 2:] == 0).all()
    ref = reference("fused_edge_features_backward", go, x, ei)
    check((gx, None), ref, fp32_sum_tol(2 * e))


def test_ef_results_do_not_depend_on_thread_count(rng):
    args, _ = sample("fused_edge_features_backward", rng, n=3000, e=50_000, h=32)
    one, seven = thread_counts(lambda: qkernels.fused_edge_features_backward(*args))
    for a, b in zip(one, seven):
        np.testing.assert_array_equal(a, b)


def test_ef_non_contiguous_inputs(rng):
    go, x, ei = sample("fused_edge_features_backward", rng, n=30, e=77, h=5)[0]
    wide = np.zeros((77, 40), np.float32)
    wide[:, 3:18] = go  # grad_out as a column block
    views = (wide[:, 3:18], np.asfortranarray(x), np.ascontiguousarray(ei.T).T)
    assert not views[0].flags.c_contiguous and not views[1].flags.c_contiguous
    check(qkernels.fused_edge_features_backward(*views), reference("fused_edge_features_backward", go, x, ei))
    rev = (np.ascontiguousarray(go[::-1])[::-1], strided(x, 3), strided(ei.T).T)
    check(qkernels.fused_edge_features_backward(*rev), reference("fused_edge_features_backward", go, x, ei))


def test_ef_no_edges_and_empty_h(rng):
    x = rng.standard_normal((4, 3)).astype(np.float32)
    gx, gea = qkernels.fused_edge_features_backward(np.zeros((0, 9), np.float32), x, np.zeros((2, 0), np.int64))
    assert gx.shape == (4, 3) and (gx == 0).all() and gea.shape == (0, 3)
    gx, gea = qkernels.fused_edge_features_backward(np.zeros((5, 0), np.float32), np.zeros((4, 0), np.float32),
                                                    np.zeros((2, 5), np.int64))
    assert gx.shape == (4, 0) and gea is None


def test_ef_bad_input():
    go, x, ei = sample("fused_edge_features_backward", np.random.default_rng(5), n=6, e=11, h=4)[0]
    fn = qkernels.fused_edge_features_backward
    bad = ei.copy()
    bad[1, 7] = 6
    with pytest.raises(ValueError, match=r"^fused_edge_features_backward: edge_index\[1, 7\] = 6 is out of range "
                                         r"for x with N = 6"):
        fn(go, x, bad)
    bad = ei.copy()
    bad[0, 2] = -3
    with pytest.raises(ValueError, match=r"^fused_edge_features_backward: edge_index\[0, 2\] = -3 is out of range"):
        fn(go, x, bad)
    with pytest.raises(ValueError, match=r"^fused_edge_features_backward: grad_out must have shape \[E, 3H\] = "
                                         r"\[11, 12\] or \[E, 2H\] = \[11, 8\], got \[11, 10\]"):
        fn(go[:, :10], x, ei)
    with pytest.raises(ValueError, match=r"^fused_edge_features_backward: grad_out must have shape"):
        fn(go[:10], x, ei)
    with pytest.raises(TypeError, match=r"^fused_edge_features_backward: grad_out must have x's dtype"):
        fn(go.astype(np.float16), x, ei)
    with pytest.raises(TypeError, match=r"^fused_edge_features_backward: edge_index must be int32 or int64"):
        fn(go, x, ei.astype(np.float32))


def ef_torch(x, ei, edge_attr=None):
    """fused_edge_features in torch: the formulation torch.autograd differentiates."""
    import torch

    s, d = x[ei[0]], x[ei[1]]
    return torch.cat([s + d, (s - d).abs()] + ([] if edge_attr is None else [edge_attr]), 1)


@requires_torch
@pytest.mark.parametrize("attr", [True, False])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_ef_matches_torch_autograd(rng, attr, index_dtype):
    import torch

    go, x, ei = sample("fused_edge_features_backward", rng, n=40, e=300, h=6, edge_attr=attr,
                       index_dtype=index_dtype)[0]
    x[::3] = np.round(x[::3])  # some ties
    x[5] = x[6]
    t_x = torch.from_numpy(x).double().requires_grad_()
    t_ea = torch.zeros(300, 6, dtype=torch.float64, requires_grad=True) if attr else None
    ef_torch(t_x, torch.from_numpy(ei.astype(np.int64)), t_ea).backward(torch.from_numpy(go).double())
    gx, gea = qkernels.fused_edge_features_backward(*(torch.from_numpy(a) for a in (go, x, ei)))
    assert isinstance(gx, torch.Tensor) and gx.dtype == torch.float32
    assert rel_err(gx.numpy(), t_x.grad.numpy()) < FP32_TOL
    if attr:
        np.testing.assert_array_equal(gea.numpy(), t_ea.grad.numpy())
    else:
        assert gea is None


@requires_torch
def test_ef_nan_difference_takes_torch_sign():
    import torch

    x = np.array([[1.0, np.nan], [2.0, 3.0]], np.float32)
    ei = np.array([[0], [1]])
    go = np.ones((1, 4), np.float32)
    t_x = torch.from_numpy(x).double().requires_grad_()
    ef_torch(t_x, torch.from_numpy(ei)).backward(torch.from_numpy(go).double())
    gx, _ = qkernels.fused_edge_features_backward(go, x, ei)
    np.testing.assert_array_equal(gx, t_x.grad.numpy().astype(np.float32))  # sign(NaN) = 0: column 1 gets g_sum only
