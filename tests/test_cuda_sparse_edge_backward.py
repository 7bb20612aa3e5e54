"""sparse_aggregate_backward and fused_edge_features_backward on the cuda backend: float64 references in
float32, float16 and bfloat16 for every kernel shape (vector walks of each width, scalar fallbacks),
sources and nodes whose edges cross the walks' chunk boundaries, bitwise repeatability, the opt-in
atomic path, bad indices contained, QKERNELS_CHECK=1 and CUDA-graph replay.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import capture_graph, cuda, f64, fp32_sum_tol, rel_err, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

DTYPES = ["float32", "float16", "bfloat16"]
# one rounding of an fp32 result to the output dtype, norm-wise (the reference takes the rounded inputs)
ROUNDING = {"float32": 0.0, "float16": 2e-3, "bfloat16": 1.6e-2}


def tol(dtype, terms):
    return fp32_sum_tol(max(terms, 1)) + ROUNDING[dtype]


def check(got, ref, dtype, terms, like):
    """The op's tuple against the float64 reference: None in the same places, dtype, shape, device, error."""
    assert isinstance(got, tuple) and len(got) == len(ref)
    for g, r in zip(got, ref):
        assert (g is None) == (r is None)
        if r is not None:
            assert g.is_cuda and g.dtype == like.dtype and tuple(g.shape) == r.shape
            assert torch.isfinite(g).all(), "non-finite gradient (an element not written?)"
            assert rel_err(f64(g), r) < tol(dtype, terms)


