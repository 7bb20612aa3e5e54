"""The cpu attn_prefill / attn_paged_prefill per instruction-set level (csrc/cpu/attn_prefill_x86.c),
each forced through the raw ops' private _isa= keyword, every level this machine has: accuracy
against the float64 references on awkward head dims, GQA ratios, causal and both mask kinds, ragged
pools; the AMX and VDPBF16PS bfloat16 kernels against the fp32 path; AVX2 giving the AVX-512 bits;
the same bits for any thread count at every level (QKERNELS_NUM_THREADS too)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from qkernels import _C, _dispatch
from qkernels.testing import prefill_keep, reference, sample
from conftest import (HAS_TORCH, close_to_naive, f64, fp32_sum_tol, naive_paged_causal, naive_prefill, rel_err,
                      requires_torch)

if HAS_TORCH:
    import torch

LEVELS = ["portable", "avx2", "avx512", "avx512_bf16", "amx"]
BEST = _C._cpu_isa()
HERE = LEVELS[:LEVELS.index(BEST) + 1]  # the levels this machine runs
# (B, Lq, Lkv, D, ratio, causal): D off the 16/32 tiles, rows off the 16-row tiles, a prefix cache,
# more queries than keys, key counts off the 32/128-key tiles
CASES = [(2, 17, 113, 72, 4, True), (1, 130, 130, 128, 1, True), (1, 40, 300, 40, 5, False), (2, 20, 16, 64, 4, True),
         (1, 9, 257, 256, 8, False), (1, 300, 300, 24, 2, True)]


def prefill(q, k, v, isa, **kw):
    r = _C.attn_prefill_raw(q, k, v, _isa=isa, **kw)
    return np.from_dlpack(r) if isinstance(q, np.ndarray) else torch.from_dlpack(r)


def paged(args, isa, **kw):
    r = _C.attn_paged_prefill_raw(*args, _isa=isa, **kw)
    return np.from_dlpack(r) if isinstance(args[0], np.ndarray) else torch.from_dlpack(r)


def test_keyword():
    q, k, v = sample("attn_prefill", np.random.default_rng(0), b=1, lq=3, lkv=5, hkv=1, ratio=2, d=16)[0]
    # a level above the machine's runs the best it has: the same bits as auto
    np.testing.assert_array_equal(prefill(q, k, v, "amx"), prefill(q, k, v, None))
    with pytest.raises(ValueError, match="attn_prefill: _isa must be one of 'auto', 'portable', 'avx2'"):
        prefill(q, k, v, "sse9")
    with pytest.raises(TypeError, match="attn_prefill: _isa must be a str"):
        prefill(q, k, v, 3)


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio,causal", CASES)
def test_fp32(rng, isa, B, Lq, Lkv, D, ratio, causal):
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)[0]
    mask = rng.random((B, Lkv)) < 0.8
    out = prefill(q, k, v, isa, is_causal=causal, mask=mask)
    ref = reference("attn_prefill", q, k, v, is_causal=causal, mask=mask)
    assert rel_err(out, ref) < fp32_sum_tol(Lkv)


@requires_torch
@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio,causal", CASES)
def test_half(rng, isa, dtype, B, Lq, Lkv, D, ratio, causal):
    td = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(a).to(td)
               for a in sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)[0])
    mask = rng.random((B, Lkv)) < 0.8
    out = prefill(q, k, v, isa, is_causal=causal, mask=torch.from_numpy(mask))
    assert out.dtype == td and out.shape == q.shape
    ref = reference("attn_prefill", f64(q), f64(k), f64(v), is_causal=causal, mask=mask)
    keep = prefill_keep(B, 2 * ratio, Lq, Lkv, causal, mask)
    close_to_naive(out, naive_prefill(q, k, v, torch.from_numpy(keep.copy()), D ** -0.5), ref)


@requires_torch
@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_per_query_masks_half(rng, isa, kind):
    B, Lq, Lkv, Hq, D = 2, 37, 150, 8, 72
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16)
               for a in sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=4, d=D)[0])
    keep = rng.random((B, Hq, Lq, Lkv)) < 0.7
    if kind == "bool":
        mask, bias = keep, None
    else:
        bias = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(np.float32)
        mask = bias
    out = prefill(q, k, v, isa, is_causal=True, mask=torch.from_numpy(mask).to(torch.bfloat16 if bias is not None
                                                                                 else torch.bool))
    m64 = f64(torch.from_numpy(mask).to(torch.bfloat16)) if bias is not None else mask
    ref = reference("attn_prefill", f64(q), f64(k), f64(v), is_causal=True, mask=m64)
    keep_all = prefill_keep(B, Hq, Lq, Lkv, True, keep)
    b = None if bias is None else torch.from_numpy(np.where(keep_all, m64, 0.0)).to(torch.bfloat16)
    close_to_naive(out, naive_prefill(q, k, v, torch.from_numpy(keep_all.copy()), D ** -0.5, b), ref)


@requires_torch
@pytest.mark.parametrize("isa", HERE)
def test_paged_half(rng, isa):
    q_lens, kv_lens = [1, 140, 7, 0, 33], [1000, 140, 300, 4, 33]
    host = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=2, ratio=4, d=72)[0]
    args = [torch.from_numpy(a) for a in host]
    for i in range(3):
        args[i] = args[i].to(torch.bfloat16)
    out = paged(args, isa, is_causal=True)
    ref = reference("attn_paged_prefill", *[f64(a) if a.is_floating_point() else a.numpy() for a in args],
                    is_causal=True)
    close_to_naive(out, naive_paged_causal(args, q_lens, kv_lens, 8), ref)


@requires_torch
@pytest.mark.skipif("avx512_bf16" not in HERE, reason="no AVX512-BF16 here")
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio,causal", CASES)
def test_bf16_kernels_agree_with_the_fp32_path(rng, B, Lq, Lkv, D, ratio, causal):
    # AMX and VDPBF16PS against the portable kernel (bf16 inputs converted exactly, fp32 weights):
    # they differ by the weights' one rounding to bfloat16 (2^-9 relative) and the output's rounding
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16)
               for a in sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)[0])
    base = f64(prefill(q, k, v, "portable", is_causal=causal))
    scale = np.abs(base).max()
    for isa in [lv for lv in ("avx512_bf16", "amx") if lv in HERE]:
        out = f64(prefill(q, k, v, isa, is_causal=causal))
        assert np.abs(out - base).max() <= 2 ** -6 * scale, isa
        assert not np.array_equal(out, base)  # the level did run its own kernel
    if "amx" in HERE:  # two kernels, one rounding of the weights: close to each other too
        d = f64(prefill(q, k, v, "amx", is_causal=causal)) - f64(prefill(q, k, v, "avx512_bf16", is_causal=causal))
        assert np.abs(d).max() <= 2 ** -7 * scale


@pytest.mark.skipif("avx512" not in HERE, reason="no AVX-512 here")
@pytest.mark.parametrize("B,Lq,Lkv,D,ratio,causal", CASES)
def test_avx2_gives_the_avx512_bits(rng, B, Lq, Lkv, D, ratio, causal):
    q, k, v = sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=2, ratio=ratio, d=D)[0]
    wide = prefill(q, k, v, "avx512", is_causal=causal)
    np.testing.assert_array_equal(prefill(q, k, v, "avx2", is_causal=causal), wide)
    assert not np.array_equal(prefill(q, k, v, "portable", is_causal=causal), wide)  # fma: other bits


@pytest.mark.parametrize("isa", HERE)
def test_threads_do_not_change_bits(rng, isa):
    q, k, v = sample("attn_prefill", rng, b=2, lq=300, lkv=700, hkv=2, ratio=4, d=72)[0]
    mask = rng.random((2, 700)) < 0.9
    halves = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v)] if HAS_TORCH else None
    old = _dispatch.configure(num_threads=1)
    try:
        runs = []
        for n in (1, 2, 3):
            _dispatch.configure(num_threads=n)
            out = [prefill(q, k, v, isa, is_causal=True, mask=mask)]
            if halves:
                out.append(f64(prefill(*halves, isa, is_causal=True, mask=torch.from_numpy(mask))))
            runs.append(out)
    finally:
        _dispatch.configure(num_threads=old["num_threads"])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


@requires_torch
def test_num_threads_env_does_not_change_bits():
    code = ("import hashlib, numpy as np, torch\n"
            "from qkernels import _C\n"
            "from qkernels.testing import sample\n"
            "q, k, v = sample('attn_prefill', np.random.default_rng(5), b=1, lq=400, lkv=400, hkv=4, ratio=2,"
            " d=128)[0]\n"
            "h = hashlib.sha256()\n"
            "for isa in %r:\n"
            "    for dt in (torch.float32, torch.bfloat16):\n"
            "        t = [torch.from_numpy(a).to(dt) for a in (q, k, v)]\n"
            "        h.update(torch.from_dlpack(_C.attn_prefill_raw(*t, is_causal=True, _isa=isa)).float().numpy()"
            ".tobytes())\n"
            "print(h.hexdigest())\n") % (HERE,)
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "QKERNELS_NUM_THREADS": str(n)}).stdout for n in (1, 2, 5)}
    assert len(runs) == 1, runs
