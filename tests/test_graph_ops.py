"""fused_edge_features, fused_norm_residual and graph_norm_bce on the cpu backend against the float64
references of qkernels.testing (the dropout mask there: a NumPy Philox); errors; determinism."""

import numpy as np
import pytest

import qkernels
from conftest import rel_err, requires_torch
from qkernels import _dispatch
from qkernels.testing import reference, sample

FP32_TOL = 1e-5


def edges(rng, n, e, idx=np.int64, self_loops=True):
    ei = rng.integers(0, n, size=(2, e)).astype(idx)
    if self_loops and e > 2:
        ei[1, ::3] = ei[0, ::3]
    return ei


# ---- fused_edge_features --------------------------------------------------------------------

@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("n,e,h", [(1, 1, 1), (7, 19, 7), (50, 113, 19), (200, 1023, 113), (10, 0, 4)])
@pytest.mark.parametrize("attr", [True, False])
def test_edge_features(rng, idx, n, e, h, attr):
    x = rng.standard_normal((n, h)).astype(np.float32)
    ei = edges(rng, n, e, idx)
    ea = rng.standard_normal((e, h)).astype(np.float32) if attr else None
    out = qkernels.fused_edge_features(x, ei, ea)
    assert out.shape == (e, (3 if attr else 2) * h) and out.dtype == np.float32
    assert rel_err(out, reference("fused_edge_features", x, ei, ea)) < FP32_TOL


def test_edge_features_strided_inputs_and_poisoned_out(rng):
    x_t = rng.standard_normal((16, 40)).astype(np.float32)
    x = x_t.T  # [40, 16], column-major
    big = np.zeros((3, 2, 500), np.int64)
    big[1] = edges(rng, 40, 500)
    ei = big[1, :, ::2]  # strided in both dims
    ea = rng.standard_normal((16, 250)).astype(np.float32).T
    poisoned = np.full((250, 48), np.nan, np.float32)
    assert qkernels.fused_edge_features(x, ei, ea, out=poisoned) is poisoned
    assert rel_err(poisoned, reference("fused_edge_features", x, ei, ea)) < FP32_TOL


def test_edge_features_errors(rng):
    x = rng.standard_normal((5, 4)).astype(np.float32)
    ei = edges(rng, 5, 9)
    ei[1, 6] = 5
    with pytest.raises(ValueError, match=r"fused_edge_features: edge_index\[1, 6\] = 5 is out of range for x with N = 5"):
        qkernels.fused_edge_features(x, ei)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\]"):
        qkernels.fused_edge_features(x, np.zeros((3, 9), np.int64))
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E, H\] = \[9, 4\]"):
        qkernels.fused_edge_features(x, edges(rng, 5, 9), np.zeros((9, 5), np.float32))
    with pytest.raises(TypeError, match="fused_edge_features: x must be float32, got float64"):
        qkernels.fused_edge_features(x.astype(np.float64), edges(rng, 5, 9))
    with pytest.raises(TypeError, match=r"edge_attr must have x's dtype \(float32\), got float64"):
        qkernels.fused_edge_features(x, edges(rng, 5, 9), np.zeros((9, 4)))
    with pytest.raises(TypeError, match="edge_index must be int32 or int64, got float32"):
        qkernels.fused_edge_features(x, np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \[9, 12\], got \[9, 8\]"):
        qkernels.fused_edge_features(x, edges(rng, 5, 9), np.zeros((9, 4), np.float32), out=np.zeros((9, 8), np.float32))


# ---- fused_norm_residual --------------------------------------------------------------------

@pytest.mark.parametrize("r,h", [(1, 1), (19, 7), (113, 19), (7, 113), (3, 1023), (64, 128)])
def test_norm_residual_inference(rng, r, h):
    args, _ = sample("fused_norm_residual", rng, rows=r, h=h)
    out = qkernels.fused_norm_residual(*args)
    assert out.shape == (r, h) and out.dtype == np.float32
    assert rel_err(out, reference("fused_norm_residual", *args)) < FP32_TOL
    # training=False ignores p entirely
    assert np.array_equal(qkernels.fused_norm_residual(*args, p=0.5, seed=3), out)


def test_norm_residual_large_mean_is_stable(rng):
    args, _ = sample("fused_norm_residual", rng, rows=64, h=256, mean=1e4)
    out = qkernels.fused_norm_residual(*args)
    assert rel_err(out, reference("fused_norm_residual", *args)) < FP32_TOL


def test_norm_residual_eps_and_constant_rows(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=4, h=16)
    x[1] = 3.0  # zero variance: the output is beta + residual
    out = qkernels.fused_norm_residual(x, res, g, b, eps=1e-3)
    assert rel_err(out, reference("fused_norm_residual", x, res, g, b, eps=1e-3)) < FP32_TOL
    assert np.allclose(out[1], b + res[1], atol=1e-6)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_norm_residual_dropout_matches_documented_mask(rng, p):
    args, _ = sample("fused_norm_residual", rng, rows=37, h=19)
    seed = int(rng.integers(0, 2**63))
    out = qkernels.fused_norm_residual(*args, p=p, training=True, seed=seed)
    assert rel_err(out, reference("fused_norm_residual", *args, p=p, training=True, seed=seed)) < FP32_TOL
    again = qkernels.fused_norm_residual(*args, p=p, training=True, seed=seed)
    assert np.array_equal(out, again)


def test_dropout_keep_rate_and_fresh_seeds(rng):
    r, h, p = 512, 256, 0.3
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=r, h=h)
    zero = np.zeros_like(res)
    a = qkernels.fused_norm_residual(x, zero, g, b, p=p, training=True)
    c = qkernels.fused_norm_residual(x, zero, g, b, p=p, training=True)
    kept = (a != 0).mean()
    n = r * h
    assert abs(kept - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)  # binomial, 5 sigma
    assert not np.array_equal(a != 0, c != 0)  # seed=None draws a fresh seed each call
    d = qkernels.fused_norm_residual(x, zero, g, b, p=p, training=True, seed=1)
    e = qkernels.fused_norm_residual(x, zero, g, b, p=p, training=True, seed=2)
    assert not np.array_equal(d != 0, e != 0)


