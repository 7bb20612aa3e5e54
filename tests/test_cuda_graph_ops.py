"""The graph ops on the cuda backend: float64 references (qkernels.testing), fp16/bf16 against a naive same-precision
torch computation, the dropout mask identical to the cpu backend's, graph_norm_bce determinism and
both of its launch paths, bad indices contained, CUDA-graph capture.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import Ops, capture_graph, close_to_naive, cuda, f64, large_bce_batch, rel_err, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

# ---- fused_edge_features --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n,e,h", [(1, 1, 1), (7, 19, 7), (1000, 4096, 32), (300, 1023, 64), (50, 113, 19)])
@pytest.mark.parametrize("attr", [True, False])
def test_edge_features(rng, dtype, n, e, h, attr):
    x = cuda(rng.standard_normal((n, h)).astype(np.float32), dtype)
    ei = cuda(rng.integers(0, n, (2, e)))
    ea = cuda(rng.standard_normal((e, h)).astype(np.float32), dtype) if attr else None
    out = qkernels.fused_edge_features(x, ei, ea)
    assert out.dtype == x.dtype and out.shape == (e, (3 if attr else 2) * h)
    ref = reference("fused_edge_features", f64(x), ei.cpu().numpy(), f64(ea) if attr else None)
    if dtype == "float32":
        assert rel_err(f64(out), ref) < 1e-5
    else:
        s, d = x[ei[0]], x[ei[1]]
        naive = torch.cat([s + d, (s - d).abs()] + ([ea] if attr else []), 1)
        close_to_naive(out, naive, ref)


def test_edge_features_strided_poisoned_and_bad_index(rng):
    x = cuda(rng.standard_normal((16, 40)).astype(np.float32)).t()  # [40, 16] column-major: scalar path
    ei = cuda(rng.integers(0, 40, (2, 600)))[:, ::2]
    out = torch.full((300, 32), float("nan"), device="cuda")
    qkernels.fused_edge_features(x, ei, out=out)
    assert rel_err(f64(out), reference("fused_edge_features", f64(x), ei.cpu().numpy())) < 1e-5
    bad = ei.clone()
    bad[0, 5] = 10**9
    big = torch.full((302, 32), float("nan"), device="cuda")
    qkernels.fused_edge_features(x, bad, out=big[1:301])
    torch.cuda.synchronize()
    assert torch.isnan(big[0]).all() and torch.isnan(big[301]).all() and torch.isfinite(big[1:301]).all()


# ---- fused_norm_residual --------------------------------------------------------------------

def norm_args(rng, r, h, dtype="float32", mean=0.0):
    return [cuda(a, dtype) for a in sample("fused_norm_residual", rng, rows=r, h=h, mean=mean)[0]]


@pytest.mark.parametrize("r,h", [(1, 1), (19, 7), (113, 19), (1000, 128), (300, 512), (64, 1024), (7, 113), (5, 2000)])
def test_norm_residual_fp32(rng, r, h):
    args = norm_args(rng, r, h)
    out = qkernels.fused_norm_residual(*args)
    assert rel_err(f64(out), reference("fused_norm_residual", *[f64(a) for a in args])) < 1e-5


@pytest.mark.parametrize("h", [128, 100])
def test_norm_residual_large_mean(rng, h):
    args = norm_args(rng, 256, h, mean=1e4)
    out = qkernels.fused_norm_residual(*args)
    assert rel_err(f64(out), reference("fused_norm_residual", *[f64(a) for a in args])) < 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("h", [128, 512, 96])
def test_norm_residual_half(rng, dtype, h):
    args = norm_args(rng, 200, h, dtype)
    out = qkernels.fused_norm_residual(*args)
    naive = torch.nn.functional.layer_norm(args[0], (h,), args[2], args[3], 1e-5) + args[1]
    close_to_naive(out, naive, reference("fused_norm_residual", *[f64(a) for a in args]))


@pytest.mark.parametrize("r,h,p", [(257, 128, 0.1), (64, 512, 0.5), (33, 19, 0.3), (10, 1024, 0.9)])
def test_dropout_mask_is_the_cpu_mask(rng, r, h, p):
    args = norm_args(rng, r, h)
    seed = int(rng.integers(0, 2**63))
    out = qkernels.fused_norm_residual(*args, p=p, training=True, seed=seed)
    cpu = qkernels.fused_norm_residual(*[a.cpu() for a in args], p=p, training=True, seed=seed)
    ref = reference("fused_norm_residual", *[f64(a) for a in args], p=p, training=True, seed=seed)
    assert rel_err(f64(out), ref) < 1e-5 and rel_err(cpu.double().numpy(), ref) < 1e-5
    zero = torch.zeros_like(args[1])
    mask_gpu = qkernels.fused_norm_residual(args[0], zero, *args[2:], p=p, training=True, seed=seed) != 0
    mask_cpu = qkernels.fused_norm_residual(args[0].cpu(), zero.cpu(), *[a.cpu() for a in args[2:]], p=p,
                                            training=True, seed=seed) != 0
    assert torch.equal(mask_gpu.cpu(), mask_cpu)


def test_norm_residual_strided(rng):
    x, res, g, b = norm_args(rng, 40, 64)
    xt = x.t().contiguous().t()
    out = torch.full((40, 128), float("nan"), device="cuda")[:, ::2]
    qkernels.fused_norm_residual(xt, res, g, b, out=out)
    assert rel_err(f64(out), reference("fused_norm_residual", f64(x), f64(res), f64(g), f64(b))) < 1e-5


# ---- graph_norm_bce -------------------------------------------------------------------------

def bce_args(rng, e, g, sorted_=True, dtype="float32", idx=np.int64):
    logits, target, eg, _ = sample("graph_norm_bce", rng, e=e, graphs=g, sort=sorted_, index_dtype=idx)[0]
    return cuda(logits, dtype), cuda(target, dtype), cuda(eg)


@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("e,g", [(1, 1), (19, 1), (113, 7), (2048, 3), (2049, 3), (50_000, 64), (300_000, 4096),
                                 (10, 50), (100_000, 1)])
@pytest.mark.parametrize("pos_weight", [None, 2.0])
def test_graph_bce(rng, sorted_, e, g, pos_weight):
    lg, t, eg = bce_args(rng, e, g, sorted_)
    r = qkernels.graph_norm_bce(lg, t, eg, g, pos_weight=pos_weight)
    assert r.shape == () and r.dtype == torch.float32 and r.is_cuda
    ref = reference("graph_norm_bce", f64(lg), f64(t), eg.cpu().numpy(), g, pos_weight=pos_weight)
    assert abs(r.item() - ref) <= 1e-5 * abs(ref)


@pytest.mark.parametrize("shape", ["three", "uniform", "skewed"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "int32"])
def test_graph_bce_large_sorted(rng, shape, layout):
    """Large enough that each block owns several chunks: graphs continue across chunks inside a
    block, across blocks, span many blocks, or are empty, next to one-edge graphs."""
    g, eg, lg_h, t_h = large_bce_batch(rng, shape)
    if layout == "strided":  # every other element of a buffer twice as long: the scalar loads
        lg = cuda(np.repeat(lg_h, 2))[::2]
        t = cuda(np.repeat(t_h, 2))[::2]
        egd = cuda(np.repeat(eg, 2))[::2]
    else:
        lg, t, egd = cuda(lg_h), cuda(t_h), cuda(eg.astype(np.int32 if layout == "int32" else np.int64))
    r = qkernels.graph_norm_bce(lg, t, egd, g, pos_weight=2.0).item()
    ref = reference("graph_norm_bce", lg_h, t_h, eg, g, pos_weight=2.0)
    assert abs(r - ref) <= 1e-5 * abs(ref)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_graph_bce_half(rng, dtype):
    lg, t, eg = bce_args(rng, 20_000, 16, dtype=dtype, idx=np.int32)
    r = qkernels.graph_norm_bce(lg, t, eg, 16)
    ref = reference("graph_norm_bce", f64(lg), f64(t), eg.cpu().numpy(), 16)  # on the rounded inputs
    assert abs(r.item() - ref) <= 1e-5 * abs(ref)


def test_graph_bce_deterministic_empty_and_bad_ids(rng):
    for sorted_ in (True, False):
        lg, t, eg = bce_args(rng, 1_000_000, 128, sorted_)
        bits = {qkernels.graph_norm_bce(lg, t, eg, 128, pos_weight=2.0).item().hex() for _ in range(5)}
        assert len(bits) == 1
    empty = torch.zeros(0, device="cuda")
    assert qkernels.graph_norm_bce(empty, empty, torch.zeros(0, dtype=torch.int64, device="cuda"), 4).item() == 0.0
    lg, t, eg = bce_args(rng, 5000, 8)
    eg[100] = 99  # out of range on cuda: skipped, never followed
    ok = eg.clone()
    keep = torch.ones(5000, dtype=torch.bool)
    keep[100] = False
    r = qkernels.graph_norm_bce(lg, t, eg, 8).item()
    ref = reference("graph_norm_bce", lg.cpu().numpy()[keep], t.cpu().numpy()[keep], ok.cpu().numpy()[keep], 8)
    assert abs(r - ref) <= 1e-5 * abs(ref)


# The forward as picked (one cooperative launch on a GPU that takes it) and forced onto the three
# launches it falls back to: the same phases, so the same bits.
BCE_PATHS = [Ops(), Ops("launches", _variant="launches")]


def bce_ref(lg, t, eg, g, **kw):
    """The float64 reference on the inputs as the kernel reads them (16-bit values rounded)."""
    return reference("graph_norm_bce", f64(lg), f64(t), eg.cpu().numpy(), g, **kw)


@pytest.mark.parametrize("ops", BCE_PATHS, ids=repr)
@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("e,g", [(1, 1), (257, 1), (5000, 1), (3001, 400), (20_000, 100_000), (300_000, 4096),
                                 (2_500_000, 777)])
def test_graph_bce_paths(rng, ops, sorted_, e, g):
    """One graph; more graphs than blocks, most of them empty; more graphs than a wave of blocks;
    warps that take several 256-edge steps (E = 2.5M): sorted and unsorted, on both paths."""
    lg, t, eg = bce_args(rng, e, g, sorted_)
    r = ops.graph_norm_bce(lg, t, eg, g, pos_weight=1.5)
    assert r.shape == () and r.dtype == torch.float32 and r.is_cuda
    ref = bce_ref(lg, t, eg, g, pos_weight=1.5)
    assert abs(r.item() - ref) <= 1e-5 * abs(ref)


@pytest.mark.parametrize("ops", BCE_PATHS, ids=repr)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("sorted_", [True, False])
def test_graph_bce_paths_dtypes(rng, ops, dtype, sorted_):
    lg, t, eg = bce_args(rng, 40_003, 300, sorted_, dtype=dtype, idx=np.int32)
    r = ops.graph_norm_bce(lg, t, eg, 300).item()
    ref = bce_ref(lg, t, eg, 300)
    assert abs(r - ref) <= 1e-5 * abs(ref)


@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("e,g", [(777, 3), (300_000, 4096), (1_000_003, 128)])
def test_graph_bce_paths_same_bits(rng, sorted_, e, g):
    """Two calls give the same bits, and the cooperative launch the bits of the three launches."""
    lg, t, eg = bce_args(rng, e, g, sorted_)
    bits = {ops.label: {ops.graph_norm_bce(lg, t, eg, g, pos_weight=2.0).item().hex() for _ in range(2)}
            for ops in BCE_PATHS}
    assert bits["picked"] == bits["launches"] and len(bits["picked"]) == 1


@pytest.mark.parametrize("ops", BCE_PATHS, ids=repr)
def test_graph_bce_empty_and_out_of_range(rng, ops):
    empty = torch.zeros(0, device="cuda")
    assert ops.graph_norm_bce(empty, empty, torch.zeros(0, dtype=torch.int64, device="cuda"), 4).item() == 0.0
    lg, t, eg = bce_args(rng, 9000, 20)
    bad = [0, 4500, 8999]
    eg[bad] = torch.tensor([-1, 20, 1 << 40], device="cuda")  # skipped (and not sorted)
    keep = np.ones(9000, dtype=bool)
    keep[bad] = False
    r = ops.graph_norm_bce(lg, t, eg, 20).item()
    ref = reference("graph_norm_bce", f64(lg)[keep], f64(t)[keep], eg.cpu().numpy()[keep], 20)
    assert abs(r - ref) <= 1e-5 * abs(ref)


def test_graph_bce_output_owns_its_block(rng):
    """The loss and its scratch are one allocation: each result keeps its own block (a later call
    does not write over an earlier loss), and dropping the results frees them all."""
    args = [bce_args(rng, 50_000, 64, sorted_) for sorted_ in (True, False, True)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    rs = [qkernels.graph_norm_bce(*a, 64) for a in args]
    for r, a in zip(rs, args):
        ref = bce_ref(*a, 64)
        assert r.shape == () and abs(r.item() - ref) <= 1e-5 * abs(ref)
    assert torch.cuda.memory_allocated() > base
    del rs, r
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.parametrize("ops", BCE_PATHS, ids=repr)
def test_graph_bce_capture_and_replay(rng, ops):
    sorted_args, unsorted_args = bce_args(rng, 100_000, 300, True), bce_args(rng, 100_000, 300, False)
    g, outs = capture_graph(lambda: (ops.graph_norm_bce(*sorted_args, 300), ops.graph_norm_bce(*unsorted_args, 300)))
    for _ in range(2):
        for a in (sorted_args, unsorted_args):
            a[0].copy_(3 * torch.randn_like(a[0]))
        g.replay()
        torch.cuda.synchronize()
        for out, a in zip(outs, (sorted_args, unsorted_args)):
            ref = bce_ref(*a, 300)
            assert abs(out.item() - ref) <= 1e-5 * abs(ref)


# ---- capture --------------------------------------------------------------------------------

def test_graph_ops_capture_and_replay(rng):
    x = cuda(rng.standard_normal((500, 32)).astype(np.float32))
    ei = cuda(rng.integers(0, 500, (2, 3000)))
    ea = cuda(rng.standard_normal((3000, 32)).astype(np.float32))
    nargs = norm_args(rng, 300, 128)
    lg, t, eg = bce_args(rng, 100_000, 16)
    calls = lambda: (qkernels.fused_edge_features(x, ei, ea),  # noqa: E731
                     qkernels.fused_norm_residual(*nargs, p=0.2, training=True, seed=7),
                     qkernels.graph_norm_bce(lg, t, eg, 16, pos_weight=1.5))
    g, outs = capture_graph(calls)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        nargs[0].copy_(torch.randn_like(nargs[0]))
        lg.copy_(torch.randn_like(lg))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(f64(outs[0]), reference("fused_edge_features", f64(x), ei.cpu().numpy(), f64(ea))) < 1e-5
        ref = reference("fused_norm_residual", *[f64(a) for a in nargs], p=0.2, training=True, seed=7)
        assert rel_err(f64(outs[1]), ref) < 1e-5
        bref = reference("graph_norm_bce", f64(lg), f64(t), eg.cpu().numpy(), 16, pos_weight=1.5)
        assert abs(outs[2].item() - bref) <= 1e-5 * bref


# ---- QKERNELS_CHECK=1 on cuda ---------------------------------------------------------------

def test_checked_indices_on_cuda(rng):
    old = qkernels._C._configure(check_indices=True)
    try:
        x = cuda(rng.standard_normal((50, 8)).astype(np.float32))
        ei = rng.integers(0, 50, (2, 300))
        ei[1, 123] = 50
        with pytest.raises(ValueError, match=r"edge_index\[1, 123\] = 50 is out of range for x with N = 50"):
            qkernels.fused_edge_features(x, cuda(ei))
        ei[1, 123] = 3
        ei[0, 7] = -1
        with pytest.raises(ValueError, match=r"edge_index\[0, 7\] = -1 is out of range"):
            qkernels.fused_edge_features(x, cuda(ei.astype(np.int32)))
        lg, t, eg = bce_args(rng, 5000, 8)
        eg[4000] = 8
        with pytest.raises(ValueError, match=r"edge_graph\[4000\] = 8 is out of range for num_graphs = 8"):
            qkernels.graph_norm_bce(lg, t, eg, 8)
        eg[4000] = 7
        assert np.isfinite(qkernels.graph_norm_bce(lg, t, eg, 8).item())
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])
