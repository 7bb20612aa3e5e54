"""Property tests through the public API on the cpu backend: random valid shapes (0- and 1-sized
dims included), int32/int64 indices, strided, reversed, offset, transposed and broadcast views,
float32 and float16 for the LLM ops, `out=` or not, all matched against the float64 references
of qkernels.testing, prefill attention also in bfloat16 (torch tensors, when
torch is installed); a last dimension that is not unit-stride is rejected with a ValueError naming
it; and random invalid calls, run in a subprocess so that a crash fails the test instead of killing
the run."""

import importlib.util
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkernels
from qkernels.testing import appended, freqs_cis, prefill_keep, reference, sample
from conftest import fp32_sum_tol, rel_err

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LLM_SETTINGS = settings(SETTINGS, max_examples=100)
INDEX = st.sampled_from([np.int32, np.int64])


def view(rng, a, how):
    """a as a differently laid out array with the same values."""
    if how == "strided":
        big = np.zeros((a.shape[0] * 2,) + a.shape[1:], a.dtype) if a.ndim else a
        if a.ndim:
            big[::2] = a
            return big[::2]
    if how == "reversed" and a.ndim:
        return np.ascontiguousarray(a[::-1])[::-1]
    if how == "offset" and a.size:
        flat = np.concatenate([np.zeros(3, a.dtype), a.ravel()])
        return flat[3:].reshape(a.shape)
    if how == "fortran" and a.ndim > 1:
        return np.asfortranarray(a)
    return a


LAYOUT = st.sampled_from(["contiguous", "strided", "reversed", "offset", "fortran"])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_dst=st.integers(0, 12), n_src=st.integers(1, 12), h=st.integers(1, 4),
       d=st.integers(1, 6), max_deg=st.integers(0, 5), idx=INDEX, layout=LAYOUT, use_out=st.booleans(),
       broadcast=st.booleans())
def test_sparse_aggregate_property(seed, n_dst, n_src, h, d, max_deg, idx, layout, use_out, broadcast):
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, n_dst)
    row_ptr = np.concatenate([[0], np.cumsum(deg)]).astype(idx)
    col = rng.integers(0, n_src, int(row_ptr[-1])).astype(idx)
    ew = rng.standard_normal((len(col), h)).astype(np.float32)
    if broadcast:
        ew = np.broadcast_to(np.float32(rng.standard_normal()), ew.shape)
    nf = rng.standard_normal((n_src, h, d)).astype(np.float32)
    args = [view(rng, row_ptr, layout), view(rng, col, layout), ew if broadcast else view(rng, ew, layout),
            view(rng, nf, layout)]
    out = np.full((n_dst, h, d), np.nan, np.float32) if use_out else None
    r = qkernels.sparse_aggregate(*args, out=out)
    assert r.shape == (n_dst, h, d)
    assert rel_err(r, reference("sparse_aggregate", row_ptr, col, ew, nf)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 10), e=st.integers(0, 30), h=st.integers(1, 9), idx=INDEX,
       layout=LAYOUT, attr=st.booleans(), use_out=st.booleans())
def test_edge_features_property(seed, n, e, h, idx, layout, attr, use_out):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    ei = rng.integers(0, n, (2, e)).astype(idx)
    ea = rng.standard_normal((e, h)).astype(np.float32) if attr else None
    out = np.full((e, (3 if attr else 2) * h), np.nan, np.float32) if use_out else None
    r = qkernels.fused_edge_features(view(rng, x, layout), view(rng, ei.T, layout).T,
                                     view(rng, ea, layout) if attr else None, out=out)
    assert rel_err(r, reference("fused_edge_features", x, ei, ea)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), r=st.integers(0, 12), h=st.integers(1, 70), layout=LAYOUT,
       p=st.sampled_from([0.0, 0.1, 0.5, 1.0]), training=st.booleans(), mean=st.sampled_from([0.0, 1e3]))
def test_norm_residual_property(seed, r, h, layout, p, training, mean):
    rng = np.random.default_rng(seed)
    x = (mean + rng.standard_normal((r, h))).astype(np.float32)
    res = rng.standard_normal((r, h)).astype(np.float32)
    g = rng.standard_normal(h).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    out = qkernels.fused_norm_residual(view(rng, x, layout), view(rng, res, layout), view(rng, g, layout),
                                       view(rng, b, layout), p=p, training=training, seed=seed)
    assert rel_err(out, reference("fused_norm_residual", x, res, g, b, p=p, training=training, seed=seed)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), e=st.integers(0, 200), g=st.integers(1, 20), idx=INDEX, layout=LAYOUT,
       sorted_=st.booleans(), pos_weight=st.sampled_from([None, 0.5, 3.0]))
def test_graph_bce_property(seed, e, g, idx, layout, sorted_, pos_weight):
    rng = np.random.default_rng(seed)
    lg = (4 * rng.standard_normal(e)).astype(np.float32)
    t = rng.random(e).astype(np.float32)
    eg = rng.integers(0, g, e).astype(idx)
    if sorted_:
        eg.sort()
    r = float(qkernels.graph_norm_bce(view(rng, lg, layout), view(rng, t, layout), view(rng, eg, layout), g,
                                      pos_weight=pos_weight))
    ref = reference("graph_norm_bce", lg, t, eg, g, pos_weight=pos_weight)
    assert abs(r - ref) <= 1e-5 * abs(ref) + 1e-12


