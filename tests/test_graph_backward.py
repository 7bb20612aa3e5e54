"""fused_norm_residual_backward and graph_norm_bce_backward on the cpu backend: against the float64
references of qkernels.testing and against torch.autograd of a float64 torch formulation of each
forward op (written here); awkward sizes, strided views, int32/int64 ids, seeds and pos_weight
given as tensors, errors, determinism for any thread count.  Also the forward ops' tensor
arguments that came with them (seed, pos_weight)."""

import numpy as np
import pytest

import qkernels
from conftest import check_norm_grads, rel_err, requires_torch, strided_all
from qkernels import _dispatch
from qkernels.testing import dropout_keep, reference, sample

FP32_TOL = 1e-5


# ---- fused_norm_residual_backward ----------------------------------------------------------

@pytest.mark.parametrize("r,h", [(1, 1), (19, 7), (113, 19), (7, 113), (3, 1023), (64, 128), (1000, 33)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.9])
def test_norm_backward(rng, r, h, p):
    args, kw = sample("fused_norm_residual_backward", rng, rows=r, h=h, p=p)
    check_norm_grads(qkernels.fused_norm_residual_backward(*args, **kw),
                     reference("fused_norm_residual_backward", *args, **kw))


def test_norm_backward_large_mean_and_eps(rng):
    args, kw = sample("fused_norm_residual_backward", rng, rows=64, h=256, mean=1e4, p=0.3)
    check_norm_grads(qkernels.fused_norm_residual_backward(*args, **kw, eps=1e-3),
                     reference("fused_norm_residual_backward", *args, **kw, eps=1e-3))