def test_dropout_extremes(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=8, h=32)
    assert np.array_equal(qkernels.fused_norm_residual(x, res, g, b, p=1.0, training=True, seed=5), res)
    assert np.array_equal(qkernels.fused_norm_residual(x, res, g, b, p=0.0, training=True, seed=5),
                          qkernels.fused_norm_residual(x, res, g, b))


def test_norm_residual_strided_and_poisoned_out(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=30, h=24)
    xs = np.asfortranarray(x)
    gs = np.repeat(g, 2)[::2]
    out = np.full((30, 48), np.nan, np.float32)[:, ::2]
    assert qkernels.fused_norm_residual(xs, res, gs, b, out=out) is out
    assert rel_err(out, reference("fused_norm_residual", x, res, g, b)) < FP32_TOL


def test_norm_residual_errors(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=5, h=8)
    with pytest.raises(ValueError, match=r"fused_norm_residual: p must be in \[0, 1\], got 1.5"):
        qkernels.fused_norm_residual(x, res, g, b, p=1.5, training=True)
    with pytest.raises(ValueError, match="eps must be a finite value >= 0"):
        qkernels.fused_norm_residual(x, res, g, b, eps=-1.0)
    with pytest.raises(TypeError, match="p must be a float"):
        qkernels.fused_norm_residual(x, res, g, b, p="x")
    with pytest.raises(TypeError, match="seed must be an int, a one-element int64 tensor or None, got float"):
        qkernels.fused_norm_residual(x, res, g, b, seed=1.5)
    with pytest.raises(ValueError, match=r"residual must have shape \[R, H\] = \[5, 8\]"):
        qkernels.fused_norm_residual(x, res[:4], g, b)
    with pytest.raises(ValueError, match=r"gamma must have shape \[H\] = \[8\]"):
        qkernels.fused_norm_residual(x, res, g[:7], b)
    with pytest.raises(TypeError, match=r"beta must have x's dtype \(float32\), got float64"):
        qkernels.fused_norm_residual(x, res, g, b.astype(np.float64))


# ---- graph_norm_bce -------------------------------------------------------------------------

@pytest.mark.parametrize("idx", [np.int32, np.int64])
@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("e,g", [(1, 1), (19, 1), (113, 7), (5000, 64), (100_000, 4096), (10, 50)])
@pytest.mark.parametrize("pos_weight", [None, 2.5])
def test_graph_bce(rng, idx, sorted_, e, g, pos_weight):
    (logits, target, eg, _), _ = sample("graph_norm_bce", rng, e=e, graphs=g, sort=sorted_, index_dtype=idx)
    r = qkernels.graph_norm_bce(logits, target, eg, g, pos_weight=pos_weight)
    ref = reference("graph_norm_bce", logits, target, eg, g, pos_weight=pos_weight)
    assert np.asarray(r).shape == () and np.asarray(r).dtype == np.float32
    assert abs(float(r) - ref) <= FP32_TOL * abs(ref)


