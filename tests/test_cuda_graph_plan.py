"""sparse_aggregate_plan and fused_edge_features_plan on the cuda backend, and the backward ops'
plan=: each plan equal to the cpu kernel's and the NumPy reference; gradients with a plan bit-identical
to those without, in float32, float16 and bfloat16, int32/int64 indices, vector and scalar walks
(strided inputs), awkward graphs; malformed plans contained; a CUDA graph that replays the planned
backward.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from conftest import capture_graph, cuda, rel_err, requires_cuda, sab_graph
from qkernels.testing import reference, sample

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

DTYPES = ["float32", "float16", "bfloat16"]
SAB, EFB = "sparse_aggregate_backward", "fused_edge_features_backward"


def same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                               y.view(torch.int16 if y.element_size() == 2 else torch.int32))


# (n_dst, n_src, degrees, lo, tail): small, empty, isolated sources, one hub (duplicates, a source
# across many walk chunks), edges outside the rows, many edges (256-edge chunks)
SAB_GRAPHS = [(7, 5, None, 0, 0), (1, 1, [0], 0, 0), (4, 9, [0, 3, 0, 2], 0, 0), (3, 1, [3000, 5, 5], 0, 0),
              (50, 200, None, 3, 4), (20000, 3000, None, 0, 0), (5, 3000, None, 0, 0)]


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,degrees,lo,tail", SAB_GRAPHS)
def test_sparse_aggregate_plan(rng, ix, n_dst, n_src, degrees, lo, tail):
    row_ptr, col_idx = sab_graph(rng, ix, n_dst, n_src, degrees, lo, tail)
    got = qkernels.sparse_aggregate_plan(cuda(row_ptr), cuda(col_idx), n_src, backend="cuda")
    assert got.is_cuda and got.dtype == torch.int32
    ref = reference("sparse_aggregate_plan", row_ptr, col_idx, n_src)
    assert np.array_equal(got.cpu().numpy(), ref)
    assert np.array_equal(np.asarray(qkernels.sparse_aggregate_plan(row_ptr, col_idx, n_src)), ref)


@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n,e", [(6, 11), (1, 0), (1, 3000), (9, 3), (40, 700), (3000, 50), (100000, 400000)])
def test_fused_edge_features_plan(rng, ix, n, e):
    ei = rng.integers(0, max(n, 1), (2, e)).astype(ix)
    got = qkernels.fused_edge_features_plan(cuda(ei), n, backend="cuda")
    assert np.array_equal(got.cpu().numpy(), reference("fused_edge_features_plan", ei, n))


def test_plans_of_bad_indices_leave_them_out(rng):
    """cuda leaves out what the cpu kernel refuses: bad columns and nodes go last, key N (unchecked:
    QKERNELS_CHECK=1 would refuse them)."""
    if qkernels._C._configure()["check_indices"]:
        pytest.skip("QKERNELS_CHECK=1 refuses the bad indices")
    row_ptr, col_idx = sab_graph(rng, np.int64, 10, 6)
    col_idx[[1, 4]] = [-1, 6]
    got = qkernels.sparse_aggregate_plan(cuda(row_ptr), cuda(col_idx), 6, backend="cuda").cpu().numpy()
    e = len(col_idx)
    assert got[6] == e - 2 and got[7 + e - 2:7 + e].tolist() == [6, 6] and got[7 + 2 * e - 2:7 + 2 * e].tolist() == [1, 4]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n_dst,n_src,degrees,lo,tail", SAB_GRAPHS)
@pytest.mark.parametrize("h,d", [(2, 32), (4, 8), (3, 5)])  # vector walks of 1 and 2 chunks a lane; scalar
def test_sparse_aggregate_backward_plan_same_bits(rng, dtype, ix, n_dst, n_src, degrees, lo, tail, h, d):
    row_ptr, col_idx = sab_graph(rng, ix, n_dst, n_src, degrees, lo, tail)
    e = len(col_idx)
    args = (cuda(rng.standard_normal((n_dst, h, d)), dtype), cuda(row_ptr), cuda(col_idx),
            cuda(rng.standard_normal((e, h)), dtype), cuda(rng.standard_normal((n_src, h, d)), dtype))
    plan = qkernels.sparse_aggregate_plan(args[1], args[2], n_src, backend="cuda")
    both = qkernels.sparse_aggregate_backward(*args, backend="cuda")
    for flags in ({}, {"edge_weight_grad": False}):
        plain = qkernels.sparse_aggregate_backward(*args, **flags, backend="cuda")
        same_bits(qkernels.sparse_aggregate_backward(*args, **flags, plan=plan, backend="cuda"), plain)
    strided = [torch.stack([a, a], -1)[..., 0] if a.is_floating_point() else a for a in args]
    same_bits(qkernels.sparse_aggregate_backward(*strided, plan=plan, backend="cuda"),
              qkernels.sparse_aggregate_backward(*strided, backend="cuda"))
    if dtype == "float32":
        ref = reference(SAB, *[a.double().cpu().numpy() if a.is_floating_point() else a.cpu().numpy() for a in args])
        for g, r in zip(both, ref):
            assert rel_err(g.double().cpu().numpy(), r) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ix", [np.int32, np.int64])
@pytest.mark.parametrize("n,e", [(6, 11), (1, 0), (1, 3000), (9, 3), (40, 700), (3000, 50), (20000, 90000)])
@pytest.mark.parametrize("h", [8, 32, 64, 256, 1024, 7])  # 8-, 16-lane and warp walks, 2 and 4 chunks, scalar
def test_fused_edge_features_backward_plan_same_bits(rng, dtype, ix, n, e, h):
    if h == 8 and dtype != "float32":
        h = 16  # a 16-bit row needs 8 values per vector
    (go, x, ei), _ = sample(EFB, rng, index_dtype=ix, n=n, e=e, h=h)
    if e:
        ei[1, ::5] = ei[0, ::5]  # self loops
    x[::3] = 0.0  # ties
    go, x, ei = cuda(go, dtype), cuda(x, dtype), cuda(ei)
    plan = qkernels.fused_edge_features_plan(ei, n, backend="cuda")
    plain = qkernels.fused_edge_features_backward(go, x, ei, backend="cuda")
    same_bits(qkernels.fused_edge_features_backward(go, x, ei, plan=plan, backend="cuda"), plain)
    go_s = torch.stack([go, go], -1)[..., 0]
    same_bits(qkernels.fused_edge_features_backward(go_s, x, ei, plan=plan, backend="cuda"),
              qkernels.fused_edge_features_backward(go_s, x, ei, backend="cuda"))


@pytest.mark.parametrize("kind", ["random", "small", "reversed", "huge_ptr"])
def test_malformed_plans_stay_in_bounds(rng, kind):
    """Wrong gradients, but no fault: the walks skip entries outside their arrays.  Run under
    compute-sanitizer to see every access checked."""
    def spoil(p):
        p = p.clone()
        if kind == "random":
            p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, dtype=torch.int32))
        elif kind == "small":
            p.copy_(torch.randint(-3, 40, p.shape, dtype=torch.int32))
        elif kind == "reversed":
            p.copy_(p.flip(0))
        else:
            p[0] = 2**31 - 1
        return p

    args, _ = sample(SAB, rng, n_dst=300, n_src=200, heads=2, dim=32)
    dev = [cuda(a) for a in args]
    plan = qkernels.sparse_aggregate_plan(dev[1], dev[2], 200, backend="cuda")
    qkernels.sparse_aggregate_backward(*dev, plan=spoil(plan), backend="cuda")
    (go, x, ei), _ = sample(EFB, rng, n=250, e=600, h=32)
    go, x, ei = cuda(go), cuda(x), cuda(ei)
    plan = qkernels.fused_edge_features_plan(ei, 250, backend="cuda")
    qkernels.fused_edge_features_backward(go, x, ei, plan=spoil(plan), backend="cuda")
    torch.cuda.synchronize()  # a fault would surface here


def test_planned_backward_replays_in_a_cuda_graph(rng):
    """Plans built once, both backward ops captured with them: replays give the eager bits, and
    read grad_out anew."""
    args, _ = sample(SAB, rng, n_dst=500, n_src=400, heads=2, dim=16)
    sa = [cuda(a) for a in args]
    sa_plan = qkernels.sparse_aggregate_plan(sa[1], sa[2], 400, backend="cuda")
    (go, x, ei), _ = sample(EFB, rng, n=300, e=2000, h=32)
    ef = [cuda(go), cuda(x), cuda(ei)]
    ef_plan = qkernels.fused_edge_features_plan(ef[2], 300, backend="cuda")

    def calls():
        return (qkernels.sparse_aggregate_backward(*sa, plan=sa_plan, backend="cuda")
                + qkernels.fused_edge_features_backward(*ef, plan=ef_plan, backend="cuda"))

    graph, outs = capture_graph(calls)
    for _ in range(2):
        sa[0].copy_(torch.randn_like(sa[0]))
        ef[0].copy_(torch.randn_like(ef[0]))
        graph.replay()
        torch.cuda.synchronize()
        eager = (qkernels.sparse_aggregate_backward(*sa, backend="cuda")
                 + qkernels.fused_edge_features_backward(*ef, backend="cuda"))
        same_bits(outs, eager)


def test_plan_ops_replay_from_new_indices(rng):
    """The plan ops captured in a CUDA graph: a replay after the indices changed gives the new plans."""
    row_ptr, col_idx = sab_graph(rng, np.int64, 300, 200)
    rp, ci = cuda(row_ptr), cuda(col_idx)
    ei = cuda(rng.integers(0, 150, (2, 900)))

    def calls():
        return (qkernels.sparse_aggregate_plan(rp, ci, 200, backend="cuda"),
                qkernels.fused_edge_features_plan(ei, 150, backend="cuda"))

    graph, outs = capture_graph(calls)
    first = [o.clone() for o in outs]
    ci.copy_(ci[torch.randperm(len(ci), device="cuda")])
    ei.copy_(ei[:, torch.randperm(ei.shape[1], device="cuda")])
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(outs[0].cpu().numpy(), reference("sparse_aggregate_plan", row_ptr, ci.cpu().numpy(), 200))
    assert np.array_equal(outs[1].cpu().numpy(), reference("fused_edge_features_plan", ei.cpu().numpy(), 150))
    assert not torch.equal(outs[0], first[0]) and not torch.equal(outs[1], first[1])
