"""qkernels.jax on the CPU: every op eager and under jit against the float64 references, gradients
against jax.grad of float64 jax.numpy formulations and directional finite differences, vmap against a
loop, a jitted two-layer GNN training step, dispatch and trace-time errors."""

import os

import numpy as np
import pytest

import qkernels
from qkernels import testing as T

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import qkernels.jax as qj  # noqa: E402
from conftest import jax_attn_mask, with_traced  # noqa: E402



@pytest.fixture(autouse=True)
def _on_cpu():
    """The CPU handlers, also on a machine with a GPU (tests/test_cuda_jax.py covers that one)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _jargs(args):
    return tuple(a if isinstance(a, (int, float)) else jnp.asarray(a) for a in args)


def _close(got, ref, tol=2e-5):
    if ref is None:
        assert got is None
        return
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)


def _sample(op, rng, **options):
    """A sample at awkward sizes (primes, GQA, int32 indices for half the ops)."""
    ix = np.int32 if hash(op) % 2 else np.int64
    return T.sample(op, rng, index_dtype=ix, **options)


def _check_op(op, args, kwargs, outs):
    ref = T.reference(op, *args, **kwargs)
    if op in T.MUTATED:  # qkernels.jax returns the updated arguments after the output
        ref = (ref, *T.written(op, *args, **kwargs))
    if isinstance(ref, tuple):
        assert isinstance(outs, tuple) and len(outs) == len(ref)
        for o, r in zip(outs, ref):
            _close(o, r)
    else:
        _close(outs, ref)


@pytest.mark.parametrize("op", T.OPS)
def test_op_eager_and_jit(op, rng):
    args, kwargs = _sample(op, rng)
    f = getattr(qj, op)
    _check_op(op, args, kwargs, f(*_jargs(args), **kwargs))
    tensors = [i for i, a in enumerate(args) if not isinstance(a, (int, float))]

    run = jax.jit(with_traced(f, args, kwargs, tensors))
    out = run(*[jnp.asarray(args[i]) for i in tensors])
    _check_op(op, args, kwargs, out)
    assert all(isinstance(o, jax.Array) for o in (out if isinstance(out, tuple) else (out,)) if o is not None)


@pytest.mark.parametrize("options", [dict(graphs=3), dict(graphs=2, sort=False)])
def test_norm_graph_mode(options, rng):
    args, kwargs = _sample("fused_norm_residual", rng, rows=11, h=5, **options)
    out = jax.jit(lambda *a: qj.fused_norm_residual(*a, batch=jnp.asarray(kwargs["batch"]),
                                                    num_graphs=kwargs["num_graphs"]))(*_jargs(args))
    _close(out, T.reference("fused_norm_residual", *args, **kwargs))


def test_dropout_seed(rng):
    args, _ = _sample("fused_norm_residual", rng, rows=37, h=24)
    kw = dict(p=0.3, training=True)
    a = qj.fused_norm_residual(*_jargs(args), seed=1234, **kw)
    b = jax.jit(lambda s, *xs: qj.fused_norm_residual(*xs, seed=s, **kw))(jnp.int32(1234), *_jargs(args))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # an int and an array seed: the same mask
    _close(a, T.reference("fused_norm_residual", *args, seed=1234, **kw))
    c = qj.fused_norm_residual(*_jargs(args), seed=1235, **kw)
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    with pytest.raises(ValueError, match="fused_norm_residual: .*seed"):
        qj.fused_norm_residual(*_jargs(args), **kw)
    # the backward op regenerates the forward's mask from the seed
    g = rng.standard_normal(args[0].shape).astype(np.float32)
    got = qj.fused_norm_residual_backward(jnp.asarray(g), jnp.asarray(args[0]), jnp.asarray(args[2]), seed=2**40 + 7,
                                          **kw)
    ref = T.reference("fused_norm_residual_backward", g, args[0], args[2], seed=2**40 + 7, **kw)
    for o, r in zip(got, ref):
        _close(o, r)


def test_paged_decode_appends(rng):
    args, _ = _sample("attn_paged_decode", rng, lens=(5, 3, 7))
    q, k_cache, v_cache, r2t, rpi, kv_indptr = args
    B, Hkv, D = q.shape[0], k_cache.shape[1], q.shape[2]
    new_k = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    new_v = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    run = jax.jit(lambda *a: qj.attn_paged_decode(*a[:6], new_k=a[6], new_v=a[7]))
    out, k2, v2 = run(*_jargs(args), jnp.asarray(new_k), jnp.asarray(new_v))
    _close(out, T.reference("attn_paged_decode", *args, new_k=new_k, new_v=new_v))
    _close(k2, T.appended(k_cache, new_k, r2t, rpi, kv_indptr))
    _close(v2, T.appended(v_cache, new_v, r2t, rpi, kv_indptr))


# ---- gradients ------------------------------------------------------------------------------------

def _segment_rows(row_ptr):
    return np.repeat(np.arange(len(row_ptr) - 1), np.diff(np.asarray(row_ptr)))


def _jnp_sparse_aggregate(row_ptr, col_idx, ew, nf):
    rows = _segment_rows(row_ptr)
    msg = ew[:, :, None] * nf[np.asarray(col_idx)]
    return jax.ops.segment_sum(msg, rows, num_segments=len(row_ptr) - 1)


def _jnp_fused_edge_features(x, ei, attr):
    s, d = x[np.asarray(ei[0])], x[np.asarray(ei[1])]
    return jnp.concatenate([s + d, jnp.abs(s - d), attr], 1)


def _jnp_norm(x, residual, gamma, beta, eps=1e-5):
    mean = x.mean(1, keepdims=True)
    var = ((x - mean) ** 2).mean(1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + beta + residual


def _jnp_bce(logits, target, edge_graph, num_graphs):
    bce = jnp.maximum(logits, 0) - logits * target + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    eg = np.asarray(edge_graph)
    counts = np.maximum(np.bincount(eg, minlength=num_graphs), 1)
    return (jax.ops.segment_sum(bce, eg, num_segments=num_graphs) / counts).mean()


def _jnp_rotary(x, f, interleaved=True):
    c, s = f[..., 0][..., None, :], f[..., 1][..., None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return jnp.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return jnp.concatenate([a * c - b * s, a * s + b * c], -1)


def _jnp_swiglu(x, up, gate):
    g = x @ gate.T
    return (x @ up.T) * g * jax.nn.sigmoid(g)


def _jnp_message_passing(x, e, ei, rp, ci, de, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o, gamma_x, beta_x,
                         gamma_e, beta_e):
    (N, H), K = x.shape, w_att.shape[1]
    h = jax.nn.relu(_jnp_fused_edge_features(x, ei, e) @ w1 + b1)
    att = jax.nn.sigmoid(h @ w_att + b_att)[np.asarray(de)]
    agg = _jnp_sparse_aggregate(rp, ci, att, (x @ w_v).reshape(N, K, H // K)).reshape(N, H)
    return _jnp_norm(agg @ w_o, x, gamma_x, beta_x), _jnp_norm(h @ w_msg + b_msg, e, gamma_e, beta_e)


# op -> (sample options, differentiable positions, jnp float64 formulation of (args) -> out)
GRADS = {
    "sparse_aggregate": (dict(n_dst=7, n_src=6, heads=3, dim=5), (2, 3), lambda a: _jnp_sparse_aggregate(*a)),
    "fused_edge_features": (dict(n=7, e=13, h=5), (0, 2), lambda a: _jnp_fused_edge_features(*a)),
    "fused_norm_residual": (dict(rows=9, h=13), (0, 1, 2, 3), lambda a: _jnp_norm(*a)),
    "graph_norm_bce": (dict(e=19, graphs=3), (0,), lambda a: _jnp_bce(*a)),
    "rotary_emb": (dict(lead=(2, 5), h=3, d=8), (0,), lambda a: _jnp_rotary(*a)),
    "linear": (dict(m=5, k=11, n=7), (0, 1, 2), lambda a: a[0] @ a[1].T + a[2]),
    "swiglu": (dict(m=5, k=11, n=7), (0, 1, 2), lambda a: _jnp_swiglu(*a)),
    "message_passing": (dict(n=7, e=13, h=6, f=5, heads=3), (0, 1) + tuple(range(6, 18)),
                        lambda a: _jnp_message_passing(*a)),
}


def _outs(out):
    return out if isinstance(out, tuple) else (out,)


def _weights(out, rng):
    """A random weight per output of the op (message_passing has two)."""
    return tuple(jnp.asarray(rng.standard_normal(o.shape).astype(np.float32)) for o in _outs(out))


def _loss_of(fn, args, diff, w):
    def loss(*d):
        full = list(args)
        for i, v in zip(diff, d):
            full[i] = v
        return sum(jnp.sum(o * wo) for o, wo in zip(_outs(fn(full)), w))

    return loss


@pytest.mark.parametrize("op", sorted(GRADS))
def test_grad_vs_jax_reference(op, rng):
    options, diff, ref_fn = GRADS[op]
    args, kwargs = T.sample(op, rng, **options)
    args = list(_jargs(args))
    w = _weights(getattr(qj, op)(*args, **kwargs), rng)
    ours = jax.grad(_loss_of(lambda a: getattr(qj, op)(*a, **kwargs), args, diff, w), argnums=tuple(range(len(diff))))
    got = jax.jit(ours)(*[args[i] for i in diff])
    with jax.enable_x64(True):
        args64 = [a if isinstance(a, int) else jnp.asarray(np.asarray(a, np.float64 if
                  np.issubdtype(np.asarray(a).dtype, np.floating) else None)) for a in args]
        ref = jax.grad(_loss_of(ref_fn, args64, diff, [jnp.asarray(np.asarray(wo), jnp.float64) for wo in w]),
                       argnums=tuple(range(len(diff))))(*[args64[i] for i in diff])
        ref = [np.asarray(r) for r in ref]
    for g, r in zip(got, ref):
        _close(g, r, tol=1e-4)


# Finite differences over the inputs past message_passing's relu and |x[src] - x[dst]|: a step across one
# of their kinks is off by percents; the gradients before them are checked against float64 jax.grad.
FD_DIFF = {"message_passing": tuple(range(8, 18))}


@pytest.mark.parametrize("op", sorted(GRADS))
def test_grad_directional_fd(op, rng):
    """<grad, v> against (L(a + h v) - L(a - h v)) / 2h, on the op itself."""
    options, diff, _ = GRADS[op]
    diff = FD_DIFF.get(op, diff)
    args, kwargs = T.sample(op, rng, **options)
    if op == "fused_edge_features":  # node rows 0.5 apart: no |x[src] - x[dst]| kink within the step
        n, h = args[0].shape
        args = ((0.5 * np.arange(n)[:, None] + 0.05 * rng.standard_normal((n, h))).astype(np.float32),) + args[1:]
    args = list(_jargs(args))
    f = getattr(qj, op)
    w = _weights(f(*args, **kwargs), rng)
    loss = _loss_of(lambda a: f(*a, **kwargs), args, diff, w)
    primals = [args[i] for i in diff]
    grads = jax.grad(loss, argnums=tuple(range(len(diff))))(*primals)
    dirs = [jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)) for p in primals]
    h = 1e-3 if op == "message_passing" else 1e-2  # LayerNorms after sigmoids: a shorter step
    plus = loss(*[p + h * d for p, d in zip(primals, dirs)])
    minus = loss(*[p - h * d for p, d in zip(primals, dirs)])
    fd = float(plus - minus) / (2 * h)
    an = sum(float(jnp.vdot(g, d)) for g, d in zip(grads, dirs))
    assert abs(fd - an) <= 2e-2 * max(1.0, abs(an)), (fd, an)


def test_norm_dropout_grad(rng):
    """Training with dropout: the gradient is the backward op's, with the forward's mask."""
    args, _ = T.sample("fused_norm_residual", rng, rows=6, h=10)
    args = _jargs(args)
    kw = dict(p=0.25, training=True, seed=99)
    g = jax.grad(lambda x: jnp.sum(qj.fused_norm_residual(x, *args[1:], **kw) ** 2))(args[0])
    out = qj.fused_norm_residual(*args, **kw)
    ref = T.reference("fused_norm_residual_backward", np.asarray(2 * out), *map(np.asarray, (args[0], args[2])), **kw)
    _close(g, ref[0], tol=1e-4)


def test_jit_grad_two_layer_gnn(rng):
    """jit(grad) of a two-layer GNN (edge features, linear, aggregation, norm, BCE) against jnp in float64."""
    n, e, h, graphs = 9, 23, 6, 2
    x = rng.standard_normal((n, h)).astype(np.float32)
    ei = rng.integers(0, n, (2, e)).astype(np.int64)
    order = np.argsort(ei[1], kind="stable")
    ei = ei[:, order]
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(ei[1], minlength=n))]).astype(np.int64)
    col_idx = ei[0]
    eg = np.sort(rng.integers(0, graphs, e)).astype(np.int64)
    target = (rng.random(e) < 0.3).astype(np.float32)
    params = {"w1": rng.standard_normal((1, 2 * h)).astype(np.float32) * 0.3,
              "w2": rng.standard_normal((h, h)).astype(np.float32) * 0.3,
              "gamma": np.ones(h, np.float32), "beta": np.zeros(h, np.float32),
              "wo": rng.standard_normal((1, 3 * h)).astype(np.float32) * 0.3}

    def model(p, x, ops):
        for _ in range(2):
            feats = ops["fef"](x, ei, None)                       # [E, 2H]
            att = ops["linear"](feats, p["w1"])                   # [E, 1]
            agg = ops["sa"](row_ptr, col_idx, att, x[:, None, :])[:, 0, :]  # [N, H]
            x = ops["norm"](ops["linear"](agg, p["w2"]), x, p["gamma"], p["beta"])
        logits = ops["linear"](ops["fef"](x, ei, x[ei[0]]), p["wo"])[:, 0]
        return ops["bce"](logits, target, eg, graphs)

    ours = {"fef": lambda x, ei, a: qj.fused_edge_features(x, ei, a), "linear": lambda x, w: qj.linear(x, w),
            "sa": qj.sparse_aggregate, "norm": qj.fused_norm_residual, "bce": qj.graph_norm_bce}
    ref = {"fef": lambda x, ei, a: (_jnp_fused_edge_features(x, ei, a) if a is not None else
                                    _jnp_fused_edge_features(x, ei, jnp.zeros((e, 0), x.dtype))),
           "linear": lambda x, w: x @ w.T, "sa": _jnp_sparse_aggregate,
           "norm": _jnp_norm, "bce": _jnp_bce}
    pj = {k: jnp.asarray(v) for k, v in params.items()}
    loss, grads = jax.jit(jax.value_and_grad(lambda p, x: model(p, x, ours)))(pj, jnp.asarray(x))
    with jax.enable_x64(True):
        p64 = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
        loss64, grads64 = jax.value_and_grad(lambda p, x: model(p, x, ref))(p64, jnp.asarray(x, jnp.float64))
        grads64 = {k: np.asarray(v) for k, v in grads64.items()}
    _close(loss, float(loss64), tol=1e-4)
    for k in params:
        _close(grads[k], grads64[k], tol=2e-4)


# ---- vmap ---------------------------------------------------------------------------------------

def _stack(rng, make, V=3):
    return [make(np.random.default_rng(int(rng.integers(1 << 30)))) for _ in range(V)]


VMAPS = {  # op -> (sample options, batched positions)
    "linear": (dict(m=4, k=9, n=5), (0,)),
    "linear_weights": (dict(m=4, k=9, n=5), (0, 1)),  # weights batched: the sequential fallback
    "swiglu": (dict(m=4, k=9, n=5), (0,)),
    "rotary_emb": (dict(lead=(5,), h=3, d=8), (0,)),
    "sparse_aggregate": (dict(n_dst=6, n_src=5, heads=2, dim=3, degrees=[3, 0, 2, 5, 1, 4]), (2, 3)),
    "sparse_aggregate_nf": (dict(n_dst=6, n_src=5, heads=2, dim=3, degrees=[3, 0, 2, 5, 1, 4]), (3,)),
    "fused_edge_features": (dict(n=6, e=11, h=4), (0, 2)),
    "fused_edge_features_x": (dict(n=6, e=11, h=4), (0,)),
    "fused_norm_residual": (dict(rows=5, h=12), (0, 1)),
    "graph_norm_bce": (dict(e=17, graphs=3), (0, 1)),  # no batch dimension to fold into: sequential
    "message_passing": (dict(n=6, e=11, h=4, f=3, heads=2), (0, 1, 14)),  # sequential
}


@pytest.mark.parametrize("case", sorted(VMAPS))
def test_vmap_vs_loop(case, rng):
    op = case.split("_weights")[0].split("_nf")[0].split("_x")[0] if case not in GRADS else case
    options, batched = VMAPS[case]
    f = getattr(qj, op)
    samples = [T.sample(op, np.random.default_rng(int(rng.integers(1 << 30))), **options) for _ in range(3)]
    args0, kwargs = samples[0]
    stacked = [jnp.asarray(np.stack([s[0][i] for s in samples])) if i in batched else a
               for i, a in enumerate(_jargs(args0))]
    ints = {i: a for i, a in enumerate(args0) if isinstance(a, int)}  # static: closed over
    tensors = [a for i, a in enumerate(stacked) if i not in ints]
    axes = [0 if i in batched else None for i in range(len(args0)) if i not in ints]

    def call(*ts):
        it = iter(ts)
        return f(*[ints[i] if i in ints else next(it) for i in range(len(args0))], **kwargs)

    got = _outs(jax.jit(jax.vmap(call, in_axes=axes))(*tensors))
    for b in range(3):
        call = [np.asarray(stacked[i][b]) if i in batched else args0[i] for i in range(len(args0))]
        for g, r in zip(got, _outs(T.reference(op, *call, **kwargs)), strict=True):
            _close(g[b], r)


def test_vmap_of_grad(rng):
    args, _ = T.sample("linear", rng, m=3, k=6, n=4)
    x, w, b = _jargs(args)
    xs = jnp.asarray(rng.standard_normal((4,) + x.shape).astype(np.float32))
    got = jax.vmap(jax.grad(lambda x: jnp.sum(qj.linear(x, w, b) ** 2)))(xs)
    ref = jax.vmap(jax.grad(lambda x: jnp.sum((x @ w.T + b) ** 2)))(xs)
    _close(got, ref, tol=1e-4)


# ---- dispatch and errors --------------------------------------------------------------------------

def test_explain_jax_arrays_and_tracers(rng):
    args, _ = T.sample("linear", rng)
    d = qj.explain("linear", *_jargs(args))
    assert d.winner == "cpu" and d.axes["framework"] == "jax"
    seen = []
    jax.jit(lambda x: seen.append(qj.explain("linear", x, args[1])) or x)(jnp.asarray(args[0]))
    assert seen[0].winner == "cpu" and seen[0].axes["dtype"] == "float32"
    assert qkernels.explain("linear", *_jargs(args)).winner == "cpu"


def test_backend_selection(rng):
    args = _jargs(T.sample("linear", rng)[0])
    with pytest.raises(qkernels.ExplicitSelectionError, match="linear"):
        qj.linear(*args, backend="cuda")
    with qkernels.use_backend(linear="cuda"), pytest.raises(qkernels.ExplicitSelectionError, match="linear"):
        jax.jit(qj.linear)(*args)
    _close(qj.linear(*args, backend="cpu"), T.reference("linear", *map(np.asarray, args)))


def test_env_backend(env, rng):
    args = _jargs(T.sample("sparse_aggregate", rng)[0])
    env(QECDEC_BACKEND="cuda")
    with pytest.raises(qkernels.ExplicitSelectionError, match="sparse_aggregate"):
        qj.sparse_aggregate(*args)


@pytest.mark.parametrize("op, change, exc, match", [
    ("sparse_aggregate", lambda a: (a[0], a[1], a[2][:, :1], a[3]), ValueError, "sparse_aggregate: edge_weight"),
    ("sparse_aggregate", lambda a: (a[0], a[1].astype(jnp.float32), a[2], a[3]), TypeError,
     "sparse_aggregate: col_idx"),
    ("linear", lambda a: (a[0], a[1][:, :3], a[2]), ValueError, "linear: weight"),
    ("rotary_emb", lambda a: (a[0][..., :7], a[1]), ValueError, "rotary_emb: x"),
    ("fused_edge_features", lambda a: (a[0].astype(jnp.int32), a[1], a[2]), TypeError, "fused_edge_features: x"),
    ("graph_norm_bce", lambda a: (a[0], a[1][:3], a[2], a[3]), ValueError, "graph_norm_bce: target"),
    ("fused_norm_residual", lambda a: (a[0], a[1], a[2][:2], a[3]), ValueError, "fused_norm_residual: gamma"),
    ("message_passing", lambda a: (a[0].astype(jnp.int32),) + a[1:], TypeError,
     "message_passing: x must be float32, got int32"),
    ("message_passing", lambda a: a[:4] + (a[4].astype(jnp.float32),) + a[5:], TypeError,
     "message_passing: col_idx must have row_ptr's dtype"),
    ("message_passing", lambda a: (a[0], a[1][:, :-1]) + a[2:], ValueError,
     r"message_passing: e must have shape \[E, H\]"),
    ("message_passing", lambda a: a[:10] + (jnp.concatenate([a[10], a[10][:, :1]], 1),
                                            jnp.concatenate([a[11], a[11][:1]])) + a[12:], ValueError,
     r"message_passing: the number of heads K = w_att.shape\[1\] = 3 must be >= 1 and divide H = 8"),
])
def test_trace_time_errors(op, change, exc, match, rng):
    args, kwargs = T.sample(op, rng)
    bad = change(_jargs(args))
    with pytest.raises(exc, match=match):
        getattr(qj, op)(*bad, **kwargs)
    tensors = [a for a in bad if not isinstance(a, int)]
    ints = {i: a for i, a in enumerate(bad) if isinstance(a, int)}

    def run(*ts):
        it = iter(ts)
        return getattr(qj, op)(*[ints[i] if i in ints else next(it) for i in range(len(bad))], **kwargs)

    with pytest.raises(exc, match=match):
        jax.jit(run)(*tensors)


def test_message_passing_fused_outside_differentiation(rng):
    """Eager, jitted and vjp's primal agree; the primal is the one fused call, and jax.grad differentiates
    the composition (no message_passing call left in its program)."""
    args, _ = _sample("message_passing", rng, n=9, e=17, h=6, f=5, heads=3)
    args = _jargs(args)

    def f(*a):
        return qj.message_passing(*a, eps=1e-3)

    eager = f(*args)
    for got, want in zip(jax.jit(f)(*args), eager, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(eager, T.reference("message_passing", *map(np.asarray, args), eps=1e-3), strict=True):
        _close(got, want)
    primal, _ = jax.vjp(lambda x, w1: f(x, *args[1:6], w1, *args[7:]), args[0], args[6])
    for got, want in zip(primal, eager, strict=True):
        _close(got, want, tol=1e-5)
    plain = str(jax.make_jaxpr(f)(*args))
    assert "qkernels_message_passing" in plain and "qkernels_fused_edge_features" not in plain

    def loss(x):
        return sum(jnp.sum(o) for o in f(x, *args[1:]))

    grad = str(jax.make_jaxpr(jax.grad(loss))(args[0]))
    assert "qkernels_message_passing" not in grad
    for piece in ("fused_edge_features", "sparse_aggregate", "fused_norm_residual"):
        assert f"qkernels_{piece}_backward" in grad


def test_message_passing_index_error_at_run_time(rng):
    args, _ = T.sample("message_passing", rng)
    dir_edge = np.array(args[5])
    dir_edge[3] = args[1].shape[0] + 2
    with pytest.raises(Exception, match=r"message_passing: dir_edge\[3\] = .* is out of range for e with E"):
        jax.block_until_ready(qj.message_passing(*_jargs(args[:5] + (dir_edge,) + args[6:])))


def test_index_error_at_run_time(rng):
    """An out-of-range index is found by the CPU handler: the error names the op and the argument."""
    args, _ = T.sample("sparse_aggregate", rng)
    col = np.array(args[1])
    col[0] = 99
    with pytest.raises(Exception, match="sparse_aggregate: col_idx"):
        jax.block_until_ready(qj.sparse_aggregate(*_jargs((args[0], col) + args[2:])))


# mask shapes per op, in the bindings' forms: B batch, L keys (Lkv, or a width W < max_ctx for the
# token pools), H query heads, Q query rows (Lq, or Mq for the pools)
MASK_SHAPES = {
    "attn_decode": ["B,L", "1,L", "B,1,L", "1,1,1,L"],
    "attn_paged_decode": ["B,L", "1,1,L", "B,1,1,L"],
    "attn_prefill": ["B,L", "B,1,Q,L", "1,H,1,L", "H,Q,L", "B,H,Q,L"],
    "attn_paged_prefill": ["B,L", "B,1,Q,L", "1,H,1,L", "1,Q,L"],
}


def _mask_case(op, rng, shape, kind):
    args, kwargs = _sample(op, rng)
    q = args[0]
    if op in ("attn_decode", "attn_prefill"):
        B, L = q.shape[0], args[1].shape[1]
    else:
        B, L = args[4].shape[0], args[3].shape[1] - 2  # narrower than max_ctx: positions from W on drop
    H = q.shape[-2]
    Q = q.shape[1] if op == "attn_prefill" else max(np.diff(args[6])) if op == "attn_paged_prefill" else 1
    dims = tuple({"B": B, "L": L, "H": H, "Q": Q}.get(d, 1) for d in shape.split(","))
    return args, kwargs, jax_attn_mask(rng, dims, kind)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("op,shape", [(op, s) for op, shapes in MASK_SHAPES.items() for s in shapes])
def test_attention_masks(op, shape, kind, rng):
    """Bool and additive float masks in the bindings' broadcast forms, under jit, against the float64
    references."""
    args, kwargs, mask = _mask_case(op, rng, shape, kind)
    kwargs = dict(kwargs, mask=mask)
    if op == "attn_decode" and shape == "B,L":
        kwargs["kv_lens"] = np.array([args[1].shape[1], 4], np.int32)[:args[0].shape[0]]
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (int, float))]
    f = getattr(qj, op)

    @jax.jit
    def run(*ts):
        full = list(args)
        for i, t in zip(arrays, ts[:-1]):
            full[i] = t
        return f(*full, **dict(kwargs, mask=ts[-1]))

    out = run(*[jnp.asarray(args[i]) for i in arrays], jnp.asarray(mask))
    _close(out, T.reference(op, *args, **kwargs))


def test_paged_decode_appends_with_a_mask(rng):
    args, _, mask = _mask_case("attn_paged_decode", rng, "B,L", "float")
    B, Hkv, D = args[0].shape[0], args[1].shape[1], args[0].shape[2]
    nk, nv = (rng.standard_normal((B, Hkv, D)).astype(np.float32) for _ in range(2))
    out, k2, v2 = qj.attn_paged_decode(*_jargs(args), new_k=nk, new_v=nv, mask=mask)
    _close(out, T.reference("attn_paged_decode", *args, new_k=nk, new_v=nv, mask=mask))
    _close(k2, T.appended(args[1], nk, *args[3:6]))


def test_mask_errors(rng):
    args, _ = T.sample("attn_prefill", rng)
    B, Lkv, Hq = args[0].shape[0], args[1].shape[1], args[0].shape[2]
    with pytest.raises(TypeError, match="attn_prefill: mask must be bool .* float32 .* got int32"):
        qj.attn_prefill(*_jargs(args), mask=jnp.ones((B, Lkv), jnp.int32))
    with pytest.raises(TypeError, match="attn_prefill: mask .* got float16"):
        qj.attn_prefill(*_jargs(args), mask=jnp.zeros((B, Lkv), jnp.float16))  # q is float32
    with pytest.raises(ValueError, match="attn_prefill: mask must have shape"):
        qj.attn_prefill(*_jargs(args), mask=jnp.ones((B, Lkv + 1), bool))
    with pytest.raises(ValueError, match="attn_prefill: mask must have shape"):
        qj.attn_prefill(*_jargs(args), mask=jnp.ones((B, Hq + 1, 1, Lkv), bool))
    with pytest.raises(ValueError, match="attn_prefill: mask must be"):
        qj.attn_prefill(*_jargs(args), mask=jnp.ones((Lkv,), bool))
    dargs, _ = T.sample("attn_decode", rng)
    with pytest.raises(ValueError, match="attn_decode: mask must have shape"):
        qj.attn_decode(*_jargs(dargs), mask=jnp.ones((dargs[0].shape[0], 2, dargs[1].shape[1]), bool))
    pargs, _ = T.sample("attn_paged_decode", rng)
    with pytest.raises(ValueError, match="attn_paged_decode: mask must have shape .*W <= max_ctx"):
        qj.attn_paged_decode(*_jargs(pargs), mask=jnp.ones((pargs[0].shape[0], pargs[3].shape[1] + 1), bool))
    hq = T.sample("attn_prefill", rng)[0]
    half = tuple(jnp.asarray(a, jnp.bfloat16) for a in hq[:3])
    qj.attn_prefill(*half, mask=jnp.zeros((B, Lkv), jnp.bfloat16))  # q's own 16-bit dtype is taken


def test_registered_and_import_isolation():
    assert set(qj.registered()) == set(qkernels._C.OPS)
    assert all(callable(getattr(qj, op, None)) for op in qkernels._C.OPS)
    assert all("cpu" in p for p in qj.registered().values())
    import subprocess
    import sys
    code = "import sys, qkernels; assert 'jax' not in sys.modules, 'import qkernels imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(qkernels.__file__)))


def test_every_handler_is_command_buffer_compatible():
    """The trait XLA reads: every op, since a call's scratch is one of its results (handlers.c)."""
    handlers = qkernels._C._jax_handlers(False)
    assert set(handlers) == set(qkernels._C.OPS)
    assert [op for op, (_, _, cb) in handlers.items() if cb is not True] == []


