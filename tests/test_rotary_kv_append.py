"""rotary_kv_append on the cpu backend against the float64 references of qkernels.testing: float32,
float16 and bfloat16 (torch), both pair conventions, int32 and int64 indices, awkward sizes, strided
views (a fused qkv projection split into q, k, v; a [B, L, Hkv, D] cache seen as a token pool; one
cache holding k and v), out= (NaN-poisoned, in place as out=q), the pools written in place and nothing
else, the index refusals (positions, slots, a slot given twice) before anything is written, the torch
operator (mutation annotation, version counters, torch.compile fullgraph, forward-only), jax.jit
(pools aliased and donated, no gradient) and the dispatcher's hold on the CUDA kernels."""

import numpy as np
import pytest

import qkernels
from qkernels import _dispatch
from qkernels.testing import freqs_cis, reference, sample, written
from conftest import requires_jax, requires_torch

OP = "rotary_kv_append"
TOL = {np.float32: 2e-6, np.float16: 2e-3}


def call(*args, **kwargs):
    return qkernels.rotary_kv_append(*args, backend="cpu", **kwargs)


def check(args, kwargs, got, tol):
    """got (the result) and the pools args[5], args[6] as the call left them, against the references of
    the arguments before the call (args holds copies)."""
    ref, (kp, vp) = reference(OP, *args, **kwargs), written(OP, *args, **kwargs)
    return (float(np.abs(np.asarray(got, np.float64) - ref).max(initial=0)) <= tol * max(1.0, np.abs(ref).max(initial=0)),
            kp, vp)


def copies(args):
    return [a.copy() if isinstance(a, np.ndarray) else a for a in args]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 1, 1, 2), (1, 32, 8, 128), (7, 5, 3, 6), (64, 8, 2, 64), (33, 4, 4, 130)])