def bitwise(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def sa_device(args, dtype):
    """sparse_aggregate_backward's sample on the GPU, float tensors cast to dtype."""
    go, row_ptr, col, ew, nf = args
    return (cuda(go, dtype), cuda(row_ptr), cuda(col), cuda(ew, dtype), cuda(nf, dtype))


def sa_ref(dev, **kw):
    go, row_ptr, col, ew, nf = dev
    return reference("sparse_aggregate_backward", f64(go), row_ptr.cpu().numpy(), col.cpu().numpy(), f64(ew),
                     f64(nf), **kw)


# ---- sparse_aggregate_backward ----------------------------------------------------------------

# (heads, dim): vector walks with 1..8 chunks per lane, heads of 1..32 lanes and of whole slices of 32,
# and the scalar kernels (odd D, D / V not a power of two, more than 256 chunks)
SA_SHAPES = [(1, 1), (2, 16), (4, 32), (8, 32), (3, 64), (8, 128), (2, 256), (1, 512), (3, 5), (2, 12), (16, 128),
             (5, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("heads,dim", SA_SHAPES)
def test_sa_matches_reference(rng, dtype, index_dtype, heads, dim):
    args, _ = sample("sparse_aggregate_backward", rng, n_dst=300, n_src=97, heads=heads, dim=dim, avg_degree=6,
                     index_dtype=index_dtype)
    dev = sa_device(args, dtype)
    in_deg = np.bincount(args[2], minlength=97).max(initial=0)
    check(qkernels.sparse_aggregate_backward(*dev), sa_ref(dev), dtype, max(in_deg, dim), dev[0])
    only_ew = qkernels.sparse_aggregate_backward(*dev, node_feat_grad=False)
    check(only_ew, sa_ref(dev, node_feat_grad=False), dtype, dim, dev[0])


def boundary_graph(rng, n_src=40, hub=100_000):
    """In-degrees that put sources' edges exactly at, just past and far across the walks' 256-edge chunks:
    col_idx holding source j counts[j] times, in random order; rows of degree 0..7."""
    counts = np.array([1, 255, 256, 257, 1, 512, 513, hub, 3, 0, 767, 768, 769, 2] + [5] * (n_src - 14))
    col = rng.permutation(np.repeat(np.arange(n_src), counts))
    degrees = rng.integers(0, 8, size=len(col))
    degrees = degrees[:np.searchsorted(np.cumsum(degrees), len(col))]
    degrees = np.append(degrees, len(col) - degrees.sum())
    row_ptr = np.concatenate([[0], np.cumsum(degrees)])
    return row_ptr, col, counts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [True, False])
def test_sa_sources_across_chunks(rng, dtype, deterministic):
    row_ptr, col, counts = boundary_graph(rng)
    n_dst, heads, dim = len(row_ptr) - 1, 2, 32
    args = (rng.standard_normal((n_dst, heads, dim)).astype(np.float32), row_ptr, col,
            rng.standard_normal((len(col), heads)).astype(np.float32),
            rng.standard_normal((len(counts), heads, dim)).astype(np.float32))
    dev = sa_device(args, dtype)
    got = qkernels.sparse_aggregate_backward(*dev, deterministic=deterministic)
    check(got, sa_ref(dev), dtype, counts.max(), dev[0])
    assert (got[1][9] == 0).all()  # the source without edges


@pytest.mark.parametrize("dtype", DTYPES)
def test_sa_bitwise_repeatable(rng, dtype):
    row_ptr, col, counts = boundary_graph(rng, hub=20_000)
    args = (rng.standard_normal((len(row_ptr) - 1, 4, 16)).astype(np.float32), row_ptr, col,
            rng.standard_normal((len(col), 4)).astype(np.float32),
            rng.standard_normal((len(counts), 4, 16)).astype(np.float32))
    dev = sa_device(args, dtype)
    first = qkernels.sparse_aggregate_backward(*dev)
    for _ in range(3):
        bitwise(first, qkernels.sparse_aggregate_backward(*dev))
    # each gradient the same bits whichever others are asked for, and bf16/fp16 ignore deterministic=False
    bitwise((first[0], None), qkernels.sparse_aggregate_backward(*dev, node_feat_grad=False))
    bitwise((None, first[1]), qkernels.sparse_aggregate_backward(*dev, edge_weight_grad=False))
    relaxed = qkernels.sparse_aggregate_backward(*dev, deterministic=False)
    if dtype != "float32":
        bitwise(first, relaxed)
    else:  # the atomic scatter: grad_edge_weight computed the same way, grad_node_feat to rounding
        bitwise((first[0], None), (relaxed[0], None))
        assert rel_err(f64(relaxed[1]), f64(first[1])) < tol(dtype, counts.max())


def test_sa_strided_and_misaligned_inputs(rng):
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=80, n_src=50, heads=4, dim=16)[0]
    d_go, d_rp, d_col, d_ew, d_nf = sa_device((go, row_ptr, col, ew, nf), "float32")
    views = [
        (d_go, d_rp, d_col, d_ew.t().contiguous().t(), d_nf.transpose(0, 1).contiguous().transpose(0, 1)),
        (torch.stack([d_go, d_go], -1)[..., 0], torch.stack([d_rp, d_rp], 1)[:, 0],
         torch.stack([d_col, d_col], 1)[:, 0], d_ew, d_nf),
        # one element in: rows no longer 16-byte aligned
        (torch.cat([d_go.new_zeros(1), d_go.flatten()])[1:].view(go.shape), d_rp, d_col, d_ew,
         torch.cat([d_nf.new_zeros(1), d_nf.flatten()])[1:].view(nf.shape)),
    ]
    ref = reference("sparse_aggregate_backward", go, row_ptr, col, ew, nf)
    for v in views:
        check(qkernels.sparse_aggregate_backward(*v), ref, "float32", 64, d_go)


def test_sa_csr_slice(rng):
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=600, n_src=70, heads=2, dim=8)[0]
    sub = row_ptr[100:450]
    dev = (cuda(go[100:449]), cuda(sub), cuda(col), cuda(ew), cuda(nf))
    gew, gnf = qkernels.sparse_aggregate_backward(*dev)
    assert (gew[:sub[0]] == 0).all() and (gew[sub[-1]:] == 0).all()
    check((gew, gnf), sa_ref(dev), "float32", 100, dev[0])


