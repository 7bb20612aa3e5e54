"""attn_decode and attn_paged_decode on CUDA through the public API: the float64 references of
qkernels.testing, fp16/bf16
against a naive same-precision torch computation (flash-attention's rule), kv_lens and masks,
non-contiguous views, the token pool with new_k/new_v appended, bad indices contained, the cpu
backend staging device tensors, CUDA-graph replay with lengths changed on the device, and the real
flash_attn where installed.  Every kernel test runs with the on-chip cluster merge of the splits
(sm_90, short splits) and without it (the raw ops' _variant="workspace": workspace and combine
kernel; conftest.Ops); the paged ones also with each paged kernel forced (_variant="rows" and
"heads").  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels import _frameworks
from qkernels.testing import appended, reference, sample
from conftest import capture_graph, close_to_naive, cuda, f64, naive_decode, Ops, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

HALVES = ["bfloat16", "float16"]


@pytest.fixture(params=["picked", "workspace"])
def ops(request):
    """attn_decode and attn_paged_decode as the launcher picks their split merge (on sm_90 the
    cluster merge for short splits), or always through the workspace (_variant="workspace")."""
    return Ops() if request.param == "picked" else Ops("workspace", _variant="workspace")


@pytest.fixture(params=["picked", "workspace", "rows", "heads"])
def paged_ops(request):
    """attn_paged_decode (and attn_decode) as the launcher picks, through the workspace, and with
    each paged kernel forced: "rows" (a CTA per sequence and split reading whole token rows, where
    it takes the call: D 64 or 128, Hkv * D <= 1024, GQA <= 16) and "heads" (a CTA per sequence,
    kv head and split)."""
    return Ops() if request.param == "picked" else Ops(request.param, _variant=request.param)


def keep_of(B, L, kv_lens=None, mask=None):
    keep = torch.ones(B, L, dtype=torch.bool, device="cuda")
    if kv_lens is not None:
        keep &= torch.arange(L, device="cuda")[None, :] < kv_lens.long()[:, None]
    if mask is not None:
        keep &= mask.reshape(B, L)
    return keep


# ---- attn_decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("ratio", [1, 4, 5, 8])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("B,L", [(1, 1), (3, 7), (17, 129), (1, 4097), (3, 4097)])
def test_decode(rng, ops, dtype, B, L, D, ratio):
    q, k, v = (cuda(a, dtype) for a in sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=ratio, d=D)[0])
    out = ops.attn_decode(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_cuda
    ref = reference("attn_decode", f64(q), f64(k), f64(v))
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L), D ** -0.5), ref)


@pytest.mark.parametrize("splits", [1, 3, 4, 7, 16, 64])
def test_decode_forced_splits(rng, ops, splits):
    """_splits= (tuning sweeps) forces the split count: any count is correct, with lengths that leave
    some splits empty and a poisoned out; contiguous and paged."""
    ops = ops.with_(_splits=splits)
    B, L, D = 5, 1000, 128
    q, k, v = (cuda(a, "bfloat16") for a in sample("attn_decode", rng, b=B, l=L, hkv=8, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([1, 17, 500, 999, 1000], np.int32))
    out = torch.full_like(q, float("nan"))
    ops.attn_decode(q, k, v, kv_lens=kv_lens, out=out)
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.cpu().numpy())
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L, kv_lens), D ** -0.5), ref)
    lens = [0, 3, 1000, 257]
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=D, index_dtype=np.int32)[0],
                      "bfloat16")
    ref = reference("attn_paged_decode", *host64(args))
    out = ops.attn_paged_decode(*args)
    close_to_naive(out, naive_paged(args, lens, D), ref)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_decode_many_splits(rng, ops, D):
    """More than 32 splits (the combine's batches of 32, the wide combine past 8 splits), with a
    ragged last batch and empty splits past kv_lens; the picked merge falls back to the workspace
    path at 750-key splits."""
    B, L = 2, 30000
    q, k, v = (cuda(a, "bfloat16") for a in sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([L, 9000], np.int32))
    out = torch.full_like(q, float("nan"))
    ops.with_(_splits=40).attn_decode(q, k, v, kv_lens=kv_lens, out=out)
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.cpu().numpy())
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L, kv_lens), D ** -0.5), ref)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("mask_shape", [None, "2d", "3d"])
def test_decode_kv_lens_and_mask(rng, ops, dtype, mask_shape):
    B, L, D = 6, 300, 128
    q, k, v = (cuda(a, dtype) for a in sample("attn_decode", rng, b=B, l=L, hkv=8, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([0, 1, 150, 299, 300, 5000], np.int32))
    mask = None
    if mask_shape:
        m = rng.random((B, L)) < 0.7
        m[4] = False  # fully masked: 0
        mask = cuda(m if mask_shape == "2d" else m[:, None, :])
    out = ops.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.cpu().numpy(),
                    mask=None if mask is None else mask.cpu().numpy())
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L, kv_lens, mask), D ** -0.5), ref)
    assert torch.all(out[0] == 0)
    if mask_shape:
        assert torch.all(out[4] == 0)
    out64 = ops.attn_decode(q, k, v, kv_lens=kv_lens.long(), mask=mask)
    assert torch.equal(out, out64)


def float_mask(rng, shape, dtype, drop=0.3):
    """An additive mask (normal values, -inf = drop) on the GPU, in float32 or the torch dtype named
    dtype."""
    m = np.where(rng.random(shape) >= drop, 2 * rng.standard_normal(shape), -np.inf).astype(np.float32)
    return cuda(m, None if dtype == "float32" else dtype)


def bias_keep(mask, B, L):
    """An additive mask [B|1, .., L] as (keep [B, L], bias [B, L] with 0 where dropped) on the GPU."""
    m = mask.double().reshape(mask.shape[0], L).expand(B, L)
    keep = m != float("-inf")
    return keep, torch.where(keep, m, 0.0).float()


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("mask_dtype", ["float32", "own"])
@pytest.mark.parametrize("form", ["B,L", "B,1,1,L", "1,L"])
@pytest.mark.parametrize("L", [300, 4097])
def test_decode_float_masks(rng, ops, dtype, mask_dtype, form, L):
    """Additive masks with kv_lens: -inf entries, a fully masked sequence (0), one split and many
    (4097 keys: the cluster or workspace merge)."""
    B, D = 6, 128
    q, k, v = (cuda(a, dtype) for a in sample("attn_decode", rng, b=B, l=L, hkv=8, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([0, 1, 150, L - 1, L, 5000], np.int32))
    dims = {"B": B, "L": L, "1": 1}
    mask = float_mask(rng, tuple(dims[d] for d in form.split(",")), dtype if mask_dtype == "own" else "float32")
    if mask.shape[0] > 1:
        mask[4] = float("-inf")
    out = ops.attn_decode(q, k, v, kv_lens=kv_lens, mask=mask)
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.cpu().numpy(), mask=f64(mask))
    keep, bias = bias_keep(mask, B, L)
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L, kv_lens, keep), D ** -0.5, bias), ref)
    assert torch.all(out[0] == 0) and (mask.shape[0] == 1 or torch.all(out[4] == 0))


def test_decode_float_mask_equals_bool_and_large_values(rng, ops):
    B, L, D = 3, 1000, 64
    q, k, v = (cuda(a, "bfloat16") for a in sample("attn_decode", rng, b=B, l=L, hkv=2, ratio=8, d=D)[0])
    keep = rng.random((B, L)) < 0.5
    a = ops.attn_decode(q, k, v, mask=cuda(keep))
    b = ops.attn_decode(q, k, v, mask=cuda(np.where(keep, 0.0, -np.inf).astype(np.float32)))
    assert (a.float() - b.float()).abs().max().item() < 1e-2
    mask = np.zeros((B, L), np.float32)
    mask[0] = -1e30  # every key equally far down: the average of the values, as SDPA
    mask[1] = -3e38  # clamped to -2.35e38 on cuda, still the average
    out = ops.attn_decode(q, k, v, mask=cuda(mask))
    for s in (0, 1):
        avg = v[s].float().mean(0).repeat_interleave(8, dim=0)
        assert (out[s, 0].float() - avg).abs().max().item() < 1e-2


def test_decode_strided_and_poisoned_out(rng, ops):
    B, L, Hkv, ratio, D = 3, 200, 2, 4, 128
    q = cuda(rng.standard_normal((B, 1, Hkv * ratio, 2 * D)).astype(np.float32), "bfloat16")[..., D:]
    k = cuda(rng.standard_normal((L, B, Hkv, D)).astype(np.float32), "bfloat16").transpose(0, 1)
    v = cuda(rng.standard_normal((B, Hkv, L, D)).astype(np.float32), "bfloat16").transpose(1, 2)
    out = torch.full((B, 1, Hkv * ratio, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert ops.attn_decode(q, k, v, out=out) is out
    assert not out.isnan().any()
    ref = reference("attn_decode", f64(q), f64(k), f64(v))
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L), D ** -0.5), ref)
    k2 = torch.zeros(B, L, Hkv, 2 * D, dtype=torch.bfloat16, device="cuda")[..., ::2]
    with pytest.raises(ValueError, match="attn_decode: k must be unit-stride in its last dimension, got stride 2"):
        qkernels.attn_decode(q, k2, v)


def test_decode_cuda_checks(rng):
    q, k, v = (cuda(a) for a in sample("attn_decode", rng, b=2, l=5, hkv=2, ratio=4, d=64)[0])  # float32 on cuda
    with pytest.raises(TypeError, match="attn_decode: q must be bfloat16 or float16 on cuda"):
        qkernels._C.attn_decode_raw(q, k, v)
    with pytest.raises(qkernels.ExplicitSelectionError, match="requires dtype float16 or bfloat16"):
        qkernels.attn_decode(q, k, v, backend="cuda")
    _frameworks._staging_warned.clear()  # the warning comes once per op and framework
    with pytest.warns(qkernels.FallbackWarning):  # the chain stages float32 through the cpu backend
        out = qkernels.attn_decode(q, k, v)
    assert out.is_cuda and np.abs(f64(out) - reference("attn_decode", f64(q), f64(k), f64(v))).max() < 1e-5
    q, k, v = (cuda(a, "bfloat16") for a in sample("attn_decode", rng, b=2, l=5, hkv=2, ratio=4, d=40)[0])
    with pytest.raises(qkernels.ExplicitSelectionError, match="requires head_dim 32, 64, 128 or 256"):
        qkernels.attn_decode(q, k, v, backend="cuda")


# ---- attn_paged_decode ----------------------------------------------------------------------

def paged_cuda(host, dtype):
    return [cuda(a, dtype) if i < 3 else cuda(a) for i, a in enumerate(host)]


def host64(args):
    """attn_paged_decode's CUDA arguments on the host: the floats in float64."""
    return [f64(a) if i < 3 else a.cpu().numpy() for i, a in enumerate(args)]


def naive_paged(args, lens, D):
    """The naive same-precision yardstick: each sequence gathered from the (updated) pool, then
    decoded."""
    r2t, rpi = args[3].long(), args[4].long()
    naive = torch.zeros_like(args[0])
    for b, n in enumerate(lens):
        slots = r2t[rpi[b], :n]
        keep = torch.ones(1, n, dtype=torch.bool, device="cuda")
        naive[b] = naive_decode(args[0][b:b + 1, None], args[1][slots][None], args[2][slots][None], keep,
                                D ** -0.5)[0, 0]
    return naive


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("D,ratio", [(32, 1), (64, 4), (128, 5), (256, 8), (128, 8)])
def test_paged(rng, paged_ops, dtype, D, ratio):
    ops = paged_ops
    lens = [0, 1, 7, 129, 4097, 33]
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=ratio, d=D, index_dtype=np.int32)[0],
                      dtype)
    new_k = cuda(rng.standard_normal((len(lens), 2, D)).astype(np.float32), dtype)
    new_v = cuda(rng.standard_normal((len(lens), 2, D)).astype(np.float32), dtype)
    host = host64(args)
    ref = reference("attn_paged_decode", *host, new_k=f64(new_k), new_v=f64(new_v))
    k_ref, v_ref = appended(host[1], f64(new_k), *host[3:]), appended(host[2], f64(new_v), *host[3:])
    got = []
    names = kernel_names(lambda: got.append(ops.attn_paged_decode(*args, new_k=new_k, new_v=new_v)))
    out = got[0]
    if ops.label in ("heads", "workspace"):
        assert not any("decode_rows" in n for n in names), names
    if ops.label == "rows" and D in (64, 128):
        assert not names or any("decode_rows" in n for n in names), names
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    assert np.array_equal(f64(args[1]), k_ref) and np.array_equal(f64(args[2]), v_ref)  # appended
    assert torch.all(out[0] == 0)
    close_to_naive(out, naive_paged(args, lens, D), ref)


