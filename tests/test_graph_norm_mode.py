"""fused_norm_residual and fused_norm_residual_backward in graph mode (batch=, num_graphs=: PyG's
LayerNorm(mode="graph"), statistics over all rows and channels of each graph) on the cpu backend:
against the float64 references of qkernels.testing, against torch.autograd of a float64 torch
formulation written here (PyG's algorithm), against torch_geometric itself where it is installed,
and through the torch operators' autograd; sorted and unsorted batches, empty graphs, awkward
sizes, strided views, int32/int64 ids, dropout, in-place forms, errors, determinism."""

import importlib.util

import numpy as np
import pytest

import qkernels
from conftest import assert_compiles_like_eager, check_norm_grads, rel_err, requires_torch, strided_all
from qkernels import _dispatch
from qkernels.testing import dropout_keep, graph_batch, reference, sample

FP32_TOL = 1e-5
FWD, BWD = "fused_norm_residual", "fused_norm_residual_backward"


# (rows, channels, graphs): one row, one graph, graphs of one row, many empty graphs, sizes that are
# multiples of nothing
SIZES = [(1, 1, 1), (7, 5, 3), (19, 33, 4), (113, 19, 50), (1000, 64, 3), (3000, 128, 1), (200, 7, 200),
         (50, 1023, 7), (5000, 24, 700)]


@pytest.mark.parametrize("r,h,g", SIZES)
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_forward(rng, r, h, g, sort, idx, p):
    args, kw = sample(FWD, rng, rows=r, h=h, graphs=g, sort=sort, index_dtype=idx)
    assert kw["batch"].dtype == idx and kw["num_graphs"] == g
    if p:
        kw.update(p=p, training=True, seed=int(rng.integers(0, 2**63)))
    out = qkernels.fused_norm_residual(*args, **kw)
    assert out.shape == (r, h) and out.dtype == np.float32
    assert rel_err(out, reference(FWD, *args, **kw)) < FP32_TOL


@pytest.mark.parametrize("r,h,g", SIZES)
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_backward(rng, r, h, g, sort, idx, p):
    args, kw = sample(BWD, rng, rows=r, h=h, graphs=g, sort=sort, index_dtype=idx, p=p)
    check_norm_grads(qkernels.fused_norm_residual_backward(*args, **kw), reference(BWD, *args, **kw))


def test_reference_is_the_layer_norm_of_each_graph(rng):
    """The reference itself: each graph's rows flattened and normalised alone (an independent
    statement of the math), empty graphs taking no part."""
    (x, res, g, b), _ = sample(FWD, rng, rows=60, h=9)
    batch = graph_batch(rng, 60, 8, sort=False)
    batch[batch == 3] = 4  # graph 3 has no rows
    y = reference(FWD, x, res, g, b, batch=batch, num_graphs=8, eps=1e-3)
    for k in range(8):
        rows = x[batch == k].astype(np.float64)
        if len(rows):
            want = (rows - rows.mean()) / np.sqrt(rows.var() + 1e-3) * g + b + res[batch == k]
            np.testing.assert_allclose(y[batch == k], want, rtol=1e-12, atol=1e-12)


def test_graph_by_graph(rng):
    """Each graph normalised by its own call with num_graphs=1 gives the batched call's rows."""
    (x, res, g, b), kw = sample(FWD, rng, rows=400, h=17, graphs=9, sort=False)
    out = qkernels.fused_norm_residual(x, res, g, b, **kw)
    for k in range(9):
        m = kw["batch"] == k
        alone = qkernels.fused_norm_residual(x[m], res[m], g, b, batch=np.zeros(m.sum(), np.int64), num_graphs=1)
        np.testing.assert_allclose(out[m], alone, rtol=1e-5, atol=1e-5)


