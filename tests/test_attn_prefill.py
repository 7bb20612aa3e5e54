"""attn_prefill and attn_paged_prefill on the cpu backend against the float64 references of qkernels.testing:
lengths, GQA ratios, head dims, causal bottom-right alignment (prefix caches, Lq > Lkv), both mask
kinds, non-contiguous views, poisoned out=, empty inputs, thread-count independence; the ragged token
pool (very uneven lengths, permuted slots and request rows, rows of no request); fp16/bf16 against a
naive same-precision computation; index, shape, dtype and stride errors; dispatch and the flash
backend (through the fake flash_attn of conftest)."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels import _dispatch
from qkernels.testing import prefill_keep, reference, sample
from conftest import (FakeCudaTensor, RecordingOut, as_dtype, close_to_naive, f64, fp32_sum_tol, naive_paged_causal,
                      naive_prefill, rel_err, replaced, request_mask, sdpa64)

HAS_TORCH = importlib.util.find_spec("torch") is not None
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (bfloat16 on the CPU)")
if HAS_TORCH:
    import torch


# ---- attn_prefill, float32 ------------------------------------------------------------------

# (B, Lq, Lkv, D, ratio): lengths from {1, 17, 113, 1023, 1024}, square, prefix caches (Lq < Lkv)
# and more queries than keys; head dims 32-256 and a non-power-of-two; GQA 1, 4, 5, 6, 8.
FP32_CASES = [
    (3, 1, 1, 64, 1), (2, 1, 113, 128, 8), (2, 17, 17, 32, 4), (2, 17, 113, 256, 5), (1, 113, 17, 64, 6),
    (1, 113, 113, 128, 1), (1, 17, 1024, 64, 8), (1, 1023, 1024, 32, 4), (1, 1024, 1024, 64, 1), (2, 19, 57, 40, 4),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio", FP32_CASES)
def test_prefill_fp32(rng, B, Lq, Lkv, D, ratio, is_causal):
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)[0]
    out = qkernels.attn_prefill(q, k, v, is_causal=is_causal)
    assert out.shape == q.shape and out.dtype == np.float32
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=is_causal)) < fp32_sum_tol(Lkv)


def test_causal_is_bottom_right(rng):
    # a prefix cache: the 5 queries are the last 5 of 12 positions, so query i sees keys j <= i + 7
    q, k, v = sample("attn_prefill", rng, b=1, lq=5, lkv=12, hkv=1, ratio=1, d=32)[0]
    out = qkernels.attn_prefill(q, k, v, is_causal=True)
    for i in range(5):
        np.testing.assert_allclose(out[:, i], qkernels.attn_prefill(q[:, i:i + 1], k[:, :i + 8], v[:, :i + 8])[:, 0],
                                   rtol=1e-6, atol=1e-7)
    # the last query sees every key: the same as without causal
    np.testing.assert_allclose(out[:, -1], qkernels.attn_prefill(q, k, v)[:, -1], rtol=1e-6, atol=1e-7)


def test_more_queries_than_keys(rng):
    # Lq > Lkv with causal: query i keeps keys j <= i - 4, so the first 4 keep nothing and give 0
    q, k, v = sample("attn_prefill", rng, b=2, lq=20, lkv=16, hkv=2, ratio=4, d=64)[0]
    out = qkernels.attn_prefill(q, k, v, is_causal=True)
    assert np.all(out[:, :4] == 0)
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=True)) < 1e-5
    np.testing.assert_allclose(out[:, 4], np.repeat(v[:, 0], 4, axis=1), rtol=1e-6)  # only key 0


def test_peaked_scores(rng):
    # scale 2 on D = 128: scores spread ~20, so the running max moves across tiles; keys sorted by
    # score make every tile raise it
    q, k, v = sample("attn_prefill", rng, b=1, lq=40, lkv=300, hkv=1, ratio=4, d=128)[0]
    s = np.einsum("id,jd->ij", q[0, :, 0].astype(np.float64), k[0, :, 0].astype(np.float64))
    order = np.argsort(s[0])
    k, v = k[:, order].copy(), v[:, order].copy()
    for causal in (False, True):
        out = qkernels.attn_prefill(q, k, v, is_causal=causal, scale=2.0)
        assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=causal, scale=2.0)) < 1e-4


# ---- masks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
def test_key_mask(rng, is_causal):
    B, Lq, Lkv = 4, 33, 70
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=5, d=32)[0]
    mask = rng.random((B, Lkv)) < 0.6
    mask[1] = False  # fully masked: 0, not NaN
    mask[2] = False
    mask[2, 0] = True  # a single kept key, visible to every query even with causal
    out = qkernels.attn_prefill(q, k, v, is_causal=is_causal, mask=mask)
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=is_causal, mask=mask)) < 1e-5
    assert np.all(out[1] == 0)
    np.testing.assert_allclose(out[2], np.broadcast_to(np.repeat(v[2, 0], 5, axis=0), out[2].shape), rtol=1e-6)


@pytest.mark.parametrize("heads", ["shared", "per_head"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_query_mask(rng, heads, is_causal):
    B, Lq, Lkv, Hkv, ratio = 2, 45, 80, 2, 4
    Hq = Hkv * ratio
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=Hkv, ratio=ratio, d=64)[0]
    mask = rng.random((B, 1 if heads == "shared" else Hq, Lq, Lkv)) < 0.5
    mask[0, :, 3] = False  # query 3 of sequence 0 keeps nothing in any head
    mask[1, :, 7] = False
    mask[1, :, 7, 79] = True  # query 7 of sequence 1 keeps one key in every head (the last: causal drops it)
    out = qkernels.attn_prefill(q, k, v, is_causal=is_causal, mask=mask)
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=is_causal, mask=mask)) < 1e-5
    assert np.all(out[0, 3] == 0)
    if is_causal:
        assert np.all(out[1, 7] == 0)  # its only key is past its diagonal
    else:
        np.testing.assert_allclose(out[1, 7], np.repeat(v[1, 79], ratio, axis=0), rtol=1e-6)


def test_strided_masks(rng):
    B, Lq, Lkv, Hq = 2, 9, 40, 4
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=1, ratio=Hq, d=32)[0]
    key_mask = (rng.random((Lkv, 2 * B)) < 0.5)[:, ::2].T  # strides (2, 2B)
    out = qkernels.attn_prefill(q, k, v, mask=key_mask)
    assert rel_err(out, reference("attn_prefill", q, k, v, mask=key_mask)) < 1e-5
    big = rng.random((B, Lkv, Hq, Lq)) < 0.5
    query_mask = big.transpose(0, 2, 3, 1)  # [B, Hq, Lq, Lkv], keys the outer stride
    out = qkernels.attn_prefill(q, k, v, is_causal=True, mask=query_mask)
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=True, mask=query_mask)) < 1e-5
    shared = np.broadcast_to(rng.random((1, 1, Lq, Lkv)) < 0.5, (B, 1, Lq, Lkv))  # stride 0 over B
    out = qkernels.attn_prefill(q, k, v, mask=shared)
    assert rel_err(out, reference("attn_prefill", q, k, v, mask=shared)) < 1e-5


@pytest.mark.parametrize("shape", ["B,1,1,Lkv", "1,1,Lq,Lkv", "B,1,Lq,Lkv", "1,Lq,Lkv", "Hq,Lq,Lkv", "Hq,1,Lkv",
                                   "1,Hq,1,Lkv", "B,Hq,1,Lkv"])
def test_masks_broadcast_as_sdpa_does(rng, shape):
    """Every size-1 dimension of a per-query mask broadcasts, as in scaled_dot_product_attention: the
    result equals the call with the mask expanded to [B, Hq, Lq, Lkv]."""
    B, Lq, Lkv, Hkv, ratio = 3, 7, 20, 2, 2
    Hq = Hkv * ratio
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=Hkv, ratio=ratio, d=16)[0]
    dims = {"B": B, "Hq": Hq, "Lq": Lq, "Lkv": Lkv, "1": 1}
    mask = rng.random(tuple(dims[d] for d in shape.split(","))) < 0.6
    full = np.ascontiguousarray(np.broadcast_to(mask, (B, Hq, Lq, Lkv)))
    out = qkernels.attn_prefill(q, k, v, mask=mask)
    np.testing.assert_array_equal(out, qkernels.attn_prefill(q, k, v, mask=full))
    assert rel_err(out, reference("attn_prefill", q, k, v, mask=mask)) < 1e-5
    if HAS_TORCH:  # the same mask through SDPA itself (its head-major layout, GQA expanded)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).double().transpose(1, 2)  # noqa: E731
        kk, vv = (t(a).repeat_interleave(ratio, dim=1) for a in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(t(q), kk, vv, attn_mask=torch.from_numpy(mask))
        assert rel_err(out, want.transpose(1, 2).nan_to_num(0.0).numpy()) < 1e-5


def test_mask_shapes_that_do_not_broadcast(rng):
    q, k, v = sample("attn_prefill", rng, b=2, lq=3, lkv=9, hkv=1, ratio=2, d=8)[0]
    for shape in [(2, 2, 3, 8), (3, 1, 3, 9), (2, 3, 9, 1), (2, 5, 9), (3, 3, 9), (1, 3, 3, 3, 9)]:
        with pytest.raises(ValueError, match="attn_prefill: mask"):
            qkernels.attn_prefill(q, k, v, mask=np.ones(shape, bool))


# ---- additive float masks, and every mask against SDPA ------------------------------------------

MASK_FORMS = ["B,Lkv", "B,1,1,Lkv", "1,1,Lq,Lkv", "B,1,Lq,Lkv", "B,Hq,Lq,Lkv", "1,Lq,Lkv", "Hq,Lq,Lkv", "Hq,1,Lkv",
              "1,Hq,1,Lkv", "B,Hq,1,Lkv"]


def random_mask(rng, shape, kind, dtype=np.float32, drop=0.3):
    """A bool mask (True = keep) or an additive float one (normal values, -inf = drop) of shape, whose
    first row (last dim) is dropped whole, so some query keeps nothing."""
    keep = rng.random(shape) >= drop
    keep[(0,) * (len(shape) - 1)] = False
    if kind == "bool":
        return keep
    return np.where(keep, 2 * rng.standard_normal(shape), -np.inf).astype(dtype)


def sdpa_form(mask, B):
    """Our [B, Lkv] key mask in SDPA's layout ([B, 1, 1, Lkv]); the other forms are SDPA's already."""
    return mask[:, None, None, :] if mask.ndim == 2 else mask


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_FORMS)
def test_masks_against_sdpa(rng, shape, kind):
    """Bool and float masks in every form against torch's SDPA in float64 with the same mask, and
    against the float64 reference; -inf entries and fully masked query rows (0, as SDPA gives)."""
    B, Lq, Lkv, Hkv, ratio = 3, 7, 45, 2, 3
    Hq = Hkv * ratio
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=Hkv, ratio=ratio, d=24)[0]
    dims = {"B": B, "Hq": Hq, "Lq": Lq, "Lkv": Lkv, "1": 1}
    mask = random_mask(rng, tuple(dims[d] for d in shape.split(",")), kind)
    out = qkernels.attn_prefill(q, k, v, mask=mask)
    assert rel_err(out, reference("attn_prefill", q, k, v, mask=mask)) < 1e-5
    if HAS_TORCH:
        want = sdpa64(q, k, v, sdpa_form(mask, B))
        assert rel_err(out, want) < 1e-5
        dropped = np.broadcast_to(~prefill_keep(B, Hq, Lq, Lkv, False, mask).any(-1).transpose(0, 2, 1)[..., None],
                                  out.shape)
        assert dropped.any() and np.all(out[dropped] == 0) and np.all(want[dropped] == 0)


@pytest.mark.parametrize("shape", ["B,Lkv", "B,Hq,Lq,Lkv", "1,Lq,Lkv"])
def test_float_mask_of_zeros_and_minus_inf_is_the_bool_mask(rng, shape):
    B, Lq, Lkv, Hkv, ratio = 2, 40, 77, 2, 2
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=Hkv, ratio=ratio, d=32)[0]
    dims = {"B": B, "Hq": Hkv * ratio, "Lq": Lq, "Lkv": Lkv, "1": 1}
    keep = rng.random(tuple(dims[d] for d in shape.split(","))) < 0.5
    additive = np.where(keep, 0.0, -np.inf).astype(np.float32)
    for causal in (False, True):
        want = qkernels.attn_prefill(q, k, v, mask=keep, is_causal=causal)
        got = qkernels.attn_prefill(q, k, v, mask=additive, is_causal=causal)
        if keep.ndim == 2:  # a bool key mask skips its keys, a float one masks them per score: same within rounding
            assert rel_err(got, f64(want)) < 1e-6
        else:  # the same scores, -inf where dropped
            np.testing.assert_array_equal(got, want)


def test_float_mask_with_causal(rng):
    B, Lq, Lkv = 2, 33, 70
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=4, d=32)[0]
    for shape in [(B, Lkv), (B, 8, Lq, Lkv), (1, Lq, Lkv)]:
        mask = random_mask(rng, shape, "float")
        out = qkernels.attn_prefill(q, k, v, is_causal=True, mask=mask)
        assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=True, mask=mask)) < 1e-5
    if HAS_TORCH:  # SDPA takes no mask with is_causal: causal as a mask (bottom-right) added to ours
        mask = random_mask(rng, (B, 8, Lq, Lkv), "float")
        causal = np.arange(Lkv)[None, :] <= np.arange(Lq)[:, None] + Lkv - Lq
        out = qkernels.attn_prefill(q, k, v, is_causal=True, mask=mask)
        assert rel_err(out, sdpa64(q, k, v, np.where(causal, mask.astype(np.float64), -np.inf))) < 1e-5


def test_float_mask_large_values(rng):
    """Big finite entries shift a row's scores together (the softmax is invariant); a row whose every
    entry is -1e30 averages its values, as SDPA does, rather than dropping them."""
    B, Lq, Lkv = 2, 5, 50
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=1, ratio=2, d=16)[0]
    mask = np.zeros((B, 1, Lq, Lkv), np.float32)
    mask[0, 0, 1] = -1e30
    mask[0, 0, 2] = 1e30 * (rng.random(Lkv) < 0.5) - 1e30  # -1e30 and 0: only the zeros count
    mask[1, 0, 3] = -3e38
    out = qkernels.attn_prefill(q, k, v, mask=mask)
    np.testing.assert_allclose(out[0, 1], np.repeat(v[0].mean(0), 2, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1, 3], np.repeat(v[1].mean(0), 2, axis=0), rtol=1e-5, atol=1e-6)
    if HAS_TORCH:
        assert rel_err(out, sdpa64(q, k, v, mask)) < 1e-5


def test_strided_float_masks(rng):
    B, Lq, Lkv, Hq = 2, 9, 40, 4
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=1, ratio=Hq, d=32)[0]
    key_mask = random_mask(rng, (Lkv, 2 * B), "float")[:, ::2].T  # strides (2, 2B)
    query_mask = random_mask(rng, (B, Lkv, Hq, Lq), "float").transpose(0, 2, 3, 1)  # keys the outer stride
    shared = np.broadcast_to(random_mask(rng, (1, 1, Lq, Lkv), "float"), (B, Hq, Lq, Lkv))  # stride 0 over B, H
    for mask in (key_mask, query_mask, shared):
        assert not mask.flags.c_contiguous
        out = qkernels.attn_prefill(q, k, v, mask=mask)
        assert rel_err(out, reference("attn_prefill", q, k, v, mask=mask)) < 1e-5
        if HAS_TORCH:
            assert rel_err(out, sdpa64(q, k, v, sdpa_form(mask, B))) < 1e-5


@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask_dtype", ["float32", "own"])
def test_float_mask_half(rng, dtype, mask_dtype):
    """16-bit queries take float32 masks or masks of their own dtype (as SDPA); the mask is added in fp32."""
    B, Lq, Lkv = 2, 19, 70
    tdt = getattr(torch, dtype)
    q, k, v = (as_dtype(a, dtype) for a in sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=2, d=32)[0])
    for shape in [(B, Lkv), (B, 1, Lq, Lkv)]:
        mask = torch.from_numpy(random_mask(rng, shape, "float"))
        mask = mask if mask_dtype == "float32" else mask.to(tdt)
        out = qkernels.attn_prefill(q, k, v, is_causal=True, mask=mask)
        assert out.dtype == tdt
        m64 = mask.double().numpy()
        ref = reference("attn_prefill", f64(q), f64(k), f64(v), is_causal=True, mask=m64)
        keep = prefill_keep(B, 4, Lq, Lkv, True, m64)
        bias = torch.from_numpy(np.where(keep, sdpa_form(m64, B), 0.0)).float()
        close_to_naive(out, naive_prefill(q.float(), k.float(), v.float(), keep, 32 ** -0.5, bias).to(tdt), ref,
                       slack=1e-2)


@pytest.mark.parametrize("q_dtype,mask_dtype", [("float32", "float64"), ("float32", "float16"), ("float32", "int32"),
                                                ("bfloat16", "float16"), ("float16", "bfloat16"),
                                                ("float16", "float64")])
def test_bad_mask_dtypes(rng, q_dtype, mask_dtype):
    if "bfloat16" in (q_dtype, mask_dtype) and not HAS_TORCH:
        pytest.skip("bfloat16 needs torch")
    q, k, v = (as_dtype(a, q_dtype) for a in sample("attn_prefill", rng, b=2, lq=3, lkv=5, hkv=1, ratio=2, d=8)[0])
    for op, args, shape in [("attn_prefill", (q, k, v), (2, 5)), ("attn_prefill", (q, k, v), (2, 1, 3, 5))]:
        with pytest.raises(TypeError, match=rf"{op}: mask must be bool \(True = keep\).*got {mask_dtype}"):
            getattr(qkernels, op)(*args, mask=as_dtype(np.zeros(shape, np.float32), mask_dtype))


def test_bad_float_mask_shapes(rng):
    q, k, v = sample("attn_prefill", rng, b=2, lq=3, lkv=9, hkv=1, ratio=2, d=8)[0]
    for shape in [(2, 8), (3, 9), (2, 2, 3, 8), (3, 1, 3, 9), (2, 3, 9, 1), (2, 5, 9), (9,), (1, 3, 3, 3, 9)]:
        with pytest.raises(ValueError, match="attn_prefill: mask"):
            qkernels.attn_prefill(q, k, v, mask=np.zeros(shape, np.float32))


# ---- layouts, out=, empty inputs, threads ---------------------------------------------------

def test_non_contiguous_views(rng):
    B, Lq, Lkv, Hkv, ratio, D = 3, 21, 45, 2, 4, 64
    q = rng.standard_normal((B, Lq, Hkv * ratio, 2 * D)).astype(np.float32)[..., D:]  # head stride 2D
    k = rng.standard_normal((Lkv, B, Hkv, D)).astype(np.float32).transpose(1, 0, 2, 3)  # batch-transposed
    v = rng.standard_normal((B, Hkv, Lkv, D)).astype(np.float32).transpose(0, 2, 1, 3)  # heads outside keys
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out_big = np.full((Lq, B, Hkv * ratio, D + 3), np.nan, np.float32)
    out = out_big[..., 3:].transpose(1, 0, 2, 3)
    r = qkernels.attn_prefill(q, k, v, is_causal=True, out=out)
    assert r is out
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=True)) < 1e-5
    assert np.isnan(out_big[..., :3]).all()  # nothing written outside the view


def test_poisoned_out_is_fully_written(rng):
    q, k, v = sample("attn_prefill", rng, b=2, lq=50, lkv=30, hkv=2, ratio=5, d=40)[0]
    out = np.full(q.shape, np.nan, np.float32)
    qkernels.attn_prefill(q, k, v, is_causal=True, out=out)
    assert not np.isnan(out).any()
    assert np.all(out[:, :20] == 0)  # no key at or before their diagonal
    assert rel_err(out, reference("attn_prefill", q, k, v, is_causal=True)) < 1e-5


def test_empty_inputs(rng):
    for B, Lq, Lkv in ((0, 5, 5), (2, 0, 5)):
        q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=4, d=32)[0]
        assert qkernels.attn_prefill(q, k, v, is_causal=True).shape == (B, Lq, 8, 32)
    q, k, v = sample("attn_prefill", rng, b=2, lq=7, lkv=0, hkv=2, ratio=4, d=32)[0]
    out = np.full(q.shape, np.nan, np.float32)
    qkernels.attn_prefill(q, k, v, out=out)  # no keys at all: 0
    assert np.all(out == 0)
    q = np.zeros((2, 7, 0, 32), np.float32)  # no query heads
    assert qkernels.attn_prefill(q, k, v).shape == (2, 7, 0, 32)


def test_threads_do_not_change_bits(rng):
    # work items are taken from a shared counter: who computes what varies, the bits must not
    q, k, v = sample("attn_prefill", rng, b=2, lq=300, lkv=700, hkv=2, ratio=4, d=64)[0]
    mask = rng.random((2, 700)) < 0.9
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.attn_prefill(q, k, v, is_causal=True, mask=mask)
        _dispatch.configure(num_threads=4)
        many = qkernels.attn_prefill(q, k, v, is_causal=True, mask=mask)
    finally:
        _dispatch.configure(num_threads=old["num_threads"])
    np.testing.assert_array_equal(one, many)


# ---- float16 / bfloat16 ---------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio,is_causal", [
    (2, 1, 17, 64, 1, False), (2, 17, 113, 128, 4, True), (1, 113, 113, 256, 8, True), (1, 1023, 1024, 128, 4, True),
    (2, 33, 20, 32, 5, True), (1, 60, 60, 40, 1, False),
])
def test_prefill_half(rng, dtype, B, Lq, Lkv, D, ratio, is_causal):
    td = getattr(torch, dtype)
    host, _ = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)
    q, k, v = (torch.from_numpy(a).to(td) for a in host)
    mask = rng.random((B, Lkv)) < 0.8
    out = qkernels.attn_prefill(q, k, v, is_causal=is_causal, mask=torch.from_numpy(mask))
    assert isinstance(out, torch.Tensor) and out.dtype == td and out.shape == q.shape
    ref = reference("attn_prefill", f64(q), f64(k), f64(v), is_causal=is_causal, mask=mask)
    keep = prefill_keep(B, 2 * ratio, Lq, Lkv, is_causal, mask)
    close_to_naive(out, naive_prefill(q, k, v, torch.from_numpy(keep.copy()), D ** -0.5), ref)


# ---- attn_paged_prefill ---------------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("D,ratio", [(32, 1), (64, 4), (128, 5), (256, 8), (40, 6)])
def test_paged(rng, D, ratio, is_causal, index_dtype):
    # very uneven: a lone query against ~4000 keys beside whole prompts, prefix caches and empties
    q_lens = [1, 17, 0, 113, 5, 0, 2]
    kv_lens = [4000, 17, 9, 300, 5, 0, 70]
    args, _ = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=2, ratio=ratio, d=D,
                     index_dtype=index_dtype)
    assert not np.array_equal(args[4], np.arange(len(q_lens)))  # req_pool_indices is not the identity
    k_before = args[1].copy()
    out = np.full(args[0].shape, np.nan, np.float32)
    qkernels.attn_paged_prefill(*args, is_causal=is_causal, out=out)
    ref = reference("attn_paged_prefill", *args, is_causal=is_causal)
    assert rel_err(out, ref) < fp32_sum_tol(4000)
    np.testing.assert_array_equal(args[1], k_before)  # the pools are only read
    # request 4 (5 queries, 5 keys) alone, as a dense call on its gathered keys
    q, kc, vc, r2t, rpi, _, qo = args
    slots = r2t[rpi[4], :5]
    dense = qkernels.attn_prefill(q[None, qo[4]:qo[5]], kc[slots][None], vc[slots][None], is_causal=is_causal)[0]
    np.testing.assert_allclose(out[qo[4]:qo[5]], dense, rtol=1e-6, atol=1e-7)


def test_paged_rows_of_no_request_are_zero(rng):
    args = sample("attn_paged_prefill", rng, q_lens=[3, 4], kv_lens=[10, 4], hkv=2, ratio=4, d=64, lead=2, tail=3)[0]
    out = np.full(args[0].shape, np.nan, np.float32)
    qkernels.attn_paged_prefill(*args, is_causal=True, out=out)
    assert np.all(out[:2] == 0) and np.all(out[-3:] == 0)
    assert rel_err(out, reference("attn_paged_prefill", *args, is_causal=True)) < 1e-5
    # no requests at all: every row is 0
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    none = np.zeros(0, np.int32)
    out = qkernels.attn_paged_prefill(q, args[1], args[2], args[3], none, np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert out.shape == q.shape and np.all(out == 0)


def test_paged_permuted_request_rows(rng):
    # the requests' query rows in another order than the batch: qo_indptr still ascends, but request
    # b's keys are those of row req_pool_indices[b]; swapping two requests' rows and pool rows together
    # must swap their outputs
    args = list(sample("attn_paged_prefill", rng, q_lens=[6, 9, 4], kv_lens=[20, 9, 50], hkv=1, ratio=4, d=32)[0])
    out = qkernels.attn_paged_prefill(*args, is_causal=True)
    q, kc, vc, r2t, rpi, kv_indptr, qo = args
    order = [2, 0, 1]
    q_lens, kv_lens = np.diff(qo), np.diff(kv_indptr)
    q2 = np.concatenate([q[qo[b]:qo[b + 1]] for b in order])
    qo2 = np.concatenate([[0], np.cumsum(q_lens[order])]).astype(qo.dtype)
    kv2 = np.concatenate([[0], np.cumsum(kv_lens[order])]).astype(kv_indptr.dtype)
    out2 = qkernels.attn_paged_prefill(q2, kc, vc, r2t, rpi[order], kv2, qo2, is_causal=True)
    np.testing.assert_array_equal(out2, np.concatenate([out[qo[b]:qo[b + 1]] for b in order]))
    assert rel_err(out, reference("attn_paged_prefill", *args, is_causal=True)) < 1e-5


def test_paged_mask(rng):
    q_lens, kv_lens = [5, 16, 3, 1], [64, 16, 10, 1]
    args = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=2, ratio=4, d=64)[0]
    max_ctx = args[3].shape[1]
    mask = rng.random((len(q_lens), max_ctx)) < 0.6
    mask[2] = False  # fully masked request
    mask[3, 0] = True
    for causal in (False, True):
        out = qkernels.attn_paged_prefill(*args, mask=mask, is_causal=causal)
        assert rel_err(out, reference("attn_paged_prefill", *args, is_causal=causal, mask=mask)) < 1e-5
        qo = args[6]
        assert np.all(out[qo[2]:qo[3]] == 0)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("form", ["B,1,Mq,W", "B,Hq,Mq,W", "1,1,Mq,W", "B,1,1,W", "Hq,Mq,W", "B,W", "B,max_ctx",
                                  "B,1,Mq,max_ctx"])
def test_paged_per_query_and_narrow_masks(rng, form, kind):
    """Per-query masks [B|1, 1|Hq, Mq, W] (row i for query i of a request), key masks [B, W], and masks
    narrower than max_ctx (positions from W on dropped: request 0 has 64 keys, W = 50), against the
    reference, and per request against SDPA in float64 and the dense op with the request's slice."""
    q_lens, kv_lens = [5, 16, 3, 1, 0], [64, 16, 10, 1, 4]
    Hkv, ratio = 2, 2
    args = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=Hkv, ratio=ratio, d=32)[0]
    max_ctx = args[3].shape[1]
    dims = {"B": len(q_lens), "Hq": Hkv * ratio, "Mq": max(q_lens) + 2, "W": 50, "max_ctx": max_ctx, "1": 1}
    mask = random_mask(rng, tuple(dims[d] for d in form.split(",")), kind)
    qo = args[6]
    for causal in (False, True):
        out = qkernels.attn_paged_prefill(*args, mask=mask, is_causal=causal)
        assert rel_err(out, reference("attn_paged_prefill", *args, is_causal=causal, mask=mask)) < 1e-5
        for b, (q_len, n) in enumerate(zip(q_lens, kv_lens)):
            if q_len == 0:
                continue
            slots = args[3][args[4][b], :n]
            qb, kb, vb = args[0][None, qo[b]:qo[b + 1]], args[1][None, slots], args[2][None, slots]
            mb = request_mask(mask, b, q_len, n)
            dense = qkernels.attn_prefill(qb, kb, vb, mask=mb, is_causal=causal)
            assert rel_err(out[None, qo[b]:qo[b + 1]], f64(dense)) < 1e-6
            if HAS_TORCH and not causal:
                assert rel_err(out[None, qo[b]:qo[b + 1]], sdpa64(qb, kb, vb, mb)) < 1e-5