def kernel_names(call):
    """The names of the GPU kernels call() runs, as torch.profiler records them (empty where the
    profiler records no device activity)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


ROWS_LENS = {"1": [1], "4097": [4097], "B5": [1, 255, 256, 257, 4097], "B8": [257, 0, 4097, 256, 1, 255, 33, 4096]}


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("D,hkv,ratio", [(128, 8, 4), (128, 8, 1), (128, 8, 8), (128, 4, 5), (128, 1, 16),
                                         (128, 2, 12), (64, 16, 4), (64, 3, 1)])
@pytest.mark.parametrize("lens", list(ROWS_LENS), ids=list(ROWS_LENS))
@pytest.mark.parametrize("splits", [0, 3])
def test_paged_rows_kernel(rng, dtype, D, hkv, ratio, lens, splits):
    """The row kernel forced (_variant="rows") on shuffled pools: lengths around the 16-key tiles and
    the splits, B 1..8 with an empty sequence, GQA 1..16 (one or two groups of 8 rows), rows of
    Hkv * D = 128 .. 1024 elements, new_k/new_v written to the pool and used, the picked split count
    and 3 forced; a second call on the updated pool gives the same bits (fixed merge order)."""
    lens = ROWS_LENS[lens]
    ops = Ops("rows", _variant="rows", **({"_splits": splits} if splits else {}))
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=hkv, ratio=ratio, d=D, index_dtype=np.int32)[0],
                      dtype)
    new_k = cuda(rng.standard_normal((len(lens), hkv, D)).astype(np.float32), dtype)
    new_v = cuda(rng.standard_normal((len(lens), hkv, D)).astype(np.float32), dtype)
    host = host64(args)
    ref = reference("attn_paged_decode", *host, new_k=f64(new_k), new_v=f64(new_v))
    k_ref, v_ref = appended(host[1], f64(new_k), *host[3:]), appended(host[2], f64(new_v), *host[3:])
    out = ops.attn_paged_decode(*args, new_k=new_k, new_v=new_v)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    assert np.array_equal(f64(args[1]), k_ref) and np.array_equal(f64(args[2]), v_ref)  # appended
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[b] == 0)
    close_to_naive(out, naive_paged(args, lens, D), ref)
    again = []
    names = kernel_names(lambda: again.append(ops.attn_paged_decode(*args, new_k=new_k, new_v=new_v)))
    assert torch.equal(out, again[0])
    assert not names or any("decode_rows" in n for n in names), names  # the row kernel, not a fallback


def test_paged_rows_kernel_strided_views(rng):
    """The row kernel on pools, q and new_k/new_v that are views with gaps between heads and rows
    (each head's piece of a pool row read at its own offset)."""
    lens, hkv, ratio, D = [257, 4097, 1, 16], 8, 4, 128
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=hkv, ratio=ratio, d=D, index_dtype=np.int32)[0],
                      "bfloat16")

    def gapped(t):  # the same values, every row of the last dim followed by D unused elements
        big = torch.full(t.shape[:-1] + (2 * D,), float("nan"), dtype=t.dtype, device="cuda")
        big[..., :D] = t
        return big[..., :D]

    args[0], args[1], args[2] = gapped(args[0]), gapped(args[1]), gapped(args[2])
    new_k, new_v = (gapped(cuda(rng.standard_normal((len(lens), hkv, D)).astype(np.float32), "bfloat16"))
                    for _ in range(2))
    host = host64(args)
    ref = reference("attn_paged_decode", *host, new_k=f64(new_k), new_v=f64(new_v))
    k_ref = appended(host[1], f64(new_k), *host[3:])
    out = Ops("rows", _variant="rows").attn_paged_decode(*args, new_k=new_k, new_v=new_v)
    assert np.array_equal(f64(args[1]), k_ref)
    close_to_naive(out, naive_paged(args, lens, D), ref)


