"""qkernels.jax on the GPU: every op under jit through its CUDA handler, in float32, bfloat16 and
float16 where the kernels take them, against the float64 references; gradients and the paged
decode's aliased caches.  Skips without jax, without the handlers or without a GPU that both jax
and qkernels see."""

import functools

import numpy as np
import pytest

import qkernels
from qkernels import testing as T

from conftest import jax_attn_mask, requires_cuda, with_traced

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
if not hasattr(qkernels._C, "_jax_handlers"):
    pytest.skip("qkernels was built without its XLA FFI handlers", allow_module_level=True)
try:
    GPU = jax.devices("gpu")[0]
except RuntimeError:
    GPU = None
CPU = jax.devices("cpu")[0]
pytestmark = [requires_cuda, pytest.mark.skipif(GPU is None, reason="jax has no GPU platform")]

import qkernels.jax as qj  # noqa: E402

GRAPH = ("sparse_aggregate", "sparse_aggregate_backward", "fused_edge_features", "fused_edge_features_backward",
         "fused_norm_residual", "fused_norm_residual_backward", "graph_norm_bce", "graph_norm_bce_backward")
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _dtypes(op):
    if op == "message_passing":
        return ("float32",)
    if op in GRAPH:
        return ("float32", "bfloat16", "float16")
    return ("bfloat16", "float16")  # the dense and attention kernels on cuda


def _cast(op, args, dtype):
    """The sample's float arguments in dtype; those DEVICE_DTYPES keeps in float32 (the rotary tables,
    graph_norm_bce's grad) and the indices as sampled."""
    kept = T.DEVICE_DTYPES.get(op, ())
    out = []
    for i, a in enumerate(args):
        keep = (isinstance(a, (int, float)) or i not in T.FLOAT_ARGS[op]
                or (i < len(kept) and kept[i] is None))
        arr = np.asarray(a)
        out.append(a if isinstance(a, (int, float)) else
                   jax.device_put(jnp.asarray(arr if keep else arr.astype(getattr(jnp, dtype))), GPU))
    return out


def _f64(a):
    return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _close(got, ref, dtype):
    if ref is None:
        assert got is None
        return
    tol = TOL[dtype]
    got = _f64(got)
    scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), rtol=tol, atol=tol * scale)


def _host(dev):
    """The device arguments on the host: floats as float32 (of the values the device holds), the rest as is."""
    host = [a if isinstance(a, (int, float)) else _f64(a) if np.issubdtype(np.asarray(a).dtype, np.floating)
            or a.dtype == jnp.bfloat16 else np.asarray(a) for a in dev]
    return [h.astype(np.float32) if isinstance(h, np.ndarray) and h.dtype == np.float64 else h for h in host]


def _close_all(out, ref, dtype):
    if isinstance(ref, tuple):
        assert isinstance(out, tuple) and len(out) == len(ref)
        for o, r in zip(out, ref):
            _close(o, r, dtype)
    else:
        _close(out, ref, dtype)


def _sizes(op):
    if op.startswith("attn"):  # the CUDA kernels take head_dim 32, 64, 128 or 256
        return dict(d=64)
    return {}


@pytest.mark.parametrize("op", T.OPS)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
def test_op_jit_on_gpu(op, dtype, rng):
    if dtype not in _dtypes(op):
        pytest.skip(f"{op}'s CUDA kernels take {', '.join(_dtypes(op))}")
    args, kwargs = T.sample(op, rng, **_sizes(op))
    dev = _cast(op, args, dtype)
    host = _host(dev)
    arrays = [i for i, a in enumerate(dev) if not isinstance(a, (int, float))]
    f = getattr(qj, op)

    run = jax.jit(with_traced(f, dev, kwargs, arrays))

    assert qj.explain(op, *dev, **kwargs).winner == "cuda"
    out = run(*[dev[i] for i in arrays])
    ref = T.reference(op, *host, **kwargs)
    if op in T.MUTATED:  # qkernels.jax returns the updated arguments after the output
        ref = (ref, *T.written(op, *host, **kwargs))
    _close_all(out, ref, dtype)
    for o in out if isinstance(out, tuple) else (out,):
        if o is not None:
            assert next(iter(o.devices())).platform == "gpu"