def test_rows_as_graphs_is_the_row_mode(rng):
    """One graph per row (batch = arange(R)) is the per-row LayerNorm."""
    args, _ = sample(FWD, rng, rows=300, h=40)
    graph = qkernels.fused_norm_residual(*args, batch=np.arange(300), num_graphs=300)
    np.testing.assert_allclose(graph, qkernels.fused_norm_residual(*args), rtol=1e-5, atol=1e-5)
    args, kw = sample(BWD, rng, rows=300, h=40, p=0.2)
    for a, b in zip(qkernels.fused_norm_residual_backward(*args, **kw, batch=np.arange(300), num_graphs=300),
                    qkernels.fused_norm_residual_backward(*args, **kw)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_unsorted_is_a_permutation_of_sorted(rng):
    (x, res, g, b), kw = sample(FWD, rng, rows=2000, h=20, graphs=31, sort=True)
    kw.update(p=0.0)
    perm = rng.permutation(2000)
    out = qkernels.fused_norm_residual(x, res, g, b, **kw)
    shuffled = qkernels.fused_norm_residual(x[perm], res[perm], g, b, batch=kw["batch"][perm], num_graphs=31)
    np.testing.assert_allclose(shuffled, out[perm], rtol=1e-5, atol=1e-5)
    go = rng.standard_normal((2000, 20)).astype(np.float32)
    grads = qkernels.fused_norm_residual_backward(go, x, g, **kw)
    sh = qkernels.fused_norm_residual_backward(go[perm], x[perm], g, batch=kw["batch"][perm], num_graphs=31)
    np.testing.assert_allclose(sh[0], grads[0][perm], rtol=1e-4, atol=1e-5)
    for a, b in zip(sh[1:], grads[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sort", [True, False])
def test_empty_graphs_and_trailing_graphs(rng, sort):
    """Graphs without rows anywhere (first, middle, past the largest id) change nothing."""
    (x, res, g, b), _ = sample(FWD, rng, rows=500, h=11)
    batch = graph_batch(rng, 500, 5, sort=sort) * 3 + 2  # ids 2, 5, 8, 11, 14 of 40
    out = qkernels.fused_norm_residual(x, res, g, b, batch=batch, num_graphs=40)
    dense = qkernels.fused_norm_residual(x, res, g, b, batch=(batch - 2) // 3, num_graphs=5)
    np.testing.assert_allclose(out, dense, rtol=1e-6, atol=1e-6)
    assert rel_err(out, reference(FWD, x, res, g, b, batch=batch, num_graphs=40)) < FP32_TOL
    go = rng.standard_normal((500, 11)).astype(np.float32)
    check_norm_grads(qkernels.fused_norm_residual_backward(go, x, g, batch=batch, num_graphs=40),
                reference(BWD, go, x, g, batch=batch, num_graphs=40))


@pytest.mark.parametrize("sort", [True, False])
def test_large_mean_and_eps(rng, sort):
    """Graphs with mean 1e4 and unit spread: the two-pass variance loses nothing to cancellation."""
    args, kw = sample(FWD, rng, rows=800, h=32, mean=1e4, graphs=6, sort=sort)
    assert rel_err(qkernels.fused_norm_residual(*args, **kw, eps=1e-3), reference(FWD, *args, **kw, eps=1e-3)) < 1e-5
    args, kw = sample(BWD, rng, rows=800, h=32, mean=1e4, graphs=6, sort=sort, p=0.1)
    check_norm_grads(qkernels.fused_norm_residual_backward(*args, **kw, eps=0.0), reference(BWD, *args, **kw, eps=0.0))


def test_strided_views(rng):
    (x, res, g, b), kw = sample(FWD, rng, rows=150, h=13, graphs=7, sort=False)
    kw.update(p=0.2, training=True, seed=9)
    ref = reference(FWD, x, res, g, b, **kw)
    batch = kw.pop("batch")
    for views in [(np.asfortranarray(x), strided_all(res), strided_all(g), strided_all(b), strided_all(batch, 3)),
                  (strided_all(x, 3), np.asfortranarray(res), g, b, batch[::-1].copy()[::-1])]:
        assert rel_err(qkernels.fused_norm_residual(*views[:4], **kw, batch=views[4]), ref) < FP32_TOL
    out = strided_all(np.zeros_like(x))
    qkernels.fused_norm_residual(x, res, g, b, **kw, batch=batch, out=out)
    assert rel_err(out, ref) < FP32_TOL
    (go, x, g), kw = sample(BWD, rng, rows=150, h=13, graphs=7, sort=False, p=0.2)
    ref = reference(BWD, go, x, g, **kw)
    batch = kw.pop("batch")
    for views in [(np.asfortranarray(go), strided_all(x), strided_all(g), strided_all(batch)),
                  (strided_all(go, 3), np.asfortranarray(x), g, batch[::-1].copy()[::-1])]:
        check_norm_grads(qkernels.fused_norm_residual_backward(*views[:3], **kw, batch=views[3]), ref)


@pytest.mark.parametrize("which", [0, 1])
def test_in_place(rng, which):
    """out=x and out=residual: every statistic is taken before any output is written."""
    args, kw = sample(FWD, rng, rows=300, h=21, graphs=4, sort=False)
    kw.update(p=0.3, training=True, seed=4)
    want = qkernels.fused_norm_residual(*args, **kw)
    args = [a.copy() for a in args]
    got = qkernels.fused_norm_residual(*args, **kw, out=args[which])
    assert np.array_equal(got, want) and np.array_equal(args[which], want)


def test_dropout_mask_is_the_row_modes(rng):
    """The mask does not depend on the mode: element (r, h) is dropped by dropout_keep(seed)."""
    x = rng.standard_normal((90, 24)).astype(np.float32)
    zero = np.zeros_like(x)
    seed, p = int(rng.integers(0, 2**63)), 0.4
    kept = qkernels.fused_norm_residual(x, zero, np.zeros(24, np.float32), np.full(24, 5.0, np.float32), p=p,
                                        training=True, seed=seed, batch=graph_batch(rng, 90, 4), num_graphs=4) != 0
    assert np.array_equal(kept, dropout_keep(seed, x.shape, p))
    go = rng.standard_normal((90, 24)).astype(np.float32)
    _, _, gb = qkernels.fused_norm_residual_backward(go, x, np.ones(24, np.float32), p=p, training=True, seed=seed,
                                                     batch=graph_batch(rng, 90, 4, sort=False), num_graphs=4)
    terms = np.where(kept, go.astype(np.float64) / (1 - p), 0)  # fp32 sums of 90 terms: error ~ sum |terms|
    assert np.all(np.abs(gb - terms.sum(0)) <= 1e-6 * np.abs(terms).sum(0))


def test_seed_tensor(rng):
    args, kw = sample(BWD, rng, rows=64, h=10, graphs=3, p=0.3)
    seed = kw.pop("seed")
    want = qkernels.fused_norm_residual_backward(*args, **kw, seed=seed)
    got = qkernels.fused_norm_residual_backward(*args, **kw, seed=np.array([seed], np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_empty_and_zero_width(rng):
    z = np.zeros((0, 6), np.float32)
    out = qkernels.fused_norm_residual(z, z, np.ones(6, np.float32), np.zeros(6, np.float32),
                                       batch=np.zeros(0, np.int64), num_graphs=3)
    assert out.shape == (0, 6)
    gx, gg, gb = qkernels.fused_norm_residual_backward(z, z, np.ones(6, np.float32), batch=np.zeros(0, np.int32),
                                                       num_graphs=3)
    assert gx.shape == (0, 6) and np.array_equal(gg, np.zeros(6)) and np.array_equal(gb, np.zeros(6))
    w = np.zeros((4, 0), np.float32)
    e = np.zeros(0, np.float32)
    assert qkernels.fused_norm_residual(w, w, e, e, batch=np.arange(4), num_graphs=4).shape == (4, 0)
    gx, gg, gb = qkernels.fused_norm_residual_backward(w, w, e, batch=np.arange(4), num_graphs=4)
    assert gx.shape == (4, 0) and gg.shape == (0,) and gb.shape == (0,)
    with pytest.raises(ValueError, match=r"batch\[2\] = 9 is out of range"):  # checked even with H = 0
        qkernels.fused_norm_residual(w, w, e, e, batch=np.array([0, 1, 9, 2]), num_graphs=4)


@pytest.mark.parametrize("op", [FWD, BWD])
def test_errors(rng, op):
    n = 4 if op == FWD else 3
    args, _ = sample(op, rng, rows=8, h=5)
    args = args[:n]
    fn = getattr(qkernels, op)
    batch = np.array([0, 0, 1, 1, 1, 2, 2, 3])
    fn(*args, batch=batch, num_graphs=4)
    bad = batch.copy()
    bad[5], bad[6] = 4, -1  # the first bad position is reported
    with pytest.raises(ValueError, match=rf"^{op}: batch\[5\] = 4 is out of range for num_graphs = 4$"):
        fn(*args, batch=bad, num_graphs=4)
    with pytest.raises(ValueError, match=rf"^{op}: batch\[3\] = -2 is out of range"):
        fn(*args, batch=np.array([3, 2, 1, -2, 0, 0, 0, 0], np.int32), num_graphs=4)
    with pytest.raises(ValueError, match=rf"^{op}: batch needs num_graphs"):
        fn(*args, batch=batch)
    with pytest.raises(ValueError, match=rf"^{op}: num_graphs is given without batch"):
        fn(*args, num_graphs=4)
    with pytest.raises(ValueError, match=r"num_graphs must be between 1 and 2\^63 - 1, got 0"):
        fn(*args, batch=batch, num_graphs=0)
    with pytest.raises(TypeError, match=rf"^{op}: num_graphs must be an int, got float"):
        fn(*args, batch=batch, num_graphs=4.0)
    with pytest.raises(MemoryError, match="num_graphs = 4611686018427387904 needs more than 2"):
        fn(*args, batch=batch, num_graphs=2**62)
    with pytest.raises(TypeError, match=rf"^{op}: batch must be int32 or int64, got float32"):
        fn(*args, batch=batch.astype(np.float32), num_graphs=4)
    with pytest.raises(ValueError, match=r"batch must have shape \[R\] = \[8\]"):
        fn(*args, batch=batch[:7], num_graphs=4)
    with pytest.raises(ValueError, match=r"batch must have 1 dimension"):
        fn(*args, batch=batch.reshape(2, 4), num_graphs=4)
    with pytest.raises(TypeError, match="batch must be a tensor supporting DLPack"):
        fn(*args, batch=[0] * 8, num_graphs=4)


@pytest.mark.parametrize("sort", [True, False])
def test_deterministic_for_any_thread_count(rng, sort):
    fa, fkw = sample(FWD, rng, rows=20_000, h=48, graphs=37, sort=sort)
    fkw.update(p=0.2, training=True, seed=1)
    ba, bkw = sample(BWD, rng, rows=20_000, h=48, graphs=37, sort=sort, p=0.2)
    old = _dispatch.configure(num_threads=1)
    try:
        f1, b1 = qkernels.fused_norm_residual(*fa, **fkw), qkernels.fused_norm_residual_backward(*ba, **bkw)
        for n in (2, 3, 8):
            _dispatch.configure(num_threads=n)
            assert np.array_equal(f1, qkernels.fused_norm_residual(*fa, **fkw)), n
            assert all(np.array_equal(a, b) for a, b in zip(b1, qkernels.fused_norm_residual_backward(*ba, **bkw)))
    finally:
        _dispatch.configure(num_threads=old["num_threads"])


# ---- against torch -----------------------------------------------------------------------------

def torch_graph_norm_residual(x, residual, gamma, beta, batch, num_graphs, p, training, eps, seed):
    """fused_norm_residual's graph mode in float64 torch, as PyG's LayerNorm(mode="graph") computes
    it (per-graph sums by index_add, counts clamped to 1, eps on the variance), then the dropout
    mask of qkernels.testing.dropout_keep and the residual."""
    import torch

    b = batch.long()
    norm = (torch.zeros(num_graphs, dtype=x.dtype).index_add(0, b, torch.ones_like(b, dtype=x.dtype))
            .clamp(min=1) * x.shape[1])[:, None]
    mean = torch.zeros(num_graphs, x.shape[1], dtype=x.dtype).index_add(0, b, x).sum(1, keepdim=True) / norm
    d = x - mean[b]
    var = torch.zeros(num_graphs, x.shape[1], dtype=x.dtype).index_add(0, b, d * d).sum(1, keepdim=True) / norm
    y = d / (var + eps).sqrt()[b] * gamma + beta
    if training and p > 0:
        keep = torch.from_numpy(dropout_keep(seed, tuple(x.shape), p))
        y = torch.where(keep, y / (1 - p) if p < 1 else y * 0, torch.zeros_like(y))
    return y + residual


@requires_torch
@pytest.mark.parametrize("r,h,g", [(17, 33, 3), (300, 16, 40), (64, 128, 1), (500, 7, 600)])
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_against_torch_autograd(rng, r, h, g, sort, p):
    import torch

    (x, res, gm, bt), kw = sample(FWD, rng, rows=r, h=h, mean=2.0, graphs=g, sort=sort, index_dtype=np.int32)
    go = rng.standard_normal((r, h)).astype(np.float32)
    seed = int(rng.integers(0, 2**63))
    batch = torch.from_numpy(kw["batch"])
    leaves = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (x, res, gm, bt)]
    want = torch_graph_norm_residual(*leaves, batch, g, p, True, 1e-5, seed)
    want.backward(torch.from_numpy(go.astype(np.float64)))
    opts = dict(p=p, training=True, seed=seed, batch=batch, num_graphs=g)
    out = qkernels.fused_norm_residual(*[torch.from_numpy(a) for a in (x, res, gm, bt)], **opts)
    assert isinstance(out, torch.Tensor) and rel_err(out.numpy(), want.detach().numpy()) < FP32_TOL
    grads = qkernels.fused_norm_residual_backward(torch.from_numpy(go), torch.from_numpy(x), torch.from_numpy(gm),
                                                  **opts)
    for ours, leaf in zip(grads, (leaves[0], leaves[2], leaves[3])):
        assert isinstance(ours, torch.Tensor) and rel_err(ours.numpy(), leaf.grad.numpy()) < FP32_TOL


@requires_torch
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("seed_as", ["int", "tensor"])
def test_torch_operator_autograd(rng, sort, seed_as):
    """qkernels.fused_norm_residual with batch= on tensors that need grad records the op for autograd
    (batch and num_graphs reach the backward): every input's gradient as torch's float64 autograd."""
    import torch

    (x, res, gm, bt), kw = sample(FWD, rng, rows=120, h=24, graphs=9, sort=sort)
    batch = torch.from_numpy(kw["batch"])
    seed = int(rng.integers(0, 2**63))
    seed_arg = seed if seed_as == "int" else torch.tensor(seed, dtype=torch.int64)
    ours = [torch.from_numpy(a).requires_grad_() for a in (x, res, gm, bt)]
    out = qkernels.fused_norm_residual(*ours, p=0.25, training=True, seed=seed_arg, batch=batch, num_graphs=9)
    assert out.grad_fn is not None
    weight = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * weight).sum().backward()
    leaves = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (x, res, gm, bt)]
    want = torch_graph_norm_residual(*leaves, batch, 9, 0.25, True, 1e-5, seed)
    (want * weight).sum().backward()
    assert rel_err(out.detach().numpy(), want.detach().numpy()) < FP32_TOL
    for a, b in zip(ours, leaves):
        assert a.grad is not None and a.grad.dtype == torch.float32
        assert rel_err(a.grad.numpy(), b.grad.numpy()) < FP32_TOL


@requires_torch
def test_torch_operator_graph_mode_is_not_the_row_mode(rng):
    """The batch reaches the backward: the gradient differs from the row mode's (a test that the
    autograd formula does not drop batch)."""
    import torch

    (x, res, gm, bt), kw = sample(FWD, rng, rows=40, h=8, graphs=3)
    grads = []
    for extra in ({}, dict(batch=torch.from_numpy(kw["batch"]), num_graphs=3)):
        xt = torch.from_numpy(x).requires_grad_()
        out = qkernels.fused_norm_residual(xt, *[torch.from_numpy(a) for a in (res, gm, bt)], **extra)
        (out ** 2).sum().backward()
        grads.append(xt.grad)
    assert not torch.allclose(grads[0], grads[1], atol=1e-3)
    want = reference(BWD, 2 * qkernels.fused_norm_residual(x, res, gm, bt, **kw), x, gm, **kw)[0]
    assert rel_err(grads[1].numpy(), want) < FP32_TOL


@requires_torch
def test_torch_compile_and_opcheck(rng):
    import torch

    import qkernels.torch  # noqa: F401  (registers the operators)

    (x, res, gm, bt), kw = sample(FWD, rng, rows=50, h=12, graphs=4, sort=False)
    args = [torch.from_numpy(a) for a in (x, res, gm, bt)]
    batch = torch.from_numpy(kw["batch"])

    def step(x, res, gm, bt):
        return (qkernels.fused_norm_residual(x, res, gm, bt, batch=batch, num_graphs=4, p=0.1, training=True,
                                             seed=3) ** 2).sum()

    def grads(f):
        leaves = [a.detach().requires_grad_() for a in args]
        loss = f(*leaves)
        loss.backward()
        return loss, [a.grad for a in leaves]

    assert_compiles_like_eager(step, grads, *[a.detach().requires_grad_() for a in args])
    torch.library.opcheck(torch.ops.qkernels.fused_norm_residual.default,
                          tuple(a.detach().requires_grad_() for a in args) + (None, batch),
                          dict(p=0.1, training=True, seed=3, num_graphs=4))


@pytest.mark.skipif(importlib.util.find_spec("torch_geometric") is None, reason="torch_geometric is not installed")
@pytest.mark.parametrize("sort", [True, False])
def test_against_torch_geometric(rng, sort):
    import torch
    from torch_geometric.nn import LayerNorm

    (x, res, gm, bt), kw = sample(FWD, rng, rows=300, h=16, mean=1.0, graphs=12, sort=sort)
    kw["batch"][kw["batch"] == 5] = 6  # an empty graph
    kw["batch"][-1] = 11  # the largest id present: PyG versions without batch_size= infer 12 graphs
    norm = LayerNorm(16, eps=1e-5, mode="graph").double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(gm.astype(np.float64)))
        norm.bias.copy_(torch.from_numpy(bt.astype(np.float64)))
        y = norm(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(kw["batch"]))
    want = y.numpy() + res.astype(np.float64)
    assert rel_err(qkernels.fused_norm_residual(x, res, gm, bt, **kw), want) < FP32_TOL
