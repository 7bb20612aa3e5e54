"""rotary_emb_backward, linear_backward and swiglu_backward on the cpu backend, and the [*, K] inputs of
linear and swiglu: against the float64 analytic gradients of qkernels.testing and against torch.autograd
of a float64 torch formulation of each forward op (where torch is installed), float32 through NumPy,
float16 through NumPy and torch, bfloat16 through torch; awkward sizes (0, 1, tails past every tile),
leading dimensions, strided, padded, reversed and broadcast views; every combination of the gradient
flags; bitwise determinism across runs, thread counts and batch positions; errors naming the argument."""

import itertools

import numpy as np
import pytest

import qkernels
from qkernels.testing import freqs_cis, reference, sample
from conftest import HAS_TORCH, fp32_sum_tol, requires_torch

if HAS_TORCH:
    import torch
    import torch.nn.functional as F

HALF_TOL = {np.float16: 2e-3, "float16": 2e-3, "bfloat16": 1.6e-2}  # one rounding of the fp32 result


def randn(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def f64(a):
    if a is None:
        return None
    if HAS_TORCH and isinstance(a, torch.Tensor):
        return a.detach().double().numpy()
    return np.asarray(a, np.float64)


def err_vs(out, ref, mag):
    """Norm-wise error of out against ref, relative to a cancellation-free magnitude (the same product on
    the absolute values of its terms): sums that cancel to near 0 keep a meaningful tolerance."""
    s = np.linalg.norm(mag)
    return np.linalg.norm(f64(out) - ref) / (s if s > 0 else 1.0)


def check(result, refs, mags, tol):
    """Each output against its reference (None where the reference is None)."""
    assert len(result) == len(refs)
    for i, (out, ref, mag) in enumerate(zip(result, refs, mags)):
        assert (out is None) == (ref is None), i
        if ref is None:
            continue
        assert tuple(out.shape) == ref.shape, (i, out.shape, ref.shape)
        assert np.isfinite(f64(out)).all(), f"output {i}: non-finite (an element not written?)"
        assert err_vs(out, ref, mag) < tol, (i, err_vs(out, ref, mag), tol)


# ---- magnitudes: the gradients' formulas on absolute values --------------------------------------

def linear_mags(g, x, w):
    n, k = w.shape
    g2, x2, w2 = np.abs(f64(g)).reshape(-1, n), np.abs(f64(x)).reshape(-1, k), np.abs(f64(w))
    return (g2 @ w2).reshape(np.shape(x)), g2.T @ x2, g2.sum(0)


def swiglu_mags(g, x, up, gate):
    """|ga| @ |up| + |gb| @ |gate| and so on, with ga, gb from the float64 forward: their own error (from
    a and b in fp32) is bounded by |silu'| <= 1.1 and |silu''| <= 0.5 times the magnitudes of a and b."""
    n, k = np.shape(up)
    g2, x2 = f64(g).reshape(-1, n), f64(x).reshape(-1, k)
    u, gt = f64(up), f64(gate)
    a, b = x2 @ u.T, x2 @ gt.T
    s = 1 / (1 + np.exp(-b))
    ga, gb = np.abs(g2 * b * s), np.abs(g2 * a * s * (1 + b * (1 - s)))
    ma, mb = np.abs(x2) @ np.abs(u).T, np.abs(x2) @ np.abs(gt).T  # the error scale of a and b
    ga = ga + np.abs(g2) * 1.1 * mb
    gb = gb + np.abs(g2) * (1.1 * ma + 0.5 * np.abs(a) * mb)
    x_mag = ga @ np.abs(u) + gb @ np.abs(gt)
    return x_mag.reshape(np.shape(x)), ga.T @ np.abs(x2), gb.T @ np.abs(x2)


# ---- float64 torch formulations for torch.autograd -------------------------------------------------

def autograd_linear(g, x, w, bias=True):
    xt, wt = (torch.tensor(f64(a), requires_grad=True) for a in (x, w))
    bt = torch.zeros(w.shape[0], dtype=torch.float64, requires_grad=True)
    F.linear(xt, wt, bt if bias else None).backward(torch.tensor(f64(g)))
    return xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy() if bias else None


def autograd_swiglu(g, x, up, gate):
    xt, ut, gt = (torch.tensor(f64(a), requires_grad=True) for a in (x, up, gate))
    (F.linear(xt, ut) * F.silu(F.linear(xt, gt))).backward(torch.tensor(f64(g)))
    return xt.grad.numpy(), ut.grad.numpy(), gt.grad.numpy()


def autograd_rotary(g, x, f, interleaved):
    """rotary_emb as a float64 torch function of x: pairs rotated by (cos, sin)."""
    xt = torch.tensor(f64(x), requires_grad=True)
    ft = torch.tensor(f64(f))
    c, s = ft[..., 0].unsqueeze(-2), ft[..., 1].unsqueeze(-2)
    half = xt.shape[-1] // 2
    xe, xo = (xt[..., 0::2], xt[..., 1::2]) if interleaved else (xt[..., :half], xt[..., half:])
    ye, yo = xe * c - xo * s, xe * s + xo * c
    y = torch.stack([ye, yo], -1).flatten(-2) if interleaved else torch.cat([ye, yo], -1)
    y.backward(torch.tensor(f64(g)))
    return xt.grad.numpy()


# ---- rotary_emb_backward ------------------------------------------------------------------------

ROTARY_SHAPES = [(1, 1, 2), (5, 3, 8), (7, 2, 6), (2, 4, 3, 16), (3, 1, 5, 64), (0, 2, 8), (4, 0, 8)]


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_backward_fp32(rng, shape, interleaved):
    g = randn(rng, *shape)
    f = freqs_cis(rng, shape[:-2], shape[-1])
    out = qkernels.rotary_emb_backward(g, f, interleaved=interleaved)
    assert out.shape == g.shape and out.dtype == np.float32
    ref = reference("rotary_emb_backward", g, f, interleaved=interleaved)
    # a rotation keeps each pair's norm: no cancellation in the norm-wise error
    assert err_vs(out, ref, np.abs(ref)) < 1e-6
    if HAS_TORCH and g.size:
        x = randn(rng, *shape)
        np.testing.assert_allclose(autograd_rotary(g, x, f, interleaved), ref, rtol=1e-12, atol=1e-12)


def test_rotary_backward_default_and_inverse(rng):
    x = randn(rng, 6, 4, 32)
    f = freqs_cis(rng, (6,), 32)
    back = qkernels.rotary_emb_backward(qkernels.rotary_emb(x, f), f)  # interleaved by default, both
    assert err_vs(back, f64(x), np.abs(f64(x))) < 1e-6  # the transpose of a rotation is its inverse
    assert not np.array_equal(qkernels.rotary_emb_backward(x, f, interleaved=False),
                              qkernels.rotary_emb_backward(x, f))


@pytest.mark.parametrize("dtype", [np.float16, "float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_backward_half(rng, dtype, interleaved):
    g32 = randn(rng, 9, 3, 16)
    f = freqs_cis(rng, (9,), 16)
    if isinstance(dtype, str):
        if not HAS_TORCH:
            pytest.skip("torch is not installed")
        g = torch.from_numpy(g32).to(getattr(torch, dtype))
        out = qkernels.rotary_emb_backward(g, torch.from_numpy(f), interleaved=interleaved)
        assert isinstance(out, torch.Tensor) and out.dtype == g.dtype
    else:
        g = g32.astype(dtype)
        out = qkernels.rotary_emb_backward(g, f, interleaved=interleaved)
        assert out.dtype == dtype
    ref = reference("rotary_emb_backward", f64(g), f, interleaved=interleaved)
    assert err_vs(out, ref, np.abs(ref)) < HALF_TOL[dtype]


def test_rotary_backward_strided_views(rng):
    t, h, d = 11, 3, 16
    qkv = randn(rng, t, 3 * h, d + 4)
    g = qkv[:, h:2 * h, 2:2 + d]  # strided heads and tokens, padded rows
    f = np.broadcast_to(freqs_cis(rng, (1,), d), (t, d // 2, 2))  # one table for every token: stride 0
    ref = reference("rotary_emb_backward", g, f)
    assert err_vs(qkernels.rotary_emb_backward(g, f), ref, np.abs(ref)) < 1e-6
    g4 = randn(rng, 2, t, h, d)[:, ::-1]  # reversed tokens
    f4 = freqs_cis(rng, (2, t), d)
    ref4 = reference("rotary_emb_backward", g4, f4, interleaved=False)
    assert err_vs(qkernels.rotary_emb_backward(g4, f4, interleaved=False), ref4, np.abs(ref4)) < 1e-6


def test_rotary_backward_errors(rng):
    g, f = randn(rng, 4, 2, 8), freqs_cis(rng, (4,), 8)
    with pytest.raises(TypeError, match=r"rotary_emb_backward\(\) got an unexpected keyword argument 'out'"):
        qkernels.rotary_emb_backward(g, f, out=g)
    with pytest.raises(ValueError, match="rotary_emb_backward: grad_out must have 3 or 4 dimensions"):
        qkernels.rotary_emb_backward(g[0], f)
    with pytest.raises(ValueError, match="rotary_emb_backward: grad_out's last dimension D = 7 must be even"):
        qkernels.rotary_emb_backward(randn(rng, 4, 2, 7), f)
    with pytest.raises(TypeError, match="rotary_emb_backward: freqs_cis must be float32, got float64"):
        qkernels.rotary_emb_backward(g, f.astype(np.float64))
    with pytest.raises(ValueError, match=r"rotary_emb_backward: freqs_cis must have shape \[T, D/2, 2\]"):
        qkernels.rotary_emb_backward(g, freqs_cis(rng, (5,), 8))
    with pytest.raises(ValueError, match="rotary_emb_backward: grad_out must be unit-stride in its last dimension"):
        qkernels.rotary_emb_backward(randn(rng, 4, 2, 16)[..., ::2], f)
    with pytest.raises(TypeError, match="rotary_emb_backward: grad_out must be bfloat16 or float16 or float32"):
        qkernels.rotary_emb_backward(g.astype(np.float64), f)
    with pytest.raises(TypeError, match="rotary_emb_backward: interleaved must be a bool"):
        qkernels.rotary_emb_backward(g, f, interleaved=np.array([True, False]))


# ---- linear_backward ----------------------------------------------------------------------------

MS = [0, 1, 2, 7, 17, 33, 65, 300]
KN = [(1, 1), (7, 129), (100, 17), (130, 65)]


def linear_case(rng, lead, k, n, dtype=np.float32):
    return randn(rng, *lead, n, dtype=dtype), randn(rng, *lead, k, dtype=dtype), randn(rng, n, k, scale=max(k, 1) ** -0.5,
                                                                                          dtype=dtype)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", KN)
def test_linear_backward_fp32(rng, m, k, n):
    g, x, w = linear_case(rng, (m,), k, n)
    r = qkernels.linear_backward(g, x, w, bias_grad=True)
    assert type(r) is tuple and all(o.dtype == np.float32 for o in r)
    ref = reference("linear_backward", g, x, w, bias_grad=True)
    check(r, ref, linear_mags(g, x, w), fp32_sum_tol(max(m, n, 1)))
    if HAS_TORCH:
        auto = autograd_linear(g, x, w)
        for mine, theirs in zip(ref, auto):
            np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lead", [(), (1,), (2, 3), (2, 1, 4), (3, 0, 2)])
def test_linear_backward_leading_dims(rng, lead):
    """x [*, K] and grad_out [*, N]: grad_x keeps x's shape; grad_weight and grad_bias sum every position."""
    k, n = 24, 10
    g, x, w = linear_case(rng, lead, k, n)
    r = qkernels.linear_backward(g, x, w, bias_grad=True)
    assert r[0].shape == x.shape and r[1].shape == (n, k) and r[2].shape == (n,)
    check(r, reference("linear_backward", g, x, w, bias_grad=True), linear_mags(g, x, w), fp32_sum_tol(n))
    flat = qkernels.linear_backward(g.reshape(-1, n), x.reshape(-1, k), w, bias_grad=True)
    for a, b in zip(r, flat):  # the same rows in the same order: the same bits
        np.testing.assert_array_equal(np.asarray(a).reshape(np.shape(b)), b)


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_linear_backward_flags(rng, flags):
    g, x, w = linear_case(rng, (5,), 12, 9)
    kw = dict(zip(("x_grad", "weight_grad", "bias_grad"), flags))
    r = qkernels.linear_backward(g, x, w, **kw)
    assert [o is not None for o in r] == list(flags)
    check(r, reference("linear_backward", g, x, w, **kw), linear_mags(g, x, w), 1e-5)
    full = qkernels.linear_backward(g, x, w, bias_grad=True)
    for got, whole in zip(r, full):  # each gradient is the same whatever else is asked for
        if got is not None:
            np.testing.assert_array_equal(got, whole)


def test_linear_backward_defaults(rng):
    g, x, w = linear_case(rng, (3,), 8, 4)
    dx, dw, db = qkernels.linear_backward(g, x, w)
    assert dx is not None and dw is not None and db is None


def padded(rng, a, extra=3):
    """a with the same values inside longer rows (row stride + extra)."""
    big = randn(rng, *a.shape[:-1], a.shape[-1] + extra, dtype=a.dtype)
    big[..., 1:1 + a.shape[-1]] = a
    return big[..., 1:1 + a.shape[-1]]


def test_linear_backward_strided_views(rng):
    m, k, n = 13, 40, 21
    g, x, w = linear_case(rng, (m,), k, n)
    ref = reference("linear_backward", g, x, w, bias_grad=True)
    mags = linear_mags(g, x, w)
    views = [
        (padded(rng, g), padded(rng, x), padded(rng, w)),                       # padded rows
        (np.ascontiguousarray(g[::-1])[::-1], np.ascontiguousarray(x[::-1])[::-1], w),  # reversed rows
        (padded(rng, g.reshape(1, m, n))[0], x.reshape(1, m, k)[0], np.ascontiguousarray(w[::-1])[::-1]),
    ]
    for gv, xv, wv in views:
        check(qkernels.linear_backward(gv, xv, wv, bias_grad=True), ref, mags, fp32_sum_tol(m))
    # broadcast rows (stride 0): every row of x the same
    xb = np.broadcast_to(x[:1], x.shape)
    check(qkernels.linear_backward(g, xb, w, bias_grad=True), reference("linear_backward", g, xb, w, bias_grad=True),
          linear_mags(g, xb, w), fp32_sum_tol(m))
    # 3-D with padded rows: the leading dimensions still step by one stride
    g3, x3, _ = linear_case(rng, (2, 5), k, n)
    r = qkernels.linear_backward(padded(rng, g3), padded(rng, x3), w, bias_grad=True)
    check(r, reference("linear_backward", g3, x3, w, bias_grad=True), linear_mags(g3, x3, w), fp32_sum_tol(10))


def test_linear_backward_empty_and_zero_sizes(rng):
    for m, k, n in [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0), (1, 1, 1)]:
        g, x, w = linear_case(rng, (m,), k, n)
        dx, dw, db = qkernels.linear_backward(g, x, w, bias_grad=True)
        rx, rw, rb = reference("linear_backward", g, x, w, bias_grad=True)
        assert dx.shape == (m, k) and dw.shape == (n, k) and db.shape == (n,)
        np.testing.assert_allclose(f64(dx), rx, atol=1e-6)
        np.testing.assert_allclose(f64(dw), rw, atol=1e-6)
        np.testing.assert_allclose(f64(db), rb, atol=1e-6)
    # M = 0: zero gradients of the weight and bias, not uninitialised memory
    dx, dw, db = qkernels.linear_backward(randn(rng, 0, 6), randn(rng, 0, 9), randn(rng, 6, 9), bias_grad=True)
    assert not dw.any() and not db.any()


@pytest.mark.parametrize("dtype", [np.float16, "float16", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 129), (9, 100, 33), (65, 64, 17), (300, 8, 40)])
def test_linear_backward_half(rng, dtype, m, k, n):
    g, x, w = linear_case(rng, (m,), k, n)
    if isinstance(dtype, str):
        if not HAS_TORCH:
            pytest.skip("torch is not installed")
        g, x, w = (torch.from_numpy(a).to(getattr(torch, dtype)) for a in (g, x, w))
    else:
        g, x, w = (a.astype(dtype) for a in (g, x, w))
    r = qkernels.linear_backward(g, x, w, bias_grad=True)
    assert all(o.dtype == g.dtype for o in r)
    check(r, reference("linear_backward", f64(g), f64(x), f64(w), bias_grad=True), linear_mags(g, x, w),
          HALF_TOL[dtype] + fp32_sum_tol(max(m, n)))


def test_bitwise_determinism_threads_and_batch_position(rng):
    """The same bits run to run, for any thread count, and for a row of grad_x alone or in a batch."""
    old = qkernels._C._configure(num_threads=1)
    try:
        for m, k, n in [(40, 300, 200), (300, 70, 130)]:
            g, x, w = linear_case(rng, (m,), k, n)
            up, gate = w, randn(rng, n, k, scale=k ** -0.5)
            one = qkernels.linear_backward(g, x, w, bias_grad=True) + qkernels.swiglu_backward(g, x, up, gate)
            for threads in (2, 7):
                qkernels._C._configure(num_threads=threads)
                again = qkernels.linear_backward(g, x, w, bias_grad=True) + qkernels.swiglu_backward(g, x, up, gate)
                assert all(np.array_equal(p, q) for p, q in zip(one, again)), (m, threads)
            for i in (0, m // 2, m - 1):
                assert np.array_equal(qkernels.linear_backward(g[i], x[i], w)[0], one[0][i])
                assert np.array_equal(qkernels.swiglu_backward(g[i:i + 1], x[i:i + 1], up, gate)[0][0], one[3][i])
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])


def test_linear_backward_errors(rng):
    g, x, w = linear_case(rng, (4,), 6, 5)
    op = qkernels.linear_backward
    with pytest.raises(ValueError, match=r"linear_backward: grad_out must have shape \[4, 5\] \(x's leading dimensions, "
                                         r"then N = 5\), got \[4, 6\]"):
        op(randn(rng, 4, 6), x, w)
    with pytest.raises(ValueError, match=r"linear_backward: grad_out must have shape \[2, 2, 5\]"):
        op(g, x.reshape(2, 2, 6), w)
    with pytest.raises(ValueError, match=r"linear_backward: weight must have shape \[N, K\] = \[5, 6\] with size 6 in "
                                         r"dimension 1, got \[5, 7\]"):
        op(g, x, randn(rng, 5, 7))
    with pytest.raises(ValueError, match=r"linear_backward: weight must have 2 dimensions \[N, K\]"):
        op(g, x, randn(rng, 6))
    with pytest.raises(TypeError, match=r"linear_backward: x must have grad_out's dtype \(float32\), got float16"):
        op(g, x.astype(np.float16), w)
    with pytest.raises(TypeError, match=r"linear_backward: weight must have grad_out's dtype \(float32\), got float64"):
        op(g, x, w.astype(np.float64))
    with pytest.raises(TypeError, match="linear_backward: grad_out must be bfloat16 or float16 or float32, got int32"):
        op(g.astype(np.int32), x, w)
    with pytest.raises(ValueError, match="linear_backward: x must be unit-stride in its last dimension"):
        op(g, randn(rng, 4, 12)[:, ::2], w)
    with pytest.raises(ValueError, match="linear_backward: grad_out must be unit-stride in its last dimension"):
        op(randn(rng, 4, 10)[:, ::2], x, w)
    with pytest.raises(ValueError, match=r"linear_backward: x's leading dimensions \(shape \[2, 2, 6\], strides "
                                         r"\[6, 12, 1\] in elements\) cannot be read as rows of one stride; pass "
                                         r"x.contiguous\(\)"):
        op(g.reshape(2, 2, 5), x.reshape(2, 2, 6).transpose(1, 0, 2), w)
    with pytest.raises(ValueError, match=r"linear_backward: grad_out's leading dimensions .* cannot be read as rows"):
        op(g.reshape(2, 2, 5).transpose(1, 0, 2), x.reshape(2, 2, 6), w)
    with pytest.raises(ValueError, match="linear_backward: x must have at least 1 dimension"):
        op(g[0], x[0, 0, ...], w)
    with pytest.raises(TypeError, match="linear_backward: bias_grad must be a bool"):
        op(g, x, w, bias_grad=np.array([1, 2]))
    with pytest.raises(TypeError, match=r"linear_backward\(\) got an unexpected keyword argument 'out'"):
        op(g, x, w, out=x)
    with pytest.raises(TypeError, match=r"linear_backward\(\) takes at most 3 positional arguments"):
        op(g, x, w, True)
    with pytest.raises(TypeError, match=r"linear_backward\(\) missing required argument 'weight'"):
        qkernels._C.linear_backward_raw(g, x)
    with pytest.raises(ValueError, match=r"linear_backward: _variant must be one of 'auto', 'tiles', 'lt'"):
        qkernels._C.linear_backward_raw(g, x, w, _variant="fast")
    with pytest.raises(ValueError, match=r"linear_backward: _split must be in \[0, 64\]"):
        qkernels._C.linear_backward_raw(g, x, w, _split=65)


# ---- swiglu_backward ----------------------------------------------------------------------------

def swiglu_case(rng, lead, k, n, dtype=np.float32):
    return (randn(rng, *lead, n, dtype=dtype), randn(rng, *lead, k, dtype=dtype),
            randn(rng, n, k, scale=max(k, 1) ** -0.5, dtype=dtype), randn(rng, n, k, scale=2 * max(k, 1) ** -0.5, dtype=dtype))


@pytest.mark.parametrize("m", [0, 1, 2, 9, 33, 65, 300])
@pytest.mark.parametrize("k,n", [(1, 1), (7, 129), (100, 17), (130, 65)])
def test_swiglu_backward_fp32(rng, m, k, n):
    g, x, up, gate = swiglu_case(rng, (m,), k, n)
    r = qkernels.swiglu_backward(g, x, up, gate)
    assert type(r) is tuple and len(r) == 3
    ref = reference("swiglu_backward", g, x, up, gate)
    check(r, ref, swiglu_mags(g, x, up, gate), 2 * fp32_sum_tol(max(m, 2 * n, k, 1)))
    if HAS_TORCH and m:
        for mine, theirs in zip(ref, autograd_swiglu(g, x, up, gate)):
            np.testing.assert_allclose(mine, theirs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=2)))