# ---- LLM ops: attn_decode, attn_paged_decode, rotary_emb, linear, swiglu ----------------------

FLOAT = st.sampled_from([np.float32, np.float16])
# views whose last dimension stays unit-stride (the LLM ops require it); "broadcast" repeats
# index 0 of the first dimension (stride 0), so references are always taken from the views passed
LLM_LAYOUT = st.sampled_from(["contiguous", "strided", "reversed", "offset", "transposed", "padded", "broadcast"])
OUT_LAYOUT = st.sampled_from([None, "contiguous", "strided", "reversed", "offset", "transposed", "padded"])
HALF_TOL = 2e-3  # float16: one rounding of the fp32 result (2**-11), inputs already in float16


def llm_view(a, how, fill=0):
    """a laid out as `how` with the same values (except "broadcast"), last dimension unit-stride;
    whatever of the underlying buffer lies outside the view holds `fill`."""
    outer = a.ndim - 1
    if how == "strided" and outer > 0:  # every outer dimension stepped by 2
        big = np.full(tuple(2 * n for n in a.shape[:-1]) + a.shape[-1:], fill, a.dtype)
        sl = (slice(None, None, 2),) * outer
        big[sl] = a
        return big[sl]
    if how == "reversed" and outer > 0:
        return np.ascontiguousarray(a[::-1])[::-1]
    if how == "offset" and a.size:
        flat = np.concatenate([np.full(3, fill, a.dtype), a.ravel()])
        return flat[3:].reshape(a.shape)
    if how == "transposed" and outer > 1:  # outer dimensions in reverse memory order
        perm = tuple(reversed(range(outer))) + (outer,)
        return np.ascontiguousarray(a.transpose(perm)).transpose(perm)
    if how == "padded" and a.ndim:  # rows of the last dimension inside longer rows
        big = np.full(a.shape[:-1] + (a.shape[-1] + 3,), fill, a.dtype)
        big[..., 1:1 + a.shape[-1]] = a
        return big[..., 1:1 + a.shape[-1]]
    if how == "broadcast" and outer > 0 and a.shape[0]:
        return np.broadcast_to(a[:1], a.shape)
    return a


def poisoned_out(shape, dtype, how):
    """A NaN-filled out= in layout `how`, or None."""
    return None if how is None else llm_view(np.full(shape, np.nan, dtype), how, fill=np.nan)


def check_out(r, out, shape, dtype):
    """r is out (when given), has the shape and dtype, is finite, and nothing outside out's view
    was written (its buffer's other elements are still NaN)."""
    assert r.shape == shape and r.dtype == dtype
    assert np.isfinite(r).all(), "NaN/inf in the result (an element was not written?)"
    if out is not None:
        assert r is out
        base = out.base if out.base is not None else out
        assert np.isnan(base).sum() == base.size - out.size, "written outside out's view"


def err_vs(out, ref, scale):
    """|out - ref| against a cancellation-free scale (the reference on the sums of |terms|)."""
    e = np.linalg.norm(np.asarray(out, np.float64) - ref)
    s = np.linalg.norm(scale)
    return e / s if s > 0 else e


def attn_tol(dtype, q, k, scale, n_keys):
    """fp32 error of the scores grows with their magnitude (exp turns an absolute error in a
    score into a relative one in its weight); float16 adds one rounding of the output."""
    q64, k64 = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k, np.float64))
    s_abs = float((q64.max(initial=0) * k64.max(initial=0)) * q64.shape[-1] * scale)
    tol = fp32_sum_tol(max(n_keys, 1)) + 4 * 2.0**-24 * s_abs
    return tol + (HALF_TOL if dtype == np.float16 else 0)


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(0, 4), L=st.integers(0, 40), hkv=st.integers(1, 3),
       ratio=st.integers(1, 4), D=st.sampled_from([1, 2, 3, 8, 32, 40, 64]), dtype=FLOAT, idx=INDEX,
       layouts=st.tuples(LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT), out_layout=OUT_LAYOUT,
       lens=st.sampled_from([None, "random", "edges"]), mask=st.sampled_from([None, "2d", "3d", "strided"]),
       scale=st.sampled_from([None, 0.3, 2.0]), mask_layout=LAYOUT)