def test_graph_bce_graphs_without_edges_count(rng):
    (logits, target, eg, _), _ = sample("graph_norm_bce", rng, e=300, graphs=10)
    eg = np.where(eg == 4, 5, eg)  # graph 4 has no edges: it contributes 0 and still counts
    r = qkernels.graph_norm_bce(logits, target, eg, 10)
    assert abs(float(r) - reference("graph_norm_bce", logits, target, eg, 10)) <= FP32_TOL * float(r)
    r0 = qkernels.graph_norm_bce(np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64), 3)
    assert float(r0) == 0.0


def test_graph_bce_deterministic_and_strided(rng):
    (logits, target, eg, _), _ = sample("graph_norm_bce", rng, e=60_000, graphs=300, sort=False)
    runs = {float(qkernels.graph_norm_bce(logits, target, eg, 300, pos_weight=3.0)).hex() for _ in range(5)}
    assert len(runs) == 1
    wide = np.zeros((60_000, 3), np.float32)
    wide[:, 1] = logits
    r = qkernels.graph_norm_bce(wide[:, 1], target, eg, 300, pos_weight=3.0)
    assert float(r).hex() in runs


def test_graph_bce_raw_variant_names(rng):
    (logits, target, eg, _), _ = sample("graph_norm_bce", rng, e=500, graphs=9, sort=False)
    want = float(qkernels.graph_norm_bce(logits, target, eg, 9))
    for v in ("auto", "launches", None):  # cuda's launch choices; the cpu kernel has one form
        assert float(np.from_dlpack(qkernels._C.graph_norm_bce_raw(logits, target, eg, 9, _variant=v))) == want
    with pytest.raises(ValueError, match="^graph_norm_bce: _variant"):
        qkernels._C.graph_norm_bce_raw(logits, target, eg, 9, _variant="cooperative")
    with pytest.raises(TypeError, match=r"graph_norm_bce\(\) got an unexpected keyword argument '_variant'"):
        qkernels.graph_norm_bce(logits, target, eg, 9, _variant="auto")


def test_graph_bce_errors(rng):
    (logits, target, eg, _), _ = sample("graph_norm_bce", rng, e=20, graphs=4)
    eg[7] = 4
    with pytest.raises(ValueError, match=r"graph_norm_bce: edge_graph\[7\] = 4 is out of range for num_graphs = 4"):
        qkernels.graph_norm_bce(logits, target, eg, 4)
    with pytest.raises(ValueError, match=r"num_graphs must be between 1 and 2\^63 - 1, got 0"):
        qkernels.graph_norm_bce(logits, target, eg, 0)
    with pytest.raises(TypeError, match="num_graphs must be an int"):
        qkernels.graph_norm_bce(logits, target, eg, 4.0)
    with pytest.raises(ValueError, match=r"target must have shape \[E\] = \[20\]"):
        qkernels.graph_norm_bce(logits, target[:5], eg, 5)
    with pytest.raises(TypeError, match=r"target must have logits' dtype \(float32\), got float64"):
        qkernels.graph_norm_bce(logits, target.astype(np.float64), eg, 5)
    with pytest.raises(TypeError, match="pos_weight must be a float, a tensor or None, got str"):
        qkernels.graph_norm_bce(logits, target, eg, 5, pos_weight="a")


def mixed_runs(rng, e, g):
    """Graph ids in runs of 1 to 600 edges, graphs in random order and revisited: long runs, short
    runs and unsorted stretches side by side, across block and chunk boundaries."""
    ids, n = [], 0
    while n < e:
        k = int(min(e - n, rng.choice([1, 2, 3, 5, 40, 600])))
        ids.append(np.full(k, rng.integers(0, g)))
        n += k
    return np.concatenate(ids).astype(np.int64)


@pytest.mark.parametrize("e,g", [(90_000, 300), (20_000, 5000)])
def test_graph_bce_mixed_runs_any_thread_count(rng, e, g):
    (logits, target, _, _), _ = sample("graph_norm_bce", rng, e=e, graphs=g)
    eg = mixed_runs(rng, e, g)
    ref = reference("graph_norm_bce", logits, target, eg, g, pos_weight=1.5)
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.graph_norm_bce(logits, target, eg, g, pos_weight=1.5)
        assert abs(float(one) - ref) <= FP32_TOL * abs(ref)
        for n in (2, 3, 7):
            _dispatch.configure(num_threads=n)
            assert float(qkernels.graph_norm_bce(logits, target, eg, g, pos_weight=1.5)).hex() == float(one).hex(), n
    finally:
        _dispatch.configure(num_threads=old["num_threads"])


