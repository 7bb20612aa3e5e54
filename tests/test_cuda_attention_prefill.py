"""attn_prefill and attn_paged_prefill on CUDA through the public API: a float64 reference (torch
float64 on the GPU, so 1024 x 1024 cases stay quick), fp16/bf16 against a naive same-precision
torch computation (flash-attention's rule), causal bottom-right with Lq <= Lkv and Lq > Lkv, both
mask kinds and fully masked rows, non-contiguous views and a NaN-poisoned out, ragged token-pool
batches with very uneven lengths, bad indices contained, and CUDA-graph replay with the lengths
changed on the device.  Every test runs on each prefill kernel: the one the launcher picks (on
sm_90 the warp-specialised TMA kernel for dense calls without a mask), the cp.async wgmma kernel
(the raw ops' _variant="wgmma"; sm_90 only, else the same as 'picked') and the mma.sync kernel of
other GPUs and full masks (_variant="mma"); conftest.Ops.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

from attn_refs import naive_prefill
from conftest import Ops, capture_graph, close_to_naive, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

HALVES = ["bfloat16", "float16"]


def randn(gen, *shape, dtype="bfloat16"):
    return torch.randn(*shape, generator=gen, device="cuda").to(getattr(torch, dtype))


@pytest.fixture(params=["picked", "wgmma", "mma"])
def ops(request):
    """attn_prefill and attn_paged_prefill on the picked kernel, or forced onto one (_variant=)."""
    return Ops() if request.param == "picked" else Ops(request.param, _variant=request.param)


@pytest.fixture
def gen(request):
    g = torch.Generator(device="cuda")
    g.manual_seed(abs(hash(request.node.name)) % (1 << 31))
    return g


def attend(q, k, v, causal, keep=None, scale=None, dtype=torch.float64):
    """attn_refs.naive_prefill on the GPU in `dtype` (float64: the reference; the inputs' dtype:
    the naive same-precision yardstick), with causal (bottom-right) folded into keep, which
    broadcasts to [B,Hq,Lq,Lkv]."""
    Lq, Lkv, D = q.shape[1], k.shape[1], q.shape[3]
    allowed = torch.ones(1, 1, Lq, Lkv, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= (torch.arange(Lkv, device=q.device)[None, :] <=
                    torch.arange(Lq, device=q.device)[:, None] + (Lkv - Lq))
    if keep is not None:
        allowed = allowed & keep
    return naive_prefill(q.to(dtype), k.to(dtype), v.to(dtype), allowed, D ** -0.5 if scale is None else scale)


def check(out, q, k, v, causal, keep=None, scale=None):
    ref = attend(q, k, v, causal, keep, scale).cpu().numpy()
    close_to_naive(out, attend(q, k, v, causal, keep, scale, dtype=q.dtype), ref)


# ---- attn_prefill ---------------------------------------------------------------------------

SHAPES = [(1, 1, 1), (2, 17, 17), (1, 113, 113), (1, 1023, 1023), (1, 1024, 1024), (3, 17, 113), (2, 113, 1024),
          (1, 1, 1023), (2, 113, 17)]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("B,Lq,Lkv", SHAPES)
def test_prefill(gen, ops, dtype, B, Lq, Lkv, D, causal):
    ratio = (1, 4, 8)[(Lq + D) % 3]  # every ratio meets every head dim across the shapes
    q, k, v = randn(gen, B, Lq, 2 * ratio, D, dtype=dtype), randn(gen, B, Lkv, 2, D, dtype=dtype), \
        randn(gen, B, Lkv, 2, D, dtype=dtype)
    out = ops.attn_prefill(q, k, v, is_causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_cuda
    check(out, q, k, v, causal)


@pytest.mark.parametrize("ratio", [1, 5, 6, 8])
def test_prefill_gqa_ratios(gen, ops, ratio):
    q, k, v = randn(gen, 2, 77, 2 * ratio, 128), randn(gen, 2, 300, 2, 128), randn(gen, 2, 300, 2, 128)
    check(ops.attn_prefill(q, k, v, is_causal=True, scale=0.3), q, k, v, True, scale=0.3)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("kind", ["keys", "shared", "per-head"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_masks(gen, ops, dtype, kind, causal):
    B, Lq, Lkv, Hq, Hkv, D = 2, 70, 150, 8, 2, 64
    q, k, v = randn(gen, B, Lq, Hq, D, dtype=dtype), randn(gen, B, Lkv, Hkv, D, dtype=dtype), \
        randn(gen, B, Lkv, Hkv, D, dtype=dtype)
    if kind == "keys":
        mask = torch.rand(B, Lkv, generator=gen, device="cuda") < 0.7
        mask[1] = False  # a sequence with nothing kept: all its rows are 0
        keep = mask[:, None, None, :]
    else:
        mask = torch.rand(B, 1 if kind == "shared" else Hq, Lq, Lkv, generator=gen, device="cuda") < 0.6
        mask[0, :, 5] = False  # a fully masked query row
        keep = mask
    out = ops.attn_prefill(q, k, v, is_causal=causal, mask=mask)
    check(out, q, k, v, causal, keep)
    if kind == "keys":
        assert torch.all(out[1] == 0)
    else:
        assert torch.all(out[0, 5] == 0)


def test_prefill_strided_and_poisoned_out(gen, ops):
    B, Lq, Lkv, Hq, Hkv, D = 2, 90, 200, 8, 4, 128
    big_q = randn(gen, B, Lq, 2 * Hq, D)
    q = big_q[:, :, ::2]  # every other head: a strided view
    kv = randn(gen, B, 2, Lkv, Hkv, D)
    k, v = kv[:, 0], kv[:, 1]
    out = torch.full((B, Lq, Hq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    r = ops.attn_prefill(q, k, v, is_causal=True, out=out)
    assert r.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    check(out, q, k, v, True)


# ---- attn_paged_prefill ---------------------------------------------------------------------

def paged_setup(gen, q_lens, kv_lens, Hq, Hkv, D, dtype="bfloat16", index_dtype=torch.int32, spare_rows=2):
    B = len(q_lens)
    max_ctx = max(kv_lens) + 3
    S = sum(kv_lens) + 7
    k_cache, v_cache = randn(gen, S, Hkv, D, dtype=dtype), randn(gen, S, Hkv, D, dtype=dtype)
    R = B + spare_rows
    req_to_token = torch.randint(0, S, (R, max_ctx), generator=gen, device="cuda").to(index_dtype)
    slots = torch.randperm(S, generator=gen, device="cuda")
    rows = torch.randperm(R, generator=gen, device="cuda")[:B]
    used = 0
    for b, L in enumerate(kv_lens):
        req_to_token[rows[b], :L] = slots[used:used + L].to(index_dtype)
        used += L
    qo = torch.tensor([0] + list(np.cumsum(q_lens)), device="cuda").to(index_dtype)
    kvp = torch.tensor([0] + list(np.cumsum(kv_lens)), device="cuda").to(index_dtype)
    q = randn(gen, int(sum(q_lens)), Hq, D, dtype=dtype)
    return q, k_cache, v_cache, req_to_token, rows.to(index_dtype), kvp, qo


def paged_check(out, q, k_cache, v_cache, req_to_token, rpi, kvp, qo, causal, key_mask=None):
    """Each request against its gathered keys, dense, in float64 and in the inputs' precision."""
    outs, refs, naives = [], [], []
    for b in range(rpi.numel()):
        q0, q1, k0, k1 = int(qo[b]), int(qo[b + 1]), int(kvp[b]), int(kvp[b + 1])
        slots = req_to_token[int(rpi[b]), :k1 - k0].long()
        qb, kb, vb = q[None, q0:q1], k_cache[slots][None], v_cache[slots][None]
        keep = None if key_mask is None else key_mask[b, :k1 - k0][None, None, None, :]
        refs.append(attend(qb, kb, vb, causal, keep)[0])
        naives.append(attend(qb, kb, vb, causal, keep, dtype=q.dtype)[0])
        outs.append(out[q0:q1])
    close_to_naive(torch.cat(outs), torch.cat(naives), torch.cat(refs).cpu().numpy())


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_paged_ragged(gen, ops, dtype, D, causal):
    q_lens, kv_lens = [1, 300, 17, 64, 0], [4000, 300, 500, 64, 9]  # very uneven, prefix-cached, empty
    args = paged_setup(gen, q_lens, kv_lens, 8, 2, D, dtype)
    out = ops.attn_paged_prefill(*args, is_causal=causal)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    paged_check(out, *args, causal)