def test_attn_decode_property(seed, B, L, hkv, ratio, D, dtype, idx, layouts, out_layout, lens, mask, scale,
                              mask_layout):
    rng = np.random.default_rng(seed)
    host, _ = sample("attn_decode", rng, b=B, l=L, hkv=hkv, ratio=ratio, d=D, dtype=dtype)
    q, k, v = (llm_view(a, how) for a, how in zip(host, layouts))
    kw = {"scale": scale}
    kv_lens = m = None
    if lens == "random":
        kv_lens = rng.integers(-2, L + 3, B).astype(idx)
    elif lens == "edges":  # 0, 1, L and beyond L
        kv_lens = rng.choice([0, 1, L, L + 1, 10**6], B).astype(idx)
    if kv_lens is not None:
        kw["kv_lens"] = view(rng, kv_lens, mask_layout)
    if mask:
        m = rng.random((B, L)) < rng.random()
        m[rng.random(B) < 0.3] = False  # all-False rows: 0, not NaN
        kw["mask"] = m[:, None, :] if mask == "3d" else view(rng, m, "strided" if mask == "strided" else mask_layout)
    out = poisoned_out(q.shape, dtype, out_layout)
    r = qkernels.attn_decode(q, k, v, out=out, **kw)
    check_out(r, out, (B, 1, hkv * ratio, D), dtype)
    ref = reference("attn_decode", q, k, v, kv_lens=kv_lens, mask=m, scale=scale)
    mag = reference("attn_decode", q, k, np.abs(np.asarray(v, np.float64)), kv_lens=kv_lens, mask=m, scale=scale)
    sc = 1 / np.sqrt(D) if scale is None else scale
    assert err_vs(r, ref, mag) < attn_tol(dtype, q, k, sc, L)
    keep = np.ones((B, L), bool) if m is None else m.copy()
    if kv_lens is not None:
        keep &= np.arange(L)[None, :] < kv_lens.astype(np.int64)[:, None]
    assert np.all(np.asarray(r)[~keep.any(1)] == 0)  # no kept key: exactly 0


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lens=st.lists(st.integers(0, 20), max_size=4), hkv=st.integers(1, 3),
       ratio=st.integers(1, 3), D=st.sampled_from([1, 2, 5, 8, 32, 64]), dtype=FLOAT,
       idx=st.tuples(INDEX, INDEX, INDEX), layouts=st.tuples(LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT),
       idx_layouts=st.tuples(LAYOUT, LAYOUT, LAYOUT), new_kv=st.booleans(), mask=st.booleans(),
       out_layout=OUT_LAYOUT, scale=st.sampled_from([None, 0.5]))
def test_attn_paged_decode_property(seed, lens, hkv, ratio, D, dtype, idx, layouts, idx_layouts, new_kv, mask,
                                    out_layout, scale):
    rng = np.random.default_rng(seed)
    (q, kc, vc, r2t, rpi, indptr), _ = sample("attn_paged_decode", rng, lens=lens, hkv=hkv, ratio=ratio, d=D,
                                              extra_slots=int(rng.integers(0, 4)), dtype=dtype)
    B = len(lens)
    pool_layouts = tuple("padded" if new_kv and h == "broadcast" else h for h in layouts[1:3])  # written
    q = llm_view(q, layouts[0])
    kc, vc = llm_view(kc, pool_layouts[0]), llm_view(vc, pool_layouts[1])
    r2t, rpi, indptr = (view(rng, a.astype(t), how) for a, t, how in zip((r2t, rpi, indptr), idx, idx_layouts))
    kw = {"scale": scale}
    if new_kv:
        kw["new_k"], kw["new_v"] = (llm_view(rng.standard_normal((B, hkv, D)).astype(dtype), layouts[3])
                                    for _ in range(2))
    m = None
    if mask:
        m = rng.random((B, r2t.shape[1])) < rng.random()
        m[rng.random(B) < 0.3] = False
        kw["mask"] = view(rng, m, idx_layouts[1])
    ref = reference("attn_paged_decode", q, kc, vc, r2t, rpi, indptr, mask=m, scale=scale, new_k=kw.get("new_k"),
                    new_v=kw.get("new_v"))
    k_ref, v_ref = kc.copy(), vc.copy()  # nothing may be written without new_k
    if new_kv:
        k_ref, v_ref = appended(kc, kw["new_k"], r2t, rpi, indptr), appended(vc, kw["new_v"], r2t, rpi, indptr)
    out = poisoned_out(q.shape, dtype, out_layout)
    r = qkernels.attn_paged_decode(q, kc, vc, r2t, rpi, indptr, out=out, **kw)
    check_out(r, out, (B, hkv * ratio, D), dtype)
    np.testing.assert_array_equal(kc, k_ref.astype(dtype))  # the new tokens written, nothing else
    np.testing.assert_array_equal(vc, v_ref.astype(dtype))
    mag = reference("attn_paged_decode", q, kc, np.abs(np.asarray(v_ref, np.float64)), r2t, rpi, indptr, mask=m,
                    scale=scale)
    sc = 1 / np.sqrt(D) if scale is None else scale
    assert err_vs(r, ref, mag) < attn_tol(dtype, q, k_ref, sc, max(lens, default=0))
    n = np.diff(np.asarray(indptr, np.int64))
    empty = (n == 0) if m is None else ~(m & (np.arange(m.shape[1])[None, :] < n[:, None])).any(1)
    assert np.all(np.asarray(r)[empty] == 0)


# ---- attn_prefill, attn_paged_prefill: float32, float16 and bfloat16 (torch tensors) ---------

torch = __import__("torch") if importlib.util.find_spec("torch") else None
PREFILL_FLOAT = st.sampled_from([np.float32, np.float16] + (["bfloat16"] if torch else []))
BF16_TOL = 1.6e-2  # bfloat16: one rounding of the fp32 result (2**-8), 4x as HALF_TOL is for float16


