"""attn_decode and attn_paged_decode on the cpu backend against the float64 references of qkernels.testing: shapes,
GQA ratios, head dims, kv_lens and masks, non-contiguous views, out=, the token pool (permuted slots,
uneven lengths, new_k/new_v appended in the same call), index errors, thread-count independence."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels import _dispatch
from qkernels.testing import appended, reference, sample
from conftest import as_dtype, close_to_naive, f64, fp32_sum_tol, naive_decode, rel_err, sdpa64

HAS_TORCH = importlib.util.find_spec("torch") is not None
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (bfloat16 on the CPU)")
if HAS_TORCH:
    import torch


# ---- attn_decode, float32 -------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [1, 4, 5, 8])
@pytest.mark.parametrize("D", [32, 64, 128, 256, 40])
@pytest.mark.parametrize("L", [1, 7, 129])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_decode_fp32(rng, B, L, D, ratio):
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=ratio, d=D)[0]
    out = qkernels.attn_decode(q, k, v)
    assert out.shape == q.shape and out.dtype == np.float32
    assert rel_err(out, reference("attn_decode", q, k, v)) < fp32_sum_tol(L)


@pytest.mark.parametrize("B,D,ratio", [(1, 128, 8), (3, 64, 5), (17, 32, 1), (2, 256, 4)])
def test_decode_fp32_long(rng, B, D, ratio):
    L = 4097
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=ratio, d=D)[0]
    kv_lens = rng.integers(L - 300, L + 2, B).astype(np.int32)
    out = qkernels.attn_decode(q, k, v, kv_lens=kv_lens)
    assert rel_err(out, reference("attn_decode", q, k, v, kv_lens=kv_lens)) < fp32_sum_tol(L)


def test_decode_peaked_scores(rng):
    # scale 2 on D = 128: scores of spread ~20, so the running max moves often across blocks.
    q, k, v = sample("attn_decode", rng, b=3, l=300, hkv=2, ratio=4, d=128)[0]
    out = qkernels.attn_decode(q, k, v, scale=2.0)
    assert rel_err(out, reference("attn_decode", q, k, v, scale=2.0)) < 1e-4
    # keys sorted by score ascending: every block raises the max
    s = np.einsum("bhd,bld->bhl", q[:, 0, :1].astype(np.float64), k[:, :, 0].astype(np.float64))
    order = np.argsort(s[:, 0], axis=1)
    k2 = np.take_along_axis(k, order[:, :, None, None], 1).copy()
    v2 = np.take_along_axis(v, order[:, :, None, None], 1).copy()
    assert rel_err(qkernels.attn_decode(q, k2, v2, scale=2.0), reference("attn_decode", q, k2, v2, scale=2.0)) < 1e-4


# ---- kv_lens and masks ----------------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_kv_lens(rng, index_dtype):
    B, L = 6, 37
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=4, d=64)[0]
    kv_lens = np.array([0, 1, 36, 37, 38, 1000], index_dtype)  # 0 gives 0; beyond L clamps to L
    out = qkernels.attn_decode(q, k, v, kv_lens=kv_lens)
    ref = reference("attn_decode", q, k, v, kv_lens=np.minimum(kv_lens, L))
    assert rel_err(out, ref) < 1e-5
    assert np.all(out[0] == 0)
    np.testing.assert_array_equal(out[-1], qkernels.attn_decode(q[-1:], k[-1:], v[-1:])[0])
    neg = qkernels.attn_decode(q[:1], k[:1], v[:1], kv_lens=np.array([-5], index_dtype))
    assert np.all(neg == 0)  # a negative length counts as 0


@pytest.mark.parametrize("shape", ["1,1,1,L", "1,L", "B,1,1,L"])
def test_masks_broadcast_as_sdpa_does(rng, shape):
    """SDPA's decode masks: [B|1, 1, 1, L] (and [1, L]: one mask for every sequence) equal the same mask
    expanded to [B, L]."""
    B, L = 4, 33
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=2, d=32)[0]
    dims = {"B": B, "L": L, "1": 1}
    mask = rng.random(tuple(dims[d] for d in shape.split(","))) < 0.6
    full = np.ascontiguousarray(np.broadcast_to(mask.reshape(mask.shape[0], L), (B, L)))
    out = qkernels.attn_decode(q, k, v, mask=mask)
    np.testing.assert_array_equal(out, qkernels.attn_decode(q, k, v, mask=full))
    assert rel_err(out, reference("attn_decode", q, k, v, mask=mask)) < 1e-5


@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_mask(rng, shape):
    B, L = 5, 70
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=5, d=32)[0]
    mask = rng.random((B, L)) < 0.6
    mask[1] = False  # fully masked: 0, not NaN
    mask[2] = False
    mask[2, 69] = True  # a single kept key at the end: exactly that key's value
    m = mask if shape == "2d" else mask[:, None, :]
    out = qkernels.attn_decode(q, k, v, mask=m)
    assert rel_err(out, reference("attn_decode", q, k, v, mask=mask)) < 1e-5
    assert np.all(out[1] == 0)
    np.testing.assert_allclose(out[2, 0], np.repeat(v[2, 69], 5, axis=0), rtol=1e-6)


def test_mask_and_kv_lens_together(rng):
    B, L = 4, 50
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=1, ratio=8, d=64)[0]
    mask = rng.random((B, L)) < 0.5
    mask[3, :10] = False
    kv_lens = np.array([50, 20, 0, 10], np.int32)  # sequence 3: its 10 keys are all masked
    out = qkernels.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
    assert rel_err(out, reference("attn_decode", q, k, v, kv_lens=kv_lens, mask=mask)) < 1e-5
    assert np.all(out[2] == 0) and np.all(out[3] == 0)


def test_strided_mask(rng):
    B, L = 3, 40
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=1, d=32)[0]
    big = rng.random((L, 2 * B)) < 0.5
    mask = big[:, ::2].T  # strides (2, 2B) in elements
    out = qkernels.attn_decode(q, k, v, mask=mask)
    assert rel_err(out, reference("attn_decode", q, k, v, mask=mask)) < 1e-5


# ---- additive float masks, and every mask against SDPA ------------------------------------------

def random_mask(rng, shape, kind, dtype=np.float32, drop=0.4):
    """A bool mask (True = keep) or an additive float one (normal values, -inf = drop) of shape [B|1, .., L];
    with B > 1 sequence 0's row is dropped whole."""
    keep = rng.random(shape) >= drop
    if shape[0] > 1:
        keep[0] = False
    if kind == "bool":
        return keep
    return np.where(keep, 2 * rng.standard_normal(shape), -np.inf).astype(dtype)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", ["B,L", "1,L", "B,1,L", "1,1,L", "B,1,1,L", "1,1,1,L"])
