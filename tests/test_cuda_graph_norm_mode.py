"""fused_norm_residual and fused_norm_residual_backward in graph mode (batch=, num_graphs=) on the
cuda backend: float64 references (qkernels.testing) in float32, float16 and bfloat16; sorted batches
(binary-searched segments) and unsorted ones (the one-block counting sort, over several 1024-row
tiles and several scan tiles of graphs); graphs inside one 128-row chunk and graphs spanning many;
empty graphs; int32/int64 ids; strided views; the dropout mask identical to the cpu backend's;
determinism; ids out of range contained (and raised with QKERNELS_CHECK); CUDA-graph replays with a
changed batch; autograd through the torch operators.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from conftest import capture_graph, cuda, f64, rel_err, requires_cuda, zero_variance_scale
from qkernels.testing import dropout_keep, graph_batch, reference, sample

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

# Norm-wise relative error of a result rounded once to the dtype (fp32 arithmetic before it): the
# unit roundoff is 2^-11 (float16) or 2^-8 (bfloat16) per element; twice that.  float32: 1e-5.
TOL = {"float32": 1e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}
FWD, BWD = "fused_norm_residual", "fused_norm_residual_backward"


def device_call(op, rng, dtype="float32", **sizes):
    """(device args, device kwargs, float64 reference) of a graph-mode call; the reference is taken
    from the inputs as rounded to dtype."""
    args, kw = sample(op, rng, **sizes)
    dev = [cuda(a, dtype) for a in args]
    dkw = {k: cuda(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    return dev, dkw, reference(op, *[f64(a) for a in dev], **kw)


def check(got, ref, dtype, scale=0.0):
    """scale: rel_err's floor for the first result (see conftest.rel_err)."""
    for i, (g, r) in enumerate(zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,))):
        assert g.is_cuda and g.dtype == getattr(torch, dtype) and tuple(g.shape) == r.shape
        assert torch.isfinite(g).all(), "non-finite result (an element was not written?)"
        assert rel_err(f64(g), r, scale if i == 0 else 0.0) < TOL[dtype]


# (rows, channels, graphs): one row; one graph spanning many 128-row chunks; graphs of ~1 row;
# many empty graphs; more rows than one 1024-row sort tile; more graphs than one 256-graph scan
# tile; H not a multiple of the vector width or of 32
SIZES = [(1, 1, 1), (7, 5, 3), (129, 64, 1), (5000, 32, 1), (300, 16, 299), (113, 19, 500), (3000, 128, 7),
         (20_000, 24, 700), (2049, 100, 2), (640, 1000, 5)]