def test_norm_backward_dropout_everything_and_not_training(rng):
    (go, x, g), _ = sample("fused_norm_residual_backward", rng, rows=9, h=40)
    gx, gg, gb = qkernels.fused_norm_residual_backward(go, x, g, p=1.0, training=True, seed=3)
    assert not gx.any() and not gg.any() and not gb.any()  # p = 1 drops every element
    plain = qkernels.fused_norm_residual_backward(go, x, g)
    for a, b in zip(qkernels.fused_norm_residual_backward(go, x, g, p=0.5, training=False), plain):
        assert np.array_equal(a, b)  # training=False ignores p (and needs no seed)
    for a, b in zip(qkernels.fused_norm_residual_backward(go, x, g, p=0.0, training=True), plain):
        assert np.array_equal(a, b)
    np.testing.assert_allclose(plain[2], go.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_norm_backward_mask_is_the_forwards(rng):
    """Where the forward dropped an element its gradient path is cut: with gamma = 1, grad_beta is
    the column sum of grad_out over the kept elements, scaled."""
    (go, x, _), _ = sample("fused_norm_residual_backward", rng, rows=50, h=24)
    seed, p = int(rng.integers(0, 2**63)), 0.4
    zero = np.zeros_like(x)
    kept = qkernels.fused_norm_residual(x, zero, np.ones(24, np.float32), np.full(24, 5.0, np.float32), p=p,
                                        training=True, seed=seed) != 0
    assert np.array_equal(kept, dropout_keep(seed, x.shape, p))
    _, _, gb = qkernels.fused_norm_residual_backward(go, x, np.ones(24, np.float32), p=p, training=True, seed=seed)
    np.testing.assert_allclose(gb, np.where(kept, go / (1 - p), 0).sum(0), rtol=1e-5, atol=1e-6)


def test_norm_backward_strided_views(rng):
    args, kw = sample("fused_norm_residual_backward", rng, rows=37, h=20, p=0.2)
    ref = reference("fused_norm_residual_backward", *args, **kw)
    go, x, g = args
    for views in [(np.asfortranarray(go), strided_all(x), strided_all(g)), (go[::-1].copy()[::-1], x, g[::-1].copy()[::-1]),
                  (strided_all(go, 3), np.asfortranarray(x), g)]:
        check_norm_grads(qkernels.fused_norm_residual_backward(*views, **kw), ref)


def test_norm_backward_broadcast_grad_out(rng):
    (_, x, g), _ = sample("fused_norm_residual_backward", rng, rows=12, h=16)
    go = np.broadcast_to(rng.standard_normal(16).astype(np.float32), (12, 16))  # stride 0 over rows
    check_norm_grads(qkernels.fused_norm_residual_backward(go, x, g),
                     reference("fused_norm_residual_backward", go, x, g))


def test_norm_backward_empty(rng):
    x = np.zeros((0, 6), np.float32)
    gx, gg, gb = qkernels.fused_norm_residual_backward(x, x, np.ones(6, np.float32), p=0.5, training=True, seed=1)
    assert gx.shape == (0, 6) and np.array_equal(gg, np.zeros(6)) and np.array_equal(gb, np.zeros(6))
    e = np.zeros((4, 0), np.float32)
    gx, gg, gb = qkernels.fused_norm_residual_backward(e, e, np.zeros(0, np.float32))
    assert gx.shape == (4, 0) and gg.shape == (0,) and gb.shape == (0,)


@pytest.mark.parametrize("shape", [(), (1,)])
def test_seed_tensor_is_the_int_seed(rng, shape):
    args, kw = sample("fused_norm_residual_backward", rng, rows=30, h=33, p=0.3)
    seed = kw.pop("seed")
    want = qkernels.fused_norm_residual_backward(*args, **kw, seed=seed)
    got = qkernels.fused_norm_residual_backward(*args, **kw, seed=np.full(shape, seed, np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=30, h=33)
    y = qkernels.fused_norm_residual(x, res, g, b, **kw, seed=np.full(shape, seed, np.int64))
    assert np.array_equal(y, qkernels.fused_norm_residual(x, res, g, b, **kw, seed=seed))
    # an int64 tensor holds the low 64 bits of an int seed, as a signed value
    neg = np.array(-5, np.int64)
    assert np.array_equal(qkernels.fused_norm_residual(x, res, g, b, **kw, seed=neg),
                          qkernels.fused_norm_residual(x, res, g, b, **kw, seed=2**64 - 5))
    assert rel_err(y, reference("fused_norm_residual", x, res, g, b, **kw, seed=np.full(shape, seed))) < FP32_TOL


def test_seed_tensor_read_at_each_call(rng):
    """The tensor's value is read when the kernel runs: changing it in place changes the mask."""
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=20, h=16)
    seed = np.array([1], np.int64)
    first = qkernels.fused_norm_residual(x, res, g, b, p=0.5, training=True, seed=seed)
    seed[0] = 2
    second = qkernels.fused_norm_residual(x, res, g, b, p=0.5, training=True, seed=seed)
    assert np.array_equal(second, qkernels.fused_norm_residual(x, res, g, b, p=0.5, training=True, seed=2))
    assert not np.array_equal(first, second)


def test_norm_backward_errors(rng):
    (go, x, g), _ = sample("fused_norm_residual_backward", rng, rows=5, h=8)
    op = qkernels.fused_norm_residual_backward
    with pytest.raises(ValueError, match=r"^fused_norm_residual_backward: seed is required when training with p > 0"):
        op(go, x, g, p=0.1, training=True)
    with pytest.raises(TypeError, match="seed must be an int, a one-element int64 tensor or None, got float"):
        op(go, x, g, p=0.1, training=True, seed=1.0)
    with pytest.raises(TypeError, match=r"^fused_norm_residual_backward: seed must be an int64 tensor, got int32"):
        op(go, x, g, p=0.1, training=True, seed=np.array(3, np.int32))
    with pytest.raises(ValueError, match=r"seed must hold one element \(shape \[\] or \[1\]\), got shape \[2\]"):
        op(go, x, g, p=0.1, training=True, seed=np.array([3, 4], np.int64))
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\], got 1.5"):
        op(go, x, g, p=1.5, training=True, seed=1)
    with pytest.raises(ValueError, match="eps must be a finite value >= 0"):
        op(go, x, g, eps=-1.0)
    with pytest.raises(ValueError, match=r"grad_out must have shape \[R, H\] = \[5, 8\]"):
        op(go[:4], x, g)
    with pytest.raises(ValueError, match=r"gamma must have shape \[H\] = \[8\]"):
        op(go, x, g[:7])
    with pytest.raises(ValueError, match=r"x must have 2 dimensions \[R, H\]"):
        op(go, x[0], g)
    with pytest.raises(TypeError, match=r"grad_out must be float32, got float64"):
        op(go.astype(np.float64), x, g)
    with pytest.raises(TypeError, match=r"gamma must have grad_out's dtype \(float32\), got float64"):
        op(go, x, g.astype(np.float64))
    with pytest.raises(TypeError, match="unexpected keyword argument 'out'"):
        op(go, x, g, out=np.zeros_like(go))