@pytest.mark.parametrize("op", ("sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce",
                                "linear", "swiglu", "rotary_emb"))
def test_grad_on_gpu_matches_cpu(op, rng):
    """jax.grad on the GPU handlers against the same on the CPU handlers (float32 graph ops; the dense
    ops in bfloat16 on the GPU against float32 on the CPU).  Inside jit a tracer has no device, so the
    dispatcher reads the default device: the CPU reference runs with the CPU as default, else it would
    trace for cuda (where the dense kernels take no float32, and the graph ops would run on the GPU)."""
    args, kwargs = T.sample(op, rng)
    dtype = "float32" if op in GRAPH else "bfloat16"
    dev = _cast(op, args, dtype)
    cpu = [a if isinstance(a, (int, float)) else jax.device_put(jnp.asarray(np.asarray(a)), CPU) for a in args]
    diff = [i for i in T.FLOAT_ARGS[op] if not (op == "rotary_emb" and i == 1)
            and not (op == "graph_norm_bce" and i == 1)]

    def grads(full):
        def loss(*d):
            a = list(full)
            for i, v in zip(diff, d):
                a[i] = v
            return jnp.sum(getattr(qj, op)(*a, **kwargs).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=tuple(range(len(diff)))))(*[full[i] for i in diff])

    got = grads(dev)
    with jax.default_device(CPU):
        ref = grads(cpu)
    for r in ref:
        assert next(iter(r.devices())).platform == "cpu"
    for g, r in zip(got, ref):
        assert next(iter(g.devices())).platform == "gpu"
        _close(g, _f64(r), dtype)


def test_paged_decode_appends_on_gpu(rng):
    args, _ = T.sample("attn_paged_decode", rng, lens=(5, 3, 7), d=64)
    q, k_cache, v_cache, r2t, rpi, kv_indptr = args
    B, Hkv, D = q.shape[0], k_cache.shape[1], q.shape[2]
    new_k = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    new_v = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    dev = _cast("attn_paged_decode", args, "bfloat16")
    nk, nv = (jax.device_put(jnp.asarray(a, jnp.bfloat16), GPU) for a in (new_k, new_v))
    # the caches are donated: read them back before the call deletes them
    host = [_f64(a).astype(np.float32) if i < 3 else np.asarray(a) for i, a in enumerate(dev)]
    run = jax.jit(lambda *a: qj.attn_paged_decode(*a[:6], new_k=a[6], new_v=a[7]), donate_argnums=(1, 2))
    out, k2, v2 = run(*dev, nk, nv)
    assert dev[1].is_deleted() and dev[2].is_deleted()  # updated in place, not copied
    nkh, nvh = _f64(nk).astype(np.float32), _f64(nv).astype(np.float32)
    _close(out, T.reference("attn_paged_decode", *host, new_k=nkh, new_v=nvh), "bfloat16")
    _close(k2, T.appended(host[1], nkh, r2t, rpi, kv_indptr), "bfloat16")
    _close(v2, T.appended(host[2], nvh, r2t, rpi, kv_indptr), "bfloat16")


@pytest.mark.parametrize("kind", ["bool", "float32", "q_dtype"])
@pytest.mark.parametrize("op,shape", [("attn_decode", "B,L"), ("attn_decode", "1,1,1,L"),
                                      ("attn_paged_decode", "B,W"), ("attn_prefill", "B,L"),
                                      ("attn_prefill", "B,1,Q,L"), ("attn_prefill", "1,H,1,L"),
                                      ("attn_paged_prefill", "B,W"), ("attn_paged_prefill", "B,1,Q,W")])
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_attention_masks_on_gpu(op, shape, kind, dtype, rng):
    """Bool and additive float masks (float32, or q's own dtype) through the CUDA handlers, under jit."""
    args, kwargs = T.sample(op, rng, **_sizes(op))
    q = args[0]
    B = q.shape[0] if op in ("attn_decode", "attn_prefill") else args[4].shape[0]
    L = args[1].shape[1] if op in ("attn_decode", "attn_prefill") else args[3].shape[1]
    Q = q.shape[1] if op == "attn_prefill" else int(max(np.diff(args[6]))) if op == "attn_paged_prefill" else 1
    dims = tuple({"B": B, "L": L, "W": L - 2, "H": q.shape[-2], "Q": Q}.get(d, 1) for d in shape.split(","))
    mask = jax_attn_mask(rng, dims, "bool" if kind == "bool" else "float")
    dev = _cast(op, args, dtype)
    m = jax.device_put(jnp.asarray(mask, None if kind != "q_dtype" else getattr(jnp, dtype)), GPU)
    host = [_f64(a).astype(np.float32) if i < 3 else np.asarray(a) for i, a in enumerate(dev)]
    out = jax.jit(lambda *a: getattr(qj, op)(*a[:-1], mask=a[-1], **kwargs))(*dev, m)
    assert next(iter(out.devices())).platform == "gpu"
    ref = T.reference(op, *host, mask=_f64(m) if kind != "bool" else np.asarray(m), **kwargs)
    _close(out, ref, dtype)