@pytest.mark.parametrize("r,h,g", SIZES)
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_fp32(rng, r, h, g, sort, p):
    dev, kw, ref = device_call(FWD, rng, rows=r, h=h, graphs=g, sort=sort)
    if p:
        seed = int(rng.integers(0, 2**63))
        kw.update(p=p, training=True, seed=seed)
        ref = reference(FWD, *[f64(a) for a in dev], **{k: v.cpu().numpy() if torch.is_tensor(v) else v
                                                         for k, v in kw.items()})
    check(qkernels.fused_norm_residual(*dev, **kw), ref, "float32")
    dev, kw, ref = device_call(BWD, rng, rows=r, h=h, graphs=g, sort=sort, p=p)
    scale = zero_variance_scale(dev[0], dev[2]) if r * h == 1 else 0.0  # one value: variance 0
    check(qkernels.fused_norm_residual_backward(*dev, **kw), ref, "float32", scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("r,h,g", [(3000, 128, 9), (257, 36, 40)])
def test_half(rng, dtype, sort, idx, r, h, g):
    dev, kw, ref = device_call(FWD, rng, dtype, rows=r, h=h, graphs=g, sort=sort, index_dtype=idx)
    assert kw["batch"].dtype == getattr(torch, np.dtype(idx).name)
    check(qkernels.fused_norm_residual(*dev, **kw), ref, dtype)
    dev, kw, ref = device_call(BWD, rng, dtype, rows=r, h=h, graphs=g, sort=sort, index_dtype=idx, p=0.2)
    check(qkernels.fused_norm_residual_backward(*dev, **kw), ref, dtype)


@pytest.mark.parametrize("sort", [True, False])
def test_large_mean(rng, sort):
    """Graphs with mean 1e4 and unit spread: the per-graph shift keeps the fp32 sums exact enough."""
    dev, kw, ref = device_call(FWD, rng, rows=2000, h=64, mean=1e4, graphs=5, sort=sort)
    check(qkernels.fused_norm_residual(*dev, **kw), ref, "float32")
    dev, kw, ref = device_call(BWD, rng, rows=2000, h=64, mean=1e4, graphs=5, sort=sort, p=0.1)
    check(qkernels.fused_norm_residual_backward(*dev, **kw), ref, "float32")


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("shape", ["skewed", "one_row_graphs"])
def test_graph_sizes(rng, sort, shape):
    """Heavy-tailed graph sizes (a third empty, some of thousands of rows) and graphs of one row."""
    if shape == "skewed":
        sizes = np.minimum((rng.pareto(1.1, 3000) * 2).astype(np.int64), 5000)
        g, batch = 3000, np.repeat(np.arange(3000), sizes)
    else:
        g, batch = 4000, np.arange(4000)
    if not sort:
        batch = rng.permutation(batch)
    r = len(batch)
    (x, res, gm, bt), _ = sample(FWD, rng, rows=r, h=40)
    go = rng.standard_normal((r, 40)).astype(np.float32)
    out = qkernels.fused_norm_residual(*[cuda(a) for a in (x, res, gm, bt)], batch=cuda(batch), num_graphs=g)
    check(out, reference(FWD, x, res, gm, bt, batch=batch, num_graphs=g), "float32")
    grads = qkernels.fused_norm_residual_backward(cuda(go), cuda(x), cuda(gm), batch=cuda(batch), num_graphs=g)
    check(grads, reference(BWD, go, x, gm, batch=batch, num_graphs=g), "float32")


def test_sorted_with_ids_out_of_range_at_the_ends(rng):
    """A sorted batch whose first rows are negative and last rows past num_graphs stays on the
    sorted path; those rows belong to no graph: out = residual, grad_x = 0, no column share."""
    (x, res, gm, bt), _ = sample(FWD, rng, rows=600, h=32)
    batch = np.sort(graph_batch(rng, 600, 6))
    batch[:5], batch[-7:] = -1, 6  # out of range, still non-decreasing
    inside = slice(5, 593)
    go = rng.standard_normal((600, 32)).astype(np.float32)
    dev = [cuda(a) for a in (x, res, gm, bt)]
    out = qkernels.fused_norm_residual(*dev, batch=cuda(batch), num_graphs=6)
    assert torch.equal(out[:5], dev[1][:5]) and torch.equal(out[-7:], dev[1][-7:])
    ref = reference(FWD, x[inside], res[inside], gm, bt, batch=batch[inside], num_graphs=6)
    assert rel_err(f64(out[inside]), ref) < 1e-5
    gx, gg, gb = qkernels.fused_norm_residual_backward(cuda(go), dev[0], dev[2], batch=cuda(batch), num_graphs=6)
    assert not gx[:5].any() and not gx[-7:].any()
    ref = reference(BWD, go[inside], x[inside], gm, batch=batch[inside], num_graphs=6)
    for a, r in zip((gx[inside], gg, gb), ref):
        assert rel_err(f64(a), r) < 1e-5


def test_ids_out_of_range_contained_and_checked(rng):
    """Unsorted with bad ids anywhere: never followed; the rows are in no graph.  QKERNELS_CHECK=1
    raises naming the first bad position."""
    (x, res, gm, bt), _ = sample(FWD, rng, rows=3000, h=24)
    batch = graph_batch(rng, 3000, 11, sort=False)
    bad = np.zeros(3000, bool)
    bad[[0, 17, 1500, 2999]] = True
    batch[[0, 17, 1500, 2999]] = [11, -4, 2**31 - 1, -(2**31)]
    go = rng.standard_normal((3000, 24)).astype(np.float32)
    dev = [cuda(a) for a in (x, res, gm, bt)]
    b = cuda(batch)
    out = qkernels.fused_norm_residual(*dev, batch=b, num_graphs=11)
    assert torch.equal(out[torch.from_numpy(bad).cuda()], dev[1][torch.from_numpy(bad).cuda()])
    ref = reference(FWD, x[~bad], res[~bad], gm, bt, batch=batch[~bad], num_graphs=11)
    assert rel_err(f64(out)[~bad], ref) < 1e-5
    gx, gg, gb = qkernels.fused_norm_residual_backward(cuda(go), dev[0], dev[2], batch=b, num_graphs=11)
    assert not gx[torch.from_numpy(bad).cuda()].any()
    ref = reference(BWD, go[~bad], x[~bad], gm, batch=batch[~bad], num_graphs=11)
    for a, r in zip((f64(gx)[~bad], f64(gg), f64(gb)), ref):
        assert rel_err(a, r) < 1e-5
    old = qkernels._C._configure(check_indices=True)
    try:
        with pytest.raises(ValueError, match=r"^fused_norm_residual: batch\[0\] = 11 is out of range for num_graphs"):
            qkernels.fused_norm_residual(*dev, batch=b, num_graphs=11)
        with pytest.raises(ValueError, match=r"^fused_norm_residual_backward: batch\[0\] = 11 is out of range"):
            qkernels.fused_norm_residual_backward(cuda(go), dev[0], dev[2], batch=b, num_graphs=11)
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])