def test_matches_reference(rng, dtype, interleaved, index_dtype, t, hq, hkv, d):
    args, kw = sample(OP, rng, dtype=dtype, index_dtype=index_dtype, t=t, hq=hq, hkv=hkv, d=d, pool=t + 13,
                      max_pos=2 * t + 3, interleaved=interleaved)
    before = copies(args)
    ref, (kp, vp) = reference(OP, *before, **kw), written(OP, *before, **kw)
    out = call(*args, **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    tol = TOL[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(args[5], kp, rtol=tol, atol=tol)
    np.testing.assert_array_equal(args[6], vp.astype(dtype))  # v is copied bit for bit
    untouched = np.setdiff1d(np.arange(args[5].shape[0]), args[7])
    np.testing.assert_array_equal(args[5][untouched], before[5][untouched])
    for i in (0, 1, 2, 3, 4, 7):  # inputs are not written
        np.testing.assert_array_equal(args[i], before[i])


@pytest.mark.parametrize("interleaved", [True, False])
def test_same_as_rotary_emb_of_the_gathered_table(rng, interleaved):
    args, kw = sample(OP, rng, t=9, hq=6, hkv=2, d=32, pool=30, max_pos=40, interleaved=interleaved)
    q, k, v, cs, pos, kp, vp, slots = args
    out = call(*args, **kw)
    f = cs[pos]
    np.testing.assert_allclose(out, qkernels.rotary_emb(q, f, interleaved=interleaved, backend="cpu"), rtol=0,
                               atol=1e-6)
    np.testing.assert_allclose(kp[slots], qkernels.rotary_emb(k, f, interleaved=interleaved, backend="cpu"), rtol=0,
                               atol=1e-6)


@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_torch_dtypes(rng, dtype, interleaved):
    import torch

    args, kw = sample(OP, rng, t=11, hq=8, hkv=2, d=64, pool=40, max_pos=50, interleaved=interleaved)
    dt = getattr(torch, dtype)
    t = [torch.from_numpy(a) for a in args]
    for i in (0, 1, 2, 5, 6):
        t[i] = t[i].to(dt)
    seen = [x.double().numpy() if x.is_floating_point() else x.numpy() for x in t]  # the rounded inputs
    ref, (kp, vp) = reference(OP, *seen, **kw), written(OP, *seen, **kw)
    out = qkernels.rotary_kv_append(*t, **kw)
    assert out.dtype == dt
    # one rounding of the fp32 result: half an ulp of the dtype (2^-8 bf16, 2^-11 fp16) relative
    tol = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 1e-6}[dtype]
    for got, want in ((out, ref), (t[5], kp), (t[6], vp)):
        err = (got.double() - torch.from_numpy(want)).abs()
        assert bool((err <= tol * torch.from_numpy(want).abs() + 1e-6).all()), float(err.max())


def test_strided_views(rng):
    """q, k, v as views of one fused qkv projection; the pools as a [B, L, Hkv, D] cache viewed as
    [B*L, Hkv, D] (slot b*L + position) and as the two halves of one [S, 2, Hkv, D] kv cache; a
    strided table and strided indices."""
    T, Hq, Hkv, D, B, L = 6, 4, 2, 16, 3, 8
    qkv = rng.standard_normal((T, Hq + 2 * Hkv + 1, D)).astype(np.float32)  # a spare head: no row is dense
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:Hq + 2 * Hkv]
    table = np.zeros((50, 2, D // 2, 2), np.float32)
    table[:, 1] = freqs_cis(rng, (50,), D)
    cs = table[:, 1]  # row stride D * 2, not D
    seq = rng.integers(0, B, T)
    pos = rng.permutation(L)[:T]  # distinct positions, so distinct slots
    pos_strided = np.repeat(pos, 2)[::2].astype(np.int64)
    cache = rng.standard_normal((B, L, Hkv, D)).astype(np.float32)
    k_pool = cache.reshape(B * L, Hkv, D)
    kv = rng.standard_normal((B * L, 2, Hkv, D)).astype(np.float32)
    slots = (seq * L + pos).astype(np.int32)
    before = [a.copy() for a in (q, k, v, cs, pos_strided, k_pool, kv[:, 1], slots)]
    out = call(q, k, v, cs, pos_strided, k_pool, kv[:, 1], slots)
    ok, kp, vp = check(before, {}, out, 2e-6)
    assert ok
    np.testing.assert_allclose(cache.reshape(B * L, Hkv, D), kp, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(kv[:, 1], vp.astype(np.float32))
    np.testing.assert_allclose(cache[seq, pos], kp[slots], rtol=2e-6, atol=2e-6)  # slot b*L + position
    # the pool's other half (kv[:, 0]) and qkv are untouched
    np.testing.assert_array_equal(qkv[:, :Hq], before[0])


def test_out_poisoned_and_in_place(rng):
    args, kw = sample(OP, rng, t=8, hq=4, hkv=2, d=24, interleaved=False)
    ref = reference(OP, *args, **kw)
    out = np.full(args[0].shape, np.nan, np.float32)
    r = call(*copies(args), out=out, **kw)
    assert np.shares_memory(r, out) and not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    a = copies(args)
    q = a[0]
    r = call(*a, out=q, **kw)  # in place
    assert np.shares_memory(r, q)
    np.testing.assert_array_equal(q, out)
    # out over the q rows of a fused qkv buffer, in place too
    qkv = np.concatenate([args[0], args[1]], axis=1)
    a = copies(args)
    call(qkv[:, :4], *a[1:], out=qkv[:, :4], **kw)
    np.testing.assert_array_equal(qkv[:, :4], out)
    np.testing.assert_array_equal(qkv[:, 4:], args[1])
    # q, k and v all columns of one fused buffer, out=q: what a decode step passes
    qkv = np.concatenate([args[0], args[1], args[2]], axis=1)
    a = copies(args)
    call(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], *a[3:], out=qkv[:, :4], **kw)
    np.testing.assert_array_equal(qkv[:, :4], out)
    np.testing.assert_array_equal(qkv[:, 4:], np.concatenate([args[1], args[2]], axis=1))
    kp, vp = written(OP, *copies(args), **kw)
    np.testing.assert_allclose(a[5], kp, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(a[6], vp)


def test_results_do_not_depend_on_the_thread_count(rng):
    args, kw = sample(OP, rng, t=37, hq=8, hkv=2, d=64, pool=80, max_pos=100)
    results = []
    for n in (1, 3):
        old = _dispatch.configure(num_threads=n)
        try:
            a = copies(args)
            results.append((call(*a, **kw), a[5], a[6]))
        finally:
            _dispatch.configure(**old)
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)


def test_empty(rng):
    args, kw = sample(OP, rng, t=0, hq=4, hkv=2, d=8, pool=5)
    before = copies(args)
    out = call(*args, **kw)
    assert out.shape == (0, 4, 8)
    np.testing.assert_array_equal(args[5], before[5])
    args, kw = sample(OP, rng, t=3, hq=0, hkv=2, d=8, pool=5)  # no q heads: the append alone
    call(*args, **kw)
    np.testing.assert_allclose(args[5], written(OP, *copies(args), **kw)[0], atol=1e-6)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case,arg,message", [
    ("pos_high", 4, r"positions\[2\] = 11 is out of range for cos_sin with max_pos = 11 rows"),
    ("pos_neg", 4, r"positions\[2\] = -1 is out of range"),
    ("slot_high", 7, r"slots\[2\] = 9 is out of range for the KV pools with S = 9 slots"),
    ("slot_neg", 7, r"slots\[2\] = -3 is out of range"),
    ("slot_twice", 7, r"slots\[1\] = slots\[3\] = \d+: two tokens would write one pool slot"),
])
def test_bad_indices_write_nothing(rng, index_dtype, case, arg, message):
    args, kw = sample(OP, rng, index_dtype=index_dtype)  # t=5, pool=9, max_pos=11
    args = copies(args)
    bad = {"pos_high": 11, "pos_neg": -1, "slot_high": 9, "slot_neg": -3}
    if case == "slot_twice":
        args[7][3] = args[7][1]
    else:
        args[arg][2] = bad[case]
    before = copies(args)
    out = np.full(args[0].shape, 7.0, np.float32)
    with pytest.raises(ValueError, match=rf"^rotary_kv_append: {message}"):
        call(*args, out=out, **kw)
    for a, b in zip(args, before):
        np.testing.assert_array_equal(a, b)
    assert (out == 7.0).all()


