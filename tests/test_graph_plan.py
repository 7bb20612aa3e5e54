"""sparse_aggregate_plan and fused_edge_features_plan on the cpu backend, and the backward ops'
plan=: each plan against its NumPy reference (a stable argsort), and gradients with a plan
bit-identical to those without, for int32/int64 indices, awkward graphs (empty, isolated nodes,
duplicate edges, self loops, edges outside the rows), strided inputs and any thread count; malformed
plans raise in the binding or are skipped by the walks."""

import numpy as np
import pytest

import qkernels
from conftest import sab_graph, strided_all
from qkernels.testing import reference, sample

SAB, EFB = "sparse_aggregate_backward", "fused_edge_features_backward"


def same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def with_threads(n, fn):
    old = qkernels._C._configure(num_threads=n)
    try:
        return fn()
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])


SAB_GRAPHS = [  # (n_dst, n_src, degrees, lo, tail)
    (7, 5, None, 0, 0),
    (1, 1, [0], 0, 0),            # no edges
    (4, 9, [0, 3, 0, 2], 0, 0),   # empty rows, isolated sources
    (3, 1, [5, 5, 5], 0, 0),      # every edge to one source: duplicates
    (50, 200, None, 3, 4),        # edges outside the rows
    (300, 40, None, 0, 0),
    (5, 3000, None, 0, 0),        # most sources isolated
]


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,degrees,lo,tail", SAB_GRAPHS)
def test_sparse_aggregate_plan_matches_reference(rng, ix, n_dst, n_src, degrees, lo, tail):
    row_ptr, col_idx = sab_graph(rng, ix, n_dst, n_src, degrees, lo, tail)
    plan = np.asarray(qkernels.sparse_aggregate_plan(row_ptr, col_idx, n_src))
    assert plan.dtype == np.int32 and plan.shape == (n_src + 1 + 3 * len(col_idx),)
    assert np.array_equal(plan, reference("sparse_aggregate_plan", row_ptr, col_idx, n_src))
    strided = qkernels.sparse_aggregate_plan(strided_all(row_ptr), strided_all(col_idx), n_src)
    assert np.array_equal(np.asarray(strided), plan)
    assert np.array_equal(np.asarray(with_threads(7, lambda: qkernels.sparse_aggregate_plan(row_ptr, col_idx, n_src))),
                          plan)


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n,e,self_loops", [(6, 11, False), (1, 0, False), (1, 5, True), (9, 3, False),
                                            (40, 700, True), (3000, 50, False), (0, 0, False)])
def test_fused_edge_features_plan_matches_reference(rng, ix, n, e, self_loops):
    ei = rng.integers(0, max(n, 1), (2, e)).astype(ix)
    if self_loops and e:
        ei[1, ::3] = ei[0, ::3]
    plan = np.asarray(qkernels.fused_edge_features_plan(ei, n))
    assert plan.dtype == np.int32 and plan.shape == (n + 1 + 4 * e,)
    assert np.array_equal(plan, reference("fused_edge_features_plan", ei, n))
    assert np.array_equal(np.asarray(qkernels.fused_edge_features_plan(strided_all(ei), n)), plan)
    assert np.array_equal(np.asarray(with_threads(7, lambda: qkernels.fused_edge_features_plan(ei, n))), plan)


def test_plan_reference_layout():
    """The layout spelled out on a small graph, so the reference itself is checked."""
    row_ptr, col_idx = np.array([0, 2, 2, 5]), np.array([1, 0, 1, 1, 2])
    assert reference("sparse_aggregate_plan", row_ptr, col_idx, 4).tolist() == \
        [0, 1, 4, 5, 5] + [0, 1, 1, 1, 2] + [1, 0, 2, 3, 4] + [0, 0, 2, 2, 2]
    ei = np.array([[0, 1, 2], [1, 1, 0]])
    assert reference("fused_edge_features_plan", ei, 3).tolist() == [0, 2, 5, 6] + [0, 0, 1, 1, 1, 2] + [0, 5, 1, 2, 3, 4]


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,degrees,lo,tail", SAB_GRAPHS)
@pytest.mark.parametrize("flags", [{}, {"edge_weight_grad": False}, {"deterministic": False}])
def test_sparse_aggregate_backward_plan_same_bits(rng, ix, n_dst, n_src, degrees, lo, tail, flags):
    row_ptr, col_idx = sab_graph(rng, ix, n_dst, n_src, degrees, lo, tail)
    e, h, d = len(col_idx), 3, 5
    go = rng.standard_normal((n_dst, h, d)).astype(np.float32)
    ew = rng.standard_normal((e, h)).astype(np.float32)
    nf = rng.standard_normal((n_src, h, d)).astype(np.float32)
    plan = qkernels.sparse_aggregate_plan(row_ptr, col_idx, n_src)
    args = (go, row_ptr, col_idx, ew, nf)
    plain = qkernels.sparse_aggregate_backward(*args, **flags)
    same_bits(qkernels.sparse_aggregate_backward(*args, **flags, plan=plan), plain)
    same_bits(with_threads(7, lambda: qkernels.sparse_aggregate_backward(*args, **flags, plan=plan)), plain)
    strided = tuple(strided_all(a) for a in args)
    same_bits(qkernels.sparse_aggregate_backward(*strided, **flags, plan=plan), plain)
    ref = reference(SAB, *args, **flags, plan=plan)
    for got, r in zip(plain, ref):
        if r is not None:
            np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n,e,h,self_loops,edge_attr", [(6, 11, 4, False, True), (1, 0, 3, False, True),
                                                        (1, 5, 2, True, False), (9, 3, 8, False, True),
                                                        (40, 700, 33, True, True), (3000, 50, 5, False, False)])