def test_paged_decode_style_masks_and_bad_paged_masks(rng):
    q_lens, kv_lens = [5, 16, 3], [64, 16, 10]
    args = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=2, ratio=2, d=16)[0]
    max_ctx = args[3].shape[1]
    # a mask of fewer query rows than a request's queries: ValueError naming the request
    with pytest.raises(ValueError, match=r"attn_paged_prefill: mask has Mq = 4 query rows, but sequence 0 has "
                                         r"q_len = 5 queries"):
        qkernels.attn_paged_prefill(*args, mask=np.ones((3, 1, 4, max_ctx), bool))
    for shape in [(3, max_ctx + 1), (3, 0), (2, max_ctx), (3, 1, 16, max_ctx + 1), (3, 1, 0, 9), (3, 3, 16, 9),
                  (2, 1, 16, 9), (3, 9, 1, 1, 1), (9,)]:
        for dtype in (bool, np.float32):
            with pytest.raises(ValueError, match="attn_paged_prefill: mask"):
                qkernels.attn_paged_prefill(*args, mask=np.zeros(shape, dtype))
    with pytest.raises(TypeError, match=r"attn_paged_prefill: mask must be bool \(True = keep\) or float32"):
        qkernels.attn_paged_prefill(*args, mask=np.zeros((3, 1, 16, 9), np.float64))


