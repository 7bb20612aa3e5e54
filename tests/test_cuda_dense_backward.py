"""rotary_emb_backward, linear_backward and swiglu_backward on the cuda backend (torch CUDA tensors): the
float64 gradients of qkernels.testing on host copies of the inputs, bfloat16/float16 held to twice the
error of torch.autograd of the same formulation in the same precision on the GPU (cuBLAS's products);
M from 1 to 300 over awkward and Llama-like weights, each case on the kernel the launcher picks, on
linear_backward.cu's tile kernels at every M (_variant="tiles") and on cuBLASLt at every M
(_variant="lt"; the tile kernels where it cannot load); forced reduction splits (the fp32 workspaces);
16-byte-vectorised and element-wise loads (unaligned rows, K or N % 8); leading dimensions; every
gradient flag; zero sizes; bitwise determinism; the caller's stream; CUDA-graph capture and replay;
float32 staged through the cpu backend.  Skipped without a GPU."""

import functools
import importlib.util
import warnings

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference
from conftest import (behind_held_copy, capture_graph, close_to_naive, cuda_randn as randn, f64, naive_rotary, Ops,
                      outputs, replay_like_eager, requires_cuda)

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch
    import torch.nn.functional as F

HALF = ["bfloat16", "float16"]
MS = [1, 2, 7, 8, 9, 16, 33, 64, 65, 300]
KN = [(7, 129), (100, 33), (136, 4104), (1536, 4096)]


@pytest.fixture(params=["picked", "tiles", "lt"])
def kernels(request):
    """The products the launcher picks (the tile kernels for M <= 64, cuBLASLt past it where it loads),
    linear_backward.cu's tile kernels at every M, or cuBLASLt at every M."""
    if request.param == "picked":
        return Ops()
    return Ops(request.param, _variant=request.param)


@functools.lru_cache(maxsize=8)
def weights(n, k, dtype):
    """(up, gate) of one size, shared by the M cases."""
    return (randn(n, k, dtype=dtype, scale=k ** -0.5, seed=n * 7 + k),
            randn(n, k, dtype=dtype, scale=2 * k ** -0.5, seed=n * 11 + k))


def close_all(ours, naive, op, *args, slack=1e-5, **kwargs):
    """Each gradient against qkernels.testing's of the inputs' float64 host copies, within twice the naive
    computation's error (close_to_naive); None exactly where the reference has None."""
    refs = reference(op, *(f64(a) for a in args), **kwargs)
    assert len(outputs(ours)) == len(refs)
    for mine, theirs, ref in zip(outputs(ours), outputs(naive), refs):
        assert (mine is None) == (ref is None)
        if ref is None:
            continue
        assert mine.is_cuda and mine.dtype == args[1].dtype and tuple(mine.shape) == ref.shape
        close_to_naive(mine, theirs, ref, slack=slack)


def naive_linear(g, x, w):
    """torch.autograd of F.linear in the inputs' precision: (grad_x, grad_weight, grad_bias)."""
    xt, wt = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    bt = torch.zeros(w.shape[0], device="cuda", dtype=w.dtype, requires_grad=True)
    F.linear(xt, wt, bt).backward(g)
    return xt.grad, wt.grad, bt.grad


def naive_swiglu(g, x, up, gate):
    xt, ut, gt = (a.detach().clone().requires_grad_() for a in (x, up, gate))
    (F.linear(xt, ut) * F.silu(F.linear(xt, gt))).backward(g)
    return xt.grad, ut.grad, gt.grad


def naive_rotary_grad(g, f, interleaved):
    x = torch.zeros_like(g, requires_grad=True)
    naive_rotary(x, f, interleaved).backward(g)
    return x.grad


# ---- linear_backward and swiglu_backward over M, K, N ---------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k,n", KN)
@pytest.mark.parametrize("m", MS)
def test_linear_backward(dtype, m, k, n, kernels):
    w, _ = weights(n, k, dtype)
    x, g = randn(m, k, dtype=dtype, seed=m), randn(m, n, dtype=dtype, seed=m + 1)
    r = kernels.linear_backward(g, x, w, bias_grad=True)
    close_all(r, naive_linear(g, x, w), "linear_backward", g, x, w, bias_grad=True)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k,n", KN)