def rounded(a, dtype):
    """float32 a rounded to dtype; for bfloat16 kept as float32 holding bfloat16 values."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).float().numpy()
    return a.astype(dtype)


def bf16_layout(how):
    """torch has no negative strides: "reversed" becomes "offset" for bfloat16."""
    return "offset" if how == "reversed" else how


def as_bf16(a):
    """A float32 NumPy view (of bfloat16 values) as a torch bfloat16 tensor with the same shape, element
    strides and offset over a bfloat16 copy of its whole buffer. -> (tensor, buffer)"""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    assert root.flags.c_contiguous and root.dtype == np.float32 and min(a.strides, default=0) >= 0
    buf = torch.from_numpy(root.reshape(-1)).to(torch.bfloat16)
    offset = (a.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // 4 if a.size else 0
    return torch.as_strided(buf, a.shape, [s // 4 for s in a.strides], offset), buf


def to_input(a, dtype):
    return as_bf16(a)[0] if dtype == "bfloat16" else a


def beside(a, dtype):
    """A NumPy index or mask array to pass beside to_input(..., dtype)'s tensors: one framework per
    call, so beside torch's bfloat16 it goes as a (framework-neutral) qkernels.Tensor."""
    return qkernels.from_dlpack(a) if dtype == "bfloat16" else a


def checked_result(r, out, buf, shape, dtype):
    """check_out for every dtype (buf: out's whole bfloat16 buffer) -> the result as float64 NumPy."""
    if dtype != "bfloat16":
        check_out(r, out, shape, dtype)
        return np.asarray(r, np.float64)
    assert isinstance(r, torch.Tensor) and r.dtype == torch.bfloat16 and tuple(r.shape) == shape
    assert bool(torch.isfinite(r).all()), "NaN/inf in the result (an element was not written?)"
    if out is not None:
        assert r is out
        assert int(torch.isnan(buf).sum()) == buf.numel() - out.numel(), "written outside out's view"
    return r.double().numpy()


def prefill_out(shape, dtype, how):
    """poisoned_out for every dtype -> (out, its whole buffer for bfloat16)."""
    if dtype != "bfloat16" or how is None:
        return poisoned_out(shape, dtype, how), None
    return as_bf16(poisoned_out(shape, np.float32, bf16_layout(how)))


def prefill_tol(dtype, q, k, scale, n_keys):
    if dtype == "bfloat16":
        return attn_tol(np.float32, q, k, scale, n_keys) + BF16_TOL
    return attn_tol(dtype, q, k, scale, n_keys)


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(0, 3), Lq=st.integers(0, 20), Lkv=st.integers(0, 40),
       hkv=st.integers(1, 3), ratio=st.integers(1, 4), D=st.sampled_from([1, 2, 3, 8, 32, 40, 64]), dtype=PREFILL_FLOAT,
       layouts=st.tuples(LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT), out_layout=OUT_LAYOUT, is_causal=st.booleans(),
       mask=st.sampled_from([None, "keys", "shared", "per_head"]), scale=st.sampled_from([None, 0.3, 2.0]),
       mask_layout=LAYOUT)
def test_attn_prefill_property(seed, B, Lq, Lkv, hkv, ratio, D, dtype, layouts, out_layout, is_causal, mask, scale,
                               mask_layout):
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        layouts = tuple(map(bf16_layout, layouts))
    q, k, v = (llm_view(rounded(a, dtype), how)
               for a, how in zip(sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=hkv, ratio=ratio, d=D)[0],
                                 layouts))
    Hq = hkv * ratio
    kw = {"is_causal": is_causal, "scale": scale}
    m = None
    if mask:
        m = rng.random((B, Lkv) if mask == "keys" else (B, 1 if mask == "shared" else Hq, Lq, Lkv)) < rng.random()
        m[rng.random(B) < 0.3] = False  # all-False sequences: 0, not NaN
        kw["mask"] = beside(view(rng, m, mask_layout), dtype)
    ref = reference("attn_prefill", q, k, v, is_causal=is_causal, mask=m, scale=scale)
    mag = reference("attn_prefill", q, k, np.abs(np.asarray(v, np.float64)), is_causal=is_causal, mask=m, scale=scale)
    out, buf = prefill_out(q.shape, dtype, out_layout)
    r = qkernels.attn_prefill(*(to_input(a, dtype) for a in (q, k, v)), out=out, **kw)
    res = checked_result(r, out, buf, (B, Lq, Hq, D), dtype)
    sc = 1 / np.sqrt(D) if scale is None else scale
    assert err_vs(res, ref, mag) < prefill_tol(dtype, q, k, sc, Lkv)
    kept = prefill_keep(B, Hq, Lq, Lkv, is_causal, m).any(-1).transpose(0, 2, 1)  # [B, Lq, Hq]
    assert np.all(res[~kept] == 0)


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=4),
       hkv=st.integers(1, 2), ratio=st.integers(1, 3), D=st.sampled_from([1, 2, 3, 8, 32, 64]), dtype=PREFILL_FLOAT,
       idx=st.tuples(INDEX, INDEX, INDEX, INDEX), layouts=st.tuples(LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT),
       idx_layouts=st.tuples(LAYOUT, LAYOUT, LAYOUT, LAYOUT, LAYOUT), lead=st.integers(0, 2), tail=st.integers(0, 2),
       is_causal=st.booleans(), mask=st.booleans(), out_layout=OUT_LAYOUT, scale=st.sampled_from([None, 0.5]))