def test_masks_against_sdpa(rng, shape, kind):
    """Bool and float decode masks in every form against torch's SDPA in float64 with the same mask
    ([B|1, 1, 1, L] there) and the float64 reference; -inf entries; a fully masked sequence gives 0."""
    B, L = 4, 77
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=3, d=32)[0]
    dims = {"B": B, "L": L, "1": 1}
    mask = random_mask(rng, tuple(dims[d] for d in shape.split(",")), kind)
    out = qkernels.attn_decode(q, k, v, mask=mask)
    assert rel_err(out, reference("attn_decode", q, k, v, mask=mask)) < 1e-5
    if HAS_TORCH:
        want = sdpa64(q, k, v, mask.reshape(mask.shape[0], 1, 1, L))
        assert rel_err(out, want) < 1e-5
    assert mask.shape[0] == 1 or np.all(out[0] == 0)


def test_float_mask_of_zeros_and_minus_inf_is_the_bool_mask(rng):
    B, L = 3, 150
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=4, d=64)[0]
    keep = rng.random((B, L)) < 0.5
    np.testing.assert_array_equal(qkernels.attn_decode(q, k, v, mask=np.where(keep, 0.0, -np.inf).astype(np.float32)),
                                  qkernels.attn_decode(q, k, v, mask=keep))