def test_cpu_handler_ignores_a_scratch_result(rng):
    """A call traced for the GPU and compiled for the CPU carries the scratch result: the cpu handler
    computes as without it."""
    (x, w, b), _ = _sample("linear", rng, m=5, k=12, n=9)
    out = jax.ShapeDtypeStruct((5, 9), jnp.float32)
    call = jax.ffi.ffi_call("qkernels_linear", [out, jax.ShapeDtypeStruct((300,), jnp.uint8)])
    got, scratch = jax.jit(lambda *a: call(*a, scratch=True))(*_jargs((x, w, b)))
    assert scratch.shape == (300,) and scratch.dtype == jnp.uint8
    _close(got, T.reference("linear", x, w, b))


@pytest.mark.parametrize("op", ("sparse_aggregate", "linear", "fused_norm_residual_backward"))
def test_no_scratch_result_on_cpu(op, rng):
    """Traced for the CPU, a call has only the op's results (the scratch result is the GPU's)."""
    args, kwargs = _sample(op, rng)
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (int, float))]
    jaxpr = jax.make_jaxpr(with_traced(getattr(qj, op), _jargs(args), kwargs, arrays))(
        *[jnp.asarray(args[i]) for i in arrays])
    text = str(jaxpr)
    assert "qkernels_" + op in text
    assert "u8[" not in text and "scratch" not in text