@pytest.mark.parametrize("deterministic", [True, False])
def test_sa_bad_columns_are_skipped(rng, deterministic):
    """On cuda (without QKERNELS_CHECK) an out-of-range column is never followed: that edge gets
    grad_edge_weight 0 and adds nothing to grad_node_feat."""
    go, row_ptr, col, ew, nf = sample("sparse_aggregate_backward", rng, n_dst=500, n_src=60, heads=2, dim=16)[0]
    bad = rng.random(len(col)) < 0.05
    bad_col = col.copy()
    bad_col[bad] = rng.choice([-1, 60, 10**9, -2**40], bad.sum())
    gew, gnf = qkernels.sparse_aggregate_backward(cuda(go), cuda(row_ptr), cuda(bad_col), cuda(ew), cuda(nf),
                                                  deterministic=deterministic)
    ew0 = ew.copy()
    ew0[bad] = 0  # the skipped edges, as edges of weight 0 to a valid source
    r_gew, r_gnf = reference("sparse_aggregate_backward", go, row_ptr, col, ew0, nf)
    r_gew[bad] = 0
    assert rel_err(f64(gew), r_gew) < 1e-5 and rel_err(f64(gnf), r_gnf) < 1e-5
    old = qkernels._C._configure(check_indices=True)
    try:
        with pytest.raises(ValueError, match=r"^sparse_aggregate_backward: col_idx\[\d+\] = -?\d+ is out of range"):
            qkernels.sparse_aggregate_backward(cuda(go), cuda(row_ptr), cuda(bad_col), cuda(ew), cuda(nf))
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])


def test_sa_empty_dimensions(rng):
    for n_dst, n_src, heads, dim, degrees in [(9, 5, 2, 3, np.zeros(9)), (9, 0, 2, 3, np.zeros(9)), (9, 5, 2, 0, None),
                                              (0, 5, 2, 3, None)]:
        args, _ = sample("sparse_aggregate_backward", rng, n_dst=n_dst, n_src=n_src, heads=heads, dim=dim,
                         degrees=degrees)
        gew, gnf = qkernels.sparse_aggregate_backward(*sa_device(args, "float32"))
        assert tuple(gew.shape) == (len(args[2]), heads) and tuple(gnf.shape) == (n_src, heads, dim)
        assert (gew == 0).all() and (gnf == 0).all()


def test_sa_capture_replay_with_new_inputs(rng):
    row_ptr, col, counts = boundary_graph(rng, hub=5000)
    shapes = ((len(row_ptr) - 1, 2, 32), (len(col), 2), (len(counts), 2, 32))
    go, ew, nf = (cuda(rng.standard_normal(s).astype(np.float32)) for s in shapes)
    rp, c = cuda(row_ptr), cuda(col)
    g, out = capture_graph(lambda: qkernels.sparse_aggregate_backward(go, rp, c, ew, nf))
    for t in (go, ew, nf):
        t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    check(out, sa_ref((go, rp, c, ew, nf)), "float32", counts.max(), go)


# ---- fused_edge_features_backward ---------------------------------------------------------------

def ef_device(args, dtype):
    go, x, ei = args
    return cuda(go, dtype), cuda(x, dtype), cuda(ei)


def ef_ref(dev):
    go, x, ei = dev
    return reference("fused_edge_features_backward", f64(go), f64(x), ei.cpu().numpy())