def test_float_mask_with_kv_lens_and_large_values(rng):
    B, L = 4, 50
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=1, ratio=8, d=64)[0]
    mask = random_mask(rng, (B, L), "float")
    mask[1] = -1e30  # every key equally far down: the average of its values, as SDPA
    kv_lens = np.array([50, 20, 35, 10], np.int64)
    out = qkernels.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
    assert rel_err(out, reference("attn_decode", q, k, v, kv_lens=kv_lens, mask=mask)) < 1e-5
    np.testing.assert_allclose(out[1, 0], np.repeat(v[1, :20].mean(0), 8, axis=0), rtol=1e-5, atol=1e-6)
    if HAS_TORCH:
        cut = np.where(np.arange(L)[None, :] < kv_lens[:, None], mask.astype(np.float64), -np.inf)
        assert rel_err(out, sdpa64(q, k, v, cut[:, None, None, :])) < 1e-4


def test_strided_float_masks(rng):
    B, L = 3, 40
    q, k, v = sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=1, d=32)[0]
    for mask in (random_mask(rng, (L, 2 * B), "float")[:, ::2].T,  # strides (2, 2B) in elements
                 np.broadcast_to(random_mask(rng, (1, 1, L), "float"), (B, 1, L))):  # stride 0 over B
        out = qkernels.attn_decode(q, k, v, mask=mask)
        assert rel_err(out, reference("attn_decode", q, k, v, mask=mask)) < 1e-5
        if HAS_TORCH:
            assert rel_err(out, sdpa64(q, k, v, mask.reshape(B, 1, 1, L))) < 1e-5


@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask_dtype", ["float32", "own"])
def test_float_mask_half(rng, dtype, mask_dtype):
    B, L, ratio = 3, 90, 4
    tdt = getattr(torch, dtype)
    q, k, v = (as_dtype(a, dtype) for a in sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=ratio, d=64)[0])
    mask = torch.from_numpy(random_mask(rng, (B, 1, 1, L), "float"))
    mask = mask if mask_dtype == "float32" else mask.to(tdt)
    out = qkernels.attn_decode(q, k, v, mask=mask)
    assert out.dtype == tdt
    m64 = mask.double().reshape(B, L)
    ref = reference("attn_decode", f64(q), f64(k), f64(v), mask=m64.numpy())
    keep = m64 != float("-inf")
    naive = naive_decode(q.float(), k.float(), v.float(), keep, 64 ** -0.5, torch.where(keep, m64, 0.0).float())
    close_to_naive(out, naive.to(tdt), ref, slack=1e-2)


@pytest.mark.parametrize("q_dtype,mask_dtype", [("float32", "float64"), ("float32", "float16"), ("float32", "int64"),
                                                ("bfloat16", "float16"), ("float16", "bfloat16"), ("float16", "float64")])
def test_bad_mask_dtypes(rng, q_dtype, mask_dtype):
    if "bfloat16" in (q_dtype, mask_dtype) and not HAS_TORCH:
        pytest.skip("bfloat16 needs torch")
    q, k, v = (as_dtype(a, q_dtype) for a in sample("attn_decode", rng, b=2, l=5, hkv=1, ratio=2, d=8)[0])
    paged_args = sample("attn_paged_decode", rng, lens=(3, 4), hkv=1, ratio=2, d=8)[0]
    paged = [as_dtype(a, q_dtype if i < 3 else str(a.dtype)) for i, a in enumerate(paged_args)]
    max_ctx = paged[3].shape[1]
    for op, args, shape in [("attn_decode", (q, k, v), (2, 5)), ("attn_decode", (q, k, v), (2, 1, 1, 5)),
                            ("attn_paged_decode", paged, (2, max_ctx))]:
        with pytest.raises(TypeError, match=rf"{op}: mask must be bool \(True = keep\).*got {mask_dtype}"):
            getattr(qkernels, op)(*args, mask=as_dtype(np.zeros(shape, np.float32), mask_dtype))


def test_bad_float_mask_shapes(rng):
    q, k, v = sample("attn_decode", rng, b=2, l=9, hkv=1, ratio=2, d=8)[0]
    for shape in [(2, 8), (3, 9), (2, 2, 9), (3, 1, 1, 9), (2, 1, 2, 9), (9,), (1, 2, 1, 1, 9)]:
        with pytest.raises(ValueError, match="attn_decode: mask"):
            qkernels.attn_decode(q, k, v, mask=np.zeros(shape, np.float32))


