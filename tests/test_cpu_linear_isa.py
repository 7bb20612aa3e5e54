"""The cpu backend's instruction-set paths of linear and swiglu (csrc/cpu/linear_x86.c), each forced
through the raw ops' private _isa= keyword, every level this machine has: accuracy against the float64
references on awkward sizes (K, N off the tile sizes), strided inputs and outputs, the silu extremes,
and the same bits for any thread count and for a row alone or anywhere in a batch."""

import numpy as np
import pytest

import qkernels
from qkernels import _C
from qkernels.testing import reference
from conftest import HAS_TORCH, close_to_naive, f64, fp32_sum_tol, requires_torch

if HAS_TORCH:
    import torch
    import torch.nn.functional as F

LEVELS = ["portable", "avx2", "avx512", "avx512_bf16", "amx"]
BEST = _C._cpu_isa()
HERE = LEVELS[:LEVELS.index(BEST) + 1]  # the levels this machine runs
# (M, K, N): K and N off the 16/32 tiles, M across the kernels' thresholds (8, 16, the 512-row slab)
SHAPES = [(1, 7, 129), (2, 100, 40), (5, 33, 17), (9, 1537, 70), (17, 64, 33), (40, 300, 100), (97, 31, 129),
          (530, 45, 50), (66, 1100, 7)]  # the last: a 64-row block in k chunks, then 2 rows that take K whole


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _host(x, r, kw):
    """the raw op's result as NumPy for NumPy inputs (an out= is returned as given)"""
    return np.from_dlpack(r) if isinstance(x, np.ndarray) and "out" not in kw else r


def lin(x, w, b=None, isa=None, **kw):
    return _host(x, _C.linear_raw(x, w, b, _isa=isa, **kw), kw)


def swi(x, w, g, isa=None, **kw):
    return _host(x, _C.swiglu_raw(x, w, g, _isa=isa, **kw), kw)


def test_levels_and_keyword(rng):
    assert BEST in LEVELS
    x, w = randn(rng, 3, 20), randn(rng, 5, 20)
    # a level above the machine's runs the best it has: the same bits as auto
    assert np.array_equal(lin(x, w, isa="amx"), lin(x, w))
    with pytest.raises(ValueError, match="linear: _isa must be one of 'auto', 'portable', 'avx2', 'avx512'"):
        lin(x, w, isa="sse9")
    with pytest.raises(TypeError, match="swiglu: _isa must be a str"):
        swi(x, w, w, isa=3)


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_fp32(rng, isa, m, k, n):
    x, w, g, b = randn(rng, m, k), randn(rng, n, k), randn(rng, n, k), randn(rng, n)
    # against the sum of |terms|: a single output may cancel to ~0
    scale = np.linalg.norm(np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + np.abs(b))
    out = lin(x, w, b, isa)
    assert out.dtype == np.float32 and out.shape == (m, n)
    assert np.linalg.norm(np.asarray(out, np.float64) - reference("linear", x, w, b)) / scale < fp32_sum_tol(k)
    out = swi(x, w, g, isa)
    scale = np.linalg.norm(reference("swiglu", np.abs(x), np.abs(w), np.abs(g)))
    assert np.linalg.norm(np.asarray(out, np.float64) - reference("swiglu", x, w, g)) / scale < 2 * fp32_sum_tol(k)


@requires_torch
@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_half(rng, isa, dtype, m, k, n):
    dt = getattr(torch, dtype)
    x = torch.from_numpy(randn(rng, m, k)).to(dt)
    w, g = (torch.from_numpy(randn(rng, n, k, scale=k ** -0.5)).to(dt) for _ in range(2))
    b = torch.from_numpy(randn(rng, n)).to(dt)
    out = lin(x, w, b, isa)
    assert out.dtype == dt and out.shape == (m, n)
    close_to_naive(out, F.linear(x, w, b), reference("linear", f64(x), f64(w), f64(b)))
    out = swi(x, w, g, isa)
    close_to_naive(out, F.linear(x, w) * F.silu(F.linear(x, g)), reference("swiglu", f64(x), f64(w), f64(g)))


def _batch_cases(rng, dtype):
    """(x, w, b, g) in dtype, sizes that split x's rows between threads and slabs"""
    for m, k, n in [(600, 100, 70), (33, 1536, 300), (7, 4100, 129), (70, 1500, 50)]:
        arrs = randn(rng, m, k), randn(rng, n, k, scale=k ** -0.5), randn(rng, n), randn(rng, n, k, scale=k ** -0.5)
        if dtype != "float32":
            arrs = tuple(torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrs)
        yield arrs