@pytest.mark.parametrize("m", MS)
def test_swiglu_backward(dtype, m, k, n, kernels):
    up, gate = weights(n, k, dtype)
    x, g = randn(m, k, dtype=dtype, seed=m), randn(m, n, dtype=dtype, seed=m + 1)
    r = kernels.swiglu_backward(g, x, up, gate)
    close_all(r, naive_swiglu(g, x, up, gate), "swiglu_backward", g, x, up, gate)


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_llama_shapes(m, k, n):
    """The MLP's weights of a Llama-3-8B-like model at decode and micro-batch sizes, on the picked kernels."""
    w, gate = weights(n, k, "bfloat16")
    x, g = randn(m, k, seed=m), randn(m, n, seed=m + 1)
    close_all(qkernels.linear_backward(g, x, w, bias_grad=True), naive_linear(g, x, w), "linear_backward", g, x, w,
              bias_grad=True)
    if n == 14336:
        close_all(qkernels.swiglu_backward(g, x, w, gate), naive_swiglu(g, x, w, gate), "swiglu_backward", g, x, w, gate)


@pytest.mark.parametrize("split", [1, 2, 5, 64])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (9, 136, 129), (40, 1536, 4096), (70, 64, 33), (3, 8, 1)])
def test_forced_splits(split, m, k, n):
    """_split= on the tile kernels: grad_x's reduction (and swiglu's K, grad_bias's rows) in that many
    partial sums through the fp32 workspaces, more splits than steps included."""
    ops = Ops("tiles", _variant="tiles", _split=split)
    up, gate = weights(n, k, "bfloat16")
    x, g = randn(m, k, seed=m), randn(m, n, seed=m + 1)
    close_all(ops.linear_backward(g, x, up, bias_grad=True), naive_linear(g, x, up), "linear_backward", g, x, up,
              bias_grad=True)
    close_all(ops.swiglu_backward(g, x, up, gate), naive_swiglu(g, x, up, gate), "swiglu_backward", g, x, up, gate)


# ---- layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [5, 33, 130])
def test_strided_and_unaligned_rows(dtype, m, kernels):
    """Padded rows (16-byte loads with a row stride), rows one element off 16-byte alignment and weights of
    strided rows (element-wise loads): the same gradients."""
    k, n = 520, 264
    up, gate = weights(n, k, dtype)
    x, g = randn(m, k, dtype=dtype, seed=4), randn(m, n, dtype=dtype, seed=5)
    naive_l, naive_s = naive_linear(g, x, up), naive_swiglu(g, x, up, gate)
    xb, gb = randn(m, k + 72, dtype=dtype, seed=6), randn(m, n + 24, dtype=dtype, seed=7)
    for off in (8, 1):  # 8: aligned, padded rows; 1: 2 bytes off
        xv, gv = xb[:, off:off + k], gb[:, off:off + n]
        xv.copy_(x)
        gv.copy_(g)
        both = torch.cat([up, gate], 1)
        close_all(kernels.linear_backward(gv, xv, both[:, :k], bias_grad=True), naive_l, "linear_backward", g, x, up,
                  bias_grad=True)
        close_all(kernels.swiglu_backward(gv, xv, both[:, :k], both[:, k:]), naive_s, "swiglu_backward", g, x, up, gate)


@pytest.mark.parametrize("m,k,n", [(3, 7, 129), (17, 100, 33), (65, 12, 5)])
def test_ragged_k_and_n(m, k, n, kernels):
    """K or N not a multiple of 8: element-wise loads and stores throughout."""
    up, gate = weights(n, k, "bfloat16")
    x, g = randn(m, k, seed=8), randn(m, n, seed=9)
    close_all(kernels.linear_backward(g, x, up, bias_grad=True), naive_linear(g, x, up), "linear_backward", g, x, up,
              bias_grad=True)
    close_all(kernels.swiglu_backward(g, x, up, gate), naive_swiglu(g, x, up, gate), "swiglu_backward", g, x, up, gate)


def test_leading_dimensions_and_forward():
    k, n = 256, 136
    up, gate = weights(n, k, "bfloat16")
    x, g = randn(2, 3, k, seed=10), randn(2, 3, n, seed=11)
    r = qkernels.linear_backward(g, x, up, bias_grad=True)
    assert r[0].shape == x.shape
    close_all(r, naive_linear(g, x, up), "linear_backward", g, x, up, bias_grad=True)
    close_all(qkernels.swiglu_backward(g, x, up, gate), naive_swiglu(g, x, up, gate), "swiglu_backward", g, x, up, gate)
    out = qkernels.linear(x, up)
    assert out.shape == (2, 3, n) and torch.equal(out.reshape(6, n), qkernels.linear(x.reshape(6, k), up))
    assert torch.equal(qkernels.swiglu(x, up, gate).reshape(6, n), qkernels.swiglu(x.reshape(6, k), up, gate))