# ---- layouts, out=, empty inputs ------------------------------------------------------------

def test_non_contiguous_views(rng):
    B, L, Hkv, ratio, D = 3, 45, 2, 4, 64
    q_big = rng.standard_normal((B, 1, Hkv * ratio, 2 * D)).astype(np.float32)
    q = q_big[..., D:]  # head stride 2D
    k = rng.standard_normal((L, B, Hkv, D)).astype(np.float32).transpose(1, 0, 2, 3)  # batch-transposed
    v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32).transpose(0, 2, 1, 3)  # heads outside keys
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out_big = np.full((B, 1, Hkv * ratio, D + 3), np.nan, np.float32)
    out = out_big[..., 3:]
    r = qkernels.attn_decode(q, k, v, out=out)
    assert r is out
    ref = reference("attn_decode", q, k, v)
    assert rel_err(out, ref) < 1e-5
    assert np.isnan(out_big[..., :3]).all()  # nothing written outside the view


def test_poisoned_out_is_fully_written(rng):
    q, k, v = sample("attn_decode", rng, b=4, l=9, hkv=2, ratio=5, d=40)[0]
    out = np.full(q.shape, np.nan, np.float32)
    kv_lens = np.array([9, 0, 3, 1], np.int64)
    qkernels.attn_decode(q, k, v, kv_lens=kv_lens, out=out)
    assert not np.isnan(out).any()
    assert np.all(out[1] == 0)
    assert rel_err(out, reference("attn_decode", q, k, v, kv_lens=kv_lens)) < 1e-5


def test_empty_inputs(rng):
    q, k, v = sample("attn_decode", rng, b=0, l=5, hkv=2, ratio=4, d=32)[0]
    assert qkernels.attn_decode(q, k, v).shape == (0, 1, 8, 32)
    q, k, v = sample("attn_decode", rng, b=3, l=0, hkv=2, ratio=4, d=32)[0]
    out = qkernels.attn_decode(q, k, v)  # no keys at all: 0
    assert out.shape == (3, 1, 8, 32) and np.all(out == 0)


def test_threads_do_not_change_bits(rng):
    q, k, v = sample("attn_decode", rng, b=8, l=2000, hkv=4, ratio=2, d=64)[0]
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.attn_decode(q, k, v)
        _dispatch.configure(num_threads=4)
        many = qkernels.attn_decode(q, k, v)
    finally:
        _dispatch.configure(num_threads=old["num_threads"])
    np.testing.assert_array_equal(one, many)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype,D", [("float32", 128), ("float32", 40), ("bfloat16", 128), ("bfloat16", 40),
                                     ("float16", 64)])
