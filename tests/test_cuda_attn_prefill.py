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
from conftest import capture_graph, close_to_naive, cuda, f64, naive_prefill, Ops, request_mask, requires_cuda

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


def host_mask(mask):
    """A torch mask on the host: bool, or an additive one as float64."""
    return None if mask is None else (mask.cpu().numpy() if mask.dtype == torch.bool else f64(mask))


def bias_of(mask, keep, device):
    """An additive mask (NumPy, SDPA's layout, or our [B, Lkv]) as the naive yardstick's bias, 0 where
    keep drops the key; None for a bool mask."""
    if mask is None or mask.dtype == bool:
        return None
    m = mask[:, None, None, :] if mask.ndim == 2 else mask
    return torch.from_numpy(np.where(keep, m, 0.0)).float().to(device)


def check(out, q, k, v, causal, mask=None, scale=None):
    """out against the float64 reference of attn_prefill(q, k, v, mask=mask, is_causal=causal, scale=scale)
    on host copies, and the naive yardstick in q's dtype on the GPU."""
    mask = host_mask(mask)
    ref = reference("attn_prefill", f64(q), f64(k), f64(v), mask=mask, is_causal=causal, scale=scale)
    keep = prefill_keep(q.shape[0], q.shape[2], q.shape[1], k.shape[1], causal, mask)
    close_to_naive(out, naive_prefill(q, k, v, keep, q.shape[3] ** -0.5 if scale is None else scale,
                                      bias_of(mask, keep, q.device)), ref)


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


def float_mask(rng, shape, dtype, drop=0.3):
    """An additive mask on the GPU (normal values, -inf = drop; the first row of the last dim dropped
    whole), in float32 or the torch dtype named dtype."""
    m = np.where(rng.random(shape) >= drop, 2 * rng.standard_normal(shape), -np.inf).astype(np.float32)
    m[(0,) * (len(shape) - 1)] = -np.inf
    return cuda(m, None if dtype == "float32" else dtype)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("mask_dtype", ["float32", "own"])