def test_paged_strided_indices_and_pools(rng):
    (q, kc, vc, r2t, rpi, kv_indptr, qo), _ = sample("attn_paged_prefill", rng, q_lens=[4, 11, 0], kv_lens=[7, 11, 3],
                                                     hkv=2, ratio=4, d=64)
    S = kc.shape[0]
    kc_big = np.zeros((S, 3, 64), np.float32)
    kc_big[:, 1:] = kc
    q_big = np.zeros((len(q), 8, 2 * 64), np.float32)
    q_big[..., ::2] = 0
    q_big[..., 64:] = q
    out = qkernels.attn_paged_prefill(q_big[..., 64:], kc_big[:, 1:], vc, np.asfortranarray(r2t),
                                      np.repeat(rpi, 2)[::2], np.repeat(kv_indptr, 3)[::3], np.repeat(qo, 2)[::2],
                                      is_causal=True)
    assert rel_err(out, reference("attn_paged_prefill", q, kc, vc, r2t, rpi, kv_indptr, qo, is_causal=True)) < 1e-5


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_half(rng, dtype):
    td = getattr(torch, dtype)
    q_lens, kv_lens = [1, 40, 7, 0], [1000, 40, 30, 4]
    host = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=2, ratio=4, d=128)[0]
    args = [torch.from_numpy(a) for a in host]
    for i in range(3):
        args[i] = args[i].to(td)
    out = qkernels.attn_paged_prefill(*args, is_causal=True)
    assert out.dtype == td and out.shape == args[0].shape
    ref = reference("attn_paged_prefill", *[f64(a) if a.is_floating_point() else a.numpy() for a in args],
                    is_causal=True)
    close_to_naive(out, naive_paged_causal(args, q_lens, kv_lens, 8), ref)