def test_fused_edge_features_backward_plan_same_bits(rng, ix, n, e, h, self_loops, edge_attr):
    (go, x, ei), _ = sample(EFB, rng, index_dtype=ix, n=n, e=e, h=h, edge_attr=edge_attr)
    if self_loops and e:
        ei[1, ::3] = ei[0, ::3]
    x[::4] = 0.0  # ties between the ends
    plan = qkernels.fused_edge_features_plan(ei, n)
    plain = qkernels.fused_edge_features_backward(go, x, ei)
    same_bits(qkernels.fused_edge_features_backward(go, x, ei, plan=plan), plain)
    same_bits(with_threads(7, lambda: qkernels.fused_edge_features_backward(go, x, ei, plan=plan)), plain)
    same_bits(qkernels.fused_edge_features_backward(strided_all(go), strided_all(x), strided_all(ei), plan=plan),
              plain)
    gx, _ = reference(EFB, go, x, ei)
    np.testing.assert_allclose(plain[0], gx, rtol=1e-5, atol=1e-5)


def test_forward_ops_take_and_ignore_plan(rng):
    (rp, ci, ew, nf), _ = sample("sparse_aggregate", rng)
    plan = qkernels.sparse_aggregate_plan(rp, ci, nf.shape[0])
    same_bits([qkernels.sparse_aggregate(rp, ci, ew, nf, plan=plan)], [qkernels.sparse_aggregate(rp, ci, ew, nf)])
    (x, ei, ea), _ = sample("fused_edge_features", rng)
    plan = qkernels.fused_edge_features_plan(ei, x.shape[0])
    same_bits([qkernels.fused_edge_features(x, ei, ea, plan=plan)], [qkernels.fused_edge_features(x, ei, ea)])


# ---- bad plans and bad input ------------------------------------------------------------------

def test_plan_ops_refuse_bad_input(rng):
    row_ptr, col_idx = sab_graph(rng, np.int64, 6, 4)
    with pytest.raises(ValueError, match=r"sparse_aggregate_plan: col_idx\[\d+\] = 9 is out of range"):
        bad = col_idx.copy()
        bad[-1] = 9
        qkernels.sparse_aggregate_plan(row_ptr, bad, 4)
    with pytest.raises(ValueError, match="sparse_aggregate_plan: row_ptr must be non-decreasing"):
        qkernels.sparse_aggregate_plan(row_ptr[::-1].copy(), col_idx, 4)
    with pytest.raises(TypeError, match="sparse_aggregate_plan: col_idx must have the same dtype"):
        qkernels.sparse_aggregate_plan(row_ptr, col_idx.astype(np.int32), 4)
    with pytest.raises(ValueError, match="sparse_aggregate_plan: num_src must be between 0 and"):
        qkernels.sparse_aggregate_plan(row_ptr, col_idx, -1)
    with pytest.raises(ValueError, match="sparse_aggregate_plan: num_src must be between 0 and"):
        qkernels.sparse_aggregate_plan(row_ptr, col_idx, 2**31)
    with pytest.raises(TypeError, match="sparse_aggregate_plan: num_src must be an int"):
        qkernels.sparse_aggregate_plan(row_ptr, col_idx, 4.0)
    ei = rng.integers(0, 5, (2, 8))
    with pytest.raises(ValueError, match=r"fused_edge_features_plan: edge_index\[1, 3\] = 5 is out of range"):
        bad = ei.copy()
        bad[1, 3] = 5
        qkernels.fused_edge_features_plan(bad, 5)
    with pytest.raises(ValueError, match="fused_edge_features_plan: num_nodes must be between 0 and"):
        qkernels.fused_edge_features_plan(ei, 2**31)
    with pytest.raises(TypeError, match="fused_edge_features_plan: edge_index"):
        qkernels.fused_edge_features_plan(ei.astype(np.float32), 5)