def test_scratch_size_query_arguments():
    """The size query's argument errors (a CUDA-less machine reports the missing handlers after them)."""
    q = qkernels._C._jax_scratch_bytes
    with pytest.raises(ValueError, match="unknown op nope"):
        q("nope", 0, [], [], {}, {})
    with pytest.raises(TypeError):
        q("linear", 0, [], [], [], {})
    if "cuda" not in qj.registered()["linear"]:
        with pytest.raises(RuntimeError, match="CUDA handlers are not registered"):
            q("linear", 0, [("bfloat16", (80, 16)), ("bfloat16", (8, 16))], [("bfloat16", (80, 8))], {}, {})


# ---- graph plans ----------------------------------------------------------------------------------

def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("ix", [np.int32, np.int64])
def test_plans_give_the_same_gradient_bits(ix, rng):
    """plan= through the forward ops' vjp and the backward ops: the bits of the unplanned gradients."""
    (rp, ci, ew, nf), _ = T.sample("sparse_aggregate", rng, index_dtype=ix, n_dst=30, n_src=20, heads=2, dim=8)
    (x, ei, ea), _ = T.sample("fused_edge_features", rng, index_dtype=ix, n=20, e=70, h=8)
    ei[1, ::4] = ei[0, ::4]
    sa_plan, ef_plan = qj.sparse_aggregate_plan(rp, ci, 20), qj.fused_edge_features_plan(ei, 20)
    assert np.array_equal(np.asarray(sa_plan), T.reference("sparse_aggregate_plan", rp, ci, 20))
    assert np.array_equal(np.asarray(ef_plan), T.reference("fused_edge_features_plan", ei, 20))

    def loss(ew, nf, x, ea, sa_plan, ef_plan):
        a = qj.sparse_aggregate(rp, ci, ew, nf, plan=sa_plan)
        b = qj.fused_edge_features(x, ei, ea, plan=ef_plan)
        return (a ** 2).sum() + (b ** 2).sum()

    args = tuple(map(jnp.asarray, (ew, nf, x, ea)))
    planned = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args, sa_plan, ef_plan)
    plain = jax.grad(lambda *a: loss(*a, None, None), argnums=(0, 1, 2, 3))(*args)
    for p, q in zip(planned, plain):
        _same_bits(p, q)
    go = rng.standard_normal((30, 2, 8)).astype(np.float32)
    for p, q in zip(qj.sparse_aggregate_backward(go, rp, ci, ew, nf, plan=sa_plan),
                    qj.sparse_aggregate_backward(go, rp, ci, ew, nf)):
        _same_bits(p, q)
    g = rng.standard_normal((70, 24)).astype(np.float32)
    for p, q in zip(qj.fused_edge_features_backward(g, x, ei, plan=ef_plan), qj.fused_edge_features_backward(g, x, ei)):
        _same_bits(p, q)


def test_plan_errors_at_trace_time(rng):
    (rp, ci, ew, nf), _ = T.sample("sparse_aggregate", rng)
    plan = qj.sparse_aggregate_plan(rp, ci, nf.shape[0])
    with pytest.raises(TypeError, match="sparse_aggregate: plan must be int32"):
        qj.sparse_aggregate(rp, ci, ew, nf, plan=plan.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"sparse_aggregate_backward: plan must have shape \[N_src \+ 1 \+ 3E\]"):
        qj.sparse_aggregate_backward(np.zeros((len(rp) - 1,) + nf.shape[1:], np.float32), rp, ci, ew, nf,
                                     plan=plan[:-1])
    with pytest.raises(ValueError, match="fused_edge_features_plan: num_nodes must be an int"):
        qj.fused_edge_features_plan(np.zeros((2, 3), np.int32), -1)