def test_swiglu_backward_flags_and_leading_dims(rng, flags):
    g, x, up, gate = swiglu_case(rng, (2, 3), 20, 11)
    kw = dict(zip(("x_grad", "weight_grad"), flags))
    r = qkernels.swiglu_backward(g, x, up, gate, **kw)
    assert [o is not None for o in r] == [flags[0], flags[1], flags[1]]
    if flags[0]:
        assert r[0].shape == x.shape
    check(r, reference("swiglu_backward", g, x, up, gate, **kw), swiglu_mags(g, x, up, gate), 2 * fp32_sum_tol(22))
    full = qkernels.swiglu_backward(g.reshape(6, 11), x.reshape(6, 20), up, gate)
    for got, whole in zip(r, full):
        if got is not None:
            np.testing.assert_array_equal(np.asarray(got).reshape(whole.shape), whole)


def test_swiglu_backward_strided_views(rng):
    m, k, n = 10, 36, 19
    g, x, up, gate = swiglu_case(rng, (m,), k, n)
    ref = reference("swiglu_backward", g, x, up, gate)
    mags = swiglu_mags(g, x, up, gate)
    both = np.concatenate([up, gate], 1)  # rows of up and gate with stride 2k
    check(qkernels.swiglu_backward(padded(rng, g), padded(rng, x), both[:, :k], both[:, k:]), ref, mags,
          2 * fp32_sum_tol(2 * n))
    check(qkernels.swiglu_backward(np.ascontiguousarray(g[::-1])[::-1], x, np.ascontiguousarray(up[::-1])[::-1], gate),
          ref, mags, 2 * fp32_sum_tol(2 * n))