def test_plan_ops_refuse_sizes_past_int32():
    """An int32 plan cannot hold 2^31 edges: refused before anything is allocated (a broadcast view
    stands in for the huge index array)."""
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), (2**31,), (0,))
    with pytest.raises(ValueError, match="sparse_aggregate_plan: .*E = 2147483648 must be below 2\\^31"):
        qkernels.sparse_aggregate_plan(np.array([0, 0]), huge, 1)
    half = np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), (2, 2**30), (0, 0))
    with pytest.raises(ValueError, match="fused_edge_features_plan: .*2E = 2147483648 must be below 2\\^31"):
        qkernels.fused_edge_features_plan(half, 1)


def test_backward_validates_plan(rng):
    args, _ = sample(SAB, rng)
    good = np.asarray(qkernels.sparse_aggregate_plan(args[1], args[2], args[4].shape[0]))
    with pytest.raises(TypeError, match="sparse_aggregate_backward: plan must be int32"):
        qkernels.sparse_aggregate_backward(*args, plan=good.astype(np.int64))
    with pytest.raises(ValueError, match=r"sparse_aggregate_backward: plan must have shape \[N_src \+ 1 \+ 3E\]"):
        qkernels.sparse_aggregate_backward(*args, plan=good[:-1])
    with pytest.raises(ValueError, match="sparse_aggregate_backward: plan must have shape"):
        qkernels.sparse_aggregate_backward(*args, plan=good.reshape(1, -1))
    with pytest.raises(ValueError, match="sparse_aggregate_backward: plan must be contiguous"):
        qkernels.sparse_aggregate_backward(*args, plan=strided_all(good))
    (go, x, ei), _ = sample(EFB, rng)
    good = np.asarray(qkernels.fused_edge_features_plan(ei, x.shape[0]))
    with pytest.raises(TypeError, match="fused_edge_features_backward: plan must be int32"):
        qkernels.fused_edge_features_backward(go, x, ei, plan=good.astype(np.float32))
    with pytest.raises(ValueError, match=r"fused_edge_features_backward: plan must have shape \[N \+ 1 \+ 4E\]"):
        qkernels.fused_edge_features_backward(go, x, ei, plan=np.zeros(3, np.int32))


def malformed(rng, plan, kind):
    p = plan.copy()
    if kind == "random":
        p[:] = rng.integers(-2**31, 2**31 - 1, len(p))
    elif kind == "small":
        p[:] = rng.integers(-3, 40, len(p))
    elif kind == "reversed":
        p[:] = p[::-1]
    elif kind == "huge_ptr":
        p[0] = 2**31 - 1
    return p


@pytest.mark.parametrize("kind", ["random", "small", "reversed", "huge_ptr"])
def test_malformed_plans_stay_in_bounds(rng, kind):
    """A plan that is not the graph's gives wrong gradients, but the walks never leave their arrays:
    the call returns (finite shapes, no crash), with any thread count."""
    args, _ = sample(SAB, rng, n_dst=30, n_src=20)
    plan = np.asarray(qkernels.sparse_aggregate_plan(args[1], args[2], 20))
    for threads in (1, 7):
        gew, gnf = with_threads(threads, lambda: qkernels.sparse_aggregate_backward(*args, plan=malformed(rng, plan, kind)))
        assert gew.shape == args[3].shape and gnf.shape == args[4].shape
    (go, x, ei), _ = sample(EFB, rng, n=25, e=60)
    plan = np.asarray(qkernels.fused_edge_features_plan(ei, 25))
    for threads in (1, 7):
        gx, _ = with_threads(threads, lambda: qkernels.fused_edge_features_backward(go, x, ei, plan=malformed(rng, plan, kind)))
        assert gx.shape == x.shape


def test_plan_of_a_changed_graph_stays_in_bounds(rng):
    """edge_index edited after its plan was built: the other ends are read from edge_index, and one
    out of range reads as a zero row instead of being followed."""
    (go, x, ei), _ = sample(EFB, rng, n=10, e=30)
    plan = qkernels.fused_edge_features_plan(ei, 10)
    bad = ei.copy()
    bad[1, 5] = 10**9
    bad[0, 7] = -4
    gx, _ = qkernels.fused_edge_features_backward(go, x, bad, plan=plan)
    assert gx.shape == x.shape and np.isfinite(gx).all()