def test_split_keys_do_not_change_bits_with_threads(rng, dtype, D, paged):
    """Sequences long enough to be cut into several splits (merged afterwards) and a batch of one, where
    the kv heads are grouped differently for each thread count: the same bits for 1 to 4 threads and
    alone or in a batch, and close to the float64 reference."""
    if dtype != "float32" and not HAS_TORCH:
        pytest.skip("torch is not installed (16-bit inputs on the CPU)")
    lens = [1000, 3, 0, 517]
    hkv, ratio = 2, 4
    same = (lambda a: torch.from_numpy(a)) if HAS_TORCH else (lambda a: a)  # as_dtype's framework
    if paged:
        args = sample("attn_paged_decode", rng, lens=lens, hkv=hkv, ratio=ratio, d=D)[0]
        mask = rng.random((len(lens), args[3].shape[1])) < 0.9
        mask[3, :300] = False  # sequence 3 keeps nothing in its first split
        ref = reference("attn_paged_decode", *[f64(as_dtype(a, dtype)) if i < 3 else a for i, a in enumerate(args)],
                        mask=mask)
        args = [as_dtype(a, dtype) if i < 3 else same(a) for i, a in enumerate(args)] + [same(mask)]
        run = lambda: qkernels.attn_paged_decode(*args[:6], mask=args[6])
        alone = lambda: qkernels.attn_paged_decode(args[0][3:], *args[1:4], args[4][3:], args[5][3:], mask=args[6][3:])
    else:
        q, k, v = sample("attn_decode", rng, b=len(lens), l=max(lens), hkv=hkv, ratio=ratio, d=D)[0]
        kv_lens = np.array(lens, np.int32)
        mask = np.where(rng.random((len(lens), max(lens))) < 0.9, rng.standard_normal((len(lens), max(lens))),
                        -np.inf).astype(np.float32)
        mask[3, :300] = -np.inf
        q, k, v = (as_dtype(a, dtype) for a in (q, k, v))
        ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens, mask=mask)
        kv_lens, mask = same(kv_lens), same(mask)
        run = lambda: qkernels.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
        alone = lambda: qkernels.attn_decode(q[3:], k[3:], v[3:], kv_lens=kv_lens[3:], mask=mask[3:])
    old = _dispatch.configure(num_threads=1)
    try:
        outs = [f64(run())]
        for n in (2, 3, 4):
            _dispatch.configure(num_threads=n)
            outs.append(f64(run()))
        one = f64(alone())
    finally:
        _dispatch.configure(num_threads=old["num_threads"])
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_array_equal(one[0], outs[0][3])
    assert np.all(outs[0][2] == 0)
    assert rel_err(outs[0], ref) < (fp32_sum_tol(1000) if dtype == "float32" else 4e-3)


def test_split_keys_peaked_and_masked(rng):
    """Splits whose running maxima differ by far (keys sorted by score, so each split's max is above
    the last one's) and splits that keep nothing between kept ones: the merge against the reference."""
    L = 1100
    q, k, v = sample("attn_decode", rng, b=2, l=L, hkv=1, ratio=4, d=64)[0]
    s = np.einsum("bd,bld->bl", q[:, 0, 0].astype(np.float64), k[:, :, 0].astype(np.float64))
    order = np.argsort(s, axis=1)
    k = np.take_along_axis(k, order[:, :, None, None], 1).copy()
    v = np.take_along_axis(v, order[:, :, None, None], 1).copy()
    mask = np.ones((2, L), bool)
    mask[1, 256:768] = False  # sequence 1: its middle splits keep nothing
    out = qkernels.attn_decode(q, k, v, mask=mask, scale=1.0)
    assert rel_err(out, reference("attn_decode", q, k, v, mask=mask, scale=1.0)) < 1e-4


# ---- float16 / bfloat16 ---------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B,L,D,ratio", [(1, 1, 64, 1), (3, 7, 128, 4), (17, 129, 32, 5), (3, 129, 256, 8),
                                         (2, 4097, 128, 8), (3, 60, 40, 1)])
def test_decode_half(rng, dtype, B, L, D, ratio):
    td = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(a).to(td) for a in sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=ratio, d=D)[0])
    kv_lens = torch.from_numpy(rng.integers(0, L + 1, B).astype(np.int32))
    mask = torch.from_numpy(rng.random((B, L)) < 0.8)
    out = qkernels.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
    assert isinstance(out, torch.Tensor) and out.dtype == td and out.shape == q.shape
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.numpy(), mask=mask.numpy())
    keep = (torch.arange(L)[None, :] < kv_lens[:, None]) & mask
    close_to_naive(out, naive_decode(q, k, v, keep, D ** -0.5), ref)