def test_swiglu_backward_empty_and_zero_sizes(rng):
    """An empty gate (whose data pointer may be NULL) is never read; sums without terms are 0."""
    for m, k, n in [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0), (1, 1, 1)]:
        args = swiglu_case(rng, (m,), k, n)
        r = qkernels.swiglu_backward(*args)
        assert [o.shape for o in r] == [(m, k), (n, k), (n, k)]
        for got, ref in zip(r, reference("swiglu_backward", *args)):  # fp32: a few roundings of values ~10
            np.testing.assert_allclose(f64(got), ref, rtol=1e-5, atol=1e-6)
    dx, dup, dgate = qkernels.swiglu_backward(randn(rng, 0, 6), randn(rng, 0, 9), randn(rng, 6, 9), randn(rng, 6, 9))
    assert not dup.any() and not dgate.any()
    dx, _, _ = qkernels.swiglu_backward(randn(rng, 3, 0), randn(rng, 3, 9), randn(rng, 0, 9), randn(rng, 0, 9))
    assert dx.shape == (3, 9) and not dx.any()
    if HAS_TORCH:  # torch's empty tensors export NULL data pointers
        e = torch.empty(0, 9)
        assert e.data_ptr() == 0
        dx, _, _ = qkernels.swiglu_backward(torch.ones(3, 0), torch.ones(3, 9), e, e)
        assert dx.shape == (3, 9) and not dx.any()
        assert not qkernels.swiglu(torch.ones(3, 0), e.T.contiguous(), e.T.contiguous()).any()  # K = 0: zeros