@pytest.mark.parametrize("form", ["B,Lkv", "B,1,1,Lkv", "B,1,Lq,Lkv", "B,Hq,Lq,Lkv", "1,Lq,Lkv", "Hq,1,Lkv"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_float_masks(rng, ops, dtype, mask_dtype, form, causal):
    """Additive masks in every form, float32 or q's dtype, -inf entries and fully masked rows (0), on
    every kernel (float masks run on the mma.sync one); D = 128 and 64 for two key-tile sizes."""
    B, Lq, Lkv, Hq, Hkv = 2, 70, 150, 8, 2
    D = 128 if causal else 64
    q, k, v = dense(rng, B, Lq, Lkv, Hq, Hkv, D, dtype)
    dims = {"B": B, "Hq": Hq, "Lq": Lq, "Lkv": Lkv, "1": 1}
    mask = float_mask(rng, tuple(dims[d] for d in form.split(",")), dtype if mask_dtype == "own" else "float32")
    out = ops.attn_prefill(q, k, v, is_causal=causal, mask=mask)
    check(out, q, k, v, causal, mask)
    keep = prefill_keep(B, Hq, Lq, Lkv, causal, host_mask(mask)).any(-1).transpose(0, 2, 1)  # [B, Lq, Hq]
    assert (~keep).any() and torch.all(out[torch.from_numpy(~keep).cuda()] == 0)


def test_prefill_float_mask_equals_bool_and_large_values(rng, ops):
    """A float mask of 0 and -inf is the bool mask (within rounding: the kernels differ); a row whose
    every entry is -1e30 or -3e38 averages its values, as SDPA (the CUDA kernels clamp finite entries
    below -2.35e38 there so log2 units do not overflow)."""
    B, Lq, Lkv, Hq, Hkv, D = 2, 40, 300, 4, 2, 128
    q, k, v = dense(rng, B, Lq, Lkv, Hq, Hkv, D)
    keep = rng.random((B, 1, Lq, Lkv)) < 0.5
    as_float = cuda(np.where(keep, 0.0, -np.inf).astype(np.float32))
    a = ops.attn_prefill(q, k, v, is_causal=True, mask=cuda(keep))
    b = ops.attn_prefill(q, k, v, is_causal=True, mask=as_float)
    assert (a.float() - b.float()).abs().max().item() < 2e-2
    mask = np.zeros((B, 1, Lq, Lkv), np.float32)
    mask[0, 0, 3] = -1e30
    mask[1, 0, 7] = -3e38
    out = ops.attn_prefill(q, k, v, mask=cuda(mask))
    check(out, q, k, v, False, cuda(mask))
    for b_, i in ((0, 3), (1, 7)):
        avg = v[b_].float().mean(0).repeat_interleave(Hq // Hkv, dim=0)
        assert (out[b_, i].float() - avg).abs().max().item() < 2e-2


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


def paged_check(out, q, k_cache, v_cache, req_to_token, rpi, kvp, qo, causal, mask=None):
    """out against the float64 reference of the call on host copies, and the naive yardstick in the
    inputs' precision: each request dense against its gathered keys (and its part of the mask), on the
    GPU."""
    mask = host_mask(mask)
    ref = reference("attn_paged_prefill", f64(q), f64(k_cache), f64(v_cache), *(a.cpu().numpy() for a in
                    (req_to_token, rpi, kvp, qo)), mask=mask, is_causal=causal)
    naive = torch.zeros_like(out)
    for b in range(rpi.numel()):
        q0, q1, k0, k1 = int(qo[b]), int(qo[b + 1]), int(kvp[b]), int(kvp[b + 1])
        slots = req_to_token[int(rpi[b]), :k1 - k0].long()
        mb = None if mask is None else request_mask(mask, b, q1 - q0, k1 - k0)
        keep = prefill_keep(1, q.shape[1], q1 - q0, k1 - k0, causal, mb)
        naive[q0:q1] = naive_prefill(q[None, q0:q1], k_cache[slots][None], v_cache[slots][None], keep,
                                     q.shape[2] ** -0.5, bias_of(mb, keep, q.device))[0]
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
    paged_check(out, *args, True, mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float32", "own"])
@pytest.mark.parametrize("form", ["B,1,Mq,W", "B,Hq,Mq,W", "B,1,1,W", "B,W", "1,1,Mq,max_ctx"])
def test_paged_per_query_and_narrow_masks(rng, ops, kind, form):
    """Per-query masks [B|1, 1|Hq, Mq, W] (row i: query i of the request) and key masks [B, W], narrower
    than max_ctx (positions from W = 200 on dropped: request 0 has 400 keys), bool and additive."""
    q_lens, kv_lens = [130, 5, 64, 0], [400, 200, 64, 9]
    Hq = 8
    args = paged_setup(rng, q_lens, kv_lens, Hq, 2, 128)
    dims = {"B": 4, "Hq": Hq, "Mq": 150, "W": 200, "max_ctx": args[3].shape[1], "1": 1}
    shape = tuple(dims[d] for d in form.split(","))
    if kind == "bool":
        mask = cuda(rng.random(shape) < 0.7)
        mask[(0,) * (len(shape) - 1)] = False
    else:
        mask = float_mask(rng, shape, "bfloat16" if kind == "own" else "float32")
    for causal in (False, True):
        out = ops.attn_paged_prefill(*args, is_causal=causal, mask=mask)
        paged_check(out, *args, causal, mask=mask)


def test_paged_mask_rows_past_mq_keep_nothing(rng, ops):
    """A per-query mask with fewer rows Mq than a request's queries: on cuda those queries keep
    nothing (0); the cpu raises ValueError."""
    q_lens, kv_lens = [20, 3], [50, 30]
    args = paged_setup(rng, q_lens, kv_lens, 4, 2, 64)
    mask = cuda(rng.random((2, 1, 8, args[3].shape[1])) < 0.8)
    out = ops.attn_paged_prefill(*args, mask=mask)
    assert torch.all(out[8:20] == 0)
    full = torch.zeros(2, 1, 20, mask.shape[3], dtype=torch.bool, device="cuda")
    full[:, :, :8] = mask
    paged_check(out, *args, False, mask=full)


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
    paged_check(out, q, kc, vc, fixed, rpi, kvp, qo, False, mask=keep)


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