def test_paged_index_errors(rng):
    good, _ = sample("attn_paged_prefill", rng, q_lens=[3, 2], kv_lens=[3, 5], hkv=1, ratio=2, d=32)
    q, kc, vc, r2t, rpi, kv_indptr, qo = good
    R, S, max_ctx = r2t.shape[0], kc.shape[0], r2t.shape[1]  # R = 4, max_ctx = 8
    cases = []

    def case(i, mutate, msg):
        a = [x.copy() for x in good]
        mutate(a[i])
        cases.append((a, msg))

    case(4, lambda x: x.__setitem__(1, R), rf"attn_paged_prefill: req_pool_indices\[1\] = {R} is out of range for "
                                           rf"req_to_token with R = {R} rows")
    case(4, lambda x: x.__setitem__(0, -1), r"req_pool_indices\[0\] = -1 is out of range")
    case(5, lambda x: x.__setitem__(2, 1), r"kv_indptr gives sequence 1 the length kv_indptr\[2\] - kv_indptr\[1\] = "
                                           rf"-2, outside \[0, max_ctx = {max_ctx}\]")
    case(5, lambda x: x.__setitem__(2, 3 + max_ctx + 1), rf"= {max_ctx + 1}, outside \[0, max_ctx = {max_ctx}\]")
    row = rpi[1]
    case(3, lambda x: x.__setitem__((row, 4), S), rf"req_to_token\[{row}, 4\] = {S} is out of range for the KV pool with "
                                                  rf"S = {S} slots")
    case(3, lambda x: x.__setitem__((rpi[0], 0), -7), rf"req_to_token\[{rpi[0]}, 0\] = -7 is out of range")
    case(6, lambda x: x.__setitem__(1, 4), r"attn_paged_prefill: sequence 0 has q_len = 4 queries \(qo_indptr\) but "
                                           r"kv_len = 3 keys \(kv_indptr\)")
    case(6, lambda x: x.__setitem__(1, 6), r"qo_indptr gives sequence 0 the query rows qo_indptr\[0\] = 0 to "
                                           r"qo_indptr\[1\] = 6, not an ascending range within \[0, total_q = 5\]")
    case(6, lambda x: x.__setitem__(0, -1), r"qo_indptr gives sequence 0 the query rows qo_indptr\[0\] = -1")
    case(6, lambda x: x.__setitem__(2, 6), r"qo_indptr\[2\] = 6, not an ascending range within \[0, total_q = 5\]")
    for a, msg in cases:
        out = np.full(q.shape, np.nan, np.float32)
        with pytest.raises(ValueError, match=msg):
            qkernels.attn_paged_prefill(*a, is_causal=True, out=out)
        assert np.isnan(out).all()  # validated before anything is written
    qkernels.attn_paged_prefill(*good)  # the unmodified inputs are fine