def test_norm_backward_deterministic_for_any_thread_count(rng):
    args, kw = sample("fused_norm_residual_backward", rng, rows=5000, h=96, p=0.2)
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.fused_norm_residual_backward(*args, **kw)
        for n in (2, 3, 8):
            _dispatch.configure(num_threads=n)
            again = qkernels.fused_norm_residual_backward(*args, **kw)
            assert all(np.array_equal(a, b) for a, b in zip(one, again)), n
    finally:
        _dispatch.configure(num_threads=old["num_threads"])


# ---- graph_norm_bce_backward ---------------------------------------------------------------

def pos_weights(rng, kind, e, dtype=np.float32):
    """pos_weight of the kind: None, a float, or an array [E], [1] or []."""
    if kind == "float":
        return 2.5
    if kind == "per_edge":
        return (3 * rng.random(e)).astype(dtype)
    if kind == "one":
        return np.array([0.5], dtype)
    if kind == "0-d":
        return np.array(4.0, dtype)
    return None


@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("e,g", [(1, 1), (19, 1), (113, 7), (5000, 64), (100_000, 4096), (10, 50)])
@pytest.mark.parametrize("pw", [None, "float", "per_edge", "one", "0-d"])
def test_bce_backward(rng, idx, sorted_, e, g, pw):
    (grad, lg, t, eg, _), _ = sample("graph_norm_bce_backward", rng, e=e, graphs=g, sort=sorted_, index_dtype=idx)
    pos_weight = pos_weights(rng, pw, e)
    out = qkernels.graph_norm_bce_backward(grad, lg, t, eg, g, pos_weight=pos_weight)
    assert isinstance(out, np.ndarray) and out.shape == (e,) and out.dtype == np.float32
    assert rel_err(out, reference("graph_norm_bce_backward", grad, lg, t, eg, g, pos_weight=pos_weight)) < FP32_TOL
    # the forward with the same pos_weight
    r = qkernels.graph_norm_bce(lg, t, eg, g, pos_weight=pos_weight)
    ref = reference("graph_norm_bce", lg, t, eg, g, pos_weight=pos_weight)
    assert abs(float(r) - ref) <= FP32_TOL * abs(ref)


@pytest.mark.parametrize("shape", [(), (1,)])
def test_bce_backward_grad_shapes_and_scale(rng, shape):
    (grad, lg, t, eg, g), _ = sample("graph_norm_bce_backward", rng, e=300, graphs=5)
    one = qkernels.graph_norm_bce_backward(np.ones(shape, np.float32), lg, t, eg, g)
    three = qkernels.graph_norm_bce_backward(np.full(shape, -3.0, np.float32), lg, t, eg, g)
    np.testing.assert_allclose(three, -3 * one, rtol=1e-6)
    assert rel_err(one, reference("graph_norm_bce_backward", np.ones(shape), lg, t, eg, g)) < FP32_TOL


def test_bce_backward_strided_and_graphs_without_edges(rng):
    (grad, lg, t, eg, _), _ = sample("graph_norm_bce_backward", rng, e=3000, graphs=40, sort=False)
    eg = np.where(eg == 7, 8, eg)  # graph 7 has no edges: it still counts in the mean over graphs
    pw = (3 * rng.random(3000)).astype(np.float32)
    ref = reference("graph_norm_bce_backward", grad, lg, t, eg, 40, pos_weight=pw)
    out = qkernels.graph_norm_bce_backward(strided_all(grad), strided_all(lg), lg.copy() * 0 + t, strided_all(eg, 3), 40,
                                           pos_weight=strided_all(pw))
    assert rel_err(out, ref) < FP32_TOL
    wide = np.zeros((3000, 3), np.float32)
    wide[:, 2] = t
    out = qkernels.graph_norm_bce_backward(grad, lg[::-1].copy()[::-1], wide[:, 2], eg, 40,
                                           pos_weight=np.broadcast_to(pw[:1], (3000,)))
    assert rel_err(out, reference("graph_norm_bce_backward", grad, lg, t, eg, 40, pos_weight=pw[:1])) < FP32_TOL


def test_bce_backward_empty():
    z = np.zeros(0, np.float32)
    out = qkernels.graph_norm_bce_backward(np.ones(1, np.float32), z, z, np.zeros(0, np.int64), 3, pos_weight=z)
    assert out.shape == (0,) and out.dtype == np.float32
    assert float(qkernels.graph_norm_bce(z, z, np.zeros(0, np.int64), 3, pos_weight=z)) == 0.0