def test_dropout_mask_same_on_gpu_and_cpu(rng):
    """The same seed gives the same Philox mask on both platforms (and the reference's)."""
    args, _ = T.sample("fused_norm_residual", rng, rows=64, h=96)
    kw = dict(p=0.2, training=True, seed=2**33 + 5)
    gpu = qj.fused_norm_residual(*_cast("fused_norm_residual", args, "float32"), **kw)
    with jax.default_device(CPU):
        cpu = qj.fused_norm_residual(*[jax.device_put(jnp.asarray(a), CPU) for a in args], **kw)
    assert next(iter(cpu.devices())).platform == "cpu"
    _close(gpu, _f64(cpu), "float32")
    _close(gpu, T.reference("fused_norm_residual", *args, **kw), "float32")


# ---- scratch as a result: sizes where the launchers take scratch, replays, the size query ---------------

# sample() options at which each scratch-taking CUDA launcher asks for scratch, and whether it always does
# there (False: it depends on the device or the libraries: the decode split and cluster choice, whether
# cuBLASLt loads and the workspace its plan takes).
SCRATCH = {
    "sparse_aggregate": (dict(n_dst=101, n_src=61, heads=2, dim=8, avg_degree=8), True),  # E > 512
    "sparse_aggregate_backward": (dict(n_dst=101, n_src=61, heads=2, dim=8, avg_degree=8), True),
    "fused_edge_features_backward": (dict(n=61, e=403, h=16), True),
    "fused_norm_residual": (dict(rows=301, h=64, graphs=5), True),  # graph mode
    "fused_norm_residual_backward": (dict(rows=301, h=64, p=0.1), True),
    "graph_norm_bce": (dict(e=5003, graphs=7), True),
    "graph_norm_bce_backward": (dict(e=5003, graphs=7), True),
    "attn_decode": (dict(b=8, l=2048, hkv=8, ratio=4, d=128), False),
    "attn_paged_decode": (dict(lens=[2000, 900, 1500, 64, 1200, 700, 30, 1800], hkv=8, ratio=4, d=128), False),
    "linear": (dict(m=200, k=256, n=192), False),  # M > 64: cuBLASLt
    "swiglu": (dict(m=200, k=256, n=192), False),
    "linear_backward": (dict(m=200, k=256, n=192), False),
    "swiglu_backward": (dict(m=200, k=256, n=192), True),  # ga, gb [M, N] at any M
}
# Arguments kept across replays: graph_norm_bce's 0/1 targets.
_KEEP = {"graph_norm_bce": (1,), "graph_norm_bce_backward": (2,)}


def _dtype(op):
    return "float32" if op in GRAPH else "bfloat16"


def _varied(op, args, rng):
    """args with new values in the float arguments (same shapes and indices): scaled and perturbed."""
    out = list(args)
    for i in T.FLOAT_ARGS[op]:
        a = args[i]
        if i in _KEEP.get(op, ()) or isinstance(a, (int, float)):
            continue
        noise = 0.1 * float(np.std(a)) * rng.standard_normal(a.shape)
        out[i] = (a * (0.5 + rng.random()) + noise).astype(a.dtype)
    return out