def test_strided(rng):
    dev, kw, ref = device_call(FWD, rng, rows=700, h=48, graphs=6, sort=False)
    x, res, gm, bt = dev
    xs = torch.zeros(700, 96, device="cuda")[:, ::2]
    xs.copy_(x)
    bs = torch.zeros(1400, dtype=kw["batch"].dtype, device="cuda")[::2]
    bs.copy_(kw["batch"])
    out = torch.zeros(700, 96, device="cuda")[:, 1::2]
    qkernels.fused_norm_residual(xs, res.t().contiguous().t(), gm, bt, batch=bs, num_graphs=6, out=out)
    check(out, ref, "float32")
    dev, kw, ref = device_call(BWD, rng, rows=700, h=48, graphs=6, sort=True, p=0.2)
    go, x, gm = dev
    gs = torch.zeros(96, device="cuda")[::2]
    gs.copy_(gm)
    bs = torch.zeros(2100, dtype=kw["batch"].dtype, device="cuda")[::3]
    bs.copy_(kw["batch"])
    check(qkernels.fused_norm_residual_backward(go.t().contiguous().t(), xs.copy_(x), gs, **{**kw, "batch": bs}),
          ref, "float32")


@pytest.mark.parametrize("which", [0, 1])
def test_in_place(rng, which):
    """out=x and out=residual: the statistics are complete before any output is written (the
    output kernel reads only its own row and the per-graph statistics)."""
    dev, kw, _ = device_call(FWD, rng, rows=3000, h=64, graphs=5, sort=False)
    kw.update(p=0.2, training=True, seed=8)
    want = qkernels.fused_norm_residual(*dev, **kw)
    got = qkernels.fused_norm_residual(*dev, **kw, out=dev[which])
    assert torch.equal(got, want) and torch.equal(dev[which], want)


@pytest.mark.parametrize("sort", [True, False])
def test_mask_and_cpu_agreement(rng, sort):
    dev, kw, _ = device_call(FWD, rng, rows=900, h=33, graphs=8, sort=sort)
    seed, p = int(rng.integers(0, 2**63)), 0.35
    kw.update(p=p, training=True, seed=seed)
    gpu = qkernels.fused_norm_residual(*dev, **kw)
    cpu_kw = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()}
    cpu = qkernels.fused_norm_residual(*[a.cpu() for a in dev], **cpu_kw)
    assert rel_err(f64(gpu), f64(cpu)) < 1e-5
    zero = torch.zeros_like(dev[0])
    kept = qkernels.fused_norm_residual(dev[0], zero, torch.zeros_like(dev[2]), torch.full_like(dev[3], 5.0), **kw)
    assert np.array_equal((kept != 0).cpu().numpy(), dropout_keep(seed, (900, 33), p))
    go = torch.randn(900, 33, device="cuda")
    a = qkernels.fused_norm_residual_backward(go, dev[0], dev[2], **kw)
    b = qkernels.fused_norm_residual_backward(go.cpu(), dev[0].cpu(), dev[2].cpu(), **cpu_kw)
    for u, v in zip(a, b):
        assert rel_err(f64(u), f64(v)) < 1e-5