def test_bce_backward_deterministic_for_any_thread_count(rng):
    (grad, lg, t, eg, _), _ = sample("graph_norm_bce_backward", rng, e=300_000, graphs=100, sort=False)
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.graph_norm_bce_backward(grad, lg, t, eg, 100, pos_weight=2.0)
        for n in (2, 5):
            _dispatch.configure(num_threads=n)
            assert np.array_equal(one, qkernels.graph_norm_bce_backward(grad, lg, t, eg, 100, pos_weight=2.0))
    finally:
        _dispatch.configure(num_threads=old["num_threads"])


def test_bce_backward_errors(rng):
    (grad, lg, t, eg, g), _ = sample("graph_norm_bce_backward", rng, e=20, graphs=4)
    op = qkernels.graph_norm_bce_backward
    bad = eg.copy()
    bad[7] = 4
    with pytest.raises(ValueError, match=r"^graph_norm_bce_backward: edge_graph\[7\] = 4 is out of range for num_graphs = 4"):
        op(grad, lg, t, bad, 4)
    bad[7], bad[3] = 1, -1  # the first bad position is reported, whichever thread found it
    with pytest.raises(ValueError, match=r"edge_graph\[3\] = -1 is out of range"):
        op(grad, lg, t, bad, 4)
    with pytest.raises(TypeError, match=r"^graph_norm_bce_backward: grad must be float32 \(the loss's dtype\), got float64"):
        op(grad.astype(np.float64), lg, t, eg, g)
    with pytest.raises(ValueError, match=r"grad must hold one element \(shape \[\] or \[1\]\), got shape \[2\]"):
        op(np.ones(2, np.float32), lg, t, eg, g)
    with pytest.raises(TypeError, match="grad must be a tensor supporting DLPack"):
        op(1.0, lg, t, eg, g)
    with pytest.raises(ValueError, match=r"num_graphs must be between 1 and 2\^63 - 1, got 0"):
        op(grad, lg, t, eg, 0)
    with pytest.raises(ValueError, match=r"target must have shape \[E\] = \[20\]"):
        op(grad, lg, t[:5], eg, g)
    with pytest.raises(TypeError, match=r"edge_graph must be int32 or int64, got float32"):
        op(grad, lg, t, eg.astype(np.float32), g)
    with pytest.raises(ValueError, match=r"pos_weight must have shape \[E\] = \[20\], \[1\] or \[\], got \[3\]"):
        op(grad, lg, t, eg, g, pos_weight=np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"pos_weight must be float32 or logits' dtype \(float32\), got float64"):
        op(grad, lg, t, eg, g, pos_weight=np.ones(20))
    with pytest.raises(ValueError, match="pos_weight must be finite in float32"):
        op(grad, lg, t, eg, g, pos_weight=float("inf"))
    with pytest.raises(TypeError, match="pos_weight must be a float, a tensor or None, got str"):
        op(grad, lg, t, eg, g, pos_weight="2")


# ---- against torch.autograd of float64 torch formulations of the forward ops ------------------

def torch_norm_residual(x, residual, gamma, beta, p, training, eps, seed):
    """fused_norm_residual in float64 torch: LayerNorm (population variance), affine, the dropout
    mask of qkernels.testing.dropout_keep, + residual."""
    import torch

    mean = x.mean(1, keepdim=True)
    var = ((x - mean) ** 2).mean(1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * gamma + beta
    if training and p > 0:
        keep = torch.from_numpy(dropout_keep(seed, tuple(x.shape), p))
        y = torch.where(keep, y / (1 - p) if p < 1 else y * 0, torch.zeros_like(y))
    return y + residual


def torch_graph_norm_bce(logits, target, edge_graph, num_graphs, pos_weight):
    """graph_norm_bce in float64 torch: per-edge weighted BCE with logits, each graph's mean over
    its edges (0 without edges), the mean over graphs."""
    import torch

    bce = torch.clamp(logits, min=0) - logits * target + torch.log1p(torch.exp(-logits.abs()))
    if pos_weight is not None:
        bce = bce * (1 + (pos_weight - 1) * target)
    sums = torch.zeros(num_graphs, dtype=torch.float64).index_add(0, edge_graph, bce)
    counts = torch.zeros(num_graphs, dtype=torch.float64).index_add(0, edge_graph, torch.ones_like(bce))
    return (sums / counts.clamp(min=1)).mean()


@requires_torch
@pytest.mark.parametrize("r,h,p", [(17, 33, 0.0), (64, 128, 0.25), (5, 7, 0.9), (200, 20, 0.5)])
@pytest.mark.parametrize("seed_as", ["int", "tensor"])
def test_norm_backward_against_torch_autograd(rng, r, h, p, seed_as):
    import torch

    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=r, h=h, mean=3.0)
    go = rng.standard_normal((r, h)).astype(np.float32)
    seed = int(rng.integers(0, 2**63))
    leaves = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (x, res, g, b)]
    out = torch_norm_residual(*leaves, p, True, 1e-5, seed)
    out.backward(torch.from_numpy(go.astype(np.float64)))
    seed_arg = seed if seed_as == "int" else torch.tensor(seed, dtype=torch.int64)
    gx, gg, gb = qkernels.fused_norm_residual_backward(torch.from_numpy(go), torch.from_numpy(x),
                                                       torch.from_numpy(g), p=p, training=True, seed=seed_arg)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in (gx, gg, gb))
    for ours, leaf in zip((gx, gg, gb), (leaves[0], leaves[2], leaves[3])):
        assert rel_err(ours.numpy(), leaf.grad.numpy()) < FP32_TOL
    assert np.allclose(leaves[1].grad.numpy(), go)  # the residual's gradient is grad_out itself