def test_bad_arguments_name_the_op_and_argument(rng):
    args, kw = sample(OP, rng)
    q, k, v, cs, pos, kp, vp, slots = args

    def refused(exc, pattern, *a, **kws):
        with pytest.raises(exc, match=rf"^rotary_kv_append: {pattern}"):
            call(*a, **kws)

    refused(TypeError, "cos_sin must be float32, got float16", q, k, v, cs.astype(np.float16), pos, kp, vp, slots)
    refused(TypeError, "positions must be int32 or int64", q, k, v, cs, pos.astype(np.float32), kp, vp, slots)
    refused(TypeError, "slots must be int32 or int64", q, k, v, cs, pos, kp, vp, slots.astype(np.float64))
    refused(TypeError, "k must have q's dtype", q, k.astype(np.float16), v, cs, pos, kp, vp, slots)
    refused(TypeError, "k_pool must have q's dtype", q, k, v, cs, pos, kp.astype(np.float16), vp, slots)
    refused(ValueError, "q's last dimension D = 7 must be even", q[..., :7], k[..., :7], v[..., :7], cs, pos, kp, vp,
            slots)
    refused(ValueError, "q must have 3 dimensions", q[None], k, v, cs, pos, kp, vp, slots)
    refused(ValueError, "v must have shape", q, k, v[:, :1], cs, pos, kp, vp, slots)
    refused(ValueError, "k must have shape", q, k[:4], v, cs, pos, kp, vp, slots)
    refused(ValueError, "cos_sin must have shape", q, k, v, cs[:, :3], pos, kp, vp, slots)
    refused(ValueError, "v_pool must have shape", q, k, v, cs, pos, kp, vp[:4], slots)
    refused(ValueError, "k_pool must have shape", q, k, v, cs, pos, kp[:, :1], vp[:, :1], slots)
    refused(ValueError, "positions must have shape", q, k, v, cs, pos[:4], kp, vp, slots)
    refused(ValueError, "slots must have shape", q, k, v, cs, pos, kp, vp, slots[:4])
    refused(ValueError, "k_pool has stride 0 in dimension 0", q, k, v, cs, pos, np.lib.stride_tricks.as_strided(
        kp, kp.shape, (0,) + kp.strides[1:]), vp, slots)
    ro = kp.copy()
    ro.flags.writeable = False
    refused(BufferError, "k_pool is read-only", q, k, v, cs, pos, ro, vp, slots)
    refused(ValueError, "k_pool overlaps v_pool in memory", q, k, v, cs, pos, kp, kp, slots)
    both = np.concatenate([kp, q[:, :2]])  # a pool whose rows include q's memory
    refused(ValueError, "k_pool overlaps q in memory", both[9:], k, v, cs, pos, both[3:12], vp, slots)
    buf = np.zeros(400, np.float32)  # out over k, then over k_pool
    kb, ob = buf[:80].reshape(5, 2, 8), buf[40:200].reshape(5, 4, 8)
    kb[...] = k
    refused(ValueError, "out overlaps k in memory", q, kb, v, cs, pos, kp, vp, slots, out=ob)
    pb = buf[200:344].reshape(9, 2, 8)
    refused(ValueError, "out overlaps k_pool in memory", q, k, v, cs, pos, pb, vp, slots, out=buf[190:350].reshape(5, 4, 8))
    refused(TypeError, "interleaved must be", q, k, v, cs, pos, kp, vp, slots, interleaved=np.array([1, 2]))