def test_attn_paged_prefill_property(seed, reqs, hkv, ratio, D, dtype, idx, layouts, idx_layouts, lead, tail,
                                     is_causal, mask, out_layout, scale):
    """reqs: (q_len, kv_len - q_len) per request (a prefix of 0..12 cached keys); query rows of no
    request before (lead) and after (tail) theirs."""
    rng = np.random.default_rng(seed)
    q_lens = [nq for nq, _ in reqs]
    kv_lens = [nq + extra for nq, extra in reqs]
    (q, kc, vc, r2t, rpi, kv_indptr, qo), _ = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=hkv,
                                                     ratio=ratio, d=D, lead=lead, tail=tail)
    if dtype == "bfloat16":
        layouts = tuple(map(bf16_layout, layouts))
    q, kc, vc = (llm_view(rounded(a, dtype), how) for a, how in zip((q, kc, vc), layouts))
    indices = [view(rng, a.astype(t), how) for a, t, how in zip((r2t, rpi, kv_indptr, qo), idx, idx_layouts)]
    B, Hq = len(reqs), hkv * ratio
    kw = {"is_causal": is_causal, "scale": scale}
    m = None
    if mask:
        m = rng.random((B, r2t.shape[1])) < rng.random()
        m[rng.random(B) < 0.3] = False
        kw["mask"] = beside(view(rng, m, idx_layouts[4]), dtype)
    ref = reference("attn_paged_prefill", q, kc, vc, *indices, is_causal=is_causal, mask=m, scale=scale)
    mag = reference("attn_paged_prefill", q, kc, np.abs(np.asarray(vc, np.float64)), *indices, is_causal=is_causal,
                    mask=m, scale=scale)
    out, buf = prefill_out(q.shape, dtype, out_layout)
    pools = [to_input(a, dtype) for a in (kc, vc)]
    r = qkernels.attn_paged_prefill(to_input(q, dtype), *pools, *(beside(a, dtype) for a in indices), out=out, **kw)
    res = checked_result(r, out, buf, q.shape, dtype)
    for pool, before in zip(pools, (kc, vc)):  # the pools are only read
        np.testing.assert_array_equal(np.asarray(pool.float() if dtype == "bfloat16" else pool), before)
    sc = 1 / np.sqrt(D) if scale is None else scale
    assert err_vs(res, ref, mag) < prefill_tol(dtype, q, kc, sc, max(kv_lens, default=0))
    zero = np.ones(q.shape[:2], bool)  # rows of no request, and queries that keep no key, are 0
    for b in range(B):
        keep = prefill_keep(1, Hq, q_lens[b], kv_lens[b], is_causal, None if m is None else m[b:b + 1, :kv_lens[b]])
        zero[qo[b]:qo[b + 1]] = ~keep.any(-1)[0].T
    assert np.all(res[zero] == 0)


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=st.lists(st.integers(0, 5), min_size=1, max_size=2),
       H=st.integers(0, 3), D=st.sampled_from([0, 2, 4, 6, 16, 64]), dtype=FLOAT, interleaved=st.booleans(),
       x_layout=LLM_LAYOUT, f_layout=LLM_LAYOUT, out_layout=st.one_of(OUT_LAYOUT, st.just("inplace")))
def test_rotary_emb_property(seed, lead, H, D, dtype, interleaved, x_layout, f_layout, out_layout):
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    if out_layout == "inplace" and x_layout == "broadcast":
        x_layout = "strided"
    x = llm_view(rng.standard_normal(lead + (H, D)).astype(dtype), x_layout)
    f = llm_view(freqs_cis(rng, lead, D), f_layout)
    ref = reference("rotary_emb", x, f, interleaved=interleaved)  # before an in-place call overwrites x
    if out_layout == "inplace":
        fresh = qkernels.rotary_emb(x, f, interleaved=interleaved)
        r = qkernels.rotary_emb(x, f, interleaved=interleaved, out=x)
        assert r is x and np.array_equal(x, fresh)
    else:
        out = poisoned_out(x.shape, dtype, out_layout)
        r = qkernels.rotary_emb(x, f, interleaved=interleaved, out=out)
        check_out(r, out, x.shape, dtype)
    # a rotation keeps each pair's norm: no cancellation in the norm-wise relative error
    assert rel_err(r, ref) < (1e-5 if dtype == np.float32 else HALF_TOL)


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), M=st.integers(0, 9), K=st.integers(0, 40), N=st.integers(0, 12),
       one_d=st.booleans(), dtype=FLOAT, swiglu=st.booleans(), bias=st.booleans(),
       layouts=st.tuples(LLM_LAYOUT, LLM_LAYOUT, LLM_LAYOUT), bias_layout=LAYOUT, out_layout=OUT_LAYOUT)