@pytest.mark.parametrize("kind", ["linear", "swiglu"])
def test_flags(kind, kernels):
    """Each gradient alone equals the same gradient computed beside the others, bit for bit."""
    k, n, m = 264, 72, 12
    up, gate = weights(n, k, "bfloat16")
    x, g = randn(m, k, seed=12), randn(m, n, seed=13)
    if kind == "linear":
        full = kernels.linear_backward(g, x, up, bias_grad=True)
        for flags in [(True, False, False), (False, True, False), (False, False, True), (False, False, False)]:
            r = kernels.linear_backward(g, x, up, **dict(zip(("x_grad", "weight_grad", "bias_grad"), flags)))
            for got, whole, want in zip(r, full, flags):
                assert (got is not None) == want and (got is None or torch.equal(got, whole))
    else:
        full = kernels.swiglu_backward(g, x, up, gate)
        for flags in [(True, False), (False, True)]:
            r = kernels.swiglu_backward(g, x, up, gate, x_grad=flags[0], weight_grad=flags[1])
            for got, whole, want in zip(r, full, (flags[0], flags[1], flags[1])):
                assert (got is not None) == want and (got is None or torch.equal(got, whole))


def test_zero_sizes(kernels):
    up, gate = weights(33, 24, "bfloat16")
    dx, dw, db = kernels.linear_backward(randn(0, 33), randn(0, 24), up, bias_grad=True)
    assert dx.shape == (0, 24) and torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))
    dx, du, dg = kernels.swiglu_backward(randn(0, 33), randn(0, 24), up, gate)
    assert torch.equal(du, torch.zeros_like(du)) and torch.equal(dg, torch.zeros_like(dg))
    e = randn(0, 24)
    dx, dw, db = kernels.linear_backward(randn(5, 0), randn(5, 24), e, bias_grad=True)  # N = 0
    assert torch.equal(dx, torch.zeros_like(dx)) and dw.shape == (0, 24) and db.shape == (0,)
    dx, du, dg = kernels.swiglu_backward(randn(5, 0), randn(5, 24), e, e)
    assert torch.equal(dx, torch.zeros_like(dx))
    g = randn(5, 33)
    dx, dw, db = kernels.linear_backward(g, randn(5, 0), randn(33, 0), bias_grad=True)  # K = 0: the bias's only
    assert dx.shape == (5, 0) and dw.shape == (33, 0)
    close_to_naive(db, g.sum(0), f64(g).sum(0))


# ---- determinism, streams, graphs ------------------------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (16, 4096, 14336), (64, 1536, 4096), (300, 1536, 4096)])
def test_bitwise_determinism(m, k, n, kernels):
    up, gate = weights(n, k, "bfloat16")
    x, g = randn(m, k, seed=m), randn(m, n, seed=m + 2)
    first = kernels.linear_backward(g, x, up, bias_grad=True) + kernels.swiglu_backward(g, x, up, gate)
    for _ in range(3):
        again = kernels.linear_backward(g, x, up, bias_grad=True) + kernels.swiglu_backward(g, x, up, gate)
        assert all(torch.equal(p, q) for p, q in zip(first, again))


@pytest.mark.parametrize("rows", [33, 130])  # 130: cuBLASLt on the picked path, its workspace on `side`
def test_runs_on_the_callers_current_stream(rows, kernels):
    up, gate = weights(4096, 1536, "bfloat16")
    x, g = randn(rows, 1536), randn(rows, 4096, seed=3)
    new_g = randn(rows, 4096, seed=9)
    lin, swi = behind_held_copy(g, new_g, lambda: (kernels.linear_backward(g, x, up, bias_grad=True),
                                                   kernels.swiglu_backward(g, x, up, gate)))
    close_all(lin, naive_linear(new_g, x, up), "linear_backward", new_g, x, up, bias_grad=True)
    close_all(swi, naive_swiglu(new_g, x, up, gate), "swiglu_backward", new_g, x, up, gate)


@pytest.mark.parametrize("rows", [16, 130])  # 130: cuBLASLt's workspace and our scratch from the graph's pool
def test_cuda_graph_capture_and_replay(rows, kernels):
    up, gate = weights(4096, 1536, "bfloat16")
    x, g = randn(rows, 1536), randn(rows, 4096, seed=1)
    q, f = randn(8, 32, 128), torch.stack([torch.ones(8, 64), torch.zeros(8, 64)], -1).cuda()
    calls = lambda: (kernels.linear_backward(g, x, up, bias_grad=True) +  # noqa: E731
                     kernels.swiglu_backward(g, x, up, gate) + (qkernels.rotary_emb_backward(q, f),))
    graph, outs = capture_graph(calls)
    for i in range(3):
        x.copy_(randn(rows, 1536, seed=100 + i))
        g.copy_(randn(rows, 4096, seed=200 + i))
        q.copy_(randn(8, 32, 128, seed=300 + i))
        ang = torch.rand(8, 64, device="cuda") * 10
        f.copy_(torch.stack([ang.cos(), ang.sin()], -1))
        replay_like_eager(graph, outs, calls)
        close_all(outs[:3], naive_linear(g, x, up), "linear_backward", g, x, up, bias_grad=True)