def test_graph_bce_softplus_sweep():
    # one edge per call: each result is one term, so the fp32 exp and log1p are checked across
    # their whole range, not only where the few hand-picked values of the test above fall
    logits = np.concatenate([np.linspace(-95, 95, 1901), -np.logspace(-8, 2, 101), np.logspace(-8, 2, 101)])
    worst = 0.0
    for t in (0.0, 1.0, 0.3):
        for lg in logits.astype(np.float32):
            args = (np.array([lg]), np.array([t], np.float32), np.zeros(1, np.int64), 1)
            r = float(qkernels.graph_norm_bce(*args))
            ref = reference("graph_norm_bce", *args)
            worst = max(worst, abs(r - ref) / (abs(ref) + 1e-30 / 3e-7))
    assert worst <= 3e-7


def test_norm_residual_dropout_any_thread_count(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=3000, h=100)
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.fused_norm_residual(x, res, g, b, p=0.3, training=True, seed=2**40 + 3)
        for n in (2, 5):
            _dispatch.configure(num_threads=n)
            assert np.array_equal(one, qkernels.fused_norm_residual(x, res, g, b, p=0.3, training=True,
                                                                    seed=2**40 + 3)), n
    finally:
        _dispatch.configure(num_threads=old["num_threads"])


# ---- through torch and the dispatcher -------------------------------------------------------

@requires_torch
def test_torch_cpu_and_dispatch(rng):
    import torch

    x = torch.from_numpy(rng.standard_normal((30, 8)).astype(np.float32))
    ei = torch.from_numpy(edges(rng, 30, 50))
    out = qkernels.fused_edge_features(x, ei)
    assert isinstance(out, torch.Tensor)
    assert rel_err(out.numpy(), reference("fused_edge_features", x.numpy(), ei.numpy())) < FP32_TOL
    args = [torch.from_numpy(a) for a in sample("fused_norm_residual", rng, rows=9, h=16)[0]]
    y = qkernels.fused_norm_residual(*args, p=0.2, training=True, seed=11)
    ref = reference("fused_norm_residual", *[a.numpy() for a in args], p=0.2, training=True, seed=11)
    assert rel_err(y.numpy(), ref) < FP32_TOL
    lg, t, eg = [torch.from_numpy(a) for a in sample("graph_norm_bce", rng, e=500, graphs=9)[0][:3]]
    r = qkernels.graph_norm_bce(lg, t, eg, 9)
    assert isinstance(r, torch.Tensor) and r.shape == () and r.dtype == torch.float32
    for op, a in [("fused_edge_features", (x, ei)), ("fused_norm_residual", args), ("graph_norm_bce", (lg, t, eg, 9))]:
        d = qkernels.resolve(op, *a)
        assert d.winner == "cpu" and d.family in qkernels.FAMILIES
    with pytest.raises(qkernels.ExplicitSelectionError, match="'cuda' selected by explicit cannot run family 'graph_norm_bce'"):
        qkernels.graph_norm_bce(lg, t, eg, 9, backend="cuda")
    with pytest.raises(qkernels.ExplicitSelectionError):
        with qkernels.use_backend(graph="flash"):
            qkernels.fused_norm_residual(*args)
    d = qkernels.resolve("fused_norm_residual", x=args[0], residual=args[1], gamma=args[2], beta=args[3])
    assert d.winner == "cpu"


@pytest.mark.parametrize("logit", [-1e4, -100.0, -87.5, -86.9, -20.0, -3.3, -1e-3, -1e-8, 0.0, 1e-8, 0.7, 5.0,
                                   17.0, 30.0, 88.0, 1e4])
@pytest.mark.parametrize("target", [0.0, 1.0, 0.25])
def test_graph_bce_single_term_accuracy(logit, target):
    # one edge, one graph: the result is the term itself, so the fp32 softplus is checked per value
    r = float(qkernels.graph_norm_bce(np.array([logit], np.float32), np.array([target], np.float32),
                                      np.zeros(1, np.int64), 1, pos_weight=2.0))
    ref = reference("graph_norm_bce", np.array([logit], np.float32), np.array([target], np.float32), np.zeros(1), 1,
                    pos_weight=2.0)
    assert abs(r - ref) <= 2e-7 * abs(ref) + 1e-30, (r, ref)


def test_norm_residual_in_place(rng):
    (x, res, g, b), _ = sample("fused_norm_residual", rng, rows=50, h=128)
    ref = qkernels.fused_norm_residual(x, res, g, b)
    r2 = res.copy()
    assert qkernels.fused_norm_residual(x, r2, g, b, out=r2) is r2
    x2 = x.copy()
    qkernels.fused_norm_residual(x2, res, g, b, out=x2)
    assert np.array_equal(r2, ref) and np.array_equal(x2, ref)