def test_swiglu_backward_extreme_gates():
    """Gate products of +-200, -88 and 0: silu and its derivative must give finite values (0, g), never NaN."""
    x = np.array([[1.0, 0.0]], np.float32)
    gate = np.array([[200.0, 0], [-200.0, 0], [0, 0], [-88.0, 0], [30.0, 0]], np.float32)
    up = np.full((5, 2), 0.5, np.float32)
    g = np.ones((1, 5), np.float32)
    dx, dup, dgate = qkernels.swiglu_backward(g, x, up, gate)
    assert np.isfinite(dx).all() and np.isfinite(dup).all() and np.isfinite(dgate).all()
    ref = reference("swiglu_backward", g, x, up, gate)
    for got, r in zip((dx, dup, dgate), ref):
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, "float16", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 129), (9, 100, 33), (70, 64, 17)])
def test_swiglu_backward_half(rng, dtype, m, k, n):
    args = swiglu_case(rng, (m,), k, n)
    if isinstance(dtype, str):
        if not HAS_TORCH:
            pytest.skip("torch is not installed")
        args = tuple(torch.from_numpy(a).to(getattr(torch, dtype)) for a in args)
    else:
        args = tuple(a.astype(dtype) for a in args)
    r = qkernels.swiglu_backward(*args)
    assert all(o.dtype == args[0].dtype for o in r)
    check(r, reference("swiglu_backward", *(f64(a) for a in args)), swiglu_mags(*args),
          HALF_TOL[dtype] + 2 * fp32_sum_tol(2 * n))


