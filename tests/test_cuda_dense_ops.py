"""rotary_emb, linear and swiglu on the cuda backend (torch CUDA tensors, the public API): the float64
references of qkernels.testing on host copies of the inputs, bfloat16/float16 held to twice a naive same-precision torch
computation's error (cuBLAS's F.linear, the unfused silu chain), the full M x K x N grid of
Llama-3-8B-like decode shapes, each linear case on both CUDA kernels where two apply (wgmma and mma.sync on sm_90),
bitwise determinism run to run, poisoned and strided outputs, non-contiguous inputs, the
caller's stream, CUDA-graph capture and replay, and the dispatcher.  A kernel is forced through the
raw ops' private tuning keywords (conftest.Ops).  Skipped without a GPU."""

import functools
import importlib.util
import warnings

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference
from conftest import (behind_held_copy, capture_graph, close_to_naive, cuda_randn as randn, f64, naive_rotary, Ops,
                      replay_like_eager, requires_cuda)

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch
    import torch.nn.functional as F

HALF = ["bfloat16", "float16"]
MS = [1, 2, 7, 8, 9, 16, 33, 64, 65, 300]
KS = [7, 100, 1536, 4096]
NS = [1, 129, 4096, 14336]


@pytest.fixture(params=["picked", "mma", "gemv", "rows"])
def linear_kernel(request):
    """linear's and swiglu's kernel (Ops: .linear, .swiglu): the one the launcher picks (cuBLASLt past
    M = 64 where the library loads; on sm_90 the row kernel for M <= 64 with at least 16 weight rows per
    SM and K >= 2048, the cluster wgmma kernel for the rest of 16 < M <= 64; elsewhere the CUDA-core
    GEMV for M = 1 and N >= 64 per SM), linear.cu's mma.sync kernel (_variant="mma"), its CUDA-core
    GEMV for M <= 8 (_variant="gemv"; the tile kernels elsewhere), and the sm_90 one-CTA-per-SM row
    kernel for M <= 64 (_variant="rows"; with 16-byte aligned rows and K % 8 == 0, the other kernels
    elsewhere)."""
    if request.param == "picked":
        return Ops()
    return Ops(request.param, _variant=request.param)


def close(ours, naive, op, *args, **kwargs):
    """close_to_naive against qkernels.testing.reference(op) of the tensors' float64 host copies."""
    ref = reference(op, *(None if a is None else f64(a) for a in args), **kwargs)
    close_to_naive(ours, naive, ref, slack=1e-5)


@functools.lru_cache(maxsize=8)
def weights(n, k, dtype):
    """(up, gate, bias) for one size, shared by the M cases (the 14336 x 4096 ones are 117 MB each)."""
    return (randn(n, k, dtype=dtype, scale=k ** -0.5, seed=n * 7 + k), randn(n, k, dtype=dtype, scale=2 * k ** -0.5,
            seed=n * 11 + k), randn(n, dtype=dtype, seed=n + k))