@pytest.mark.parametrize("sort", [True, False])
def test_deterministic(rng, sort):
    dev, kw, _ = device_call(FWD, rng, rows=100_000, h=64, graphs=300, sort=sort)
    kw.update(p=0.1, training=True, seed=2)
    first = qkernels.fused_norm_residual(*dev, **kw)
    go = torch.randn(100_000, 64, device="cuda")
    grads = qkernels.fused_norm_residual_backward(go, dev[0], dev[2], **kw)
    for _ in range(3):
        assert torch.equal(first, qkernels.fused_norm_residual(*dev, **kw))
        again = qkernels.fused_norm_residual_backward(go, dev[0], dev[2], **kw)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_graph_replay_with_a_new_batch(rng):
    """Forward and backward captured with a sorted batch, replayed after the batch (now unsorted,
    with other graph sizes), x and the seed change: the replay is the eager result."""
    (x, res, gm, bt), kw = sample(FWD, rng, rows=5000, h=64, graphs=40, sort=True)
    x, res, gm, bt = (cuda(a) for a in (x, res, gm, bt))
    batch, seed = cuda(kw["batch"]), torch.tensor(5, dtype=torch.int64, device="cuda")
    go = torch.randn(5000, 64, device="cuda")
    opts = dict(p=0.2, training=True, seed=seed, batch=batch, num_graphs=40)
    graph, (y, grads) = capture_graph(lambda: (qkernels.fused_norm_residual(x, res, gm, bt, **opts),
                                               qkernels.fused_norm_residual_backward(go, x, gm, **opts)))
    for sort in (False, True):
        batch.copy_(cuda(graph_batch(rng, 5000, 40, sort=sort)))
        x.copy_(torch.randn_like(x))
        seed.fill_(int(rng.integers(0, 2**62)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, qkernels.fused_norm_residual(x, res, gm, bt, **opts))
        want = qkernels.fused_norm_residual_backward(go, x, gm, **opts)
        assert all(torch.equal(a, w) for a, w in zip(grads, want))
        ref = reference(FWD, f64(x), f64(res), f64(gm), f64(bt), p=0.2, training=True, seed=seed.item(),
                        batch=batch.cpu().numpy(), num_graphs=40)
        assert rel_err(f64(y), ref) < 1e-5


def test_torch_operator_autograd(rng):
    dev, kw, _ = device_call(FWD, rng, rows=2000, h=32, graphs=17, sort=False)
    leaves = [a.detach().requires_grad_() for a in dev]
    out = qkernels.fused_norm_residual(*leaves, **kw, p=0.2, training=True, seed=6)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    assert torch.equal(leaves[1].grad, weight)
    want = reference(BWD, f64(weight), f64(dev[0]), f64(dev[2]), p=0.2, training=True, seed=6,
                     batch=kw["batch"].cpu().numpy(), num_graphs=17)
    for got, r in zip((leaves[0].grad, leaves[2].grad, leaves[3].grad), want):
        assert rel_err(f64(got), r) < 1e-5


def test_errors(rng):
    dev, kw, _ = device_call(FWD, rng, rows=20, h=8, graphs=3)
    with pytest.raises(ValueError, match="all tensors must be on one device; x is on cuda:0 but batch is on cpu"):
        qkernels.fused_norm_residual(*dev, batch=kw["batch"].cpu(), num_graphs=3)
    with pytest.raises(ValueError, match=r"num_graphs must be below 2\^31 on cuda"):
        qkernels.fused_norm_residual(*dev, batch=kw["batch"], num_graphs=2**31)