@requires_torch
def test_torch_operator_mutates_the_pools_and_bumps_their_versions(rng):
    import torch

    import qkernels.torch  # noqa: F401  (registers the operators)

    args, kw = sample(OP, rng, t=6, hq=4, hkv=2, d=16, pool=20, max_pos=30)
    t = [torch.from_numpy(a) for a in args]
    schema = str(torch.ops.qkernels.rotary_kv_append.default._schema)
    assert "Tensor(a!) k_pool" in schema and "Tensor(b!) v_pool" in schema and "Tensor q" in schema
    ref, (kp, vp) = reference(OP, *args, **kw), written(OP, *args, **kw)
    versions = t[5]._version, t[6]._version
    out = torch.ops.qkernels.rotary_kv_append(*[x.clone() if i in (5, 6) else x for i, x in enumerate(t)], **kw)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), rtol=1e-6, atol=1e-6)
    pools = [t[5].clone(), t[6].clone()]
    a = t[:5] + pools + t[7:]
    torch.testing.assert_close(qkernels.rotary_kv_append(*a, **kw), out, rtol=0, atol=0)  # the C path
    assert pools[0]._version > versions[0] and pools[1]._version > versions[1]
    torch.testing.assert_close(pools[0].double(), torch.from_numpy(kp), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[1].double(), torch.from_numpy(vp), rtol=0, atol=0)