def freqs_for(lead, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ang = 10 * torch.rand(*lead, d // 2, device="cuda", dtype=torch.float64, generator=g)
    return torch.stack([ang.cos(), ang.sin()], -1).float()


# ---- linear and swiglu over the M x K x N grid ---------------------------------------------

@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("m,k,n", [(8, 4096, 4096), (40, 4096, 4096), (40, 136, 129), (3, 7, 1)])
def test_linear_forced_split(linear_kernel, split, m, k, n):
    """_split= (tuning sweeps) on both kernels: any cluster size, including ranks left without a K
    step (K = 7, 136 split 8 ways), gives the right result."""
    w, _, b = weights(n, k, "bfloat16")
    x = randn(m, k, seed=m + 1)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    linear_kernel.with_(_split=split).linear(x, w, b, out=out)
    close(out, F.linear(x, w, b), "linear", x, w, b)


@pytest.mark.parametrize("tile_m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("m,k,n", [(3, 4096, 129), (20, 136, 4096), (16, 4096, 4096), (65, 100, 33)])
def test_linear_and_swiglu_any_tile_config(tile_m, m, k, n):
    """_tile_m= (tuning sweeps) gives linear.cu's kernel any tile configuration for any M (smaller
    tiles take the rows in chunks): results stay right, poisoned outputs fully written."""
    ops = Ops("mma", _variant="mma", _tile_m=tile_m)
    up, gate, b = weights(n, k, "bfloat16")
    x = randn(m, k, seed=m + 2)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.linear(x, up, b, out=out)
    close(out, F.linear(x, up, b), "linear", x, up, b)
    out2 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.swiglu(x, up, gate, out=out2)
    close(out2, F.linear(x, up) * F.silu(F.linear(x, gate)), "swiglu", x, up, gate)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_linear(dtype, m, k, n, linear_kernel):
    w, _, b = weights(n, k, dtype)
    x = randn(m, k, dtype=dtype, seed=m)
    out = linear_kernel.linear(x, w, b)
    assert out.is_cuda and out.dtype == x.dtype and out.shape == (m, n)
    close(out, F.linear(x, w, b), "linear", x, w, b)
    if m in (1, 65):
        close(linear_kernel.linear(x, w), F.linear(x, w), "linear", x, w)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_swiglu(dtype, m, k, n):
    up, gate, _ = weights(n, k, dtype)
    x = randn(m, k, dtype=dtype, seed=m)
    out = qkernels.swiglu(x, up, gate)
    assert out.is_cuda and out.dtype == x.dtype and out.shape == (m, n)
    close(out, F.linear(x, up) * F.silu(F.linear(x, gate)), "swiglu", x, up, gate)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(4096, 129), (1536, 4096), (4104, 14336), (100, 33), (8, 1)])
def test_gemv_kernel(dtype, m, k, n):
    """linear and swiglu on the CUDA-core GEMV (_variant="gemv", M <= 8): K past the last full
    256-element chunk (4104, 100 falls back: K % 8), rows of x, weights and out strided, a poisoned
    out; bitwise the same on a second call."""
    ops = Ops("gemv", _variant="gemv")
    up, gate, b = weights(n, k, dtype)
    xb = randn(m, k + 64, dtype=dtype, seed=m + 7)
    x = xb[:, 32:32 + k]
    wb = torch.cat([up, gate], 1)
    ws, gs = wb[:, :k], wb[:, k:]
    big = torch.full((m, n + 16), float("nan"), device="cuda", dtype=getattr(torch, dtype))
    out = big[:, 8:8 + n]
    ops.linear(x, ws, b, out=out)
    close(out, F.linear(x, ws, b), "linear", x, ws, b)
    assert torch.equal(ops.linear(x, ws, b), out)
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + n:]).all()
    big.fill_(float("nan"))
    ops.swiglu(x, ws, gs, out=out)
    close(out, F.linear(x, ws) * F.silu(F.linear(x, gs)), "swiglu", x, ws, gs)
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + n:]).all()


@pytest.mark.parametrize("dtype", HALF)
def test_one_dimensional_x_and_empty(dtype):
    w, g, b = weights(129, 100, dtype)
    x = randn(100, dtype=dtype)
    out = qkernels.linear(x, w, b)
    assert out.shape == (129,)
    close(out, F.linear(x, w, b), "linear", x, w, b)
    assert qkernels.swiglu(x, w, g).shape == (129,)
    assert qkernels.linear(randn(0, 100, dtype=dtype), w, b).shape == (0, 129)
    assert qkernels.swiglu(randn(0, 100, dtype=dtype), w, g).shape == (0, 129)


@pytest.mark.parametrize("m,k,n", [(5, 4096, 28672), (16, 4104, 16400), (40, 4096, 16400), (7, 8200, 129)])
def test_linear_large_n(m, k, n, linear_kernel):
    """Past 16384 weight rows (the 28672 x 4096 benchmark shape and a ragged 16400 with K % 32 != 0)
    and past K = 8192 at small N: the tiles chosen from those sizes (M <= 8, M <= 16), the row kernel
    and the wgmma kernel."""
    w, _, b = weights(n, k, "bfloat16")
    x = randn(m, k, seed=m + 3)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    linear_kernel.linear(x, w, b, out=out)
    close(out, F.linear(x, w, b), "linear", x, w, b)
    assert torch.equal(linear_kernel.linear(x, w, b), out)


@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (16, 4096, 14336), (64, 1536, 4096), (300, 4096, 4096)])
def test_bitwise_determinism(m, k, n, linear_kernel):
    up, gate, b = weights(n, k, "bfloat16")
    x = randn(m, k, seed=m)
    ops = linear_kernel
    first = ops.linear(x, up, b), ops.swiglu(x, up, gate)
    for _ in range(3):
        again = ops.linear(x, up, b), ops.swiglu(x, up, gate)
        assert all(torch.equal(p, q) for p, q in zip(first, again))