def test_swiglu_backward_errors(rng):
    g, x, up, gate = swiglu_case(rng, (4,), 6, 5)
    op = qkernels.swiglu_backward
    with pytest.raises(ValueError, match=r"swiglu_backward: gate_weight must have shape \[N, K\] = \[5, 6\] with size 5 "
                                         r"in dimension 0, got \[4, 6\]"):
        op(g, x, up, randn(rng, 4, 6))
    with pytest.raises(TypeError, match=r"swiglu_backward: gate_weight must have grad_out's dtype \(float32\), got "
                                        r"float16"):
        op(g, x, up, gate.astype(np.float16))
    with pytest.raises(TypeError, match="swiglu_backward: gate_weight must be a tensor supporting DLPack"):
        op(g, x, up, None)
    with pytest.raises(ValueError, match=r"swiglu_backward: grad_out must have shape \[4, 5\]"):
        op(g[:, :4], x, up, gate)
    with pytest.raises(TypeError, match=r"swiglu_backward\(\) got an unexpected keyword argument 'bias_grad'"):
        op(g, x, up, gate, bias_grad=True)
    with pytest.raises(TypeError, match=r"swiglu_backward\(\) missing required argument 'gate_weight'"):
        qkernels._C.swiglu_backward_raw(g, x, up)
    with pytest.raises(ValueError, match="swiglu_backward: up_weight must be unit-stride in its last dimension"):
        op(g, x, np.ascontiguousarray(up.T).T, gate)