@requires_torch
@pytest.mark.parametrize("in_place", [False, True])
def test_torch_compile_fullgraph(rng, in_place):
    import torch

    import qkernels.torch  # noqa: F401

    args, kw = sample(OP, rng, t=6, hq=4, hkv=2, d=16, pool=20, max_pos=30, interleaved=False)
    ref, (kp, vp) = reference(OP, *args, **kw), written(OP, *args, **kw)

    def step(q, k, v, cs, pos, k_pool, v_pool, slots):
        q = q * 2  # something around the op, so the graph is not the op alone
        r = qkernels.rotary_kv_append(q, k, v, cs, pos, k_pool, v_pool, slots, interleaved=False,
                                      out=q if in_place else None)
        return r + 1

    t = [torch.from_numpy(a.copy()) for a in args]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*[x.clone() for x in t])
    assert explained.graph_break_count == 0, explained.break_reasons
    got = torch.compile(step, fullgraph=True)(*t)
    torch.testing.assert_close(got.double(), torch.from_numpy(2 * ref + 1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(t[5].double(), torch.from_numpy(kp), rtol=1e-6, atol=1e-6)  # written back
    torch.testing.assert_close(t[6].double(), torch.from_numpy(vp), rtol=0, atol=0)


@requires_torch
@pytest.mark.parametrize("arg", ["q", "k", "v", "cos_sin", "k_pool"])
def test_torch_forward_only(rng, arg):
    import torch

    args, kw = sample(OP, rng)
    names = ("q", "k", "v", "cos_sin", "positions", "k_pool", "v_pool", "slots")
    t = dict(zip(names, (torch.from_numpy(a) for a in args)))
    t[arg] = t[arg].clone().requires_grad_()
    pool = t["k_pool"].detach().clone()
    with pytest.raises(RuntimeError, match=rf"^rotary_kv_append: {arg} requires grad, but rotary_kv_append has no "
                                           rf"gradient for {arg} \(it is inference-only\)"):
        qkernels.rotary_kv_append(*t.values())
    torch.testing.assert_close(t["k_pool"].detach(), pool, rtol=0, atol=0)  # refused before anything was written
    with torch.no_grad():
        qkernels.rotary_kv_append(*t.values())


@requires_jax
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_jax_jit_returns_the_aliased_pools(rng, index_dtype):
    import jax
    import jax.numpy as jnp

    import qkernels.jax as qj

    args, kw = sample(OP, rng, index_dtype=index_dtype, t=7, hq=4, hkv=2, d=16, pool=12, max_pos=20,
                      interleaved=False)
    ref, (kp, vp) = reference(OP, *args, **kw), written(OP, *args, **kw)
    if index_dtype == np.int64 and not jax.config.jax_enable_x64:
        pytest.skip("jax holds int64 indices as int32 without x64")
    step = jax.jit(lambda *a: qj.rotary_kv_append(*a, interleaved=False), donate_argnums=(5, 6))
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler, also where JAX has a GPU
        out, k_pool, v_pool = step(*map(jnp.asarray, args))
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(k_pool), kp, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(v_pool), vp.astype(np.float32))
        with pytest.raises(NotImplementedError, match="^rotary_kv_append: no gradient"):
            jax.grad(lambda q: qj.rotary_kv_append(q, *map(jnp.asarray, args[1:]))[0].sum())(jnp.asarray(args[0]))
        bad = list(map(jnp.asarray, args))
        bad[7] = bad[7].at[2].set(12)
        with pytest.raises(Exception, match=r"rotary_kv_append: slots\[2\] = 12 is out of range"):
            jax.block_until_ready(qj.rotary_kv_append(*bad))
        with pytest.raises(TypeError, match="^rotary_kv_append: k_pool and v_pool would be written in place"):
            qkernels.rotary_kv_append(*map(jnp.asarray, args))


def test_cuda_kernels_held_off_the_dispatch(monkeypatch):
    """While held (CUDA_PENDING), a GPU call stages through the cpu kernels and backend="cuda" says why."""
    monkeypatch.setitem(_dispatch._availability, "cuda", (True, ""))
    monkeypatch.setattr(_dispatch, "CUDA_PENDING", {OP: True})
    axes = {"framework": "torch", "device": "cuda", "dtype": "bfloat16"}
    d = _dispatch.decide_axes(OP, dict(axes), None)
    assert d.winner == "cpu" and d.staged
    assert ("cuda", "reject", "the rotary_kv_append CUDA kernels are built but not enabled until their GPU tests "
                              "pass") in d.candidates
    d = _dispatch.decide_axes(OP, dict(axes), "cuda")
    assert d.winner is None and "built but not enabled" in d.error
    assert _dispatch.decide_axes("rotary_emb", dict(axes), None).winner == "cuda"  # the family's other op is not held
    monkeypatch.setattr(_dispatch, "CUDA_PENDING", {})
    assert _dispatch.decide_axes(OP, dict(axes), None).winner == "cuda"