def test_paged_int64_and_key_mask(gen, ops):
    q_lens, kv_lens = [33, 5, 128], [40, 200, 128]
    args = paged_setup(gen, q_lens, kv_lens, 4, 4, 128, index_dtype=torch.int64)
    max_ctx = args[3].shape[1]
    mask = torch.rand(3, max_ctx, generator=gen, device="cuda") < 0.8
    out = ops.attn_paged_prefill(*args, is_causal=True, mask=mask)
    paged_check(out, *args, True, key_mask=mask)


def test_paged_bad_indices_are_contained(gen, ops):
    """Out-of-range slots are skipped on cuda (SPEC §8): no crash, no write outside out, and the
    result is attention over the remaining keys."""
    q_lens, kv_lens = [20, 30], [50, 60]
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(gen, q_lens, kv_lens, 4, 2, 64)
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


def test_paged_capture_and_replay_with_new_lengths(gen, ops):
    """The grid depends on total_q and B only: a captured call replays correctly after the split
    of the same total_q into requests (and the kv lengths) change on the device."""
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(gen, [100, 28], [300, 28], 4, 2, 128)
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


def test_paged_rows_of_no_request_are_zero(gen, ops):
    """Rows before qo_indptr[0] and from qo_indptr[B] on are written as 0 (as on the cpu), also
    with no request at all."""
    q, kc, vc, r2t, rpi, kvp, qo = paged_setup(gen, [15, 20], [30, 20], 4, 2, 64)
    q = randn(gen, 50, 4, 64)
    qo = torch.tensor([5, 20, 40], device="cuda", dtype=qo.dtype)
    out = torch.full_like(q, float("nan"))
    ops.attn_paged_prefill(q, kc, vc, r2t, rpi, kvp, qo, out=out)
    assert torch.all(out[:5] == 0) and torch.all(out[40:] == 0) and not torch.isnan(out).any()
    paged_check(out[5:], q[5:], kc, vc, r2t, rpi, kvp, qo - 5, False)
    out.fill_(float("nan"))
    ops.attn_paged_prefill(q, kc, vc, r2t, rpi[:0], kvp[:1], qo[:1], out=out)
    assert torch.all(out == 0)
