"""rotary_kv_append on the cuda backend (torch CUDA tensors): every output element and every appended k
element the float64 reference of qkernels.testing rounded once to the dtype (half a unit in the last place,
plus fp32 noise), v appended bit for bit, the pool rows of other slots untouched, in bfloat16 and float16,
both pair conventions, int32 and int64 indices, at Llama decode and prefill sizes and at head dims that
take each path (16-byte interleaved chunks, 16-byte rotate-half chunk pairs, the scalar path; the table
read as float4 or pair by pair); the same bits as rotary_emb with the gathered table; strided and
misaligned views (a fused qkv projection, a [B, L, Hkv, D] cache, one kv cache for both pools);
NaN-poisoned and in-place out; bad indices (never followed; QKERNELS_CHECK=1 raises); the caller's
stream; CUDA-graph capture and replay with new positions and slots; and the dispatcher.

Skipped without a GPU."""

import importlib.util
import warnings

import numpy as np
import pytest

import qkernels
from qkernels.testing import freqs_cis, reference, written
from conftest import behind_held_copy, capture_graph, f64, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

OP = "rotary_kv_append"
DTYPES = ["bfloat16", "float16"]
MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}
# (T, Hq, Hkv, D): Llama-8B decode and prefill, and head dims that take each path: D % 16 == 0 the vector
# paths of both conventions, D = 8 and 24 interleaved vector / rotate-half scalar, D = 6 and 130 scalar
SHAPES = [(1, 32, 8, 128), (8, 32, 8, 128), (64, 32, 8, 128), (4096, 32, 8, 128), (5, 4, 2, 64), (3, 2, 1, 8),
          (7, 5, 3, 24), (9, 3, 2, 6), (4, 2, 2, 130), (2, 8, 8, 256), (300, 1, 1, 16)]


def tdt(name):
    return getattr(torch, name)


def make(T, Hq, Hkv, D, dtype="bfloat16", index_dtype="int64", pool=None, max_pos=None, seed=0):
    """A call on the GPU: (q, k, v, cos_sin, positions, k_pool, v_pool, slots), distinct slots."""
    rng = np.random.default_rng(seed)
    pool = pool if pool is not None else 2 * T + 7
    max_pos = max_pos if max_pos is not None else T + 100
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(tdt(dtype))

    ix = tdt(index_dtype)
    return [randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D),
            torch.from_numpy(freqs_cis(rng, (max_pos,), D)).cuda(),
            torch.from_numpy(rng.integers(0, max_pos, T)).to("cuda", ix), randn(pool, Hkv, D), randn(pool, Hkv, D),
            torch.from_numpy(rng.permutation(pool)[:T]).to("cuda", ix)]


def half_ulp(ref, dtype):
    """Half a unit in the last place of dtype at |ref| (float64), normal numbers."""
    e = torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -14)))
    return torch.exp2(e - MANTISSA[dtype] - 1)


def assert_rounded(got, ref, dtype, slack=2e-6, fp32=1e-6):
    """got is ref rounded once to dtype: within half a unit in the last place, plus the fp32 error of
    the rotation, absolute (fp32 on the products, which can cancel to a small result; inputs are O(1))."""
    err = (got.double() - ref).abs()
    bound = half_ulp(ref, dtype) + slack * ref.abs() + fp32
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert bool((err <= bound).all()), f"{worst:.3f} of the bound"


def expected(args, **kw):
    """(out, k_pool, v_pool) of the float64 references, from the arguments before the call."""
    host = [f64(a) if a.is_floating_point() else a.cpu().numpy() for a in args]
    ref, (kp, vp) = reference(OP, *host, **kw), written(OP, *host, **kw)
    return tuple(torch.from_numpy(r).cuda() for r in (ref, kp, vp))


def check(args, before, out, dtype, **kw):
    ref, kp, vp = expected(before, **kw)
    assert_rounded(out, ref, dtype)
    assert_rounded(args[5], kp, dtype)
    assert torch.equal(args[6].double(), vp)  # v rows copied; other rows as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(dtype, interleaved, shape):
    args = make(*shape, dtype=dtype, seed=sum(shape))
    before = [a.clone() for a in args]
    out = qkernels.rotary_kv_append(*args, interleaved=interleaved)
    assert out.shape == args[0].shape and out.dtype == tdt(dtype)
    check(args, before, out, dtype, interleaved=interleaved)
    for i in (0, 1, 2, 3, 4, 7):
        assert torch.equal(args[i], before[i])


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(1, 32, 8, 128), (64, 32, 8, 128), (7, 5, 3, 24), (9, 3, 2, 6)],
                         ids=lambda s: "x".join(map(str, s)))