def test_paged_mask_and_int64_indices(rng, paged_ops):
    ops = paged_ops
    lens = [5, 64, 0, 17]
    host = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=128, index_dtype=np.int64)[0]
    args = paged_cuda(host, "bfloat16")
    mask = rng.random((len(lens), host[3].shape[1])) < 0.6
    mask[3] = False
    out = ops.attn_paged_decode(*args, mask=cuda(mask))
    ref = reference("attn_paged_decode", *host64(args), mask=mask)
    assert torch.all(out[3] == 0)
    assert np.abs(f64(out) - ref).max() < 2e-2


@pytest.mark.parametrize("kind", ["bool", "float32", "own"])
@pytest.mark.parametrize("W", ["max_ctx", 40, 3000])
def test_paged_masks_float_and_narrow(rng, paged_ops, kind, W):
    """Bool and additive masks [B, W], W <= max_ctx (positions from W on dropped), with new_k/new_v
    appended (the new key is masked as any other)."""
    ops = paged_ops
    lens, D = [5, 64, 0, 17, 4097], 128
    host = sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=D, index_dtype=np.int32)[0]
    args = paged_cuda(host, "bfloat16")
    width = host[3].shape[1] if W == "max_ctx" else W
    if kind == "bool":
        mask = cuda(rng.random((len(lens), width)) < 0.7)
    else:
        mask = float_mask(rng, (len(lens), width), "bfloat16" if kind == "own" else "float32")
    new_k, new_v = (cuda(rng.standard_normal((len(lens), 2, D)).astype(np.float32), "bfloat16") for _ in range(2))
    hm = mask.cpu().numpy() if kind == "bool" else f64(mask)
    ref = reference("attn_paged_decode", *host64(args), new_k=f64(new_k), new_v=f64(new_v), mask=hm)
    out = ops.attn_paged_decode(*args, new_k=new_k, new_v=new_v, mask=mask)
    r2t, rpi = args[3].long(), args[4].long()
    naive = torch.zeros_like(args[0])
    for b, n in enumerate(lens):
        if n == 0:
            continue
        slots = r2t[rpi[b], :n]
        m = torch.full((1, n), float("-inf"), device="cuda")
        w = min(n, width)
        m[0, :w] = (torch.where(mask[b, :w], 0.0, float("-inf")) if kind == "bool" else mask[b, :w].float())
        keep = m != float("-inf")
        naive[b] = naive_decode(args[0][b:b + 1, None], args[1][slots][None], args[2][slots][None], keep, D ** -0.5,
                                torch.where(keep, m, 0.0))[0, 0]
    close_to_naive(out, naive, ref)