# ---- the forward ops' [*, K] inputs ---------------------------------------------------------------

@pytest.mark.parametrize("lead", [(2, 3), (1, 4), (2, 1, 3), (3, 0), (1, 1, 1)])
def test_forward_leading_dims(rng, lead):
    k, n = 18, 7
    x, w, b, gate = randn(rng, *lead, k), randn(rng, n, k), randn(rng, n), randn(rng, n, k)
    out = qkernels.linear(x, w, b)
    assert out.shape == lead + (n,)
    np.testing.assert_array_equal(np.asarray(out).reshape(-1, n), qkernels.linear(x.reshape(-1, k), w, b))
    s = qkernels.swiglu(x, w, gate)
    assert s.shape == lead + (n,)
    np.testing.assert_array_equal(np.asarray(s).reshape(-1, n), qkernels.swiglu(x.reshape(-1, k), w, gate))
    o = np.full(lead + (n + 2,), np.nan, np.float32)[..., 1:1 + n]  # padded rows of out: still one stride
    assert qkernels.linear(x, w, b, out=o) is o
    np.testing.assert_array_equal(o, out)


def test_forward_leading_dims_errors(rng):
    x, w = randn(rng, 2, 3, 8), randn(rng, 5, 8)
    with pytest.raises(ValueError, match=r"swiglu: x's leading dimensions \(shape \[3, 2, 8\], strides \[8, 24, 1\] in "
                                         r"elements\) cannot be read as rows of one stride; pass x.contiguous\(\)"):
        qkernels.swiglu(x.transpose(1, 0, 2), w, w)
    with pytest.raises(ValueError, match=r"linear: out's leading dimensions .* cannot be read as rows"):
        qkernels.linear(x, w, out=np.zeros((3, 2, 5), np.float32).transpose(1, 0, 2))
    with pytest.raises(ValueError, match=r"linear: out must have shape \[2, 3, 5\], got \[6, 5\]"):
        qkernels.linear(x, w, out=np.zeros((6, 5), np.float32))
    # size-1 dimensions take any stride, and a stride-0 dimension over rows that repeat is one stride
    xb = np.broadcast_to(x[:1, :1], (2, 3, 8))  # strides (0, 0, 1)
    np.testing.assert_array_equal(qkernels.linear(xb, w), qkernels.linear(np.ascontiguousarray(xb), w))