def _requested(monkeypatch, op, fn, *arrays, full=False):
    """The scratch sizes (bytes) the trace-time size query returned for op's calls while tracing fn
    (full: the (requested, result bytes) pairs)."""
    seen, real = [], qj._scratch_bytes

    def record(o, *a, **k):
        r = real(o, *a, **k)
        if o == op:
            seen.append(tuple(r) if full else r[0])
        return r

    monkeypatch.setattr(qj, "_scratch_bytes", record)
    jax.clear_caches()  # the public ops' jits would not trace again
    jax.jit(fn).lower(*arrays)
    monkeypatch.setattr(qj, "_scratch_bytes", real)
    jax.clear_caches()
    return seen


@pytest.mark.parametrize("op", sorted(SCRATCH))
def test_scratch_ops_twice_in_one_program_replayed(op, rng, monkeypatch):
    """One jitted program calls op twice (two scratch results), replayed with new inputs each time: the
    handlers are command-buffer compatible, so XLA may record them once and replay the graph; every
    replay must equal the float64 reference (stale or freed scratch would not)."""
    assert op not in T.MUTATED
    opts, always = SCRATCH[op]
    dtype = _dtype(op)
    args, kwargs = T.sample(op, rng, **opts)
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (int, float))]
    one = with_traced(getattr(qj, op), args, kwargs, arrays)
    n = len(arrays)

    def two(*ts):
        return one(*ts[:n]), one(*ts[n:])

    first = [_cast(op, _varied(op, args, rng), dtype) for _ in range(2)]
    # the op's own jit traces it once for both calls of the same signature: one size, or two equal ones
    sizes = _requested(monkeypatch, op, two, *[d[i] for d in first for i in arrays])
    assert 1 <= len(sizes) <= 2 and len(set(sizes)) == 1, sizes
    assert sizes[0] > 0 or not always, f"{op} took no scratch at {opts}"
    run = jax.jit(two)
    for step in range(5):
        devs = first if step == 0 else [_cast(op, _varied(op, args, rng), dtype) for _ in range(2)]
        outs = run(*[d[i] for d in devs for i in arrays])
        for dev, out in zip(devs, outs):
            ref = T.reference(op, *_host(dev), **kwargs)
            for o, r in zip(out if isinstance(ref, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
                _close_to_its_scale(o, r, dtype)


def _close_to_its_scale(got, ref, dtype):
    """As _close, the absolute tolerance relative to the reference's own largest value (no floor at 1):
    outputs of magnitude far below 1 (attention over thousands of keys) still tell one input from another."""
    if ref is None:
        assert got is None
        return
    ref = np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(ref), initial=0.0)) or 1.0
    np.testing.assert_allclose(_f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("op", sorted(SCRATCH))
def test_scratch_size_is_what_the_launcher_takes(op, rng, monkeypatch):
    """The dry run's size is exact: the op runs with a scratch result of that size (plus the alignment
    slack) and is refused, with an error naming op, when the result is one byte short of it."""
    opts, always = SCRATCH[op]
    dtype = _dtype(op)
    args, kwargs = T.sample(op, rng, **opts)
    dev = _cast(op, args, dtype)
    arrays = [i for i, a in enumerate(dev) if not isinstance(a, (int, float))]
    fn = with_traced(getattr(qj, op), dev, kwargs, arrays)
    ins = [dev[i] for i in arrays]
    ((requested, result_bytes),) = _requested(monkeypatch, op, fn, *ins, full=True)
    assert result_bytes == (requested + 255 if requested else 0)  # any alignment fits 256-byte blocks
    if requested == 0:
        assert not always, f"{op} took no scratch at {opts}"
        pytest.skip(f"{op} takes no scratch at {opts} on this device")
    real = qj._scratch_bytes

    def short(o, *a, **k):
        r = real(o, *a, **k)
        return (r[0], r[0] - 1) if o == op else r

    monkeypatch.setattr(qj, "_scratch_bytes", short)
    jax.clear_caches()
    with pytest.raises(Exception, match=f"{op}: the launcher asked for .* bytes of scratch"):
        jax.block_until_ready(jax.jit(fn)(*ins))
    monkeypatch.setattr(qj, "_scratch_bytes", real)
    jax.clear_caches()
    _close_all(jax.jit(fn)(*ins), T.reference(op, *_host(dev), **kwargs), dtype)


@pytest.mark.parametrize("op", ("sparse_aggregate", "fused_norm_residual", "graph_norm_bce", "linear", "swiglu"))
def test_grad_with_scratch_on_gpu_matches_cpu(op, rng):
    """jax.grad through forward and backward handlers at sizes where they take scratch, against the
    same on the CPU handlers."""
    args, kwargs = T.sample(op, rng, **SCRATCH[op][0])
    dtype = _dtype(op)
    dev = _cast(op, args, dtype)
    cpu = [a if isinstance(a, (int, float)) else jax.device_put(jnp.asarray(np.asarray(a)), CPU) for a in args]
    diff = [i for i in T.FLOAT_ARGS[op] if not (op == "graph_norm_bce" and i == 1)]
    f = getattr(qj, op)

    def grads(full, kw):
        def loss(*d):
            a = list(full)
            for i, v in zip(diff, d):
                a[i] = v
            return jnp.sum(f(*a, **kw).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=tuple(range(len(diff)))))(*[full[i] for i in diff])

    got = grads(dev, {k: jax.device_put(jnp.asarray(v), GPU) if isinstance(v, np.ndarray) else v
                      for k, v in kwargs.items()})
    with jax.default_device(CPU):
        ref = grads(cpu, {k: jax.device_put(jnp.asarray(v), CPU) if isinstance(v, np.ndarray) else v
                          for k, v in kwargs.items()})
    for g, r in zip(got, ref):
        assert next(iter(g.devices())).platform == "gpu"
        _close(g, _f64(r), dtype)