def test_paged_bad_indices_are_contained(rng, paged_ops):
    ops = paged_ops
    # Normal cuda mode does not check indices: lengths are clamped, out-of-range rows and slots
    # skipped; nothing outside the tensors is touched and the context survives.
    lens = [3, 5]
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=64)[0], "float16")
    guard = torch.full((1 << 20,), 7.0, device="cuda")
    args[4][1] = 1 << 40
    args[3][args[4][0], 1] = -(1 << 40)
    args[5][2] = 1 << 40
    out = ops.attn_paged_decode(*args, new_k=args[0][:, :2], new_v=args[0][:, :2])
    torch.cuda.synchronize()
    assert out.shape == args[0].shape and torch.all(guard == 7.0)


def test_paged_checked_pool_rows(rng):
    args = paged_cuda(sample("attn_paged_decode", rng, lens=[3, 5], hkv=2, ratio=4, d=64, index_dtype=np.int32)[0],
                      "bfloat16")
    R = args[3].shape[0]
    args[4][1] = R
    old = qkernels._C._configure(check_indices=True)
    try:
        with pytest.raises(ValueError, match=rf"req_pool_indices\[1\] = {R} is out of range"):
            qkernels.attn_paged_decode(*args)
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])


def test_cpu_backend_stages_paged_append(rng):
    lens = [4, 9]
    args = paged_cuda(sample("attn_paged_decode", rng, lens=lens, hkv=2, ratio=4, d=64, index_dtype=np.int32)[0],
                      "bfloat16")
    new_k = cuda(rng.standard_normal((2, 2, 64)).astype(np.float32), "bfloat16")
    h = host64(args)
    ref = reference("attn_paged_decode", *h, new_k=f64(new_k), new_v=f64(new_k))
    k_ref = appended(h[1], f64(new_k), *h[3:])
    _frameworks._staging_warned.clear()
    with pytest.warns(qkernels.FallbackWarning):
        out = qkernels.attn_paged_decode(*args, new_k=new_k, new_v=new_k, backend="cpu")
    assert out.is_cuda and np.array_equal(f64(args[1]), k_ref)  # the device pool got the new tokens
    assert np.abs(f64(out) - ref).max() < 2e-2