@requires_torch
def test_forward_and_backward_torch_nd(rng):
    g, x, w = (torch.from_numpy(a) for a in linear_case(rng, (2, 4), 16, 8))
    assert qkernels.linear(x, w).shape == (2, 4, 8)
    dx, dw, db = qkernels.linear_backward(g, x, w, bias_grad=True)
    assert isinstance(dx, torch.Tensor) and dx.shape == x.shape and dw.shape == w.shape and db.shape == (8,)
    auto = autograd_linear(g, x, w)
    for mine, theirs in zip((dx, dw, db), auto):
        np.testing.assert_allclose(mine.double().numpy(), theirs, rtol=1e-5, atol=1e-5)


# ---- through the dispatcher -----------------------------------------------------------------------

def test_dispatch_families(env, rng):
    env()
    for op in ("rotary_emb_backward", "linear_backward", "swiglu_backward"):
        args, kwargs = sample(op, rng)
        d = qkernels.resolve(op, *args, **kwargs)
        assert d.winner == "cpu"
        assert qkernels._dispatch.OPS[op][:2] == (op.replace("_backward", ""), 0)  # the forward's family, grad_out
    env(QKERNELS_OPS="linear=cuda")
    args, kwargs = sample("linear_backward", rng)
    with pytest.raises(qkernels.ExplicitSelectionError, match="linear_backward: backend 'cuda' selected by env "
                                                              "QKERNELS_OPS cannot run family 'linear'"):
        qkernels.linear_backward(*args, **kwargs)
    qkernels.swiglu_backward(*sample("swiglu_backward", rng)[0])  # another family: untouched