# ---- attn_paged_decode ----------------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("D,ratio", [(32, 1), (64, 4), (128, 5), (256, 8), (40, 4)])
def test_paged(rng, D, ratio, index_dtype):
    lens = [0, 1, 7, 129, 33, 2]
    args = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=ratio, d=D, index_dtype=index_dtype)[0]
    assert not np.array_equal(args[4], np.arange(len(lens)))  # req_pool_indices is not the identity
    k_before = args[1].copy()
    out = qkernels.attn_paged_decode(*args)
    ref = reference("attn_paged_decode", *args)
    assert out.shape == args[0].shape
    assert rel_err(out, ref) < fp32_sum_tol(129)
    assert np.all(out[0] == 0)  # length 0
    np.testing.assert_allclose(out[1], np.repeat(args[2][args[3][args[4][1], 0]], ratio, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(args[1], k_before)  # nothing written without new_k


def test_paged_mask(rng):
    lens = [5, 64, 0, 17]
    args = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=64)[0]
    max_ctx = args[3].shape[1]
    mask = rng.random((len(lens), max_ctx)) < 0.6
    mask[3] = False  # fully masked
    out = qkernels.attn_paged_decode(*args, mask=mask)
    ref = reference("attn_paged_decode", *args, mask=mask)
    assert rel_err(out, ref) < 1e-5
    assert np.all(out[3] == 0)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("form", ["B,max_ctx", "B,W", "B,1,W", "B,1,1,W", "1,W"])
def test_paged_masks_float_and_narrow(rng, kind, form):
    """Bool and float masks, full width or narrower than max_ctx (positions from W = 40 on dropped:
    sequence 1 has 64 keys), in the decode forms; with new_k/new_v the appended key is masked as
    any other."""
    lens = [5, 64, 0, 17]
    args = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=32)[0]
    max_ctx = args[3].shape[1]
    dims = {"B": len(lens), "W": 40, "max_ctx": max_ctx, "1": 1}
    mask = random_mask(rng, tuple(dims[d] for d in form.split(",")), kind)
    out = qkernels.attn_paged_decode(*args, mask=mask)
    assert rel_err(out, reference("attn_paged_decode", *args, mask=mask)) < 1e-5
    flat = mask.reshape(mask.shape[0], -1)
    for b, n in enumerate(lens):  # each sequence as a dense decode over its gathered keys
        if n == 0:
            continue
        slots = args[3][args[4][b], :n]
        m = flat[b if flat.shape[0] > 1 else 0, :n]
        m = np.concatenate([m, np.full(n - len(m), False if m.dtype == bool else -np.inf, m.dtype)])
        dense = qkernels.attn_decode(args[0][b, None, None], args[1][None, slots], args[2][None, slots], mask=m[None])
        assert rel_err(out[b], f64(dense[0, 0])) < 1e-6
    new_k, new_v = (rng.standard_normal((len(lens), 2, 32)).astype(np.float32) for _ in range(2))
    pools = [a.copy() for a in args[1:3]]
    got = qkernels.attn_paged_decode(args[0], *pools, *args[3:], new_k=new_k, new_v=new_v, mask=mask)
    want = reference("attn_paged_decode", *args, new_k=new_k, new_v=new_v, mask=mask)
    assert rel_err(got, want) < 1e-5


def test_paged_new_kv_is_appended_and_used(rng):
    lens = [3, 0, 1, 40, 9]
    args = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=64)[0]
    q, k_cache, v_cache, r2t, rpi, indptr = args
    new_k = rng.standard_normal((len(lens), 2, 64)).astype(np.float32)
    new_v = rng.standard_normal((len(lens), 2, 64)).astype(np.float32)
    ref = reference("attn_paged_decode", *args, new_k=new_k, new_v=new_v)
    k_ref, v_ref = appended(k_cache, new_k, r2t, rpi, indptr), appended(v_cache, new_v, r2t, rpi, indptr)
    out = np.full(q.shape, np.nan, np.float32)
    qkernels.attn_paged_decode(*args, new_k=new_k, new_v=new_v, out=out)
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_array_equal(k_cache, k_ref.astype(np.float32))  # the pools hold the new tokens
    np.testing.assert_array_equal(v_cache, v_ref.astype(np.float32))
    for b in (0, 2, 3, 4):
        slot = r2t[rpi[b], lens[b] - 1]
        np.testing.assert_array_equal(k_cache[slot], new_k[b])
    assert np.all(out[1] == 0)  # length 0: nothing written, output 0
    # sequence 2 has only the new token: its output is new_v itself
    np.testing.assert_allclose(out[2], np.repeat(new_v[2], 4, axis=0), rtol=1e-6)


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_half(rng, dtype):
    td = getattr(torch, dtype)
    lens = [1, 129, 0, 64, 7]
    host = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=8, d=128)[0]
    args = [torch.from_numpy(a) for a in host]
    for i in range(3):
        args[i] = args[i].to(td)
    new_k = torch.from_numpy(rng.standard_normal((len(lens), 2, 128)).astype(np.float32)).to(td)
    new_v = torch.from_numpy(rng.standard_normal((len(lens), 2, 128)).astype(np.float32)).to(td)
    host64 = [f64(a) if a.is_floating_point() else a.numpy() for a in args]
    ref = reference("attn_paged_decode", *host64, new_k=f64(new_k), new_v=f64(new_v))
    k_ref = appended(host64[1], f64(new_k), *host64[3:])
    out = qkernels.attn_paged_decode(*args, new_k=new_k, new_v=new_v)
    assert out.dtype == td
    np.testing.assert_array_equal(f64(args[1]), k_ref)
    # the naive yardstick: gather each sequence, then the same-precision decode
    naive = torch.zeros_like(out)
    r2t, rpi = args[3].long(), args[4].long()
    for b, n in enumerate(lens):
        slots = r2t[rpi[b], :n]
        keep = torch.ones(1, n, dtype=torch.bool)
        naive[b] = naive_decode(args[0][b:b + 1, None], args[1][slots][None], args[2][slots][None], keep,
                                128 ** -0.5)[0, 0]
    close_to_naive(out, naive, ref)


