"""rotary_emb, linear and swiglu on the cpu backend against the float64 references of qkernels.testing: float32
through NumPy, bfloat16/float16 through torch (against a naive same-precision torch computation's
own error), strided and poisoned outputs, non-contiguous inputs, bitwise determinism across runs,
thread counts and batch positions, errors and the dispatcher."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import freqs_cis, reference, sample
from conftest import HAS_TORCH, close_to_naive, f64, fp32_sum_tol, naive_rotary, rel_err, requires_torch

if HAS_TORCH:
    import torch
    import torch.nn.functional as F

FP32_TOL = 1e-5


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


# ---- linear and swiglu, float32 -----------------------------------------------------------------

MS = [1, 2, 7, 8, 9, 16, 33, 64, 65, 300]
SMALL = [(k, n) for k in (7, 100, 1536) for n in (1, 129)]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", SMALL)
def test_linear_fp32(rng, m, k, n):
    (x, w, b), _ = sample("linear", rng, m=m, k=k, n=n)
    out = qkernels.linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == np.float32
    # Error against the sum of |terms|, not the result: one output (m = n = 1) can cancel to
    # near zero, which no fixed relative tolerance survives.
    scale = np.linalg.norm(np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + np.abs(b))
    assert np.linalg.norm(np.asarray(out, np.float64) - reference("linear", x, w, b)) / scale < fp32_sum_tol(k)
    assert not np.isnan(np.asarray(out)).any()
    out = qkernels.linear(x, w)
    assert np.linalg.norm(np.asarray(out, np.float64) - reference("linear", x, w)) / scale < fp32_sum_tol(k)


@pytest.mark.parametrize("m", [1, 9, 65])
@pytest.mark.parametrize("k,n", [(7, 129), (100, 1), (1536, 129)])
def test_swiglu_fp32(rng, m, k, n):
    (x, up, gate), _ = sample("swiglu", rng, m=m, k=k, n=n)
    out = qkernels.swiglu(x, up, gate)
    assert out.shape == (m, n) and out.dtype == np.float32
    # against the size of the summands, not the result: with n = 1 a single output may cancel to ~0
    scale = np.linalg.norm(reference("swiglu", np.abs(x), np.abs(up), np.abs(gate)))
    err = np.linalg.norm(np.asarray(out, np.float64) - reference("swiglu", x, up, gate))
    assert err < 2 * fp32_sum_tol(k) * scale


@pytest.mark.parametrize("m,n", [(1, 4096), (2, 14336)])
def test_large_weights_decode_sizes(rng, m, n):
    k = 4096
    (x, w, b), _ = sample("linear", rng, m=m, k=k, n=n)
    assert rel_err(qkernels.linear(x, w, b), reference("linear", x, w, b)) < fp32_sum_tol(k)
    if n == 4096:
        gate = randn(rng, n, k, scale=k ** -0.5)
        assert rel_err(qkernels.swiglu(x, w, gate), reference("swiglu", x, w, gate)) < 2 * fp32_sum_tol(k)


def test_one_dimensional_x(rng):
    x, w, b = randn(rng, 100), randn(rng, 129, 100), randn(rng, 129)
    out = qkernels.linear(x, w, b)
    assert out.shape == (129,)
    assert rel_err(out, reference("linear", x, w, b)) < FP32_TOL
    g = randn(rng, 129, 100)
    out = qkernels.swiglu(x, w, g)
    assert out.shape == (129,) and rel_err(out, reference("swiglu", x, w, g)) < FP32_TOL
    poisoned = np.full(129, np.nan, np.float32)
    assert qkernels.linear(x, w, out=poisoned) is poisoned
    assert rel_err(poisoned, reference("linear", x, w)) < FP32_TOL


def test_silu_extremes():
    # gate dot products of +-200 and 0: silu must give g, -0 and 0, never NaN
    x = np.array([[1.0, 0.0]], np.float32)
    gate = np.array([[200.0, 0], [-200.0, 0], [0, 0], [-88.0, 0]], np.float32)
    up = np.full((4, 2), 3.0, np.float32)
    out = qkernels.swiglu(x, up, gate)
    assert np.isfinite(out).all()
    assert np.allclose(out, reference("swiglu", x, up, gate), rtol=1e-6, atol=1e-37)


def test_empty_and_zero_k(rng):
    w, b = randn(rng, 5, 3), randn(rng, 5)
    assert qkernels.linear(np.zeros((0, 3), np.float32), w, b).shape == (0, 5)
    assert qkernels.linear(randn(rng, 4, 3), np.zeros((0, 3), np.float32)).shape == (4, 0)
    # K = 0: the empty sum is 0, so out is the bias
    out = qkernels.linear(np.zeros((4, 0), np.float32), np.zeros((5, 0), np.float32), b)
    assert np.array_equal(out, np.broadcast_to(b, (4, 5)))
    assert np.array_equal(qkernels.swiglu(np.zeros((2, 0), np.float32), *np.zeros((2, 5, 0), np.float32)),
                          np.zeros((2, 5), np.float32))


def test_strided_rows_and_poisoned_out(rng):
    m, k, n = 33, 100, 129
    xb, wb, gb = randn(rng, m, k + 13), randn(rng, n, 2 * k), randn(rng, n, k + 1)
    x, w, g = xb[:, 5:5 + k], wb[:, k:], gb[:, :k]  # row strides k + 13, 2k, k + 1
    bias = randn(rng, 2 * n)[::2]  # element stride 2
    big = np.full((m, n + 7), np.nan, np.float32)
    out = big[:, 3:3 + n]
    assert qkernels.linear(x, w, bias, out=out) is out
    assert rel_err(out, reference("linear", x, w, bias)) < FP32_TOL
    assert np.isnan(big[:, :3]).all() and np.isnan(big[:, 3 + n:]).all()
    big[:] = np.nan
    qkernels.swiglu(x, w, g, out=out)
    assert rel_err(out, reference("swiglu", x, w, g)) < FP32_TOL
    assert np.isnan(big[:, :3]).all() and np.isnan(big[:, 3 + n:]).all()


@pytest.mark.parametrize("op", ["linear", "swiglu"])
def test_inner_strided_inputs_rejected(rng, op):
    x, w = randn(rng, 4, 16), randn(rng, 8, 16)
    fn = (lambda x, w, **kw: qkernels.linear(x, w, **kw)) if op == "linear" else \
        (lambda x, w, **kw: qkernels.swiglu(x, w, w, **kw))
    with pytest.raises(ValueError, match=f"{op}: x must be unit-stride in its last dimension, got stride 2"):
        fn(randn(rng, 4, 32)[:, ::2], w)
    name = "weight" if op == "linear" else "up_weight"
    with pytest.raises(ValueError, match=f"{op}: {name} must be unit-stride in its last dimension"):
        fn(x, np.ascontiguousarray(w.T).T)
    with pytest.raises(ValueError, match=f"{op}: out must be unit-stride in its last dimension"):
        fn(x, w, out=np.zeros((4, 16), np.float32)[:, ::2])
    if op == "swiglu":
        with pytest.raises(ValueError, match="swiglu: gate_weight must be unit-stride"):
            qkernels.swiglu(x, w, np.ascontiguousarray(w.T).T)


def test_bitwise_determinism_threads_and_batch_position(rng):
    """The same bits run to run, for any thread count, and for a row alone or inside a batch."""
    cases = [(33, 1000, 1536), (300, 17, 4096)]  # the second splits x's rows between threads
    old = qkernels._C._configure(num_threads=1)
    try:
        for m, n, k in cases:
            x, w, b, g = randn(rng, m, k), randn(rng, n, k), randn(rng, n), randn(rng, n, k)
            one = qkernels.linear(x, w, b), qkernels.swiglu(x, w, g)
            for threads in (2, 7):
                qkernels._C._configure(num_threads=threads)
                again = qkernels.linear(x, w, b), qkernels.swiglu(x, w, g)
                assert all(np.array_equal(p, q) for p, q in zip(one, again)), (m, n, k, threads)
                assert np.array_equal(qkernels.linear(x, w, b), again[0])
            for i in (0, m // 2, m - 1):
                assert np.array_equal(qkernels.linear(x[i], w, b), one[0][i])
                assert np.array_equal(qkernels.swiglu(x[i:i + 1], w, g)[0], one[1][i])
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])


# ---- linear and swiglu, bfloat16 / float16 ----------------------------------------------------

@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 129), (8, 100, 1), (9, 1536, 129), (65, 100, 129), (300, 7, 129),
                                   (2, 4096, 4096)])
def test_linear_swiglu_half(rng, dtype, m, k, n):
    dt = getattr(torch, dtype)
    x = torch.from_numpy(randn(rng, m, k)).to(dt)
    w, g = (torch.from_numpy(randn(rng, n, k, scale=k ** -0.5)).to(dt) for _ in range(2))
    b = torch.from_numpy(randn(rng, n)).to(dt)
    out = qkernels.linear(x, w, b)
    assert isinstance(out, torch.Tensor) and out.dtype == dt and out.shape == (m, n)
    close_to_naive(out, F.linear(x, w, b), reference("linear", f64(x), f64(w), f64(b)))
    out = qkernels.swiglu(x, w, g)
    assert out.dtype == dt and out.shape == (m, n)
    close_to_naive(out, F.linear(x, w) * F.silu(F.linear(x, g)), reference("swiglu", f64(x), f64(w), f64(g)))


def test_linear_float16_numpy(rng):
    # float16 through NumPy (no exchange API): the same kernel as through torch
    x, w, b = randn(rng, 7, 100).astype(np.float16), randn(rng, 129, 100, scale=0.1).astype(np.float16), \
        randn(rng, 129).astype(np.float16)
    out = qkernels.linear(x, w, b)
    assert out.dtype == np.float16
    ref = reference("linear", x, w, b)
    naive = (x.astype(np.float32) @ w.astype(np.float32).T + b).astype(np.float16)
    close_to_naive(out, naive, ref)


@requires_torch
def test_half_determinism_and_poisoned_out(rng):
    x = torch.from_numpy(randn(rng, 40, 1536)).bfloat16()
    w, g = (torch.from_numpy(randn(rng, 300, 1536)).bfloat16() for _ in range(2))
    old = qkernels._C._configure(num_threads=1)
    try:
        one = qkernels.swiglu(x, w, g)
        qkernels._C._configure(num_threads=7)
        out = torch.full((40, 300), float("nan"), dtype=torch.bfloat16)
        assert qkernels.swiglu(x, w, g, out=out) is out
    finally:
        qkernels._C._configure(num_threads=old["num_threads"])
    assert torch.equal(one, out)
    xs = torch.from_numpy(randn(rng, 40, 2000)).bfloat16()[:, 100:1636]  # row stride 2000
    assert torch.equal(qkernels.swiglu(xs, w, g), qkernels.swiglu(xs.contiguous(), w, g))


# ---- rotary_emb -------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 2), (19, 3, 6), (7, 4, 64), (33, 2, 128), (2, 5, 3, 6), (3, 9, 2, 128)])
def test_rotary_fp32(rng, shape, interleaved):
    x = randn(rng, *shape)
    f = freqs_cis(rng, shape[:-2], shape[-1])
    out = qkernels.rotary_emb(x, f, interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == np.float32
    assert rel_err(out, reference("rotary_emb", x, f, interleaved=interleaved)) < FP32_TOL
    y = x.copy()
    assert qkernels.rotary_emb(y, f, interleaved=interleaved, out=y) is y  # in place
    assert np.array_equal(y, out)


def test_rotary_default_is_interleaved(rng):
    x, f = randn(rng, 5, 2, 8), freqs_cis(rng, (5,), 8)
    assert np.array_equal(qkernels.rotary_emb(x, f), qkernels.rotary_emb(x, f, interleaved=True))
    assert not np.array_equal(qkernels.rotary_emb(x, f), qkernels.rotary_emb(x, f, interleaved=False))


@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(19, 3, 6), (33, 4, 64), (2, 7, 3, 128)])
def test_rotary_half(rng, dtype, interleaved, shape):
    dt = getattr(torch, dtype)
    x = torch.from_numpy(randn(rng, *shape)).to(dt)
    f = torch.from_numpy(freqs_cis(rng, shape[:-2], shape[-1]))
    out = qkernels.rotary_emb(x, f, interleaved=interleaved)
    assert isinstance(out, torch.Tensor) and out.dtype == dt and out.shape == x.shape
    ref = reference("rotary_emb", f64(x), f.numpy(), interleaved=interleaved)
    close_to_naive(out, naive_rotary(x, f, interleaved), ref)
    y = x.clone()
    assert qkernels.rotary_emb(y, f, interleaved=interleaved, out=y) is y
    assert torch.equal(y, out)


def test_rotary_strided_views_and_poisoned_out(rng):
    t, h, d = 11, 4, 64
    qkv = randn(rng, t, 3 * h, d)
    q = qkv[:, :h]  # token stride 3hd: a view into a fused qkv projection
    f = freqs_cis(rng, (t,), d)
    big = np.full((t, h, d + 8), np.nan, np.float32)
    out = big[..., 4:4 + d]
    assert qkernels.rotary_emb(q, f, out=out) is out
    assert rel_err(out, reference("rotary_emb", q, f)) < FP32_TOL
    assert np.isnan(big[..., :4]).all() and np.isnan(big[..., 4 + d:]).all()
    # in place into the fused buffer: only q's part changes
    before = qkv.copy()
    qkernels.rotary_emb(q, f, interleaved=False, out=q)
    assert rel_err(qkv[:, :h], reference("rotary_emb", before[:, :h], f, interleaved=False)) < FP32_TOL
    assert np.array_equal(qkv[:, h:], before[:, h:])
    # freqs shared across the batch (stride 0) and a strided freqs row
    x = randn(rng, 3, t, h, d)
    fb = np.broadcast_to(f, (3, t, d // 2, 2))
    assert rel_err(qkernels.rotary_emb(x, fb), reference("rotary_emb", x, fb)) < FP32_TOL
    fw = np.zeros((t, d, 2), np.float32)
    fw[:, ::2] = f
    assert rel_err(qkernels.rotary_emb(x[0], fw[:, ::2]), reference("rotary_emb", x[0], f)) < FP32_TOL


def test_rotary_errors(rng):
    x, f = randn(rng, 5, 2, 8), freqs_cis(rng, (5,), 8)
    with pytest.raises(TypeError, match="rotary_emb: x must be bfloat16 or float16 or float32, got float64"):
        qkernels.rotary_emb(x.astype(np.float64), f)
    with pytest.raises(TypeError, match="rotary_emb: freqs_cis must be float32, got float16"):
        qkernels.rotary_emb(x, f.astype(np.float16))
    with pytest.raises(ValueError, match=r"rotary_emb: x must have 3 or 4 dimensions \[T, H, D\] or \[B, S, H, D\], "
                                         r"got shape \[5, 16\]"):
        qkernels.rotary_emb(x.reshape(5, 16), f)
    with pytest.raises(ValueError, match="rotary_emb: x's last dimension D = 7 must be even"):
        qkernels.rotary_emb(randn(rng, 5, 2, 7), f)
    with pytest.raises(ValueError, match=r"rotary_emb: freqs_cis must have shape \[T, D/2, 2\] = \[5, 4, 2\] with "
                                         r"size 5 in dimension 0, got \[6, 4, 2\]"):
        qkernels.rotary_emb(x, freqs_cis(rng, (6,), 8))
    with pytest.raises(ValueError, match=r"freqs_cis must have 4 dimensions \[B, S, D/2, 2\] = \[1, 5, 4, 2\]"):
        qkernels.rotary_emb(x[None], f)
    with pytest.raises(ValueError, match=r"freqs_cis must have shape \[T, D/2, 2\] = \[5, 4, 2\] with size 2 in "
                                         r"dimension 2, got \[5, 4, 3\]"):
        qkernels.rotary_emb(x, np.zeros((5, 4, 3), np.float32))
    with pytest.raises(ValueError, match="rotary_emb: x must be unit-stride in its last dimension, got stride 2"):
        qkernels.rotary_emb(randn(rng, 5, 2, 16)[..., ::2], f)
    with pytest.raises(ValueError, match="rotary_emb: freqs_cis must be unit-stride in its last dimension"):
        qkernels.rotary_emb(x, np.ascontiguousarray(np.swapaxes(f, 1, 2)).swapaxes(1, 2))
    with pytest.raises(ValueError, match=r"rotary_emb: out must have shape \[5, 2, 8\], got \[5, 2, 6\]"):
        qkernels.rotary_emb(x, f, out=np.zeros((5, 2, 6), np.float32))
    with pytest.raises(TypeError, match="rotary_emb: out must be float32, got float16"):
        qkernels.rotary_emb(x, f, out=np.zeros((5, 2, 8), np.float16))
    with pytest.raises(TypeError, match=r"rotary_emb\(\) takes at most 2 positional arguments"):
        qkernels.rotary_emb(x, f, True)
    empty = qkernels.rotary_emb(np.zeros((0, 2, 8), np.float32), np.zeros((0, 4, 2), np.float32))
    assert empty.shape == (0, 2, 8)


def test_linear_swiglu_errors(rng):
    x, w, b = randn(rng, 4, 6), randn(rng, 5, 6), randn(rng, 5)
    with pytest.raises(TypeError, match="linear: x must be bfloat16 or float16 or float32, got float64"):
        qkernels.linear(x.astype(np.float64), w)
    with pytest.raises(TypeError, match=r"linear: weight must have x's dtype \(float32\), got float16"):
        qkernels.linear(x, w.astype(np.float16))
    with pytest.raises(TypeError, match=r"linear: bias must have x's dtype \(float32\), got float64"):
        qkernels.linear(x, w, b.astype(np.float64))
    with pytest.raises(TypeError, match="linear: x must be bfloat16 or float16 or float32, got int32"):
        qkernels.linear(x.astype(np.int32), w)
    with pytest.raises(ValueError, match=r"linear: x must have at least 1 dimension \[\*, K\], got a 0-d tensor"):
        qkernels.linear(x[0, 0, ...], w)
    with pytest.raises(ValueError, match=r"linear: x's leading dimensions \(shape \[2, 2, 6\], strides \[6, 12, 1\] "
                                         r"in elements\) cannot be read as rows of one stride; pass x.contiguous\(\)"):
        qkernels.linear(x.reshape(2, 2, 6).transpose(1, 0, 2), w)
    with pytest.raises(ValueError, match=r"linear: weight must have shape \[N, K\] = \[5, 6\] with size 6 in "
                                         r"dimension 1, got \[5, 7\]"):
        qkernels.linear(x, randn(rng, 5, 7))
    with pytest.raises(ValueError, match=r"linear: weight must have 2 dimensions \[N, K\], got shape \[6\]"):
        qkernels.linear(x, randn(rng, 6))
    with pytest.raises(ValueError, match=r"linear: bias must have shape \[N\] = \[5\] with size 5 in dimension 0, "
                                         r"got \[4\]"):
        qkernels.linear(x, w, randn(rng, 4))
    with pytest.raises(ValueError, match=r"linear: out must have shape \[4, 5\], got \[5, 4\]"):
        qkernels.linear(x, w, out=np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"linear: out must have shape \[5\], got \[1, 5\]"):
        qkernels.linear(x[0], w, out=np.zeros((1, 5), np.float32))
    with pytest.raises(TypeError, match="linear: weight must be a tensor supporting DLPack"):
        qkernels.linear(x, "w")
    with pytest.raises(TypeError, match=r"linear\(\) missing required argument 'weight'"):
        qkernels._C.linear_raw(x)
    with pytest.raises(ValueError, match=r"swiglu: gate_weight must have shape \[N, K\] = \[5, 6\] with size 5 in "
                                         r"dimension 0, got \[4, 6\]"):
        qkernels.swiglu(x, w, randn(rng, 4, 6))
    with pytest.raises(TypeError, match=r"swiglu: gate_weight must have x's dtype \(float32\), got float16"):
        qkernels.swiglu(x, w, w.astype(np.float16))
    with pytest.raises(TypeError, match=r"swiglu\(\) missing required argument 'gate_weight'"):
        qkernels._C.swiglu_raw(x, w)
    with pytest.raises(TypeError, match=r"swiglu\(\) got an unexpected keyword argument 'bias'"):
        qkernels._C.swiglu_raw(x, w, w, bias=b)
    ro = randn(rng, 4, 5)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="linear: out is read-only"):
        qkernels.linear(x, w, out=ro)


# ---- through the dispatcher ----------------------------------------------------------------

def test_dispatch_astr_backend(env, rng):
    x, w, f = randn(rng, 3, 8), randn(rng, 4, 8), freqs_cis(rng, (3,), 8)
    env()
    for op, args in (("linear", (x, w)), ("swiglu", (x, w, w)), ("rotary_emb", (x[:, None], f))):
        d = qkernels.resolve(op, *args)
        assert d.family == op and d.winner == "cpu" and d.origin == "chain"
        assert "cuda" in str(d)
    env(ASTR_BACKEND="cpu")
    d = qkernels.resolve("linear", x, w)
    assert d.winner == "cpu" and d.origin == "env ASTR_BACKEND"
    assert rel_err(qkernels.linear(x, w), reference("linear", x, w)) < FP32_TOL
    env(ASTR_BACKEND="cuda")
    for call in (lambda: qkernels.linear(x, w), lambda: qkernels.swiglu(x, w, w),
                 lambda: qkernels.rotary_emb(x[:, None], f)):
        with pytest.raises(qkernels.ExplicitSelectionError, match="backend 'cuda' selected by env ASTR_BACKEND"):
            call()
    env(ASTR_BACKEND="flash")
    with pytest.raises(qkernels.ExplicitSelectionError, match="flash.*(no flash kernel for family 'linear'|unavail)"):
        qkernels.linear(x, w)
    env(ASTR_BACKEND="auto", QECDEC_BACKEND="cuda")  # the graph variable leaves the LLM families alone
    assert qkernels.resolve("swiglu", x, w, w).winner == "cpu"
    with qkernels.use_backend(llm="cpu"):
        assert qkernels.resolve("rotary_emb", x[:, None], f).origin == "context"
    assert rel_err(qkernels.linear(x, w, backend="cpu"), reference("linear", x, w)) < FP32_TOL


def test_dispatch_requirements_in_explain(env, rng):
    env()
    d = qkernels.explain("linear", randn(rng, 2, 4).astype(np.float64), randn(rng, 3, 4))
    assert "requires dtype float32, float16 or bfloat16; got numpy cpu float64" in str(d)
    # a dtype no backend takes is the argument's TypeError, however the backend was chosen
    with pytest.raises(TypeError, match="^linear: x must be bfloat16 or float16 or float32, got float64"):
        qkernels.linear(randn(rng, 2, 4).astype(np.float64), randn(rng, 3, 4), backend="cpu")
