"""rmsnorm and fused_add_rmsnorm on the cuda backend (torch CUDA tensors): every output element the
float64 reference of qkernels.testing rounded once to the dtype (half a unit in the last place, plus fp32
noise), in float32, bfloat16 and float16, at row lengths that take each kernel (a lane group per row, a
block per row with the row in registers, the block that reads the row twice; forced through the raw ops'
_variant keyword as well as picked), the residual written as the fp32 sum rounded once, the norm of the
unrounded sum, strided and misaligned rows, NaN-poisoned and in-place outputs, bitwise determinism,
the caller's stream, CUDA-graph capture and replay (the residual accumulates once per replay), and the
dispatcher.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, written
from conftest import capture_graph, f64, Ops, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch


DTYPES = ["float32", "bfloat16", "float16"]
# lane groups of 4..32 (H <= 1024), the block kernel (to 16384 in 16-bit, 16384 in float32), the reread
# kernel (longer rows, and every H that is not a multiple of the 16-byte vector)
HS = [1, 7, 8, 64, 100, 256, 1000, 1024, 2048, 4095, 4096, 8192, 16384, 20000, 32768 + 8]
KERNELS = {"picked": Ops(), "rows": Ops("rows", _variant="rows"), "block": Ops("block", _variant="block"),
           "reread": Ops("reread", _variant="reread")}
MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}


def tdt(name):
    return getattr(torch, name)


def randn(*shape, dtype="float32", scale=1.0, seed=0, mean=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (mean + scale * torch.randn(*shape, device="cuda", generator=g)).to(tdt(dtype))


def half_ulp(ref, dtype):
    """Half the spacing of dtype at |ref| (normal range; float16's subnormals at their fixed spacing)."""
    a = np.abs(ref)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    if dtype == "float16":
        e = np.maximum(e, -14)
    return 0.5 * np.exp2(e - MANTISSA[dtype])


def assert_rounded(got, ref, dtype, slack=2e-5):
    """got (a torch tensor) is ref rounded once to dtype, up to fp32 noise (slack relative)."""
    got = f64(got)
    assert np.isfinite(got).all(), "non-finite output (an element was not written?)"
    err = np.abs(got - ref)
    bound = half_ulp(ref, dtype) + slack * np.abs(ref) + 1e-30
    worst = float((err / bound).max(initial=0))
    assert worst <= 1.0, f"error {worst:.3f} x the rounding bound"


def sums(x, r, dtype):
    """The residual the op must leave: the fp32 sum rounded once."""
    return (x.float() + r.float()).to(tdt(dtype))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm(dtype, h, kernel):
    rows = 37
    x, r = randn(rows, h, dtype=dtype, seed=h), randn(rows, h, dtype=dtype, seed=h + 1, scale=2.0)
    w = randn(h, dtype=dtype, seed=h + 2, mean=1.0, scale=0.5)
    before = r.clone()
    ref = reference("fused_add_rmsnorm", f64(x), f64(r), f64(w))
    out = KERNELS[kernel].fused_add_rmsnorm(x, r, w)
    assert out.dtype == tdt(dtype) and out.shape == x.shape
    assert_rounded(out, ref, dtype)
    torch.testing.assert_close(r, sums(x, before, dtype), rtol=0, atol=0)
    assert np.abs(f64(r) - written("fused_add_rmsnorm", f64(x), f64(before), f64(w))[0]).max() <= \
        float(half_ulp(np.abs(f64(r)).max(), dtype)) * 2 + 1e-30


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(dtype, h, kernel):
    x = randn(5, 7, h, dtype=dtype, seed=h)  # two leading dimensions: 35 rows
    w = randn(h, dtype=dtype, seed=h + 2, mean=1.0, scale=0.5)
    out = KERNELS[kernel].rmsnorm(x, w)
    assert out.shape == x.shape
    assert_rounded(out, reference("rmsnorm", f64(x), f64(w)), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("h", [64, 4096, 20000])
def test_norm_is_of_the_unrounded_sum(dtype, h):
    """Sums of values 16x apart need more bits than the dtype has: the output rounds the norm of the
    exact sum (FlashInfer's semantics), which the norm of the rounded sum does not meet."""
    x, r = randn(64, h, dtype=dtype, seed=1), randn(64, h, dtype=dtype, seed=2, scale=16.0)
    w = torch.ones(h, device="cuda", dtype=tdt(dtype))
    exact = f64(x) + f64(r)
    rounded = f64(sums(x, r, dtype))
    assert (exact != rounded).mean() > 0.3
    out = qkernels.fused_add_rmsnorm(x, r, w)
    assert_rounded(out, reference("rmsnorm", exact, f64(w)), dtype)
    with pytest.raises(AssertionError):  # the test can tell the two apart
        assert_rounded(out, reference("rmsnorm", rounded, f64(w)), dtype)


@pytest.mark.parametrize("h", [64, 4096, 4095])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_misaligned_and_poisoned(dtype, h):
    """Rows strided in two leading dimensions (one in reverse memory order), a residual and an out inside
    longer NaN-filled rows, a misaligned start (the reread kernel's single values); nothing outside the
    views is written."""
    B, S = 3, 5
    x0, r0 = randn(B, S, h, dtype=dtype, seed=3), randn(B, S, h, dtype=dtype, seed=4)
    w = randn(h, dtype=dtype, seed=5, mean=1.0)
    ref = reference("fused_add_rmsnorm", f64(x0), f64(r0), f64(w))
    for shift in (0, 8, 1):  # 1: not 16-byte aligned
        bigx = torch.full((S, B, h + 16), float("nan"), device="cuda", dtype=tdt(dtype))
        x = bigx.transpose(0, 1)[..., shift:shift + h]
        x.copy_(x0)
        bigr = torch.full((2 * B, S, h + 16), float("nan"), device="cuda", dtype=tdt(dtype))
        r = bigr[::2, :, shift:shift + h]
        r.copy_(r0)
        bigo = torch.full((B, S, h + 16), float("nan"), device="cuda", dtype=tdt(dtype))
        out = bigo[..., shift:shift + h]
        assert qkernels.fused_add_rmsnorm(x, r, w, out=out) is out
        assert_rounded(out, ref, dtype)
        torch.testing.assert_close(r, sums(x0, r0, dtype), rtol=0, atol=0)
        outside = torch.ones_like(bigo, dtype=torch.bool)
        outside[..., shift:shift + h] = False
        assert torch.isnan(bigo[outside]).all(), "out written outside its view"
        rmask = torch.ones_like(bigr, dtype=torch.bool)
        rmask[::2, :, shift:shift + h] = False
        assert torch.isnan(bigr[rmask]).all(), "residual written outside its view"
        y = qkernels.rmsnorm(x, w)
        assert_rounded(y, reference("rmsnorm", f64(x0), f64(w)), dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("h", [64, 4096, 20000, 4095])
def test_in_place_out_is_x(kernel, h):
    """FlashInfer's form, out=x: x is read before the same thread writes it."""
    x, r = randn(9, h, dtype="bfloat16", seed=6), randn(9, h, dtype="bfloat16", seed=7)
    w = randn(h, dtype="bfloat16", seed=8, mean=1.0)
    want = KERNELS[kernel].fused_add_rmsnorm(x, r.clone(), w)
    before = r.clone()
    xi = x.clone()
    assert KERNELS[kernel].fused_add_rmsnorm(xi, r, w, out=xi) is xi
    torch.testing.assert_close(xi, want, rtol=0, atol=0)
    torch.testing.assert_close(r, sums(x, before, "bfloat16"), rtol=0, atol=0)
    xi = x.clone()
    KERNELS[kernel].rmsnorm(xi, w, out=xi)
    torch.testing.assert_close(xi, KERNELS[kernel].rmsnorm(x, w), rtol=0, atol=0)


# 4096 rows and more take the block kernel's many-rows shape (narrower blocks, up to 4 vectors a thread,
# 8 where a float32 row would otherwise need more than 512 threads)
@pytest.mark.parametrize("rows,h,dtype", [(70000, 64, "bfloat16"), (4096, 4096, "bfloat16"), (1, 8192, "bfloat16"),
                                          (3, 1, "bfloat16"), (4096, 4096, "float32"), (4100, 16384, "float32"),
                                          (4099, 2048, "float16")])
def test_many_rows_and_determinism(rows, h, dtype):
    x, r = randn(rows, h, dtype=dtype, seed=9), randn(rows, h, dtype=dtype, seed=10)
    w = randn(h, dtype=dtype, seed=11, mean=1.0)
    r1, r2 = r.clone(), r.clone()
    a, b = qkernels.fused_add_rmsnorm(x, r1, w), qkernels.fused_add_rmsnorm(x, r2, w)
    assert torch.equal(a, b) and torch.equal(r1, r2)  # bitwise, run to run
    idx = torch.randint(0, rows, (min(rows, 256),), device="cuda")  # spot-check rows against the reference
    assert_rounded(a[idx], reference("fused_add_rmsnorm", f64(x[idx]), f64(r[idx]), f64(w)), dtype)


def test_callers_stream():
    x, r = randn(64, 4096, dtype="bfloat16", seed=12), randn(64, 4096, dtype="bfloat16", seed=13)
    w = randn(4096, dtype="bfloat16", seed=14, mean=1.0)
    want, rw = qkernels.fused_add_rmsnorm(x, r.clone(), w), None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rr = r.clone()
        got = qkernels.fused_add_rmsnorm(x, rr, w)
        rw = rr
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(rw, sums(x, r, "bfloat16"), rtol=0, atol=0)


@pytest.mark.parametrize("h", [128, 4096, 4095])
def test_cuda_graph_replays_accumulate_the_residual(h):
    """A captured fused_add_rmsnorm replays on the captured buffers: each replay adds x into residual
    again, and reads the residual as it is at replay time."""
    x, r0 = randn(16, h, dtype="bfloat16", seed=15), randn(16, h, dtype="bfloat16", seed=16)
    w = randn(h, dtype="bfloat16", seed=17, mean=1.0)
    r = r0.clone()
    graph, out = capture_graph(lambda: qkernels.fused_add_rmsnorm(x, r, w))  # the warm-up call adds once
    r.copy_(r0)
    graph.replay()
    torch.cuda.synchronize()
    once = sums(x, r0, "bfloat16")
    torch.testing.assert_close(r, once, rtol=0, atol=0)
    assert_rounded(out, reference("fused_add_rmsnorm", f64(x), f64(r0), f64(w)), "bfloat16")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(r, sums(x, once, "bfloat16"), rtol=0, atol=0)
    assert_rounded(out, reference("fused_add_rmsnorm", f64(x), f64(once), f64(w)), "bfloat16")
    g2, y = capture_graph(lambda: qkernels.rmsnorm(x, w))
    x.mul_(2)
    g2.replay()
    torch.cuda.synchronize()
    assert_rounded(y, reference("rmsnorm", f64(x), f64(w)), "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_runs_every_dtype_on_cuda(dtype):
    import warnings

    x, r = randn(4, 64, dtype=dtype), randn(4, 64, dtype=dtype, seed=1)
    w = randn(64, dtype=dtype, seed=2)
    assert qkernels.resolve("fused_add_rmsnorm", x, r, w).winner == "cuda"
    assert qkernels.resolve("rmsnorm", x, w).winner == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("error", qkernels.FallbackWarning)  # no staging through the host
        qkernels.fused_add_rmsnorm(x, r, w)
        qkernels.rmsnorm(x, w)


def test_cpu_backend_stages_and_writes_the_residual_back():
    """backend="cpu" on CUDA tensors copies through host memory: the updated residual comes back."""
    x, r = randn(8, 100, dtype="bfloat16", seed=18), randn(8, 100, dtype="bfloat16", seed=19)
    w = randn(100, dtype="bfloat16", seed=20, mean=1.0)
    import warnings

    before = r.clone()
    with warnings.catch_warnings():  # the FallbackWarning is once per op and framework
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        out = qkernels.fused_add_rmsnorm(x, r, w, backend="cpu")
    assert out.is_cuda
    torch.testing.assert_close(r, sums(x, before, "bfloat16"), rtol=0, atol=0)
    # both backends round the same fp32 formula once: at most one bfloat16 unit apart
    torch.testing.assert_close(out, qkernels.fused_add_rmsnorm(x, before.clone(), w), rtol=2**-7, atol=2**-7)


def test_torch_compile_reduce_overhead():
    x, r = randn(8, 4096, dtype="bfloat16", seed=21), randn(8, 4096, dtype="bfloat16", seed=22)
    w = randn(4096, dtype="bfloat16", seed=23, mean=1.0)

    def layer(x, r, w):
        return qkernels.fused_add_rmsnorm(x, r, w) * 2

    torch._dynamo.reset()
    g = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for i in range(3):  # warm-up, record, replay: the residual gains x on each call
        rr = r.clone()
        got = g(x, rr, w)
        torch.testing.assert_close(rr, sums(x, r, "bfloat16"), rtol=0, atol=0)
        torch.testing.assert_close(got, layer(x, r.clone(), w), rtol=0, atol=0)