def test_same_bits_as_rotary_emb_of_the_gathered_table(index_dtype, dtype, interleaved, shape):
    q, k, v, cs, pos, kp, vp, slots = make(*shape, dtype=dtype, index_dtype=index_dtype, seed=3)
    out = qkernels.rotary_kv_append(q, k, v, cs, pos, kp, vp, slots, interleaved=interleaved)
    f = cs[pos.long()].contiguous()
    assert torch.equal(out, qkernels.rotary_emb(q, f, interleaved=interleaved))
    assert torch.equal(kp[slots.long()], qkernels.rotary_emb(k, f, interleaved=interleaved))
    assert torch.equal(vp[slots.long()], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("misalign", [0, 1])
def test_strided_views(dtype, interleaved, misalign):
    """q, k, v from one fused qkv projection (misalign = 1: every row one element off 16 bytes, the scalar
    path); the k pool a [B, L, Hkv, D] cache seen as [B*L, Hkv, D] with slot b*L + position; the v pool one
    half of a [S, 2, Hkv, D] kv cache; a strided table (pairs read one by one) and strided indices."""
    T, Hq, Hkv, D, B, L = 24, 8, 2, 64, 3, 16
    g = torch.Generator(device="cuda").manual_seed(5)
    flat = torch.randn(T * (Hq + 2 * Hkv) * D + misalign, device="cuda", generator=g).to(tdt(dtype))
    qkv = flat[misalign:].view(T, Hq + 2 * Hkv, D)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    rng = np.random.default_rng(6)
    table = torch.zeros(80, D // 2, 3, device="cuda")
    table[..., 1:] = torch.from_numpy(freqs_cis(rng, (80,), D)).cuda()
    cs = table[..., 1:]  # pairs 3 floats apart, 4 bytes off 16: read one by one
    slots = torch.from_numpy(rng.permutation(B * L)[:T]).to("cuda", torch.int32)  # distinct: b*L + position
    within = slots.long() % L
    pos = torch.stack([within, within], 1).reshape(-1)[::2]  # strided positions
    cache = torch.randn(B, L, Hkv, D, device="cuda", generator=g).to(tdt(dtype))
    kv = torch.randn(B * L, 2, Hkv, D, device="cuda", generator=g).to(tdt(dtype))
    args = [q, k, v, cs, pos, cache.view(B * L, Hkv, D), kv[:, 1], slots]
    before = [a.clone() for a in args]
    kv0 = kv[:, 0].clone()
    out = qkernels.rotary_kv_append(*args, interleaved=interleaved)
    check(args, before, out, dtype, interleaved=interleaved)
    assert torch.equal(kv[:, 0], kv0)
    assert torch.equal(cache[slots.long() // L, slots.long() % L], args[5][slots.long()])
    # in place over the q columns of the same qkv rows (a decode step's call): the same bits
    a = [x.clone() for x in before]
    fused = torch.cat([a[0], a[1], a[2]], 1)
    qf, kf, vf = fused[:, :Hq], fused[:, Hq:Hq + Hkv], fused[:, Hq + Hkv:]
    assert qkernels.rotary_kv_append(qf, kf, vf, *a[3:], interleaved=interleaved, out=qf) is qf
    assert torch.equal(qf, out) and torch.equal(a[5], args[5]) and torch.equal(a[6], args[6])
    assert torch.equal(kf, before[1]) and torch.equal(vf, before[2])


@pytest.mark.parametrize("interleaved", [True, False])
def test_out_poisoned_and_in_place(interleaved):
    args = make(33, 32, 8, 128, seed=7)
    before = [a.clone() for a in args]
    out = torch.full_like(args[0], float("nan"))
    assert qkernels.rotary_kv_append(*args, interleaved=interleaved, out=out) is out
    check(args, before, out, "bfloat16", interleaved=interleaved)
    a = [x.clone() for x in before]
    q = a[0]
    assert qkernels.rotary_kv_append(*a, interleaved=interleaved, out=q) is q
    assert torch.equal(q, out) and torch.equal(a[5], args[5])


def test_bad_indices_are_never_followed():
    """A bad position zeroes the token's out rows and appends nothing; a bad slot skips the append only;
    the other tokens are as in a good call.  QKERNELS_CHECK=1 raises, naming the argument."""
    args = make(6, 4, 2, 64, pool=10, max_pos=20, seed=8)
    good = [a.clone() for a in args]
    want = qkernels.rotary_kv_append(*good)
    bad = [a.clone() for a in args]
    bad[4][1] = 20  # position out of range
    bad[4][2] = -1
    bad[7][3] = 10  # slot out of range
    bad[7][4] = -5
    out = qkernels.rotary_kv_append(*bad)
    torch.cuda.synchronize()
    assert torch.equal(out[1:3], torch.zeros_like(out[1:3]))
    ok = [0, 3, 4, 5]
    assert torch.equal(out[ok], want[ok])
    written_slots = args[7][[0, 5]].long()
    for p in (5, 6):
        assert torch.equal(bad[p][written_slots], good[p][written_slots])
        rest = torch.ones(10, dtype=torch.bool, device="cuda")
        rest[written_slots] = False
        assert torch.equal(bad[p][rest], args[p][rest])  # nothing else was written
    old = qkernels._C._configure(check_indices=True)
    try:
        for i, value, pattern in ((4, 20, r"positions\[1\] = 20 is out of range for cos_sin"),
                                  (7, -5, r"slots\[1\] = -5 is out of range for the KV pools")):
            b = [a.clone() for a in args]
            b[i][1] = value
            with pytest.raises(ValueError, match=rf"^rotary_kv_append: {pattern}"):
                qkernels.rotary_kv_append(*b)
    finally:
        qkernels._C._configure(check_indices=old["check_indices"])


def test_callers_stream():
    args = make(64, 32, 8, 128, seed=9)
    src = args[0].clone()
    q = torch.zeros_like(src)
    want = qkernels.rotary_kv_append(src, *[a.clone() for a in args[1:]])
    a = [q] + [x.clone() for x in args[1:]]
    got = behind_held_copy(q, src, lambda: qkernels.rotary_kv_append(*a))
    assert torch.equal(got, want)


@pytest.mark.parametrize("interleaved", [True, False])
def test_cuda_graph_replays_with_new_positions_and_slots(interleaved):
    """A captured call reads positions, slots and q at replay time: the decode step of a CUDA-graph
    server, whose indices change in place between replays."""
    args = make(8, 32, 8, 128, pool=64, max_pos=256, seed=10)
    call = lambda: qkernels.rotary_kv_append(*args, interleaved=interleaved)  # noqa: E731
    graph, out = capture_graph(call)
    rng = np.random.default_rng(11)
    for step in range(3):
        args[0].copy_(torch.randn_like(args[0], dtype=torch.float32).to(args[0].dtype))
        args[4].copy_(torch.from_numpy(rng.integers(0, 256, 8)).cuda())
        args[7].copy_(torch.from_numpy(rng.permutation(64)[:8]).cuda())
        before = [a.clone() for a in args]
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(args, before, out, "bfloat16", interleaved=interleaved)
        eager = [a.clone() for a in before]
        assert torch.equal(out, qkernels.rotary_kv_append(*eager, interleaved=interleaved))
        assert torch.equal(eager[5], args[5]) and torch.equal(eager[6], args[6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_runs_on_cuda_once_enabled(dtype):
    args = make(4, 4, 2, 64, dtype=dtype)
    assert qkernels.resolve(OP, *args).winner == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("error", qkernels.FallbackWarning)  # no staging through the host
        qkernels.rotary_kv_append(*args)


def test_held_off_the_dispatch_stages_through_the_cpu(monkeypatch):
    """While CUDA_PENDING holds the kernels: the call stages through the cpu kernels (pools copied back),
    and backend="cuda" refuses with the reason."""
    from qkernels import _dispatch

    monkeypatch.setattr(_dispatch, "CUDA_PENDING", {OP: True})
    _dispatch.reload_env()
    args = make(5, 4, 2, 64, seed=12)
    before = [a.clone() for a in args]
    assert qkernels.resolve(OP, *args).staged
    with pytest.raises(qkernels.ExplicitSelectionError, match="built but not enabled until their GPU tests pass"):
        qkernels.rotary_kv_append(*[a.clone() for a in args], backend="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        out = qkernels.rotary_kv_append(*args)
    assert out.is_cuda
    check(args, before, out, "bfloat16")


def test_float32_stages_through_the_cpu():
    args = make(5, 4, 2, 64, dtype="float32", seed=13)
    before = [a.clone() for a in args]
    assert qkernels.resolve(OP, *args).winner == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qkernels.FallbackWarning)
        out = qkernels.rotary_kv_append(*args)
    check(args, before, out, "float32")


def test_torch_compile_fullgraph_on_cuda():
    import qkernels.torch  # noqa: F401

    args = make(8, 32, 8, 128, seed=14)
    before = [a.clone() for a in args]

    def step(q, k, v, cs, pos, k_pool, v_pool, slots):
        return qkernels.rotary_kv_append(q * 2, k, v, cs, pos, k_pool, v_pool, slots, interleaved=False) + 1

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(*args)
    eager = [a.clone() for a in before]
    assert torch.equal(got, step(*eager))
    assert torch.equal(args[5], eager[5]) and torch.equal(args[6], eager[6])