# ---- argument errors --------------------------------------------------------------------------

def dense_args():
    rng = np.random.default_rng(5)
    return list(sample("attn_prefill", rng, b=2, lq=3, lkv=5, hkv=2, ratio=2, d=8)[0])  # q [2,3,4,8], k/v [2,5,2,8]


@pytest.mark.parametrize("pos,value,exc,msg", [
    (0, np.ones((2, 3, 4, 8), np.float64), TypeError, "attn_prefill: q must be bfloat16 or float16 or float32, got float64"),
    (1, np.ones((2, 5, 2, 8), np.float16), TypeError, r"attn_prefill: k must have q's dtype \(float32\), got float16"),
    (2, np.ones((2, 5, 2, 8), np.int32), TypeError, r"attn_prefill: v must have q's dtype \(float32\), got int32"),
    (0, np.ones((2, 4, 8), np.float32), ValueError, r"attn_prefill: q must have 4 dimensions \[B, Lq, Hq, D\], got shape \[2, 4, 8\]"),
    (1, np.ones((3, 5, 2, 8), np.float32), ValueError, r"attn_prefill: k must have shape \[B, Lkv, Hkv, D\] = \[2, 5, 2, 8\] with size 2 in dimension 0, got \[3, 5, 2, 8\]"),
    (1, np.ones((2, 5, 2, 6), np.float32), ValueError, r"attn_prefill: k must have shape .* with size 8 in dimension 3"),
    (2, np.ones((2, 6, 2, 8), np.float32), ValueError, r"attn_prefill: v must have shape \[B, Lkv, Hkv, D\] = \[2, 5, 2, 8\] with size 5 in dimension 1"),
    ((1, 2), np.ones((2, 5, 3, 8), np.float32), ValueError, r"attn_prefill: the query heads of q \(Hq = 4\) must be a multiple of the kv heads of k \(Hkv = 3"),
    (0, np.ones((2, 3, 4, 16), np.float32)[..., ::2], ValueError, r"attn_prefill: q must be unit-stride in its last dimension.*got stride 2"),
    (2, np.ones((2, 5, 2, 16), np.float32)[..., 1::2], ValueError, r"attn_prefill: v must be unit-stride in its last dimension"),
    (1, "k", TypeError, "attn_prefill: k must be a tensor supporting DLPack"),
])
def test_prefill_bad_argument(pos, value, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_prefill(*replaced(dense_args(), pos, value))


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(mask=np.ones((2, 5), np.float64)), TypeError, r"attn_prefill: mask must be bool \(True = keep\) or float32 \(added "
                                                         r"to the scores\), got float64"),
    (dict(mask=np.ones((2, 4), bool)), ValueError, r"attn_prefill: mask must have shape \[B, Lkv\] = \[2, 5\] with size 5 in dimension 1"),
    (dict(mask=np.ones((2, 1, 5), bool)), ValueError, r"attn_prefill: mask must have shape \[1\|Hq, Lq\|1, Lkv\] = \[1\|4, 3\|1, 5\] with size 4 in dimension 0"),
    (dict(mask=np.ones((2, 2, 3, 5), bool)), ValueError, r"attn_prefill: mask must have shape \[B\|1, 1\|Hq, Lq\|1, Lkv\] = \[2\|1, 1\|4, 3\|1, 5\] with size 4 in dimension 1"),
    (dict(mask=np.ones((2, 4, 2, 5), bool)), ValueError, r"attn_prefill: mask must have shape .* with size 3 in dimension 2"),
    (dict(mask=np.ones((3, 1, 3, 5), bool)), ValueError, r"attn_prefill: mask must have shape .* with size 2 in dimension 0"),
    (dict(mask=np.ones((2, 3, 5), bool)), ValueError, r"attn_prefill: mask must have shape \[1\|Hq, Lq\|1, Lkv\] .* dimension 0"),
    (dict(is_causal=np.array([True, False])), TypeError, "attn_prefill: is_causal must be a bool, got numpy.ndarray"),
    (dict(scale="x"), TypeError, "attn_prefill: scale must be a float or None, got str"),
    (dict(scale=float("inf")), ValueError, "attn_prefill: scale must be finite"),
    (dict(out=np.zeros((2, 3, 4, 8), np.float64)), TypeError, "attn_prefill: out must be float32, got float64"),
    (dict(out=np.zeros((2, 1, 4, 8), np.float32)), ValueError, r"attn_prefill: out must have shape \[2, 3, 4, 8\], got \[2, 1, 4, 8\]"),
    (dict(out=np.zeros((2, 3, 4, 16), np.float32)[..., ::2]), ValueError, "attn_prefill: out must be unit-stride in its last dimension"),
    (dict(causal=True), TypeError, r"attn_prefill\(\) got an unexpected keyword argument 'causal'"),
])
def test_prefill_bad_keyword(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_prefill(*dense_args(), **kw)


def paged_args():
    return list(sample("attn_paged_prefill", np.random.default_rng(6), q_lens=[2, 3], kv_lens=[4, 3], hkv=2, ratio=2,
                       d=8)[0])


@pytest.mark.parametrize("pos,value,exc,msg", [
    (0, np.ones((5, 4, 8), np.float64), TypeError, "attn_paged_prefill: q must be bfloat16 or float16 or float32, got float64"),
    (0, np.ones((1, 5, 4, 8), np.float32), ValueError, r"attn_paged_prefill: q must have 3 dimensions \[total_q, Hq, D\]"),
    (1, np.ones((12, 2, 8), np.float16), TypeError, r"attn_paged_prefill: k_cache must have q's dtype \(float32\)"),
    (2, np.ones((11, 2, 8), np.float32), ValueError, r"attn_paged_prefill: v_cache must have shape \[S, Hkv, D\] = \[12, 2, 8\] with size 12 in dimension 0"),
    ((1, 2), np.ones((12, 3, 8), np.float32), ValueError, r"attn_paged_prefill: the query heads of q \(Hq = 4\) must be a multiple of the kv heads of k_cache \(Hkv = 3"),
    (3, np.ones((4, 6), np.float32), TypeError, "attn_paged_prefill: req_to_token must be int32 or int64, got float32"),
    (3, np.ones(6, np.int32), ValueError, r"attn_paged_prefill: req_to_token must have 2 dimensions \[R, max_ctx\]"),
    (4, np.zeros((2, 1), np.int32), ValueError, r"attn_paged_prefill: req_pool_indices must have 1 dimensions \[B\]"),
    (5, np.zeros(4, np.int32), ValueError, r"attn_paged_prefill: kv_indptr must have shape \[B \+ 1\] = \[3\] with size 3 in dimension 0"),
    (6, np.zeros(2, np.int64), ValueError, r"attn_paged_prefill: qo_indptr must have shape \[B \+ 1\] = \[3\]"),
    (6, np.zeros(3, np.float64), TypeError, "attn_paged_prefill: qo_indptr must be int32 or int64, got float64"),
    (1, np.ones((12, 2, 16), np.float32)[..., ::2], ValueError, "attn_paged_prefill: k_cache must be unit-stride in its last dimension"),
])
def test_paged_bad_argument(pos, value, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_paged_prefill(*replaced(paged_args(), pos, value))


def test_paged_bad_keywords():
    args = paged_args()
    max_ctx = args[3].shape[1]
    with pytest.raises(ValueError, match=rf"attn_paged_prefill: mask must have shape \[B, W\] = \[2, {max_ctx}\] with "
                                         rf"1 <= W <= max_ctx = {max_ctx} in dimension 1"):
        qkernels.attn_paged_prefill(*args, mask=np.ones((2, max_ctx + 1), bool))
    with pytest.raises(TypeError, match=r"attn_paged_prefill: mask must be bool"):
        qkernels.attn_paged_prefill(*args, mask=np.ones((2, max_ctx), np.int32))
    with pytest.raises(ValueError, match=r"attn_paged_prefill: out must have shape \[5, 4, 8\]"):
        qkernels.attn_paged_prefill(*args, out=np.zeros((5, 4, 7), np.float32))
    with pytest.raises(TypeError, match=r"attn_paged_prefill\(\) missing required argument 'qo_indptr' \(pos 7\)"):
        qkernels._C.attn_paged_prefill_raw(*args[:6])


# ---- dispatch and the flash backend ---------------------------------------------------------

def statuses(d):
    return {b: (s, why) for b, s, why in d.candidates}


def fake_prefill(B=2, Lq=16, Lkv=16, Hq=8, Hkv=2, D=128, dtype="bfloat16"):
    return (FakeCudaTensor((B, Lq, Hq, D), dtype), FakeCudaTensor((B, Lkv, Hkv, D), dtype),
            FakeCudaTensor((B, Lkv, Hkv, D), dtype))


def test_dispatch_axes_and_env(env):
    env()
    q, k, v = sample("attn_prefill", np.random.default_rng(0), b=1, lq=3, lkv=5, hkv=1, ratio=2, d=40)[0]
    d = qkernels.resolve("attn_prefill", q, k, v, is_causal=True, mask=np.ones((1, 5), bool))
    assert d.axes == {"framework": "numpy", "device": "cpu", "dtype": "float32", "head_dim": 40, "has_mask": True,
                      "paged": False}
    assert d.winner == "cpu" and d.origin == "chain"
    env(ASTR_BACKEND="cpu")
    d = qkernels.resolve("attn_paged_prefill", q[0], k[0], v[0], None, None, None, None)
    assert d.axes["paged"] is True and d.winner == "cpu" and d.origin == "env ASTR_BACKEND"
    env(QKERNELS_OPS="attention=flash")
    with pytest.raises(qkernels.ExplicitSelectionError, match="attn_prefill: backend 'flash' selected by env "
                                                              "QKERNELS_OPS cannot run family 'attention'"):
        qkernels.attn_prefill(q, k, v)


def test_flash_predicate_reasons(env, fake_flash):
    env()
    d = qkernels.resolve("attn_prefill", *fake_prefill(), is_causal=True)
    assert statuses(d)["flash"] == ("MATCH", "")
    d = qkernels.resolve("attn_prefill", *fake_prefill(), mask=FakeCudaTensor((2, 16), "bool"))
    assert statuses(d)["flash"] == ("reject", "a mask (bool or float) is not supported by flash_attn_func (is_causal is)")
    d = qkernels.resolve("attn_prefill", *fake_prefill(), mask=FakeCudaTensor((2, 1, 16, 16), "float32"))
    assert statuses(d)["flash"][0] == "reject"
    d = qkernels.resolve("attn_prefill", *fake_prefill(D=36))
    assert statuses(d)["flash"][1].startswith("requires head_dim <= 256 and a multiple of 8; got torch cuda bfloat16 "
                                              "head_dim=36")
    d = qkernels.resolve("attn_prefill", *fake_prefill(D=512))
    assert statuses(d)["flash"][0] == "reject"
    d = qkernels.resolve("attn_prefill", *fake_prefill(dtype="float32"))
    assert statuses(d)["flash"][1].startswith("requires dtype float16 or bfloat16; got torch cuda float32")
    d = qkernels.resolve("attn_prefill", *(np.zeros((1, 2, 2, 64), np.float16),) * 3)
    assert statuses(d)["flash"][1].startswith("requires torch tensors; got numpy cpu float16")
    q, k, v = fake_prefill()
    d = qkernels.resolve("attn_paged_prefill", FakeCudaTensor((32, 8, 128)), k, v, None, None, None, None)
    assert statuses(d)["flash"] == ("reject", "token-pool paging (req_to_token) is not supported by flash_attn_func")
    assert "flash  reject: token-pool paging" in str(d)


def test_flash_receives_the_call(env, fake_flash):
    env()
    q, k, v = fake_prefill(D=96)  # not a cuda head_dim: the chain goes to flash on any machine
    assert qkernels.resolve("attn_prefill", q, k, v).winner == "flash"
    assert qkernels.attn_prefill(q, k, v, is_causal=True) == "flash_attn_func result"
    (cq, ck, cv, kw), = fake_flash
    assert cq is q and ck is k and cv is v and kw == {"softmax_scale": None, "causal": True}

    out = RecordingOut()
    assert qkernels.attn_prefill(*fake_prefill(), out=out, scale=0.5, backend="flash") is out
    assert out.got == "flash_attn_func result"
    assert fake_flash[-1][3] == {"softmax_scale": 0.5, "causal": False}
    with qkernels.use_backend(llm="flash"):
        qkernels.attn_prefill(*fake_prefill(D=128))
    assert len(fake_flash) == 3


def test_flash_strict_selection_names_the_reason(env, fake_flash):
    env(ASTR_BACKEND="flash")
    q, k, v = fake_prefill()
    with pytest.raises(qkernels.ExplicitSelectionError,
                       match=r"attn_paged_prefill: backend 'flash' selected by env ASTR_BACKEND cannot run family "
                             r"'attention' for this call: token-pool paging \(req_to_token\) is not supported by "
                             r"flash_attn_func"):
        qkernels.attn_paged_prefill(FakeCudaTensor((32, 8, 128)), k, v, None, None, None, None)
    for mask in (FakeCudaTensor((2, 16), "bool"), FakeCudaTensor((2, 1, 16, 16), "bfloat16")):
        with pytest.raises(qkernels.ExplicitSelectionError,
                           match=r"a mask \(bool or float\) is not supported by flash_attn_func"):
            qkernels.attn_prefill(q, k, v, mask=mask)
    assert not fake_flash  # nothing reached flash_attn