def test_vmap_with_scratch_on_gpu(rng):
    """vmap at sizes where the launchers take scratch: sparse_aggregate folds the batch into the heads
    (one call, sized for the folded shapes); fused_edge_features_backward runs one call per element
    (each with its own scratch result); against a loop of float64 references."""
    (rp, ci, ew, nf), _ = T.sample("sparse_aggregate", rng, **SCRATCH["sparse_aggregate"][0])
    V = 3
    ews = np.stack([ew * (1 + i) for i in range(V)]).astype(np.float32)
    nfs = np.stack([nf - i for i in range(V)]).astype(np.float32)
    put = functools.partial(jax.device_put, device=GPU)
    out = jax.jit(jax.vmap(qj.sparse_aggregate, in_axes=(None, None, 0, 0)))(
        put(jnp.asarray(rp)), put(jnp.asarray(ci)), put(jnp.asarray(ews)), put(jnp.asarray(nfs)))
    for i in range(V):
        _close(out[i], T.reference("sparse_aggregate", rp, ci, ews[i], nfs[i]), "float32")
    (g, x, ei), _ = T.sample("fused_edge_features_backward", rng, **SCRATCH["fused_edge_features_backward"][0])
    gs = np.stack([g * (1 + i) for i in range(V)]).astype(np.float32)
    xs = np.stack([x + i for i in range(V)]).astype(np.float32)
    gx, ga = jax.jit(jax.vmap(qj.fused_edge_features_backward, in_axes=(0, 0, None)))(
        put(jnp.asarray(gs)), put(jnp.asarray(xs)), put(jnp.asarray(ei)))
    for i in range(V):
        rx, ra = T.reference("fused_edge_features_backward", gs[i], xs[i], ei)
        _close(gx[i], rx, "float32")
        _close(ga[i], ra, "float32")


@pytest.mark.parametrize("sort", [True, False])
def test_graph_bce_both_device_paths(rng, sort):
    """graph_norm_bce's handler on its sorted path and its unsorted one (more graphs than a wave of
    blocks), with scratch from the call's result, jitted and run twice: the reference, the same bits."""
    g = 3000
    args, _ = T.sample("graph_norm_bce", rng, e=200_003, graphs=g, sort=sort)
    dev = _cast("graph_norm_bce", args, "float32")
    run = jax.jit(lambda lg, t, eg: qj.graph_norm_bce(lg, t, eg, g, pos_weight=1.5))
    first, second = run(*dev[:3]), run(*dev[:3])
    assert np.asarray(first).tobytes() == np.asarray(second).tobytes()
    _close(first, T.reference("graph_norm_bce", *_host(dev)[:3], g, pos_weight=1.5), "float32")