# ---- CUDA graphs: lengths live on the device ------------------------------------------------

def test_capture_and_replay_with_new_lengths(rng, paged_ops):
    ops = paged_ops
    B, L, D = 4, 512, 128
    q, k, v = (cuda(a, "bfloat16") for a in sample("attn_decode", rng, b=B, l=L, hkv=8, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([512, 100, 1, 0], np.int32))
    host = sample("attn_paged_decode", rng, lens=[300, 2, 77, 1], hkv=8, ratio=4, d=D, index_dtype=np.int32)[0]
    pargs = paged_cuda(host, "bfloat16")
    calls = lambda: (ops.attn_decode(q, k, v, kv_lens=kv_lens),  # noqa: E731
                     ops.attn_paged_decode(*pargs))
    g, outs = capture_graph(calls)
    for lens, indptr in (([7, 512, 0, 300], [0, 150, 152, 229, 230]), ([1, 2, 3, 4], [0, 300, 300, 301, 302])):
        kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        pargs[5].copy_(torch.tensor(indptr, dtype=pargs[5].dtype))  # shorter than the pool rows hold
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=np.array(lens))
        assert np.abs(f64(outs[0]) - ref).max() < 2e-2
        pref = reference("attn_paged_decode", *host64(pargs))
        assert np.abs(f64(outs[1]) - pref).max() < 2e-2


# ---- the real flash_attn --------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed")
@pytest.mark.parametrize("dtype", HALVES)
def test_flash_backend(rng, dtype):
    B, L, D = 3, 1000, 128
    q, k, v = (cuda(a, dtype) for a in sample("attn_decode", rng, b=B, l=L, hkv=8, ratio=4, d=D)[0])
    kv_lens = cuda(np.array([1000, 3, 0], np.int32))
    d = qkernels.resolve("attn_decode", q, k, v, backend="flash")
    assert d.winner == "flash"
    out = torch.full_like(q, float("nan"))
    qkernels.attn_decode(q, k, v, kv_lens=kv_lens, out=out, backend="flash")
    ref = reference("attn_decode", f64(q), f64(k), f64(v), kv_lens=kv_lens.cpu().numpy())
    close_to_naive(out, naive_decode(q, k, v, keep_of(B, L, kv_lens), D ** -0.5), ref)