def test_paged_index_errors(rng):
    lens = [3, 5]
    good = sample("attn_paged_decode", rng, lens=lens, hkv=1, ratio=2, d=32, index_dtype=np.int64)[0]
    new_k = np.ones((2, 1, 32), np.float32)
    cases = []
    a = [x.copy() for x in good]
    a[4][1] = a[3].shape[0]
    cases.append((a, r"attn_paged_decode: req_pool_indices\[1\] = 4 is out of range for req_to_token with R = 4"))
    a = [x.copy() for x in good]
    a[4][0] = -1
    cases.append((a, r"req_pool_indices\[0\] = -1 is out of range"))
    a = [x.copy() for x in good]
    a[5][2] = 1  # kv_indptr [0, 3, 1]: sequence 1 has a negative length
    cases.append((a, r"kv_indptr gives sequence 1 the length kv_indptr\[2\] - kv_indptr\[1\] = -2, outside "
                     r"\[0, max_ctx = 8\]"))
    a = [x.copy() for x in good]
    a[5][2] = 3 + 9
    cases.append((a, r"kv_indptr gives sequence 1 the length .* = 9, outside \[0, max_ctx = 8\]"))
    a = [x.copy() for x in good]
    r = a[4][1]
    a[3][r, 2] = a[1].shape[0]
    cases.append((a, rf"req_to_token\[{r}, 2\] = {a[1].shape[0]} is out of range for the KV pool with S = "
                     rf"{a[1].shape[0]} slots"))
    a = [x.copy() for x in good]
    a[3][a[4][0], 0] = -7
    cases.append((a, rf"req_to_token\[{a[4][0]}, 0\] = -7 is out of range"))
    for a, msg in cases:
        k_before = a[1].copy()
        with pytest.raises(ValueError, match=msg):
            qkernels.attn_paged_decode(*a, new_k=new_k, new_v=new_k)
        np.testing.assert_array_equal(a[1], k_before)  # validated before anything is written


def test_paged_strided_indices_and_pools(rng):
    lens = [4, 11, 0]
    q, kc, vc, r2t, rpi, indptr = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=64)[0]
    S = kc.shape[0]
    kc_big = np.zeros((S, 3, 64), np.float32)
    kc_big[:, 1:] = kc
    r2t_f = np.asfortranarray(r2t)
    rpi_s = np.repeat(rpi, 2)[::2]
    indptr_s = np.repeat(indptr, 3)[::3]
    out = qkernels.attn_paged_decode(q, kc_big[:, 1:], vc, r2t_f, rpi_s, indptr_s)
    ref = reference("attn_paged_decode", q, kc, vc, r2t, rpi, indptr)
    assert rel_err(out, ref) < 1e-5