# ---- rotary_emb_backward -----------------------------------------------------------------------------

def freqs_for(lead, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ang = 10 * torch.rand(*lead, d // 2, device="cuda", dtype=torch.float64, generator=gen)
    return torch.stack([ang.cos(), ang.sin()], -1).float()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 64), (19, 3, 6), (33, 8, 128), (4096, 32, 128), (2, 5, 3, 6),
                                   (2, 512, 8, 256)])
def test_rotary_backward(dtype, interleaved, shape):
    g = randn(*shape, dtype=dtype, seed=len(shape))
    f = freqs_for(shape[:-2], shape[-1])
    out = qkernels.rotary_emb_backward(g, f, interleaved=interleaved)
    assert out.is_cuda and out.dtype == g.dtype and out.shape == g.shape
    ref = reference("rotary_emb_backward", f64(g), f64(f), interleaved=interleaved)
    close_to_naive(out, naive_rotary_grad(g, f, interleaved), ref, slack=1e-5)
    assert torch.equal(qkernels.rotary_emb_backward(g, f, interleaved=interleaved), out)  # deterministic
    # the transpose of the rotation is its inverse: backward(forward(x)) is x to rounding
    x = randn(*shape, dtype=dtype, seed=7)
    back = qkernels.rotary_emb_backward(qkernels.rotary_emb(x, f, interleaved=interleaved), f, interleaved=interleaved)
    tol = 2 ** -6 if dtype == "bfloat16" else 2 ** -9
    assert (back.float() - x.float()).abs().max().item() <= tol * max(x.float().abs().max().item(), 1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(33, 8, 128), (3, 9, 2, 64), (19, 3, 32)])
def test_rotary_backward_vector_and_scalar_paths_agree(interleaved, shape):
    """Rows 2 bytes off 16-byte alignment take the scalar path: the same fp32 operations, the same bits."""
    g = randn(*shape, seed=3)
    f = freqs_for(shape[:-2], shape[-1])
    out = qkernels.rotary_emb_backward(g, f, interleaved=interleaved)
    g1 = torch.empty(g.numel() + 1, device="cuda", dtype=g.dtype)[1:].view(shape)
    g1.copy_(g)
    assert torch.equal(qkernels.rotary_emb_backward(g1, f, interleaved=interleaved), out)


# ---- float32 and the dispatcher ---------------------------------------------------------------------

def test_float32_is_staged_through_cpu():
    up, gate = (a.float() for a in weights(33, 24, "bfloat16"))
    x, g = randn(5, 24, dtype="float32"), randn(5, 33, dtype="float32", seed=1)
    f = freqs_for((5,), 24)
    assert qkernels.resolve("linear_backward", g, x, up).winner == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        lin = qkernels.linear_backward(g, x, up, bias_grad=True)
        swi = qkernels.swiglu_backward(g, x, up, gate)
        rot = qkernels.rotary_emb_backward(g.reshape(5, 1, 33)[..., :24].contiguous(), f)
    for got, ref in zip(lin, reference("linear_backward", f64(g), f64(x), f64(up), bias_grad=True)):
        assert got.is_cuda and got.dtype == torch.float32
        np.testing.assert_allclose(f64(got), ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(swi, reference("swiglu_backward", f64(g), f64(x), f64(up), f64(gate))):
        np.testing.assert_allclose(f64(got), ref, rtol=1e-5, atol=1e-5)
    assert rot.is_cuda
    with pytest.raises(qkernels.ExplicitSelectionError, match="requires dtype float16 or bfloat16"):
        qkernels.linear_backward(g, x, up, backend="cuda")
    with pytest.raises(TypeError, match=r"linear_backward: grad_out must be bfloat16 or float16 on cuda"):
        qkernels._C.linear_backward_raw(g, x, up)


def test_dispatch_picks_cuda():
    up, gate = weights(33, 24, "bfloat16")
    x, g = randn(5, 24), randn(5, 33)
    for op, args in [("linear_backward", (g, x, up)), ("swiglu_backward", (g, x, up, gate)),
                     ("rotary_emb_backward", (randn(5, 2, 8), freqs_for((5,), 8)))]:
        d = qkernels.resolve(op, *args)
        assert d.winner == "cuda" and d.origin == "chain"
    with pytest.raises(ValueError, match="linear_backward: all tensors must be on one device; grad_out is on cuda:0 "
                                         "but x is on cpu"):
        qkernels.linear_backward(g, x.cpu(), up)