def _equal(p, q):
    return torch.equal(p, q) if HAS_TORCH and isinstance(p, torch.Tensor) else np.array_equal(p, q)


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_same_bits_any_threads_and_rows(rng, isa, dtype):
    if dtype != "float32" and not HAS_TORCH:
        pytest.skip("torch is not installed")
    old = _C._configure(num_threads=1)
    try:
        for x, w, b, g in _batch_cases(rng, dtype):
            m = x.shape[0]
            one = lin(x, w, b, isa), swi(x, w, g, isa)
            for threads in (2, 3, 8):
                _C._configure(num_threads=threads)
                assert _equal(lin(x, w, b, isa), one[0]), (isa, dtype, x.shape, threads)
                assert _equal(swi(x, w, g, isa), one[1]), (isa, dtype, x.shape, threads)
            # a row alone, a few rows, any slice of the batch: the bits of the whole batch
            for lo, hi in [(0, 1), (m // 2, m // 2 + 1), (m - 1, m), (1, min(m, 18)), (m // 3, m)]:
                assert _equal(lin(x[lo:hi], w, b, isa), one[0][lo:hi]), (isa, dtype, x.shape, lo, hi)
                assert _equal(swi(x[lo:hi], w, g, isa), one[1][lo:hi]), (isa, dtype, x.shape, lo, hi)
            _C._configure(num_threads=1)
    finally:
        _C._configure(num_threads=old["num_threads"])


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_strided_inputs_and_out(rng, isa, dtype):
    if dtype != "float32" and not HAS_TORCH:
        pytest.skip("torch is not installed")
    m, k, n = 37, 100, 129
    xb, wb, gb = randn(rng, m, k + 13), randn(rng, n, 2 * k, scale=0.1), randn(rng, n, k + 1, scale=0.1)
    bb = randn(rng, 2 * n)
    if dtype != "float32":
        xb, wb, gb, bb = (torch.from_numpy(a).to(getattr(torch, dtype)) for a in (xb, wb, gb, bb))
    x, w, g, bias = xb[:, 5:5 + k], wb[:, k:], gb[:, :k], bb[::2]  # row strides k + 13, 2k, k + 1
    contiguous = (lambda a: a.contiguous()) if dtype != "float32" else np.ascontiguousarray
    want_l = lin(contiguous(x), contiguous(w), contiguous(bias), isa)
    want_s = swi(contiguous(x), contiguous(w), contiguous(g), isa)
    if dtype == "float32":
        big = np.full((m, n + 7), np.nan, np.float32)
    else:
        big = torch.full((m, n + 7), float("nan"), dtype=getattr(torch, dtype))
    out = big[:, 3:3 + n]
    assert lin(x, w, bias, isa, out=out) is out
    assert _equal(out, want_l)
    assert swi(x, w, g, isa, out=out) is out
    assert _equal(out, want_s)
    edges = np.asarray(f64(big))
    assert np.isnan(edges[:, :3]).all() and np.isnan(edges[:, 3 + n:]).all()
    assert float(np.abs(f64(want_l) - reference("linear", f64(x), f64(w), f64(bias))).max()) < 0.05


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_silu_extremes_and_zero_k(isa, dtype):
    if dtype != "float32" and not HAS_TORCH:
        pytest.skip("torch is not installed")
    # gate products of +-200, +-60, 0 and -88: silu gives g, ~0, 0, never NaN
    x = np.array([[1.0, 0.0]], np.float32)
    gate = np.array([[200.0, 0], [-200.0, 0], [60.0, 0], [-60.0, 0], [0, 0], [-88.0, 0], [3.0, 0]], np.float32)
    up = np.full((7, 2), 3.0, np.float32)
    want = reference("swiglu", x, up, gate)
    args = (x, up, gate)
    if dtype != "float32":
        args = tuple(torch.from_numpy(a).to(getattr(torch, dtype)) for a in args)
    out = f64(swi(*args, isa))
    assert np.isfinite(out).all()
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8
    tiny = 2.0 ** -25 if dtype == "float16" else 1e-38  # below half float16's smallest subnormal: 0
    assert np.allclose(out, want, rtol=tol, atol=tiny)
    # K = 0: the empty sum is 0 (linear: the bias)
    z = np.zeros((4, 0), np.float32), np.zeros((5, 0), np.float32), np.arange(5, dtype=np.float32)
    if dtype != "float32":
        z = tuple(torch.from_numpy(a).to(getattr(torch, dtype)) for a in z)
    assert np.array_equal(f64(lin(*z, isa)), np.broadcast_to(np.arange(5.0), (4, 5)))
    assert np.array_equal(f64(swi(z[0], z[1], z[1], isa)), np.zeros((4, 5)))


@pytest.mark.skipif("avx512" not in HERE, reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_avx2_gives_the_avx512_bits(rng, dtype):
    """the AVX2 kernel runs the lane order of the fma level in 8-float halves: the same bits, at every
    M (a lone row streams the weights, a batch takes the blocked path), K off the 16-lane step"""
    if dtype != "float32" and not HAS_TORCH:
        pytest.skip("torch is not installed")
    for m, k, n in [(1, 4100, 70), (3, 37, 129), (70, 300, 53), (9, 1030, 20)]:
        x, w, g, b = randn(rng, m, k), randn(rng, n, k, scale=k ** -0.5), randn(rng, n, k, scale=k ** -0.5), randn(rng, n)
        if dtype != "float32":
            x, w, g, b = (torch.from_numpy(a).to(getattr(torch, dtype)) for a in (x, w, g, b))
        assert _equal(lin(x, w, b, "avx2"), lin(x, w, b, "avx512")), (dtype, m, k, n)
        assert _equal(swi(x, w, g, "avx2"), swi(x, w, g, "avx512")), (dtype, m, k, n)