@pytest.mark.parametrize("m", [33, 130])  # 130: cuBLASLt on the picked path (linear_lt.cu)
@pytest.mark.parametrize("dtype", HALF)
def test_poisoned_strided_out_and_strided_rows(dtype, m, linear_kernel):
    k, n = 1536, 4096
    up, gate, b = weights(n, k, dtype)
    xb = randn(m, k + 64, dtype=dtype, seed=5)
    x = xb[:, 32:32 + k]  # row stride k + 64
    wb = torch.cat([up, gate], 1)  # [n, 2k]: rows of up and gate with stride 2k
    ws, gs = wb[:, :k], wb[:, k:]
    big = torch.full((m, n + 16), float("nan"), device="cuda", dtype=getattr(torch, dtype))
    out = big[:, 8:8 + n]
    ops = linear_kernel
    assert ops.linear(x, ws, b, out=out) is out
    close(out, F.linear(x, ws, b), "linear", x, ws, b)
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + n:]).all()
    big.fill_(float("nan"))
    ops.swiglu(x, ws, gs, out=out)
    close(out, F.linear(x, ws) * F.silu(F.linear(x, gs)), "swiglu", x, ws, gs)
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + n:]).all()
    bs = torch.stack([b, b], 1)[:, 0]  # bias with element stride 2
    close(ops.linear(x, ws, bs), F.linear(x, ws, b), "linear", x, ws, b)


def test_inner_strided_rejected():
    x, w = randn(4, 64), randn(8, 64)
    with pytest.raises(ValueError, match="linear: x must be unit-stride in its last dimension, got stride 2"):
        qkernels.linear(randn(4, 128)[:, ::2], w)
    with pytest.raises(ValueError, match="swiglu: gate_weight must be unit-stride in its last dimension"):
        qkernels.swiglu(x, w, randn(64, 8).t())
    with pytest.raises(ValueError, match="rotary_emb: x must be unit-stride in its last dimension"):
        qkernels.rotary_emb(randn(5, 2, 16)[..., ::2], freqs_for((5,), 8))


# ---- rotary_emb -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 64), (19, 3, 6), (7, 32, 64), (33, 8, 128), (4096, 32, 128),
                                   (2, 5, 3, 6), (3, 9, 2, 128), (2, 512, 8, 256)])
def test_rotary(dtype, interleaved, shape):
    x = randn(*shape, dtype=dtype, seed=len(shape))
    f = freqs_for(shape[:-2], shape[-1])
    out = qkernels.rotary_emb(x, f, interleaved=interleaved)
    assert out.is_cuda and out.dtype == x.dtype and out.shape == x.shape
    close(out, naive_rotary(x, f, interleaved), "rotary_emb", x, f, interleaved=interleaved)
    y = x.clone()
    assert qkernels.rotary_emb(y, f, interleaved=interleaved, out=y) is y  # in place
    assert torch.equal(y, out)
    assert torch.equal(qkernels.rotary_emb(x, f, interleaved=interleaved), out)  # deterministic


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(33, 8, 128), (3, 9, 2, 64), (2, 512, 8, 256), (19, 3, 32), (7, 5, 48),
                                   (4096, 32, 128)])
def test_rotary_half_paths_agree(dtype, shape):
    """Rotate-half on the vector kernel (two 16-byte chunks per thread) and on the scalar one (rows
    not 16-byte aligned) do the same fp32 operations, so they agree bit for bit, and match the
    reference; poisoned outs.  (The partner-lane and 8-byte kernels this test once held beside them
    are in benchmarks/probe/rotary_half_variants.cu.)"""
    x = randn(*shape, dtype=dtype, seed=3)
    f = freqs_for(shape[:-2], shape[-1])
    out = torch.full_like(x, float("nan"))
    qkernels.rotary_emb(x, f, interleaved=False, out=out)
    close(out, naive_rotary(x, f, False), "rotary_emb", x, f, interleaved=False)
    x1 = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(shape)  # 2 bytes past 16
    x1.copy_(x)
    out1 = torch.full((x.numel() + 1,), float("nan"), device="cuda", dtype=x.dtype)[1:].view(shape)
    qkernels.rotary_emb(x1, f, interleaved=False, out=out1)
    assert torch.equal(out1, out)