def test_linear_swiglu_property(seed, M, K, N, one_d, dtype, swiglu, bias, layouts, bias_layout, out_layout):
    rng = np.random.default_rng(seed)
    xs = (K,) if one_d else (M, K)
    x = llm_view(rng.standard_normal(xs).astype(dtype), layouts[0])
    w = llm_view((rng.standard_normal((N, K)) * max(K, 1) ** -0.5).astype(dtype), layouts[1])
    shape = xs[:-1] + (N,)
    out = poisoned_out(shape, dtype, out_layout)
    ax, aw = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    tol = fp32_sum_tol(max(K, 1)) + (HALF_TOL if dtype == np.float16 else 0)
    if swiglu:
        g = llm_view((2 * rng.standard_normal((N, K)) * max(K, 1) ** -0.5).astype(dtype), layouts[2])
        r = qkernels.swiglu(x, w, g, out=out)
        check_out(r, out, shape, dtype)
        ref = reference("swiglu", x, w, g)
        # error of u * silu(g) from errors in u and g (|silu'| <= 1.1), each bounded by its |terms|
        u, gg = reference("linear", x, w), reference("linear", x, g)
        silu = gg / (1 + np.exp(-gg))
        mag = np.abs(silu) * (ax @ aw.T) + 1.1 * np.abs(u) * (ax @ np.abs(np.asarray(g, np.float64)).T)
        assert err_vs(r, ref, mag) <= 2 * tol * (np.linalg.norm(mag) > 0)
    else:
        b = view(rng, rng.standard_normal(N).astype(dtype), bias_layout) if bias else None
        r = qkernels.linear(x, w, b, out=out)
        check_out(r, out, shape, dtype)
        ref = reference("linear", x, w, b)
        mag = ax @ aw.T + (0 if b is None else np.abs(np.asarray(b, np.float64)))
        assert err_vs(r, ref, mag) <= tol * (np.linalg.norm(mag) > 0)  # K = 0: exactly the bias (or 0)


def _inner_strided(a):
    """a with the same values and stride 2 in its last dimension."""
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    big[..., ::2] = a
    return big[..., ::2]


INNER_ARGS = {"attn_decode": ("q", "k", "v", "out"),
              "attn_paged_decode": ("q", "k_cache", "v_cache", "new_k", "new_v", "out"),
              "attn_prefill": ("q", "k", "v", "out"),
              "attn_paged_prefill": ("q", "k_cache", "v_cache", "out"),
              "rotary_emb": ("x", "freqs_cis", "out"),
              "linear": ("x", "weight", "out"),
              "swiglu": ("x", "up_weight", "gate_weight", "out")}
INNER_TARGETS = [(op, arg) for op, args in INNER_ARGS.items() for arg in args]


@LLM_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), target=st.sampled_from(INNER_TARGETS), n=st.integers(0, 3),
       d=st.integers(1, 4), dtype=FLOAT)
def test_llm_inner_stride_rejected_or_right(seed, target, n, d, dtype):
    """One argument whose last dimension has stride 2: a ValueError naming the op and the argument,
    unless that dimension has size 1 or the tensor is empty (then the right answer)."""
    rng = np.random.default_rng(seed)
    op, name = target
    D = 2 * d
    f32 = rng.standard_normal
    q, k, v = sample("attn_decode", rng, b=n, l=3, hkv=1, ratio=2, d=D, dtype=dtype)[0]
    (pq, kc, vc, r2t, rpi, indptr), _ = sample("attn_paged_decode", rng, lens=[1, 2, 0][:n], hkv=1, ratio=2, d=D,
                                               dtype=dtype, index_dtype=np.int32)
    nk = f32((n, 1, D)).astype(dtype)
    dq, dk, dv = sample("attn_prefill", rng, b=n, lq=2, lkv=3, hkv=1, ratio=2, d=D, dtype=dtype)[0]
    paged, _ = sample("attn_paged_prefill", rng, q_lens=[1, 2, 0][:n], kv_lens=[1, 3, 2][:n], hkv=1, ratio=2, d=D,
                      dtype=dtype, index_dtype=np.int32)
    x3, f = f32((n, 2, D)).astype(dtype), freqs_cis(rng, (n,), D)
    xl, w = f32((n, D)).astype(dtype), f32((3, D)).astype(dtype)
    args, kw, oshape = {  # (named positional args, keyword args, output shape)
        "attn_decode": ({"q": q, "k": k, "v": v}, {}, q.shape),
        "attn_paged_decode": ({"q": pq, "k_cache": kc, "v_cache": vc, "req_to_token": r2t, "req_pool_indices": rpi,
                               "kv_indptr": indptr}, {"new_k": nk, "new_v": nk}, pq.shape),
        "attn_prefill": ({"q": dq, "k": dk, "v": dv}, {}, dq.shape),
        "attn_paged_prefill": (dict(zip(("q", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "kv_indptr",
                                         "qo_indptr"), paged)), {}, paged[0].shape),
        "rotary_emb": ({"x": x3, "freqs_cis": f}, {}, x3.shape),
        "linear": ({"x": xl, "weight": w}, {}, (n, 3)),
        "swiglu": ({"x": xl, "up_weight": w, "gate_weight": w}, {}, (n, 3)),
    }[op]
    fn = getattr(qkernels, op)
    good = fn(*[a.copy() for a in args.values()], **{key: val.copy() for key, val in kw.items()})
    if name == "out":
        kw["out"] = bad = _inner_strided(np.zeros(oshape, dtype))
    elif name in kw:
        kw[name] = bad = _inner_strided(kw[name])
    else:
        args[name] = bad = _inner_strided(args[name])
    if bad.size and bad.shape[-1] > 1:
        with pytest.raises(ValueError, match=rf"{op}: {name} must be unit-stride in its last dimension, got stride 2"):
            fn(*args.values(), **kw)
    else:
        assert np.array_equal(fn(*args.values(), **kw), good)


