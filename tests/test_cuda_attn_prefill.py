"""attn_prefill and attn_paged_prefill on CUDA through the public API: fp16/bf16 against the float64
reference of qkernels.testing, held to twice the error of a naive same-precision torch computation
(flash-attention's rule), causal bottom-right with Lq <= Lkv and Lq > Lkv, both
mask kinds and fully masked rows, non-contiguous views and a NaN-poisoned out, ragged token-pool
batches with very uneven lengths, bad indices contained, and CUDA-graph replay with the lengths
changed on the device.  Every test runs on each prefill kernel: the one the launcher picks (on
sm_90 the warp-specialised TMA kernel for dense calls without a mask), the cp.async wgmma kernel
(the raw ops' _variant="wgmma"; sm_90 only, else the same as 'picked') and the mma.sync kernel of
other GPUs and full masks (_variant="mma"); conftest.Ops.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import prefill_keep, reference, sample
from conftest import capture_graph, close_to_naive, cuda, f64, naive_prefill, Ops, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

HALVES = ["bfloat16", "float16"]


def randn(rng, *shape, dtype="bfloat16"):
    return cuda(rng.standard_normal(shape).astype(np.float32), dtype)


def dense(rng, B, Lq, Lkv, Hq, Hkv, D, dtype="bfloat16"):
    """attn_prefill's q, k, v on the GPU."""
    return [cuda(a, dtype) for a in sample("attn_prefill", rng, b=B, lq=Lq, lkv=Lkv, hkv=Hkv, ratio=Hq // Hkv, d=D)[0]]


@pytest.fixture(params=["picked", "wgmma", "mma"])
def ops(request):
    """attn_prefill and attn_paged_prefill on the picked kernel, or forced onto one (_variant=)."""
    return Ops() if request.param == "picked" else Ops(request.param, _variant=request.param)


def check(out, q, k, v, causal, mask=None, scale=None):
    """out against the float64 reference of attn_prefill(q, k, v, mask=mask, is_causal=causal, scale=scale)
    on host copies, and the naive yardstick in q's dtype on the GPU."""
    mask = None if mask is None else mask.cpu().numpy()
    ref = reference("attn_prefill", f64(q), f64(k), f64(v), mask=mask, is_causal=causal, scale=scale)
    keep = prefill_keep(q.shape[0], q.shape[2], q.shape[1], k.shape[1], causal, mask)
    close_to_naive(out, naive_prefill(q, k, v, keep, q.shape[3] ** -0.5 if scale is None else scale), ref)


# ---- attn_prefill ---------------------------------------------------------------------------

SHAPES = [(1, 1, 1), (2, 17, 17), (1, 113, 113), (1, 1023, 1023), (1, 1024, 1024), (3, 17, 113), (2, 113, 1024),
          (1, 1, 1023), (2, 113, 17)]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("B,Lq,Lkv", SHAPES)
def test_prefill(rng, ops, dtype, B, Lq, Lkv, D, causal):
    ratio = (1, 4, 8)[(Lq + D) % 3]  # every ratio meets every head dim across the shapes
    q, k, v = dense(rng, B, Lq, Lkv, 2 * ratio, 2, D, dtype)
    out = ops.attn_prefill(q, k, v, is_causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_cuda
    check(out, q, k, v, causal)


@pytest.mark.parametrize("ratio", [1, 5, 6, 8])
def test_prefill_gqa_ratios(rng, ops, ratio):
    q, k, v = dense(rng, 2, 77, 300, 2 * ratio, 2, 128)
    check(ops.attn_prefill(q, k, v, is_causal=True, scale=0.3), q, k, v, True, scale=0.3)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("kind", ["keys", "shared", "per-head"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_masks(rng, ops, dtype, kind, causal):
    B, Lq, Lkv, Hq, Hkv, D = 2, 70, 150, 8, 2, 64
    q, k, v = dense(rng, B, Lq, Lkv, Hq, Hkv, D, dtype)
    if kind == "keys":
        mask = cuda(rng.random((B, Lkv)) < 0.7)
        mask[1] = False  # a sequence with nothing kept: all its rows are 0
    else:
        mask = cuda(rng.random((B, 1 if kind == "shared" else Hq, Lq, Lkv)) < 0.6)
        mask[0, :, 5] = False  # a fully masked query row
    out = ops.attn_prefill(q, k, v, is_causal=causal, mask=mask)
    check(out, q, k, v, causal, mask)
    if kind == "keys":
        assert torch.all(out[1] == 0)
    else:
        assert torch.all(out[0, 5] == 0)


def test_prefill_strided_and_poisoned_out(rng, ops):
    B, Lq, Lkv, Hq, Hkv, D = 2, 90, 200, 8, 4, 128
    big_q = randn(rng, B, Lq, 2 * Hq, D)
    q = big_q[:, :, ::2]  # every other head: a strided view
    kv = randn(rng, B, 2, Lkv, Hkv, D)
    k, v = kv[:, 0], kv[:, 1]
    out = torch.full((B, Lq, Hq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    r = ops.attn_prefill(q, k, v, is_causal=True, out=out)
    assert r.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    check(out, q, k, v, True)


# ---- attn_paged_prefill ---------------------------------------------------------------------

def paged_setup(rng, q_lens, kv_lens, Hq, Hkv, D, dtype="bfloat16", index_dtype=np.int32):
    """A sample of attn_paged_prefill on the GPU; req_to_token's unused entries hold random slots (in
    range), so that lengths changed on the device later still index the pool."""
    args, _ = sample("attn_paged_prefill", rng, q_lens=q_lens, kv_lens=kv_lens, hkv=Hkv, ratio=Hq // Hkv, d=D,
                     index_dtype=index_dtype)
    r2t = args[3]
    unused = r2t < 0
    r2t[unused] = rng.integers(0, len(args[1]), unused.sum())
    return [cuda(a, dtype) if i < 3 else cuda(a) for i, a in enumerate(args)]


def paged_check(out, q, k_cache, v_cache, req_to_token, rpi, kvp, qo, causal, key_mask=None):
    """out against the float64 reference of the call on host copies, and the naive yardstick in the
    inputs' precision: each request dense against its gathered keys, on the GPU."""
    mask = None if key_mask is None else key_mask.cpu().numpy()
    ref = reference("attn_paged_prefill", f64(q), f64(k_cache), f64(v_cache), *(a.cpu().numpy() for a in
                    (req_to_token, rpi, kvp, qo)), mask=mask, is_causal=causal)
    naive = torch.zeros_like(out)
    for b in range(rpi.numel()):
        q0, q1, k0, k1 = int(qo[b]), int(qo[b + 1]), int(kvp[b]), int(kvp[b + 1])
        slots = req_to_token[int(rpi[b]), :k1 - k0].long()
        keep = prefill_keep(1, q.shape[1], q1 - q0, k1 - k0, causal, None if mask is None else mask[b:b + 1, :k1 - k0])
        naive[q0:q1] = naive_prefill(q[None, q0:q1], k_cache[slots][None], v_cache[slots][None], keep,
                                     q.shape[2] ** -0.5)[0]
    close_to_naive(out, naive, ref)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_paged_ragged(rng, ops, dtype, D, causal):
    q_lens, kv_lens = [1, 300, 17, 64, 0], [4000, 300, 500, 64, 9]  # very uneven, prefix-cached, empty
    args = paged_setup(rng, q_lens, kv_lens, 8, 2, D, dtype)
    out = ops.attn_paged_prefill(*args, is_causal=causal)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    paged_check(out, *args, causal)


def test_paged_int64_and_key_mask(rng, ops):
    q_lens, kv_lens = [33, 5, 128], [40, 200, 128]
    args = paged_setup(rng, q_lens, kv_lens, 4, 4, 128, index_dtype=np.int64)
    max_ctx = args[3].shape[1]
    mask = cuda(rng.random((3, max_ctx)) < 0.8)
    out = ops.attn_paged_prefill(*args, is_causal=True, mask=mask)
    paged_check(out, *args, True, key_mask=mask)


def test_paged_bad_indices_are_contained(rng, ops):
    """Out-of-range slots are skipped on cuda (docs/ops.md): no crash, no write outside out, and the
    result is attention over the remaining keys."""
    q_lens, kv_lens = [20, 30], [50, 60]
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(rng, q_lens, kv_lens, 4, 2, 64)
    row = int(rpi[1])
    r2t[row, 7] = 10 ** 6
    r2t[row, 9] = -3
    out = ops.attn_paged_prefill(q, kc, vc, r2t, rpi, kvp, qo)
    torch.cuda.synchronize()
    keep = torch.ones(2, r2t.shape[1], dtype=torch.bool, device="cuda")
    keep[1, 7] = keep[1, 9] = False
    fixed = r2t.clone()
    fixed[row, 7] = fixed[row, 9] = 0
    paged_check(out, q, kc, vc, fixed, rpi, kvp, qo, False, key_mask=keep)


def test_paged_capture_and_replay_with_new_lengths(rng, ops):
    """The grid depends on total_q and B only: a captured call replays correctly after the split
    of the same total_q into requests (and the kv lengths) change on the device."""
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(rng, [100, 28], [300, 28], 4, 2, 128)
    out = torch.empty_like(q)
    g, _ = capture_graph(lambda: ops.attn_paged_prefill(q, kc, vc, r2t, rpi, kvp, qo, is_causal=True, out=out))
    g.replay()
    torch.cuda.synchronize()
    paged_check(out, q, kc, vc, r2t, rpi, kvp, qo, True)
    qo.copy_(torch.tensor([0, 7, 128], device="cuda", dtype=qo.dtype))
    kvp.copy_(torch.tensor([0, 7, 157], device="cuda", dtype=kvp.dtype))  # request 1: 121 queries, 150 keys
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    paged_check(out, q, kc, vc, r2t, rpi, kvp, qo, True)


def test_paged_rows_of_no_request_are_zero(rng, ops):
    """Rows before qo_indptr[0] and from qo_indptr[B] on are written as 0 (as on the cpu), also
    with no request at all."""
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(rng, [15, 20], [30, 20], 4, 2, 64)
    q = randn(rng, 50, 4, 64)
    qo = torch.tensor([5, 20, 40], device="cuda", dtype=qo.dtype)
    out = torch.full_like(q, float("nan"))
    ops.attn_paged_prefill(q, kc, vc, r2t, rpi, kvp, qo, out=out)
    assert torch.all(out[:5] == 0) and torch.all(out[40:] == 0) and not torch.isnan(out).any()
    paged_check(out[5:], q[5:], kc, vc, r2t, rpi, kvp, qo - 5, False)
    out.fill_(float("nan"))
    ops.attn_paged_prefill(q, kc, vc, r2t, rpi[:0], kvp[:1], qo[:1], out=out)
    assert torch.all(out == 0)