def test_rotary_strided_views_and_poisoned_out():
    t, h, d = 300, 8, 128
    qkv = randn(t, 3 * h, d, seed=3)
    q = qkv[:, :h]  # token stride 3hd
    f = freqs_for((t,), d)
    big = torch.full((t, h, d + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[..., 8:8 + d]
    qkernels.rotary_emb(q, f, out=out)
    close(out, naive_rotary(q, f), "rotary_emb", q, f)
    assert torch.isnan(big[..., :8]).all() and torch.isnan(big[..., 8 + d:]).all()
    before = qkv.clone()
    qkernels.rotary_emb(q, f, interleaved=False, out=q)  # in place inside the fused buffer
    close(qkv[:, :h], naive_rotary(before[:, :h], f, False), "rotary_emb", before[:, :h], f, interleaved=False)
    assert torch.equal(qkv[:, h:], before[:, h:])
    x = randn(4, t, h, d)
    fb = f.expand(4, t, d // 2, 2)  # one table for the whole batch: stride 0
    close(qkernels.rotary_emb(x, fb), naive_rotary(x, fb), "rotary_emb", x, fb)


# ---- streams, graphs, dispatch ----------------------------------------------------------------

@pytest.mark.parametrize("rows", [33, 130])  # 130: cuBLASLt on the picked path, its workspace on `side`
def test_runs_on_the_callers_current_stream(rows, linear_kernel):
    w, g, b = weights(4096, 4096, "bfloat16")
    x = randn(rows, 4096)
    new_x = randn(rows, 4096, seed=9)
    out, out2 = behind_held_copy(x, new_x, lambda: (linear_kernel.linear(x, w, b), linear_kernel.swiglu(x, w, g)))
    close(out, F.linear(new_x, w, b), "linear", new_x, w, b)
    close(out2, F.linear(new_x, w) * F.silu(F.linear(new_x, g)), "swiglu", new_x, w, g)


@pytest.mark.parametrize("rows", [40, 130])  # 130: cuBLASLt on the picked path, scratch from the graph
def test_cuda_graph_capture_and_replay(rows, linear_kernel):
    w, g, b = weights(4096, 4096, "bfloat16")
    x = randn(rows, 4096)
    q = randn(8, 32, 128)
    f = freqs_for((8,), 128)
    ops = linear_kernel
    calls = lambda: (ops.linear(x, w, b), ops.swiglu(x, w, g),  # noqa: E731
                     qkernels.rotary_emb(q, f), qkernels.rotary_emb(q, f, interleaved=False))
    graph, outs = capture_graph(calls)
    for i in range(3):
        x.copy_(randn(rows, 4096, seed=100 + i))
        q.copy_(randn(8, 32, 128, seed=200 + i))
        f.copy_(freqs_for((8,), 128, seed=300 + i))
        replay_like_eager(graph, outs, calls)
        close(outs[0], F.linear(x, w, b), "linear", x, w, b)
        close(outs[2], naive_rotary(q, f), "rotary_emb", q, f)


def test_public_ops_refuse_the_private_keywords():
    """A direct call (torch in, torch out, all in C) with a raw op's private tuning keyword goes to the
    Python path, which refuses it; the raw op takes it."""
    x, w = randn(4, 64), randn(8, 64)
    with pytest.raises(TypeError, match=r"linear\(\) got an unexpected keyword argument '_variant'"):
        qkernels.linear(x, w, _variant="mma")
    with pytest.raises(TypeError, match=r"swiglu\(\) got an unexpected keyword argument '_split'"):
        qkernels.swiglu(x, w, w, _split=2)
    assert torch.equal(Ops("mma", _variant="mma").linear(x, w), qkernels.linear(x, w))


def test_dispatch_and_float32_on_gpu(monkeypatch):
    x, w = randn(4, 64), randn(8, 64)
    d = qkernels.resolve("linear", x, w)
    assert d.winner == "cuda" and d.origin == "chain"
    monkeypatch.setenv("ASTR_BACKEND", "cpu")
    qkernels.reload_env()
    try:
        assert qkernels.resolve("swiglu", x, w, w).winner == "cpu"
        qkernels._frameworks._staging_warned.clear()
        with pytest.warns(qkernels.FallbackWarning):
            out = qkernels.linear(x, w)
        assert out.is_cuda and out.dtype == torch.bfloat16
    finally:
        monkeypatch.delenv("ASTR_BACKEND")
        qkernels.reload_env()
    # float32 on the GPU: the cuda kernels take 16-bit floats, so the chain stages through cpu
    x32, w32 = x.float(), w.float()
    assert qkernels.resolve("linear", x32, w32).winner == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        out = qkernels.linear(x32, w32)
    assert out.is_cuda and np.allclose(f64(out), reference("linear", f64(x32), f64(w32)), rtol=1e-5, atol=1e-5)
    with pytest.raises(qkernels.ExplicitSelectionError, match="requires dtype float16 or bfloat16"):
        qkernels.linear(x32, w32, backend="cuda")
    with pytest.raises(TypeError, match=r"linear: x must be bfloat16 or float16 on cuda \(float32 runs on the cpu "
                                        r"backend\), got float32"):
        qkernels._C.linear_raw(x32, w32)
    with pytest.raises(ValueError, match="all tensors must be on one device; x is on cuda:0 but weight is on cpu"):
        qkernels.linear(x, w.cpu())