@requires_torch
@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("pw", [None, "float", "per_edge", "0-d"])
def test_bce_backward_against_torch_autograd(rng, sorted_, idx, pw):
    import torch

    (_, lg, t, eg, g), _ = sample("graph_norm_bce_backward", rng, e=2000, graphs=37, sort=sorted_, index_dtype=idx)
    t = rng.random(2000).astype(np.float32)  # soft targets: the weight depends on t continuously
    pos_weight = pos_weights(rng, pw, 2000)
    logits = torch.from_numpy(lg.astype(np.float64)).requires_grad_()
    pw64 = None if pos_weight is None else torch.as_tensor(np.asarray(pos_weight, np.float64))
    loss = torch_graph_norm_bce(logits, torch.from_numpy(t.astype(np.float64)), torch.from_numpy(eg.astype(np.int64)),
                                g, pw64)
    upstream = 0.75
    loss.backward(torch.tensor(upstream, dtype=torch.float64))
    pw_arg = torch.from_numpy(pos_weight) if isinstance(pos_weight, np.ndarray) else pos_weight
    ours = qkernels.graph_norm_bce_backward(torch.tensor(upstream, dtype=torch.float32), torch.from_numpy(lg),
                                            torch.from_numpy(t), torch.from_numpy(eg), g, pos_weight=pw_arg)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float32 and ours.shape == (2000,)
    assert rel_err(ours.numpy(), logits.grad.numpy()) < FP32_TOL
    fwd = qkernels.graph_norm_bce(torch.from_numpy(lg), torch.from_numpy(t), torch.from_numpy(eg), g, pos_weight=pw_arg)
    assert abs(fwd.item() - loss.item()) <= FP32_TOL * abs(loss.item())


@requires_torch
def test_tensor_arguments_from_torch_and_qkernels(rng):
    """seed and pos_weight tensors from torch beside torch tensors, and as framework-neutral
    qkernels.Tensor beside NumPy arrays."""
    import torch

    args, kw = sample("fused_norm_residual_backward", rng, rows=10, h=12, p=0.3)
    seed = kw.pop("seed")
    want = qkernels.fused_norm_residual_backward(*args, **kw, seed=seed)
    got = qkernels.fused_norm_residual_backward(*[torch.from_numpy(a) for a in args], **kw,
                                                seed=torch.tensor([seed], dtype=torch.int64))
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(want, got))
    got = qkernels.fused_norm_residual_backward(*args, **kw, seed=qkernels.from_dlpack(np.array(seed, np.int64)))
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    with pytest.raises(ValueError, match="all tensors must come from one framework; grad_out comes from numpy but "
                                         "seed from torch"):
        qkernels.fused_norm_residual_backward(*args, **kw, seed=torch.tensor(seed))
    (grad, lg, t, eg, g), _ = sample("graph_norm_bce_backward", rng, e=100, graphs=3)
    pw = (2 * rng.random(100)).astype(np.float32)
    want = qkernels.graph_norm_bce_backward(grad, lg, t, eg, g, pos_weight=pw)
    got = qkernels.graph_norm_bce_backward(*[torch.from_numpy(a) for a in (grad, lg, t, eg)], g,
                                           pos_weight=torch.from_numpy(pw))
    assert np.array_equal(want, got.numpy())