INVALID_CALLS = textwrap.dedent('''
    import sys
    import numpy as np
    import qkernels

    rng = np.random.default_rng(int(sys.argv[1]))
    GARBAGE = [None, 3, 2.5, "x", [1, 2], object(), np.float32(1.0), b"bytes", np.array([1.0, 2.0]), np.array(1.0),
               float("nan")]
    DTYPES = [np.float64, np.float16, np.int8, np.uint8, np.complex64, np.bool_, np.int32, np.int64]
    B, L, HKV, G, D = 2, 5, 2, 2, 8  # LLM shapes: batch, keys, kv heads, query heads per kv head, head_dim
    R, S, CTX = 3, 9, 4  # requests, pool slots, max_ctx

    def ones(*shape, dtype=np.float32):
        return np.ones(shape, dtype)

    def good():
        # op -> (positional args, keyword args, output shape or None); every call valid
        e, n, h = 6, 4, 3
        rp = np.array([0, 2, 2, 5, 6]); col = rng.integers(0, n, e)
        idx = [np.int32, np.int64][int(rng.integers(0, 2))]
        r2t = rng.integers(0, S, (R, CTX)).astype(idx)
        return {
            "sparse_aggregate": ([rp, col, ones(e, h), ones(n, h, 2)], {}, (n, h, 2)),
            "fused_edge_features": ([ones(n, h), rng.integers(0, n, (2, e)), ones(e, h)], {}, (e, 3 * h)),
            "fused_norm_residual": ([ones(n, h), ones(n, h), ones(h), ones(h)], {"p": 0.1, "training": True, "seed": 3},
                                    (n, h)),
            "graph_norm_bce": ([ones(e), ones(e), np.sort(rng.integers(0, 3, e)), 3], {"pos_weight": 2.0}, None),
            "attn_decode": ([ones(B, 1, HKV * G, D), ones(B, L, HKV, D), ones(B, L, HKV, D)],
                            {"kv_lens": np.array([5, 2], idx), "mask": rng.random((B, L)) < 0.5, "scale": 0.5},
                            (B, 1, HKV * G, D)),
            "attn_paged_decode": ([ones(B, HKV * G, D), ones(S, HKV, D), ones(S, HKV, D), r2t, np.array([2, 0], idx),
                                   np.array([0, 3, 4], idx)],
                                  {"new_k": ones(B, HKV, D), "new_v": ones(B, HKV, D),
                                   "mask": rng.random((B, CTX)) < 0.5, "scale": 0.5},
                                  (B, HKV * G, D)),
            "attn_prefill": ([ones(B, 3, HKV * G, D), ones(B, L, HKV, D), ones(B, L, HKV, D)],
                             {"is_causal": True, "scale": 0.5,
                              "mask": rng.random((B, L) if rng.random() < 0.5 else (B, HKV * G, 3, L)) < 0.5},
                             (B, 3, HKV * G, D)),
            # two requests: 2 of 3 and 1 of 1 keys; query row 3 belongs to none
            "attn_paged_prefill": ([ones(4, HKV * G, D), ones(S, HKV, D), ones(S, HKV, D), r2t, np.array([2, 0], idx),
                                    np.array([0, 3, 4], idx), np.array([0, 2, 3], idx)],
                                   {"is_causal": True, "mask": rng.random((B, CTX)) < 0.5, "scale": 0.5},
                                   (4, HKV * G, D)),
            "rotary_emb": ([ones(3, 2, D), ones(3, D // 2, 2)], {"interleaved": False}, (3, 2, D)),
            "linear": ([ones(4, 6), ones(5, 6), ones(5)], {}, (4, 5)),
            "swiglu": ([ones(4, 6), ones(5, 6), ones(5, 6)], {}, (4, 5)),
            # the backward ops take no out=
            "rotary_emb_backward": ([ones(3, 2, D), ones(3, D // 2, 2)], {"interleaved": False}, None),
            "linear_backward": ([ones(4, 5), ones(4, 6), ones(5, 6)], {"bias_grad": True, "x_grad": True}, None),
            "swiglu_backward": ([ones(2, 2, 5), ones(2, 2, 6), ones(5, 6), ones(5, 6)], {"weight_grad": True}, None),
        }

    OPS = list(good())

    def break_tensor(a):
        kind = rng.integers(0, 10)
        if kind == 0 or not isinstance(a, np.ndarray):
            return GARBAGE[int(rng.integers(0, len(GARBAGE)))]
        if kind == 1:  # wrong rank
            return a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1)
        if kind == 2:  # one more row
            return np.concatenate([a, a[:1]]) if a.ndim and a.size else np.ones(3)
        if kind == 3:  # wrong dtype
            return a.astype(DTYPES[int(rng.integers(0, len(DTYPES)))])
        if kind == 4 and a.dtype.kind == "i" and a.size:  # an index out of range
            b = a.copy(); b.flat[int(rng.integers(0, b.size))] = rng.choice([-1, 10**6, -2**31]); return b
        if kind == 5:  # an empty last dimension
            return a[..., :0] if a.ndim else a
        if kind == 6:  # an extra leading dimension (stride 0)
            return np.broadcast_to(a, (2,) + a.shape)
        if kind == 7 and a.ndim:  # one dimension one longer or shorter (Hq vs Hkv, K, odd D, freqs shape...)
            shape = list(a.shape); d = int(rng.integers(0, a.ndim))
            shape[d] = max(shape[d] + int(rng.choice([-1, 1])), 0)
            return np.zeros(shape, a.dtype)
        if kind == 8 and a.ndim:  # last dimension reversed or stepped
            return a[..., ::-1] if rng.random() < 0.5 else np.repeat(a, 2, axis=-1)[..., ::2]
        return np.asarray(a.flat[0] if a.size else 0, a.dtype)  # 0-d

    count = 0
    for trial in range(100 * len(OPS)):
        op = OPS[trial % len(OPS)]
        args, kw, oshape = good()[op]
        if kw and rng.random() < 0.3:  # a keyword argument broken, dropped, or unknown
            key = list(kw)[int(rng.integers(0, len(kw)))]
            r = rng.random()
            if r < 0.15:
                del kw[key]
            elif r < 0.25:
                kw["bogus"] = 1
            else:
                kw[key] = break_tensor(kw[key])
        else:
            i = int(rng.integers(0, len(args)))
            args[i] = break_tensor(args[i])
        if oshape is not None and rng.random() < 0.2:
            ro = np.zeros((1, 1) if rng.random() < 0.5 else oshape, np.float32); ro.flags.writeable = False
            kw["out"] = ro
        try:
            getattr(qkernels, op)(*args, **kw)
        except (TypeError, ValueError, BufferError) as e:
            count += 1
            assert op in str(e), (op, repr(e))
        except Exception as e:
            raise AssertionError(f"{op}: undocumented exception {e!r}")

    # strict: a read-only out of the right shape, everything else valid
    for op in OPS:
        args, kw, oshape = good()[op]
        if oshape is None:
            continue
        ro = np.zeros(oshape, np.float32); ro.flags.writeable = False
        try:
            getattr(qkernels, op)(*args, **kw, out=ro)
            raise AssertionError(f"{op}: a read-only out was accepted")
        except BufferError as e:
            assert f"{op}: out is read-only" in str(e), (op, repr(e))
        count += 1

    # strict: the paged op's indices out of range -> ValueError naming the argument, pools untouched
    for trial in range(100):
        args, kw, _ = good()["attn_paged_decode"]
        r2t, rpi, indptr = args[3], args[4], args[5]
        b = int(rng.integers(0, B)); which = int(rng.integers(0, 3))
        if which == 0:
            rpi[b] = rng.choice([-1, R, 10**6, -2**31]); name = "req_pool_indices"
        elif which == 1:
            indptr[b + 1] = indptr[b] + rng.choice([-1, -5, CTX + 1, 10**6]); name = "kv_indptr"
        else:
            n = int(indptr[b + 1] - indptr[b])
            r2t[rpi[b], int(rng.integers(0, n))] = rng.choice([-1, S, 10**6, -2**31]); name = "req_to_token"
        before = [args[1].copy(), args[2].copy()]
        try:
            qkernels.attn_paged_decode(*args, **kw)
            raise AssertionError(f"attn_paged_decode: bad {name} accepted")
        except ValueError as e:
            assert str(e).startswith("attn_paged_decode: ") and name in str(e), (name, repr(e))
        assert np.array_equal(args[1], before[0]) and np.array_equal(args[2], before[1]), "pool written"
        count += 1

    # strict: attn_paged_prefill's indices or query rows out of range -> ValueError naming the argument, out
    # untouched (everything is validated before anything is written)
    for trial in range(100):
        args, kw, oshape = good()["attn_paged_prefill"]
        r2t, rpi, kv_indptr, qo_indptr = args[3:7]
        b = int(rng.integers(0, B)); which = int(rng.integers(0, 4))
        kv_len = int(kv_indptr[b + 1] - kv_indptr[b])
        if which == 0:
            rpi[b] = rng.choice([-1, R, 10**6, -2**31]); name = "req_pool_indices"
        elif which == 1:
            kv_indptr[b + 1] = kv_indptr[b] + rng.choice([-1, -5, CTX + 1, 10**6]); name = "kv_indptr"
        elif which == 2:
            r2t[rpi[b], int(rng.integers(0, kv_len))] = rng.choice([-1, S, 10**6, -2**31]); name = "req_to_token"
        else:  # descending, past total_q, or more queries than keys
            qo_indptr[b + 1] = qo_indptr[b] + rng.choice([-1, -5, kv_len + 1, 10**6]); name = "qo_indptr"
        out = np.full(oshape, np.nan, np.float32)
        try:
            qkernels.attn_paged_prefill(*args, **kw, out=out)
            raise AssertionError(f"attn_paged_prefill: bad {name} accepted")
        except ValueError as e:
            assert str(e).startswith("attn_paged_prefill: ") and name in str(e), (name, repr(e))
        assert np.isnan(out).all(), "out written before the indices were checked"
        count += 1
    print("OK", count)
''')


def test_invalid_calls_raise_documented_errors_without_crashing():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    r = subprocess.run([sys.executable, "-c", INVALID_CALLS, str(seed)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"seed {seed}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.startswith("OK"), r.stdout