# H: lane groups of 8, 16 and 32 (1, 2 and 4 chunks per lane), and the scalar kernel (H not a multiple of
# the vector, or beyond 128 chunks)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("h", [1, 8, 32, 64, 128, 256, 512, 1024, 19])
@pytest.mark.parametrize("attr", [True, False])
def test_ef_matches_reference(rng, dtype, index_dtype, h, attr):
    args, _ = sample("fused_edge_features_backward", rng, n=300, e=2000, h=h, edge_attr=attr, index_dtype=index_dtype)
    dev = ef_device(args, dtype)
    got = qkernels.fused_edge_features_backward(*dev)
    check(got, ef_ref(dev), dtype, 2 * np.bincount(args[2].ravel()).max(), dev[0])
    if attr:
        assert torch.equal(got[1], dev[0][:, 2 * h:]) and got[1].data_ptr() != dev[0].data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ef_hub_isolated_nodes_and_ties(rng, dtype):
    n, e, h = 4000, 300_000, 32
    ei = rng.integers(0, n // 2, (2, e))  # nodes n/2 .. n-1 have no edges
    ei[rng.random((2, e)) < 0.3] = 11  # a hub across many chunks, at both ends and on self-loops
    x = rng.integers(-2, 3, (n, h)).astype(np.float32)  # many ties: sign 0
    go = rng.standard_normal((e, 3 * h)).astype(np.float32)
    dev = ef_device((go, x, ei), dtype)
    gx, gea = qkernels.fused_edge_features_backward(*dev)
    assert (gx[n // 2:] == 0).all()
    check((gx, gea), ef_ref(dev), dtype, 2 * e, dev[0])
    bitwise((gx, gea), qkernels.fused_edge_features_backward(*dev))


def test_ef_strided_inputs(rng):
    go, x, ei = sample("fused_edge_features_backward", rng, n=70, e=500, h=16)[0]
    d_go, d_x, d_ei = ef_device((go, x, ei), "float32")
    wide = torch.zeros(500, 60, device="cuda")
    wide[:, 3:51] = d_go
    views = [(wide[:, 3:51], d_x, d_ei),  # a column block: not 16-byte aligned
             (d_go.t().contiguous().t(), d_x.t().contiguous().t(), d_ei.t().contiguous().t()),
             (d_go, d_x, torch.stack([d_ei, d_ei], 2)[..., 1])]
    ref = reference("fused_edge_features_backward", go, x, ei)
    for v in views:
        check(qkernels.fused_edge_features_backward(*v), ref, "float32", 100, d_go)


def test_ef_bad_index_reads_a_zero_row(rng):
    """On cuda an out-of-range node is never followed: its side of the edge is left out, and the other
    end sees it as a zero row (as the forward reads it)."""
    go, x, ei = sample("fused_edge_features_backward", rng, n=50, e=400, h=8)[0]
    bad = ei.copy()
    bad[0, 17] = 10**9
    gx, gea = qkernels.fused_edge_features_backward(cuda(go), cuda(x), cuda(bad))
    keep = np.arange(400) != 17
    want, _ = reference("fused_edge_features_backward", go[keep], x, ei[:, keep])
    d = ei[1, 17]
    want[d] += go[17, :8] + np.sign(x[d].astype(np.float64)) * go[17, 8:16]
    assert rel_err(f64(gx), want) < 1e-5
    assert torch.equal(gea, cuda(go)[:, 16:])
    old = qkernels._C._configure(check_indices=True)
    try:
        with pytest.raises(ValueError, match=r"^fused_edge_features_backward: edge_index\[0, 17\] = 1000000000 is out"):
            qkernels.fused_edge_features_backward(cuda(go), cuda(x), cuda(bad))
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])


def test_ef_no_edges(rng):
    x = cuda(rng.standard_normal((6, 4)).astype(np.float32))
    gx, gea = qkernels.fused_edge_features_backward(x.new_zeros(0, 12), x, cuda(np.zeros((2, 0), np.int64)))
    assert tuple(gx.shape) == (6, 4) and (gx == 0).all() and tuple(gea.shape) == (0, 4)


def test_ef_capture_replay_with_new_inputs(rng):
    go, x, ei = ef_device(sample("fused_edge_features_backward", rng, n=500, e=20_000, h=32)[0], "float32")
    g, out = capture_graph(lambda: qkernels.fused_edge_features_backward(go, x, ei))
    for t in (go, x):
        t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    check(out, ef_ref((go, x, ei)), "float32", 1000, go)
