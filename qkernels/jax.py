"""qkernels for JAX: every op of the C op table as an XLA custom call (XLA FFI), eager and under
``jax.jit``, ``jax.grad`` and ``jax.vmap``.

The ops take and return jax arrays, with the top-level op names and arguments minus ``out=``.
Static arguments (``p``, ``training``, ``eps``, ``num_graphs``, ``interleaved``, ``scale``,
``is_causal``, ``backend`` and the backward ops' flags) are Python values; dropout takes an explicit
``seed`` (an int or an integer jax array: the same seed gives the same mask).  The handlers are C
(csrc/ffi/handlers.c) and run the same launchers as the DLPack path.  See docs/jax.md.

``import qkernels.jax`` imports jax; ``import qkernels`` does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _C, _dispatch
from . import _message_passing as _mp

__all__ = list(_C.OPS) + ["explain", "registered"]

_PREFIX = "qkernels_"


def _register():
    """Register every handler with XLA once: cpu always, CUDA where qkernels' CUDA kernels load and
    jax has a GPU platform."""
    try:
        gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        gpu = False
    cuda = gpu and _C.cuda_info()["available"]
    handlers = _C._jax_handlers(cuda)
    for op, (cpu_h, cuda_h, _) in handlers.items():
        jax.ffi.register_ffi_target(_PREFIX + op, cpu_h, platform="cpu")
        if cuda_h is not None:
            jax.ffi.register_ffi_target(_PREFIX + op, cuda_h, platform="CUDA")
    return {op: ("cpu",) + (("cuda",) if h[1] is not None else ()) for op, h in handlers.items()}


_PLATFORMS = _register()


def registered():
    """{op: platforms its handler is registered on} (("cpu",) or ("cpu", "cuda"))."""
    return dict(_PLATFORMS)


# ---- dispatch: backend=, use_backend, the environment, resolved at trace time ------------------------

_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16",
                np.dtype(np.float64): "float64", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
                np.dtype(np.bool_): "bool"}


def _device(x):
    """cuda or cpu: where x lives, or for a tracer where jax will run the computation by default."""
    try:
        platform = next(iter(x.devices())).platform
    except Exception:  # a tracer: no committed device; jax places it on the default device
        default = jax.config.jax_default_device
        platform = getattr(default, "platform", None) or (default if isinstance(default, str) else None) \
            or jax.default_backend()
    return "cuda" if platform in ("gpu", "cuda") else "cpu" if platform == "cpu" else platform


def _axes(op, x, args, kwargs):
    axes = {"framework": "jax", "device": _device(x), "dtype": _DTYPE_NAMES.get(np.dtype(x.dtype), str(x.dtype))}
    extra = _dispatch.CALL_AXES.get(op)
    if extra:
        axes.update(extra(args, kwargs))
    return axes


def _decide(op, x, backend, args=(), kwargs=None):
    return _dispatch.decide_axes(op, _axes(op, x, args, kwargs or {}), backend)


def explain(op, *args, backend=None, **kwargs):
    """The dispatcher's Decision for ``qkernels.jax.<op>(*args, **kwargs)`` (jax arrays or tracers)."""
    if op not in _dispatch.OPS:
        raise ValueError(f"explain: unknown op {op!r}; expected one of {', '.join(_dispatch.OPS)}")
    _, idx, arg = _dispatch.OPS[op]
    x = args[idx] if len(args) > idx else kwargs.get(arg)
    return _decide(op, x, backend, args, kwargs)


_plan_cache = {}


def _platform(op, x, backend, args=(), kwargs=None):
    """The handler platform (cpu or cuda) the dispatcher picks for this call; raises where none can
    run it under XLA (a cpu selection for device data cannot stage through the host inside jit)."""
    axes = _axes(op, x, args, kwargs or {})
    env = _dispatch._env()  # the environment's selections: a new dict after reload_env()
    key = (op, tuple(axes.items()), backend, _dispatch._ctx.get()[1])
    hit = _plan_cache.get(key)
    if hit is not None and hit[0] is env:
        return hit[1]
    d = _dispatch.decide_axes(op, axes, backend)
    if d.winner is None:
        raise _dispatch.ExplicitSelectionError(d.error)
    if not any(status == "MATCH" for _, status, _ in d.candidates):
        raise TypeError(f"{op}: no backend takes {axes['dtype']} on {axes['device']} "
                        f"({'; '.join(f'{b}: {why}' for b, _, why in d.candidates)})")
    if d.winner == "flash" or (d.winner == "cpu" and axes["device"] != "cpu"):
        raise _dispatch.ExplicitSelectionError(
            f"{op}: backend '{d.winner}' ({d.origin}) cannot run inside XLA on {axes['device']}: under jax the "
            f"op runs where its arrays live (cpu handlers for cpu arrays, cuda handlers for GPU arrays)")
    if d.winner == "cuda" and "cuda" not in _PLATFORMS[op]:
        raise _dispatch.ExplicitSelectionError(f"{op}: qkernels' CUDA handlers are not registered "
                                               f"(qkernels.info()['cuda_reason'])")
    if len(_plan_cache) > 4096:
        _plan_cache.clear()
    _plan_cache[key] = (env, d.winner)
    return d.winner


# ---- the custom calls -------------------------------------------------------------------------------

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


_scratch_cache = {}


def _cuda_ordinal():
    """The CUDA ordinal of the GPU a traced computation runs on by default."""
    default = jax.config.jax_default_device
    dev = default if getattr(default, "platform", None) in ("gpu", "cuda") else jax.local_devices(backend="gpu")[0]
    ordinal = getattr(dev, "local_hardware_id", None)
    return dev.id if ordinal is None else int(ordinal)


def _scratch_bytes(op, arrays, results, aliases=None, attrs=None):
    """(requested, result_bytes) of op's CUDA handler for these operands, results and attributes: the
    scratch its launcher asks for, found by a dry run of the handler on the default GPU (the sizes depend
    on the device's SM count and cuBLASLt's plans), and the uint8 result that holds it (0: none)."""
    def spec(a):
        return np.dtype(a.dtype).name, tuple(int(d) for d in a.shape)
    attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in (attrs or {}).items()}
    key = (op, _cuda_ordinal(), tuple(map(spec, arrays)), tuple(map(spec, results)),
           tuple(sorted(attrs.items())), tuple(sorted((aliases or {}).items())))
    hit = _scratch_cache.get(key)
    if hit is None:
        if len(_scratch_cache) > 4096:
            _scratch_cache.clear()
        hit = _scratch_cache[key] = _C._jax_scratch_bytes(op, key[1], key[2], key[3], attrs, dict(aliases or {}))
    return hit


def _ffi(op, results, *arrays, aliases=None, **attrs):
    """One custom call of handler `op`; a result list gives a tuple.  Unbatchable calls vmap
    sequentially (one call per element): ops with a folding rule never get here batched.

    On the GPU a call whose launcher takes scratch gets one more result, uint8 [bytes] (attribute
    scratch), that the handler carves the scratch from and that is dropped here: a buffer of XLA's
    program, so every handler is command-buffer compatible (a CUDA-graph replay finds it still
    allocated).  Its size comes from a dry run of the handler at trace time (_scratch_bytes).  The
    platform is the one the dispatcher resolved for these arrays (_device: the default device under
    jit); the cpu handler ignores such a result."""
    single = not isinstance(results, (list, tuple))
    res = [results] if single else list(results)
    nbytes = 0
    if "cuda" in _PLATFORMS.get(op, ()) and _device(arrays[0]) == "cuda":
        nbytes = _scratch_bytes(op, arrays, res, aliases, attrs)[1]
    if not nbytes:
        call = jax.ffi.ffi_call(_PREFIX + op, results, vmap_method="sequential", input_output_aliases=aliases)
        return call(*arrays, **attrs)
    call = jax.ffi.ffi_call(_PREFIX + op, res + [_sds((nbytes,), jnp.uint8)], vmap_method="sequential",
                            input_output_aliases=aliases)
    outs = list(call(*arrays, scratch=True, **attrs))[:-1]
    return outs[0] if single else type(results)(outs)


def _err(kind, op, msg):
    return kind(f"{op}: {msg}")


def _check(cond, kind, op, msg):
    if not cond:
        raise _err(kind, op, msg)


_FLOATS = ("float32", "float16", "bfloat16")


def _dt(a):
    return _DTYPE_NAMES.get(np.dtype(a.dtype), str(a.dtype))


def _need_float(op, name, a, allowed=_FLOATS):
    _check(_dt(a) in allowed, TypeError, op, f"{name} must be {', '.join(allowed)}, got {_dt(a)}")


def _need_index(op, name, a):
    _check(_dt(a) in ("int32", "int64"), TypeError, op, f"{name} must be int32 or int64, got {_dt(a)}")


def _need_rank(op, name, a, ndim, layout):
    _check(a.ndim == ndim, ValueError, op, f"{name} must have {ndim} dimensions {layout}, got shape {tuple(a.shape)}")


def _need_dim(op, name, a, dim, size, layout):
    _check(a.shape[dim] == size, ValueError, op, f"{name} must have shape {layout}, got {tuple(a.shape)}")


def _same_dtype(op, name, a, owner, ref):
    _check(a.dtype == ref.dtype, TypeError, op, f"{name} must have {owner} dtype {_dt(ref)}, got {_dt(a)}")


def _arr(a):
    return a if isinstance(a, jax.Array) else jnp.asarray(a)


def _fold(raw, rule):
    """raw(*arrays) with a vmap rule: rule(axis_size, in_batched, *arrays) -> out with the batch
    leading, or None to fall back to one call per batch element."""
    f = custom_vmap(raw)

    @f.def_vmap
    def _(axis_size, in_batched, *arrays):
        out = rule(axis_size, in_batched, *arrays)
        if out is None:
            arrays = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(arrays, in_batched)]
            out = jax.lax.map(lambda xs: raw(*xs), arrays)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return f


# ---- sparse_aggregate ---------------------------------------------------------------------------

def _check_sa(op, row_ptr, col_idx, edge_weight, node_feat):
    _need_rank(op, "row_ptr", row_ptr, 1, "[N_dst + 1]")
    _need_rank(op, "col_idx", col_idx, 1, "[E]")
    _need_rank(op, "edge_weight", edge_weight, 2, "[E, H]")
    _need_rank(op, "node_feat", node_feat, 3, "[N_src, H, D]")
    _need_index(op, "row_ptr", row_ptr)
    _need_index(op, "col_idx", col_idx)
    _check(col_idx.dtype == row_ptr.dtype, TypeError, op, f"col_idx must have the same dtype as row_ptr "
           f"({_dt(row_ptr)}), got {_dt(col_idx)}")
    _need_float(op, "node_feat", node_feat)
    _same_dtype(op, "edge_weight", edge_weight, "node_feat's", node_feat)
    _check(row_ptr.shape[0] >= 1, ValueError, op, "row_ptr must have shape [N_dst + 1] with at least one element")
    layout = f"[E, H] = [{col_idx.shape[0]}, {node_feat.shape[1]}]"
    _need_dim(op, "edge_weight", edge_weight, 0, col_idx.shape[0], layout)
    _need_dim(op, "edge_weight", edge_weight, 1, node_feat.shape[1], layout)


def _sa_raw(row_ptr, col_idx, ew, nf):
    out = _sds((row_ptr.shape[0] - 1,) + nf.shape[1:], nf.dtype)
    return _ffi("sparse_aggregate", out, row_ptr, col_idx, ew, nf)


def _sa_heads(axis_size, in_batched, *arrays):
    """vmap over edge_weight/node_feat: the batch folds into the heads ([E, V*H], [N, V*H, D])."""
    row_ptr, col_idx, ew, nf = arrays
    if in_batched[0] or in_batched[1]:
        return None
    ew = ew if in_batched[2] else jnp.broadcast_to(ew, (axis_size,) + ew.shape)
    nf = nf if in_batched[3] else jnp.broadcast_to(nf, (axis_size,) + nf.shape)
    V, E, H = ew.shape
    out = _sa_raw(row_ptr, col_idx, jnp.moveaxis(ew, 0, 1).reshape(E, V * H),
                  jnp.moveaxis(nf, 0, 1).reshape(nf.shape[1], V * H, nf.shape[3]))
    return jnp.moveaxis(out.reshape(out.shape[0], V, H, out.shape[2]), 1, 0)


_sa_call = _fold(_sa_raw, _sa_heads)


def _sa_bwd_raw(g, row_ptr, col_idx, ew, nf, *plan, want_ew=True, want_nf=True, deterministic=True):
    outs = [_sds(ew.shape if want_ew else (0,), ew.dtype), _sds(nf.shape if want_nf else (0,), nf.dtype)]
    return tuple(_ffi("sparse_aggregate_backward", outs, g, row_ptr, col_idx, ew, nf, *plan,
                      edge_weight_grad=bool(want_ew), node_feat_grad=bool(want_nf), deterministic=bool(deterministic)))


def _check_plan(op, plan, length, layout):
    _check(_dt(plan) == "int32", TypeError, op, f"plan must be int32, got {_dt(plan)}")
    _check(plan.ndim == 1 and plan.shape[0] == length, ValueError, op,
           f"plan must have shape [{layout}] = [{length}], got {tuple(plan.shape)}")


# plan: the transposed graph (sparse_aggregate_plan) or nothing; the forward ignores it
@jax.custom_vjp
def _sa_diff(row_ptr, col_idx, ew, nf, *plan):
    return _sa_call(row_ptr, col_idx, ew, nf)


def _sa_fwd(row_ptr, col_idx, ew, nf, *plan):
    return _sa_call(row_ptr, col_idx, ew, nf), (row_ptr, col_idx, ew, nf, *plan)


def _sa_bwd(res, g):
    gw, gn = _sa_bwd_raw(g, *res)
    return (None, None, gw, gn) + (None,) * (len(res) - 4)


_sa_diff.defvjp(_sa_fwd, _sa_bwd)


@functools.partial(jax.jit, static_argnames=("platform",))
def _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *plan, platform):
    return _sa_diff(row_ptr, col_idx, edge_weight, node_feat, *plan)


def sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, plan=None, backend=None):
    """Multi-head CSR SpMM: out[i,h,:] = sum over e in [row_ptr[i], row_ptr[i+1]) of edge_weight[e,h] *
    node_feat[col_idx[e],h,:] -> [N_dst, H, D].  Differentiable in edge_weight and node_feat; plan
    (sparse_aggregate_plan of the graph) goes to the backward."""
    op = "sparse_aggregate"
    row_ptr, col_idx, edge_weight, node_feat = map(_arr, (row_ptr, col_idx, edge_weight, node_feat))
    _check_sa(op, row_ptr, col_idx, edge_weight, node_feat)
    plan = () if plan is None else (_arr(plan),)
    if plan:
        _check_plan(op, plan[0], node_feat.shape[0] + 1 + 3 * col_idx.shape[0], "N_src + 1 + 3E")
    return _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *plan,
                             platform=_platform(op, node_feat, backend))


@functools.partial(jax.jit, static_argnames=("want_ew", "want_nf", "deterministic", "platform"))
def _sparse_aggregate_backward(g, row_ptr, col_idx, ew, nf, *plan, want_ew, want_nf, deterministic, platform):
    return _sa_bwd_raw(g, row_ptr, col_idx, ew, nf, *plan, want_ew=want_ew, want_nf=want_nf,
                       deterministic=deterministic)


def sparse_aggregate_backward(grad_out, row_ptr, col_idx, edge_weight, node_feat, *, edge_weight_grad=True,
                              node_feat_grad=True, deterministic=True, plan=None, backend=None):
    """(grad_edge_weight or None, grad_node_feat or None) of sparse_aggregate for grad_out [N_dst, H, D]."""
    op = "sparse_aggregate_backward"
    args = tuple(map(_arr, (grad_out, row_ptr, col_idx, edge_weight, node_feat)))
    if plan is not None:
        plan = _arr(plan)
        _check_plan(op, plan, args[4].shape[0] + 1 + 3 * args[2].shape[0], "N_src + 1 + 3E")
        args = args + (plan,)
    _check_sa(op, *args[1:5])
    g, nf = args[0], args[4]
    _need_rank(op, "grad_out", g, 3, "[N_dst, H, D]")
    _same_dtype(op, "grad_out", g, "node_feat's", nf)
    want = (args[1].shape[0] - 1,) + tuple(nf.shape[1:])
    _check(tuple(g.shape) == want, ValueError, op, f"grad_out must have shape [N_dst, H, D] = {list(want)}, "
           f"got {tuple(g.shape)}")
    gw, gn = _sparse_aggregate_backward(*args, want_ew=bool(edge_weight_grad), want_nf=bool(node_feat_grad),
                                        deterministic=bool(deterministic), platform=_platform(op, g, backend))
    return (gw if edge_weight_grad else None), (gn if node_feat_grad else None)


# ---- fused_edge_features ------------------------------------------------------------------------

def _check_fe(op, x, edge_index, edge_attr=None):
    _need_rank(op, "x", x, 2, "[N, H]")
    _need_rank(op, "edge_index", edge_index, 2, "[2, E]")
    _need_index(op, "edge_index", edge_index)
    _need_float(op, "x", x)
    _need_dim(op, "edge_index", edge_index, 0, 2, "[2, E]")
    if edge_attr is not None:
        layout = f"[E, H] = [{edge_index.shape[1]}, {x.shape[1]}]"
        _need_rank(op, "edge_attr", edge_attr, 2, layout)
        _same_dtype(op, "edge_attr", edge_attr, "x's", x)
        _need_dim(op, "edge_attr", edge_attr, 0, edge_index.shape[1], layout)
        _need_dim(op, "edge_attr", edge_attr, 1, x.shape[1], layout)


def _fe_raw(x, ei, *attr):
    out = _sds((ei.shape[1], (2 + len(attr)) * x.shape[1]), x.dtype)
    return _ffi("fused_edge_features", out, x, ei, *attr)


def _fe_fold(axis_size, in_batched, x, ei, *attr):
    """vmap over x (and edge_attr): the batch folds into the channels ([N, V*H])."""
    if in_batched[1]:
        return None
    V, (N, H) = axis_size, x.shape[-2:]
    x = x if in_batched[0] else jnp.broadcast_to(x, (V, N, H))
    folded = [jnp.moveaxis(x, 0, 1).reshape(N, V * H)]
    if attr:
        a = attr[0] if in_batched[2] else jnp.broadcast_to(attr[0], (V,) + attr[0].shape)
        folded.append(jnp.moveaxis(a, 0, 1).reshape(a.shape[1], V * H))
    out = _fe_raw(folded[0], ei, *folded[1:])  # [E, parts * V * H]
    E, parts = out.shape[0], 2 + len(attr)
    return jnp.transpose(out.reshape(E, parts, V, H), (2, 0, 1, 3)).reshape(V, E, parts * H)


_fe_call = _fold(_fe_raw, _fe_fold)


def _fe_bwd_raw(g, x, ei, plan=None):
    H, E = x.shape[1], ei.shape[1]
    outs = [_sds(x.shape, x.dtype), _sds((E, H) if g.shape[1] == 3 * H and H > 0 else (0,), x.dtype)]
    return tuple(_ffi("fused_edge_features_backward", outs, g, x, ei, *(() if plan is None else (plan,))))


# plan: fused_edge_features_plan of the graph, or int32 [0] for none (the forward ignores it)
@jax.custom_vjp
def _fe_diff(x, ei, plan, *attr):
    return _fe_call(x, ei, *attr)


def _fe_fwd(x, ei, plan, *attr):
    return _fe_call(x, ei, *attr), (x, ei, plan)


def _fe_bwd(res, g):
    x, ei, plan = res
    gx, ga = _fe_bwd_raw(g, x, ei, plan if plan.shape[0] else None)
    return (gx, None, None) + ((ga,) if g.shape[1] == 3 * x.shape[1] else ())


_fe_diff.defvjp(_fe_fwd, _fe_bwd)


@functools.partial(jax.jit, static_argnames=("platform",))
def _fused_edge_features(x, ei, plan, *attr, platform):
    return _fe_diff(x, ei, plan, *attr)


def fused_edge_features(x, edge_index, edge_attr=None, *, plan=None, backend=None):
    """[x[src] + x[dst], |x[src] - x[dst]|, edge_attr] -> [E, 3H] (or [E, 2H] without edge_attr).
    Differentiable in x and edge_attr; plan (fused_edge_features_plan of the graph) goes to the backward."""
    op = "fused_edge_features"
    x, edge_index = _arr(x), _arr(edge_index)
    attr = () if edge_attr is None else (_arr(edge_attr),)
    _check_fe(op, x, edge_index, *attr)
    if plan is None:
        plan = jnp.zeros((0,), jnp.int32)
    else:
        plan = _arr(plan)
        _check_plan(op, plan, x.shape[0] + 1 + 4 * edge_index.shape[1], "N + 1 + 4E")
    return _fused_edge_features(x, edge_index, plan, *attr, platform=_platform(op, x, backend))


@functools.partial(jax.jit, static_argnames=("platform",))
def _fused_edge_features_backward(g, x, ei, *plan, platform):
    return _fe_bwd_raw(g, x, ei, *plan)


def fused_edge_features_backward(grad_out, x, edge_index, *, plan=None, backend=None):
    """(grad_x [N, H], grad_edge_attr [E, H] or None) for grad_out [E, 3H] (with edge_attr) or [E, 2H]."""
    op = "fused_edge_features_backward"
    g, x, edge_index = map(_arr, (grad_out, x, edge_index))
    _check_fe(op, x, edge_index)
    _need_rank(op, "grad_out", g, 2, "[E, 2H or 3H]")
    _same_dtype(op, "grad_out", g, "x's", x)
    H = x.shape[1]
    _check(g.shape[0] == edge_index.shape[1] and g.shape[1] in (2 * H, 3 * H), ValueError, op,
           f"grad_out must have shape [E, 2H] or [E, 3H] with E = {edge_index.shape[1]}, H = {H}, got {tuple(g.shape)}")
    plan = () if plan is None else (_arr(plan),)
    if plan:
        _check_plan(op, plan[0], x.shape[0] + 1 + 4 * edge_index.shape[1], "N + 1 + 4E")
    gx, ga = _fused_edge_features_backward(g, x, edge_index, *plan, platform=_platform(op, g, backend))
    return gx, (ga if g.shape[1] == 3 * H else None)


# ---- graph plans ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("num_src", "platform"))
def _sparse_aggregate_plan(row_ptr, col_idx, num_src, platform):
    return _ffi("sparse_aggregate_plan", _sds((num_src + 1 + 3 * col_idx.shape[0],), jnp.int32), row_ptr, col_idx)


def sparse_aggregate_plan(row_ptr, col_idx, num_src, *, backend=None):
    """The transposed graph sparse_aggregate_backward groups by source, int32 [N_src + 1 + 3E] (see
    qkernels.sparse_aggregate_plan); pass it as plan= to sparse_aggregate or its backward."""
    op = "sparse_aggregate_plan"
    row_ptr, col_idx = _arr(row_ptr), _arr(col_idx)
    _need_rank(op, "row_ptr", row_ptr, 1, "[N_dst + 1]")
    _need_rank(op, "col_idx", col_idx, 1, "[E]")
    _need_index(op, "row_ptr", row_ptr)
    _check(col_idx.dtype == row_ptr.dtype, TypeError, op, f"col_idx must have the same dtype as row_ptr "
           f"({_dt(row_ptr)}), got {_dt(col_idx)}")
    _check(row_ptr.shape[0] >= 1, ValueError, op, "row_ptr must have shape [N_dst + 1] with at least one element")
    _check(isinstance(num_src, (int, np.integer)) and 0 <= num_src < 2**31 - 1, ValueError, op,
           f"num_src must be an int between 0 and 2147483646, got {num_src!r}")
    _check(col_idx.shape[0] < 2**31, ValueError, op, f"the plan holds int32 edge ids: E = {col_idx.shape[0]} "
           "must be below 2^31")
    return _sparse_aggregate_plan(row_ptr, col_idx, int(num_src), platform=_platform(op, row_ptr, backend))


@functools.partial(jax.jit, static_argnames=("num_nodes", "platform"))
def _fused_edge_features_plan(ei, num_nodes, platform):
    return _ffi("fused_edge_features_plan", _sds((num_nodes + 1 + 4 * ei.shape[1],), jnp.int32), ei)


def fused_edge_features_plan(edge_index, num_nodes, *, backend=None):
    """The incidences fused_edge_features_backward groups by node, int32 [N + 1 + 4E] (see
    qkernels.fused_edge_features_plan); pass it as plan= to fused_edge_features or its backward."""
    op = "fused_edge_features_plan"
    edge_index = _arr(edge_index)
    _need_rank(op, "edge_index", edge_index, 2, "[2, E]")
    _need_index(op, "edge_index", edge_index)
    _need_dim(op, "edge_index", edge_index, 0, 2, "[2, E]")
    _check(isinstance(num_nodes, (int, np.integer)) and 0 <= num_nodes < 2**31 - 1, ValueError, op,
           f"num_nodes must be an int between 0 and 2147483646, got {num_nodes!r}")
    _check(2 * edge_index.shape[1] < 2**31, ValueError, op, f"the plan holds int32 incidence ids: 2E = "
           f"{2 * edge_index.shape[1]} must be below 2^31")
    return _fused_edge_features_plan(edge_index, int(num_nodes), platform=_platform(op, edge_index, backend))


# ---- fused_norm_residual ------------------------------------------------------------------------

def _seed_words(op, seed, needed):
    """seed as uint32 [2] (low word first: the bytes of the int64 the kernels read)."""
    if seed is None:
        _check(not needed, ValueError, op, "training with p > 0 needs an explicit seed in JAX (an int or an integer "
               "array; the same seed gives the same mask)")
        return jnp.zeros((2,), jnp.uint32)
    if isinstance(seed, (int, np.integer)):
        s = int(seed) & (2**64 - 1)
        return jnp.asarray(np.array([s & 0xFFFFFFFF, s >> 32], np.uint32))
    s = jnp.asarray(seed)
    _check(jnp.issubdtype(s.dtype, jnp.integer) and s.size == 1, TypeError, op,
           f"seed must be an int or a one-element integer array, got {s.dtype}{list(s.shape)}")
    s = s.reshape(())
    lo = s.astype(jnp.uint32)
    if s.dtype.itemsize == 8:
        hi = (s >> 32).astype(jnp.uint32)
    elif jnp.issubdtype(s.dtype, jnp.signedinteger):  # sign-extended to the int64 the kernels read
        hi = jnp.where(s < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    else:
        hi = jnp.uint32(0)
    return jnp.stack([lo, hi])


def _check_nr(op, x, gamma, others=(), batch=None, num_graphs=None):
    _need_rank(op, "x", x, 2, "[R, H]")
    _need_rank(op, "gamma", gamma, 1, "[H]")
    _need_float(op, "x", x)
    R, H = x.shape
    for name, a in others:
        _need_rank(op, name, a, 2, "[R, H]")
        _same_dtype(op, name, a, "x's", x)
        _need_dim(op, name, a, 0, R, f"[R, H] = [{R}, {H}]")
        _need_dim(op, name, a, 1, H, f"[R, H] = [{R}, {H}]")
    _same_dtype(op, "gamma", gamma, "x's", x)
    _need_dim(op, "gamma", gamma, 0, H, f"[H] = [{H}]")
    if batch is None:
        _check(num_graphs is None, ValueError, op, "num_graphs is given without batch")
    else:
        _check(num_graphs is not None, ValueError, op, "batch needs num_graphs (the number of graphs, an int >= 1)")
        _check(isinstance(num_graphs, (int, np.integer)) and not isinstance(num_graphs, bool), TypeError, op,
               f"num_graphs must be an int, got {type(num_graphs).__name__}")
        _check(num_graphs >= 1, ValueError, op, f"num_graphs must be >= 1, got {num_graphs}")
        _need_rank(op, "batch", batch, 1, "[R]")
        _need_index(op, "batch", batch)
        _need_dim(op, "batch", batch, 0, R, f"[R] = [{R}]")


def _nr_attrs(p, training, eps, num_graphs):
    return dict(p=np.float64(p), training=bool(training), eps=np.float32(eps), num_graphs=np.int64(num_graphs or 0))


def _nr_raw(x, residual, gamma, beta, seed, *batch, p, training, eps, num_graphs):
    return _ffi("fused_norm_residual", _sds(x.shape, x.dtype), x, residual, gamma, beta, seed, *batch,
                **_nr_attrs(p, training, eps, num_graphs))


def _nr_bwd_raw(g, x, gamma, seed, *batch, p, training, eps, num_graphs):
    outs = [_sds(x.shape, x.dtype), _sds(gamma.shape, gamma.dtype), _sds(gamma.shape, gamma.dtype)]
    return tuple(_ffi("fused_norm_residual_backward", outs, g, x, gamma, seed, *batch,
                      **_nr_attrs(p, training, eps, num_graphs)))


def _nr_call(static):
    raw = functools.partial(_nr_raw, **static)

    def rows(axis_size, in_batched, x, residual, gamma, beta, seed, *batch):
        """Row mode without dropout, gamma and beta unbatched: the batch folds into the rows."""
        if batch or (static["training"] and static["p"] > 0) or in_batched[2] or in_batched[3] or in_batched[4]:
            return None
        V = axis_size
        x = x if in_batched[0] else jnp.broadcast_to(x, (V,) + x.shape)
        residual = residual if in_batched[1] else jnp.broadcast_to(residual, (V,) + residual.shape)
        out = raw(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), gamma, beta, seed)
        return out.reshape(x.shape)

    return _fold(raw, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nr_diff(static, x, residual, gamma, beta, seed, *batch):
    return _nr_call(dict(static))(x, residual, gamma, beta, seed, *batch)


def _nr_fwd(static, x, residual, gamma, beta, seed, *batch):
    return _nr_call(dict(static))(x, residual, gamma, beta, seed, *batch), (x, gamma, seed, batch)


def _nr_bwd(static, res, g):
    x, gamma, seed, batch = res
    gx, gg, gb = _nr_bwd_raw(g, x, gamma, seed, *batch, **dict(static))
    return (gx, g, gg, gb, None) + (None,) * len(batch)


_nr_diff.defvjp(_nr_fwd, _nr_bwd)


@functools.partial(jax.jit, static_argnames=("static", "platform"))
def _fused_norm_residual(x, residual, gamma, beta, seed, *batch, static, platform):
    return _nr_diff(static, x, residual, gamma, beta, seed, *batch)


def _nr_static(p, training, eps, num_graphs):
    return (("p", float(p)), ("training", bool(training)), ("eps", float(eps)), ("num_graphs", num_graphs))


def fused_norm_residual(x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None,
                        num_graphs=None, backend=None):
    """LayerNorm(x) * gamma + beta (per row, or per graph with batch/num_graphs), dropout p when
    training (mask from seed: explicit in JAX), + residual.  Differentiable in x, residual, gamma, beta."""
    op = "fused_norm_residual"
    x, residual, gamma, beta = map(_arr, (x, residual, gamma, beta))
    batch = None if batch is None else _arr(batch)
    _check_nr(op, x, gamma, (("residual", residual),), batch, num_graphs)
    _check(beta.ndim == 1 and beta.shape[0] == x.shape[1] and beta.dtype == x.dtype, ValueError, op,
           f"beta must be [H] = [{x.shape[1]}] of x's dtype, got {_dt(beta)}{list(beta.shape)}")
    _check(0.0 <= p <= 1.0, ValueError, op, f"p must be in [0, 1], got {p}")
    s = _seed_words(op, seed, training and p > 0)
    return _fused_norm_residual(x, residual, gamma, beta, s, *(() if batch is None else (batch,)),
                                static=_nr_static(p, training, eps, num_graphs), platform=_platform(op, x, backend))


@functools.partial(jax.jit, static_argnames=("static", "platform"))
def _fused_norm_residual_backward(g, x, gamma, seed, *batch, static, platform):
    return _nr_bwd_raw(g, x, gamma, seed, *batch, **dict(static))


def fused_norm_residual_backward(grad_out, x, gamma, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None,
                                 num_graphs=None, backend=None):
    """(grad_x, grad_gamma, grad_beta) of fused_norm_residual (the residual's gradient is grad_out)."""
    op = "fused_norm_residual_backward"
    g, x, gamma = map(_arr, (grad_out, x, gamma))
    batch = None if batch is None else _arr(batch)
    _check_nr(op, x, gamma, (("grad_out", g),), batch, num_graphs)
    s = _seed_words(op, seed, training and p > 0)
    return _fused_norm_residual_backward(g, x, gamma, s, *(() if batch is None else (batch,)),
                                         static=_nr_static(p, training, eps, num_graphs),
                                         platform=_platform(op, g, backend))


# ---- graph_norm_bce -----------------------------------------------------------------------------

def _check_gb(op, logits, target, edge_graph, num_graphs, pos_weight):
    _need_rank(op, "logits", logits, 1, "[E]")
    _need_rank(op, "target", target, 1, "[E]")
    _need_rank(op, "edge_graph", edge_graph, 1, "[E]")
    _need_index(op, "edge_graph", edge_graph)
    _need_float(op, "logits", logits)
    _same_dtype(op, "target", target, "logits'", logits)
    E = logits.shape[0]
    _need_dim(op, "target", target, 0, E, f"[E] = [{E}]")
    _need_dim(op, "edge_graph", edge_graph, 0, E, f"[E] = [{E}]")
    _check(isinstance(num_graphs, (int, np.integer)) and not isinstance(num_graphs, bool), TypeError, op,
           f"num_graphs must be an int, got {type(num_graphs).__name__}")
    _check(num_graphs >= 1, ValueError, op, f"num_graphs must be >= 1, got {num_graphs}")
    if pos_weight is not None and not isinstance(pos_weight, (int, float)):
        _check(pos_weight.size in (1, E) and pos_weight.ndim <= 1, ValueError, op,
               f"pos_weight must be a float, one value or [E] = [{E}], got shape {tuple(pos_weight.shape)}")
        _check(pos_weight.dtype in (np.dtype(np.float32), logits.dtype), TypeError, op,
               f"pos_weight must be float32 or logits' dtype, got {_dt(pos_weight)}")


def _gb_attrs(num_graphs, pos_weight):
    scalar = isinstance(pos_weight, (int, float))
    return dict(num_graphs=np.int64(num_graphs), pos_weight=np.float32(pos_weight if scalar else 1.0),
                has_pos_weight=pos_weight is not None)


def _gb_raw(logits, target, edge_graph, *pw, num_graphs, pos_weight):
    return _ffi("graph_norm_bce", _sds((), jnp.float32), logits, target, edge_graph, *pw,
                **_gb_attrs(num_graphs, pos_weight))


def _gb_bwd_raw(g, logits, target, edge_graph, *pw, num_graphs, pos_weight):
    return _ffi("graph_norm_bce_backward", _sds(logits.shape, logits.dtype), g.astype(jnp.float32).reshape(()),
                logits, target, edge_graph, *pw, **_gb_attrs(num_graphs, pos_weight))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gb_diff(static, logits, target, edge_graph, *pw):
    return _gb_raw(logits, target, edge_graph, *pw, **dict(static))


def _gb_fwd(static, logits, target, edge_graph, *pw):
    return _gb_raw(logits, target, edge_graph, *pw, **dict(static)), (logits, target, edge_graph, pw)


def _gb_bwd(static, res, g):
    logits, target, edge_graph, pw = res
    return (_gb_bwd_raw(g, logits, target, edge_graph, *pw, **dict(static)), None, None) + (None,) * len(pw)


_gb_diff.defvjp(_gb_fwd, _gb_bwd)


@functools.partial(jax.jit, static_argnames=("static", "platform"))
def _graph_norm_bce(logits, target, edge_graph, *pw, static, platform):
    return _gb_diff(static, logits, target, edge_graph, *pw)


def _gb_split(pos_weight):
    if pos_weight is None or isinstance(pos_weight, (int, float)):
        return None if pos_weight is None else float(pos_weight), ()
    pw = _arr(pos_weight)
    return "tensor", (pw.reshape(-1),)


def graph_norm_bce(logits, target, edge_graph, num_graphs, *, pos_weight=None, backend=None):
    """The mean over graphs of each graph's mean BCE-with-logits over its edges: a float32 scalar.
    Differentiable in logits."""
    op = "graph_norm_bce"
    logits, target, edge_graph = map(_arr, (logits, target, edge_graph))
    pw_static, pw = _gb_split(pos_weight)
    _check_gb(op, logits, target, edge_graph, num_graphs, pw[0] if pw else pw_static)
    static = (("num_graphs", int(num_graphs)), ("pos_weight", pw_static))
    return _graph_norm_bce(logits, target, edge_graph, *pw, static=static, platform=_platform(op, logits, backend))


@functools.partial(jax.jit, static_argnames=("static", "platform"))
def _graph_norm_bce_backward(g, logits, target, edge_graph, *pw, static, platform):
    return _gb_bwd_raw(g, logits, target, edge_graph, *pw, **dict(static))


def graph_norm_bce_backward(grad, logits, target, edge_graph, num_graphs, *, pos_weight=None, backend=None):
    """d graph_norm_bce / d logits times grad (one float32 element)."""
    op = "graph_norm_bce_backward"
    grad, logits, target, edge_graph = map(_arr, (grad, logits, target, edge_graph))
    pw_static, pw = _gb_split(pos_weight)
    _check_gb(op, logits, target, edge_graph, num_graphs, pw[0] if pw else pw_static)
    _check(grad.size == 1 and grad.ndim <= 1, ValueError, op, f"grad must hold one element, got shape {grad.shape}")
    _check(grad.dtype == np.float32, TypeError, op, f"grad must be float32 (the loss's dtype), got {_dt(grad)}")
    static = (("num_graphs", int(num_graphs)), ("pos_weight", pw_static))
    return _graph_norm_bce_backward(grad, logits, target, edge_graph, *pw, static=static,
                                    platform=_platform(op, grad, backend))


# ---- rotary_emb ---------------------------------------------------------------------------------

_DENSE = ("float32", "float16", "bfloat16")


def _check_ro(op, name, x, f):
    _check(x.ndim in (3, 4), ValueError, op, f"{name} must have 3 or 4 dimensions [T, H, D] or [B, S, H, D], "
           f"got shape {tuple(x.shape)}")
    _need_float(op, name, x, _DENSE)
    _check(f.dtype == np.float32, TypeError, op, f"freqs_cis must be float32, got {_dt(f)}")
    D = x.shape[-1]
    _check(D % 2 == 0, ValueError, op, f"{name}'s last dimension D = {D} must be even (pairs are rotated)")
    want = (tuple(x.shape[:2]) if x.ndim == 4 else (x.shape[0],)) + (D // 2, 2)
    _check(tuple(f.shape) == want, ValueError, op, f"freqs_cis must have shape {list(want)}, got {tuple(f.shape)}")


def _ro_raw(x, f, interleaved, inverse):
    """x, f 4-D ([B, S, H, D], [B or 1, S, D/2, 2])."""
    return _ffi("rotary_emb_backward" if inverse else "rotary_emb", _sds(x.shape, x.dtype), x, f,
                interleaved=bool(interleaved))


def _ro_call(interleaved, inverse):
    raw = functools.partial(_ro_raw, interleaved=interleaved, inverse=inverse)

    def heads(axis_size, in_batched, x, f):
        """vmap over x alone: the batch folds into the heads ([B, S, V*H, D])."""
        if in_batched[1]:
            return None
        V, (B, S, H, D) = axis_size, x.shape[1:]
        out = raw(jnp.moveaxis(x, 0, 3).reshape(B, S, V * H, D), f)
        return jnp.moveaxis(out.reshape(B, S, H, V, D), 3, 0)

    return _fold(raw, heads)


def _ro4(x, f):
    return (x[None], f[None]) if x.ndim == 3 else (x, f)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ro_diff(interleaved, x, f):
    x4, f4 = _ro4(x, f)
    return _ro_call(interleaved, False)(x4, f4).reshape(x.shape)


def _ro_fwd(interleaved, x, f):
    return _ro_diff(interleaved, x, f), f


def _ro_bwd(interleaved, f, g):
    g4, f4 = _ro4(g, f)
    return _ro_call(interleaved, True)(g4, f4).reshape(g.shape), None


_ro_diff.defvjp(_ro_fwd, _ro_bwd)


@functools.partial(jax.jit, static_argnames=("interleaved", "platform"))
def _rotary_emb(x, f, interleaved, platform):
    return _ro_diff(interleaved, x, f)


def rotary_emb(x, freqs_cis, *, interleaved=True, backend=None):
    """Rotary position embedding of x [T, H, D] or [B, S, H, D] by freqs_cis float32 [T, D/2, 2] or
    [B, S, D/2, 2] ((cos, sin) per pair).  Differentiable in x."""
    op = "rotary_emb"
    x, f = _arr(x), _arr(freqs_cis)
    _check_ro(op, "x", x, f)
    return _rotary_emb(x, f, interleaved=bool(interleaved), platform=_platform(op, x, backend))


@functools.partial(jax.jit, static_argnames=("interleaved", "platform"))
def _rotary_emb_backward(g, f, interleaved, platform):
    g4, f4 = _ro4(g, f)
    return _ro_call(interleaved, True)(g4, f4).reshape(g.shape)


def rotary_emb_backward(grad_out, freqs_cis, *, interleaved=True, backend=None):
    """rotary_emb's gradient with respect to x: grad_out rotated by the negated angles."""
    op = "rotary_emb_backward"
    g, f = _arr(grad_out), _arr(freqs_cis)
    _check_ro(op, "grad_out", g, f)
    return _rotary_emb_backward(g, f, interleaved=bool(interleaved), platform=_platform(op, g, backend))


# ---- linear and swiglu --------------------------------------------------------------------------

def _check_ln(op, x, weights, bias=None, grad_out=None):
    _check(x.ndim >= 1, ValueError, op, "x must have at least one dimension [*, K]")
    _need_float(op, "x", x, _DENSE)
    K = x.shape[-1]
    N = None
    for name, w in weights:
        _need_rank(op, name, w, 2, "[N, K]")
        _same_dtype(op, name, w, "x's", x)
        N = w.shape[0] if N is None else N
        _check(tuple(w.shape) == (N, K), ValueError, op, f"{name} must have shape [N, K] = [{N}, {K}], got "
               f"{tuple(w.shape)}")
    if bias is not None:
        _check(bias.ndim == 1 and bias.shape[0] == N, ValueError, op, f"bias must have shape [N] = [{N}], got "
               f"{tuple(bias.shape)}")
        _same_dtype(op, "bias", bias, "x's", x)
    if grad_out is not None:
        want = tuple(x.shape[:-1]) + (N,)
        _check(tuple(grad_out.shape) == want, ValueError, op, f"grad_out must have shape {list(want)} (x's leading "
               f"dimensions, then N = {N}), got {tuple(grad_out.shape)}")
        _same_dtype(op, "grad_out", grad_out, "x's", x)


def _ln_raw(x, w, *third, swiglu):
    return _ffi("swiglu" if swiglu else "linear", _sds((x.shape[0], w.shape[0]), x.dtype), x, w, *third)


def _ln_call(swiglu):
    raw = functools.partial(_ln_raw, swiglu=swiglu)

    def rows(axis_size, in_batched, x, *rest):
        """vmap over x alone: the batch folds into the rows."""
        if any(in_batched[1:]):
            return None
        out = raw(x.reshape(-1, x.shape[-1]), *rest)
        return out.reshape(x.shape[:-1] + out.shape[-1:])

    return _fold(raw, rows)


def _lb_raw(g, x, w, *gate, want_x=True, want_w=True, want_b=False):
    swiglu = bool(gate)
    N, K = w.shape
    outs = [_sds(x.shape if want_x else (0,), x.dtype), _sds((N, K) if want_w else (0,), x.dtype),
            _sds((N, K) if swiglu and want_w else (N,) if want_b else (0,), x.dtype)]
    return tuple(_ffi("swiglu_backward" if swiglu else "linear_backward", outs, g, x, w, *gate, x_grad=bool(want_x),
                      weight_grad=bool(want_w), bias_grad=bool(want_b)))


def _rows2(a):
    return a.reshape(-1, a.shape[-1])


@jax.custom_vjp
def _ln_diff(x, w, *bias):
    return _ln_call(False)(_rows2(x), w, *bias).reshape(x.shape[:-1] + w.shape[:1])


def _ln_fwd(x, w, *bias):
    return _ln_diff(x, w, *bias), (x, w, bias)


def _ln_bwd(res, g):
    x, w, bias = res
    gx, gw, gb = _lb_raw(_rows2(g), _rows2(x), w, want_b=bool(bias))
    return (gx.reshape(x.shape), gw) + ((gb,) if bias else ())


_ln_diff.defvjp(_ln_fwd, _ln_bwd)


@jax.custom_vjp
def _sw_diff(x, up, gate):
    return _ln_call(True)(_rows2(x), up, gate).reshape(x.shape[:-1] + up.shape[:1])


def _sw_fwd(x, up, gate):
    return _sw_diff(x, up, gate), (x, up, gate)


def _sw_bwd(res, g):
    x, up, gate = res
    gx, gu, gg = _lb_raw(_rows2(g), _rows2(x), up, gate)
    return gx.reshape(x.shape), gu, gg


_sw_diff.defvjp(_sw_fwd, _sw_bwd)


@functools.partial(jax.jit, static_argnames=("platform",))
def _linear(x, w, *bias, platform):
    return _ln_diff(x, w, *bias)


@functools.partial(jax.jit, static_argnames=("platform",))
def _swiglu(x, up, gate, platform):
    return _sw_diff(x, up, gate)


def linear(x, weight, bias=None, *, backend=None):
    """x @ weight^T + bias: x [*, K], weight [N, K], bias [N] -> [*, N].  Differentiable in all three."""
    op = "linear"
    x, weight = _arr(x), _arr(weight)
    bias = () if bias is None else (_arr(bias),)
    _check_ln(op, x, (("weight", weight),), *bias)
    return _linear(x, weight, *bias, platform=_platform(op, x, backend))


def swiglu(x, up_weight, gate_weight, *, backend=None):
    """linear(x, up_weight) * silu(linear(x, gate_weight)) -> [*, N].  Differentiable in all three."""
    op = "swiglu"
    x, up, gate = map(_arr, (x, up_weight, gate_weight))
    _check_ln(op, x, (("up_weight", up), ("gate_weight", gate)))
    return _swiglu(x, up, gate, platform=_platform(op, x, backend))


@functools.partial(jax.jit, static_argnames=("flags", "platform"))
def _linear_backward(g, x, *ws, flags, platform):
    outs = _lb_raw(_rows2(g), _rows2(x), *ws, **dict(flags))
    return (outs[0].reshape(x.shape) if dict(flags)["want_x"] else outs[0],) + outs[1:]


def linear_backward(grad_out, x, weight, *, x_grad=True, weight_grad=True, bias_grad=False, backend=None):
    """(grad_x, grad_weight, grad_bias) of linear, each None unless asked for."""
    op = "linear_backward"
    g, x, w = map(_arr, (grad_out, x, weight))
    _check_ln(op, x, (("weight", w),), grad_out=g)
    flags = (("want_x", bool(x_grad)), ("want_w", bool(weight_grad)), ("want_b", bool(bias_grad)))
    gx, gw, gb = _linear_backward(g, x, w, flags=flags, platform=_platform(op, g, backend))
    return (gx if x_grad else None), (gw if weight_grad else None), (gb if bias_grad else None)


def swiglu_backward(grad_out, x, up_weight, gate_weight, *, x_grad=True, weight_grad=True, backend=None):
    """(grad_x, grad_up_weight, grad_gate_weight) of swiglu, None where not asked for."""
    op = "swiglu_backward"
    g, x, up, gate = map(_arr, (grad_out, x, up_weight, gate_weight))
    _check_ln(op, x, (("up_weight", up), ("gate_weight", gate)), grad_out=g)
    flags = (("want_x", bool(x_grad)), ("want_w", bool(weight_grad)), ("want_b", False))
    gx, gu, gg = _linear_backward(g, x, up, gate, flags=flags, platform=_platform(op, g, backend))
    return (gx if x_grad else None), (gu if weight_grad else None), (gg if weight_grad else None)


# ---- attention (forward only) -------------------------------------------------------------------

def _mask_dtype(op, m, q):
    """The bindings' rule (scaled_dot_product_attention's): bool (True = keep), or a float mask added to
    the scores: float32 for any query, or q's own dtype for float16 / bfloat16 queries."""
    dt, qd = _dt(m), _dt(q)
    if dt == "bool" or dt == "float32" or (dt == qd and qd in ("float16", "bfloat16")):
        return
    raise _err(TypeError, op, "mask must be bool (True = keep) or float32 (added to the scores), got " + dt
               if qd == "float32" else f"mask must be bool (True = keep), or float32 or q's dtype {qd} (added to "
               f"the scores), got {dt}")


def _bad_mask_shape(op, m, layout):
    return _err(ValueError, op, f"mask must have shape {layout}, got {tuple(m.shape)}")


def _decode_mask(op, mask, q, B, L, paged):
    """attn_decode's and attn_paged_decode's mask -> [B|1, W] (the handler reads a size-1 batch with
    stride 0).  [B|1, L], [B|1, 1, L] or [B|1, 1, 1, L]; paged, any width 1 <= W <= max_ctx."""
    m = _arr(mask)
    _mask_dtype(op, m, q)
    name = "max_ctx" if paged else "Lkv"
    W = "W" if paged else name
    layout = {2: f"[B|1, {W}]", 3: f"[B|1, 1, {W}]", 4: f"[B|1, 1, 1, {W}]"}.get(m.ndim)
    if layout is None:
        raise _err(ValueError, op, f"mask must be [B|1, {W}], [B|1, 1, {W}] or [B|1, 1, 1, {W}], got shape "
                   f"{tuple(m.shape)}")
    layout += f" with B = {B}, {name} = {L}"
    if m.shape[0] not in (1, B) or any(d != 1 for d in m.shape[1:-1]):
        raise _bad_mask_shape(op, m, layout)
    w = m.shape[-1]
    if (paged and not 1 <= w <= L) or (not paged and w != L):
        raise _bad_mask_shape(op, m, layout + (" (1 <= W <= max_ctx: positions from W on are masked out)"
                                               if paged else ""))
    return m.reshape(m.shape[0], w)


def _prefill_mask(op, mask, q, B, Hq, Lq, L, paged):
    """attn_prefill's and attn_paged_prefill's mask -> [B, W] (per key) or [B|1, 1|Hq, rows, W] (per
    query; size-1 dims read with stride 0).  Per key: [B, L].  Per query, trailing dims aligned as SDPA
    broadcasts: [B|1, 1|Hq, Lq|1, L] or [1|Hq, Lq|1, L]; paged, any Mq query rows (row i: query i of a
    request) and any width 1 <= W <= max_ctx."""
    m = _arr(mask)
    _mask_dtype(op, m, q)
    name, W, rows = ("max_ctx", "W", "Mq") if paged else ("Lkv", "Lkv", "Lq|1")
    if m.ndim not in (2, 3, 4):
        raise _err(ValueError, op, f"mask must be [B, {W}], [1|Hq, {rows}, {W}] or [B|1, 1|Hq, {rows}, {W}] "
                   f"(2, 3 or 4 dimensions), got shape {tuple(m.shape)}")
    w = m.shape[-1]
    width_ok = 1 <= w <= L if paged else w == L
    if m.ndim == 2:
        layout = f"[B, {W}] with B = {B}, {name} = {L}"
        if m.shape[0] != B or not width_ok:
            raise _bad_mask_shape(op, m, layout)
        return m
    if m.ndim == 3:
        m = m.reshape((1,) + tuple(m.shape))
    layout = f"[B|1, 1|Hq, {rows}, {W}] with B = {B}, Hq = {Hq}, " + ("" if paged else f"Lq = {Lq}, ") + \
        f"{name} = {L}"
    ok = m.shape[0] in (1, B) and m.shape[1] in (1, Hq) and width_ok and (paged or m.shape[2] in (1, Lq))
    if not ok:
        raise _bad_mask_shape(op, m, layout)
    return m


def _check_heads(op, q, k, Hq, Hkv, D):
    _need_float(op, "q", q, _DENSE)
    _check(Hkv >= 1 and Hq % Hkv == 0, ValueError, op, f"Hq = {Hq} must be a multiple of Hkv = {Hkv}")
    _check(k.shape[-1] == D, ValueError, op, f"k's head_dim must be q's D = {D}, got {k.shape[-1]}")


def _scale_attr(scale):
    return {} if scale is None else {"scale": np.float32(scale)}


@functools.partial(jax.jit, static_argnames=("has_kv_lens", "scale", "platform"))
def _attn_decode(q, k, v, *extra, has_kv_lens, scale, platform):
    return _ffi("attn_decode", _sds(q.shape, q.dtype), q, k, v, *extra, has_kv_lens=bool(has_kv_lens),
                **_scale_attr(scale))


def attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None, backend=None):
    """One query per sequence: q [B, 1, Hq, D], k and v [B, Lkv, Hkv, D] -> [B, 1, Hq, D]; kv_lens [B]
    keeps keys j < kv_lens[b]; mask [B|1, Lkv] ([B|1, 1, Lkv], [B|1, 1, 1, Lkv]): bool (True = keep) or
    float (float32, or q's dtype) added to the scores."""
    op = "attn_decode"
    q, k, v = map(_arr, (q, k, v))
    _need_rank(op, "q", q, 4, "[B, 1, Hq, D]")
    _need_dim(op, "q", q, 1, 1, "[B, 1, Hq, D]")
    B, _, Hq, D = q.shape
    for name, a in (("k", k), ("v", v)):
        _need_rank(op, name, a, 4, "[B, Lkv, Hkv, D]")
        _same_dtype(op, name, a, "q's", q)
        _check(a.shape[0] == B and tuple(a.shape) == tuple(k.shape), ValueError, op,
               f"{name} must have shape [B, Lkv, Hkv, D] with B = {B}, as k, got {tuple(a.shape)}")
    _check_heads(op, q, k, Hq, k.shape[2], D)
    extra = ()
    if kv_lens is not None:
        kl = _arr(kv_lens)
        _need_index(op, "kv_lens", kl)
        _check(tuple(kl.shape) == (B,), ValueError, op, f"kv_lens must have shape [B] = [{B}], got {tuple(kl.shape)}")
        extra = (kl,)
    has_kv_lens = bool(extra)
    if mask is not None:
        extra += (_decode_mask(op, mask, q, B, k.shape[1], False),)
    return _attn_decode(q, k, v, *extra, has_kv_lens=has_kv_lens, scale=scale,
                        platform=_platform(op, q, backend, (q,), {"mask": mask}))


def _check_pool(op, q, pool, B):
    k_cache, v_cache, r2t, rpi, kv_indptr = pool
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need_rank(op, name, a, 3, "[S, Hkv, D]")
        _same_dtype(op, name, a, "q's", q)
        _check(tuple(a.shape) == tuple(k_cache.shape), ValueError, op, f"{name} must have k_cache's shape "
               f"{tuple(k_cache.shape)}, got {tuple(a.shape)}")
    _need_rank(op, "req_to_token", r2t, 2, "[R, max_ctx]")
    for name, a in (("req_to_token", r2t), ("req_pool_indices", rpi), ("kv_indptr", kv_indptr)):
        _need_index(op, name, a)
    _check(tuple(rpi.shape) == (B,), ValueError, op, f"req_pool_indices must have shape [B] = [{B}], got "
           f"{tuple(rpi.shape)}")
    _check(tuple(kv_indptr.shape) == (B + 1,), ValueError, op, f"kv_indptr must have shape [B + 1] = [{B + 1}], "
           f"got {tuple(kv_indptr.shape)}")
    _check_heads(op, q, k_cache, q.shape[-2], k_cache.shape[1], q.shape[-1])


@functools.partial(jax.jit, static_argnames=("has_new", "scale", "platform"))
def _attn_paged_decode(q, kc, vc, r2t, rpi, ind, *extra, has_new, scale, platform):
    # operands: the pools, then new_k, new_v when has_new, then the mask when given
    attrs = dict(has_new=bool(has_new), **_scale_attr(scale))
    if not has_new:
        return _ffi("attn_paged_decode", _sds(q.shape, q.dtype), q, kc, vc, r2t, rpi, ind, *extra, **attrs)
    outs = [_sds(q.shape, q.dtype), _sds(kc.shape, kc.dtype), _sds(vc.shape, vc.dtype)]
    return tuple(_ffi("attn_paged_decode", outs, q, kc, vc, r2t, rpi, ind, *extra, aliases={1: 1, 2: 2}, **attrs))


def attn_paged_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None, new_v=None,
                      mask=None, scale=None, backend=None):
    """Decode attention over token pools: q [B, Hq, D] -> [B, Hq, D]; with new_k/new_v [B, Hkv, D]
    (written at position len_b - 1 first) -> (out, k_cache, v_cache), the pools updated functionally
    (XLA aliases them to the results, so a donated pool is written in place).  mask [B|1, W] (or
    [B|1, 1, W], [B|1, 1, 1, W]) over each request's positions, W <= max_ctx: bool or additive float."""
    op = "attn_paged_decode"
    q = _arr(q)
    pool = tuple(map(_arr, (k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr)))
    _need_rank(op, "q", q, 3, "[B, Hq, D]")
    _check_pool(op, q, pool, q.shape[0])
    _check((new_k is None) == (new_v is None), ValueError, op, "new_k and new_v go together")
    new = ()
    if new_k is not None:
        new = (_arr(new_k), _arr(new_v))
        want = (q.shape[0], pool[0].shape[1], q.shape[2])
        for name, a in zip(("new_k", "new_v"), new):
            _check(tuple(a.shape) == want, ValueError, op, f"{name} must have shape [B, Hkv, D] = {list(want)}, "
                   f"got {tuple(a.shape)}")
            _same_dtype(op, name, a, "q's", q)
    extra = new
    if mask is not None:
        extra += (_decode_mask(op, mask, q, q.shape[0], pool[2].shape[1], True),)
    return _attn_paged_decode(q, *pool, *extra, has_new=bool(new), scale=scale,
                              platform=_platform(op, q, backend, (q,), {"mask": mask}))


@functools.partial(jax.jit, static_argnames=("is_causal", "scale", "platform"))
def _attn_prefill(q, k, v, *mask, is_causal, scale, platform):
    return _ffi("attn_prefill", _sds(q.shape, q.dtype), q, k, v, *mask, is_causal=bool(is_causal),
                **_scale_attr(scale))


def attn_prefill(q, k, v, *, is_causal=False, mask=None, scale=None, backend=None):
    """q [B, Lq, Hq, D], k and v [B, Lkv, Hkv, D] -> [B, Lq, Hq, D]; is_causal aligns bottom-right.
    mask [B, Lkv] per key, or per query [B|1, 1|Hq, Lq|1, Lkv] / [1|Hq, Lq|1, Lkv]: bool (True = keep)
    or float (float32, or q's dtype) added to the scores."""
    op = "attn_prefill"
    q, k, v = map(_arr, (q, k, v))
    _need_rank(op, "q", q, 4, "[B, Lq, Hq, D]")
    for name, a in (("k", k), ("v", v)):
        _need_rank(op, name, a, 4, "[B, Lkv, Hkv, D]")
        _same_dtype(op, name, a, "q's", q)
        _check(a.shape[0] == q.shape[0] and tuple(a.shape) == tuple(k.shape), ValueError, op,
               f"{name} must have shape [B, Lkv, Hkv, D] with B = {q.shape[0]}, as k, got {tuple(a.shape)}")
    _check_heads(op, q, k, q.shape[2], k.shape[2], q.shape[3])
    m = () if mask is None else (_prefill_mask(op, mask, q, q.shape[0], q.shape[2], q.shape[1], k.shape[1], False),)
    return _attn_prefill(q, k, v, *m, is_causal=bool(is_causal), scale=scale,
                         platform=_platform(op, q, backend, (q,), {"mask": mask}))


@functools.partial(jax.jit, static_argnames=("is_causal", "scale", "platform"))
def _attn_paged_prefill(q, kc, vc, r2t, rpi, kvi, qoi, *mask, is_causal, scale, platform):
    return _ffi("attn_paged_prefill", _sds(q.shape, q.dtype), q, kc, vc, r2t, rpi, kvi, qoi, *mask,
                is_causal=bool(is_causal), **_scale_attr(scale))


def attn_paged_prefill(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr, *, is_causal=False,
                       mask=None, scale=None, backend=None):
    """Prefill over token pools: q [total_q, Hq, D] -> [total_q, Hq, D]; request b's queries are rows
    qo_indptr[b] .. qo_indptr[b + 1] - 1.  mask [B, W] per key, or per query [B|1, 1|Hq, Mq, W] /
    [1|Hq, Mq, W] (row i: query i of the request; Mq = 1 broadcasts), W <= max_ctx: bool or additive
    float."""
    op = "attn_paged_prefill"
    q = _arr(q)
    pool = tuple(map(_arr, (k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr)))
    qoi = _arr(qo_indptr)
    _need_rank(op, "q", q, 3, "[total_q, Hq, D]")
    B = pool[3].shape[0] if pool[3].ndim == 1 else -1
    _check_pool(op, q, pool, B)
    _need_index(op, "qo_indptr", qoi)
    _check(tuple(qoi.shape) == (B + 1,), ValueError, op, f"qo_indptr must have shape [B + 1] = [{B + 1}], got "
           f"{tuple(qoi.shape)}")
    m = () if mask is None else (_prefill_mask(op, mask, q, B, q.shape[1], -1, pool[2].shape[1], True),)
    return _attn_paged_prefill(q, *pool, qoi, *m, is_causal=bool(is_causal), scale=scale,
                               platform=_platform(op, q, backend, (q,), {"mask": mask}))


# ---- rmsnorm and fused_add_rmsnorm ----------------------------------------------------------------

def _check_rn(op, x, weight, residual=None):
    _check(x.ndim >= 1, ValueError, op, f"x must have at least one dimension [*, H], got shape {tuple(x.shape)}")
    _need_float(op, "x", x)
    _need_rank(op, "weight", weight, 1, "[H]")
    _same_dtype(op, "weight", weight, "x's", x)
    H = x.shape[-1]
    _check(weight.shape[0] == H, ValueError, op, f"weight must have shape [H] = [{H}], got {tuple(weight.shape)}")
    if residual is not None:
        _same_dtype(op, "residual", residual, "x's", x)
        _check(tuple(residual.shape) == tuple(x.shape), ValueError, op,
               f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")


def _rn_call(eps, fused):
    """The custom call on rows ([R, H] arrays and weight [H]); vmap folds a batch of x (and residual)
    into the rows, a batched weight runs one call per element."""

    def raw(*arrays):
        x = arrays[0]
        if not fused:
            return _ffi("rmsnorm", _sds(x.shape, x.dtype), *arrays, eps=np.float32(eps))
        return tuple(_ffi("fused_add_rmsnorm", [_sds(x.shape, x.dtype)] * 2, *arrays, aliases={1: 1},
                          eps=np.float32(eps)))

    def rows(axis_size, in_batched, *arrays):
        if in_batched[-1]:
            return None
        V, H = axis_size, arrays[-1].shape[0]
        R = next(a.shape[-2] for a in arrays[:-1])
        flat = [(a if b else jnp.broadcast_to(a, (V, R, H))).reshape(V * R, H)
                for a, b in zip(arrays[:-1], in_batched[:-1])]
        out = raw(*flat, arrays[-1])
        return tuple(o.reshape(V, R, H) for o in out) if fused else out.reshape(V, R, H)

    return _fold(raw, rows)


def _rn_no_grad(op):
    """A forward-only op under jax.grad: a clear error naming it instead of a missing-rule error."""

    def decorate(f):
        g = jax.custom_vjp(f, nondiff_argnums=(0,))
        g.defvjp(lambda eps, *a: (f(eps, *a), None), lambda eps, res, ct: (_ for _ in ()).throw(
            NotImplementedError(f"{op}: no gradient; the rmsnorm ops are forward-only")))
        return g

    return decorate


@_rn_no_grad("rmsnorm")
def _rn_fwd(eps, x, w):
    return _rn_call(eps, False)(x.reshape(-1, x.shape[-1]), w).reshape(x.shape)


@_rn_no_grad("fused_add_rmsnorm")
def _farn_fwd(eps, x, r, w):
    out, res = _rn_call(eps, True)(x.reshape(-1, x.shape[-1]), r.reshape(-1, x.shape[-1]), w)
    return out.reshape(x.shape), res.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "platform"))
def _rmsnorm(x, w, eps, platform):
    return _rn_fwd(eps, x, w)


@functools.partial(jax.jit, static_argnames=("eps", "platform"))
def _fused_add_rmsnorm(x, r, w, eps, platform):
    return _farn_fwd(eps, x, r, w)


def _rn_eps(op, eps):
    eps = float(eps)
    _check(eps >= 0 and np.isfinite(np.float32(eps)), ValueError, op,
           f"eps must be a finite value >= 0 (in float32), got {eps!r}")
    return eps


def rmsnorm(x, weight, *, eps=1e-6, backend=None):
    """x [*, H] * rsqrt(mean(x^2) + eps) * weight [H], in fp32, rounded once.  Forward-only."""
    op = "rmsnorm"
    x, w = _arr(x), _arr(weight)
    _check_rn(op, x, w)
    return _rmsnorm(x, w, eps=_rn_eps(op, eps), platform=_platform(op, x, backend))


def fused_add_rmsnorm(x, residual, weight, *, eps=1e-6, backend=None):
    """(out, new_residual): new_residual = x + residual rounded once, out = the rmsnorm of the unrounded
    sum.  new_residual aliases residual in the custom call, so a donated residual (jax.jit's
    donate_argnums) is updated in place.  Forward-only."""
    op = "fused_add_rmsnorm"
    x, r, w = _arr(x), _arr(residual), _arr(weight)
    _check_rn(op, x, w, r)
    return _fused_add_rmsnorm(x, r, w, eps=_rn_eps(op, eps), platform=_platform(op, x, backend))


# ---- rotary_kv_append ---------------------------------------------------------------------------

def _check_rka(op, q, k, v, cs, positions, k_pool, v_pool, slots):
    _need_rank(op, "q", q, 3, "[T, Hq, D]")
    _need_float(op, "q", q, _DENSE)
    T, D = q.shape[0], q.shape[2]
    _check(D % 2 == 0, ValueError, op, f"q's last dimension D = {D} must be even (pairs are rotated)")
    for name, a in (("k", k), ("v", v)):
        _need_rank(op, name, a, 3, "[T, Hkv, D]")
        _same_dtype(op, name, a, "q's", q)
    Hkv = k.shape[1]
    for name, a in (("k", k), ("v", v)):
        _check(tuple(a.shape) == (T, Hkv, D), ValueError, op, f"{name} must have shape [T, Hkv, D] = "
               f"[{T}, {Hkv}, {D}], got {tuple(a.shape)}")
    _check(cs.dtype == np.float32, TypeError, op, f"cos_sin must be float32, got {_dt(cs)}")
    _check(cs.ndim == 3 and tuple(cs.shape[1:]) == (D // 2, 2), ValueError, op,
           f"cos_sin must have shape [max_pos, D/2, 2] = [max_pos, {D // 2}, 2], got {tuple(cs.shape)}")
    for name, a in (("k_pool", k_pool), ("v_pool", v_pool)):
        _need_rank(op, name, a, 3, "[S, Hkv, D]")
        _same_dtype(op, name, a, "q's", q)
        _check(tuple(a.shape) == (k_pool.shape[0], Hkv, D), ValueError, op, f"{name} must have shape [S, Hkv, D] = "
               f"[{k_pool.shape[0]}, {Hkv}, {D}], got {tuple(a.shape)}")
    for name, a in (("positions", positions), ("slots", slots)):
        _need_rank(op, name, a, 1, "[T]")
        _need_index(op, name, a)
        _check(a.shape[0] == T, ValueError, op, f"{name} must have shape [T] = [{T}], got {tuple(a.shape)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rka_fwd(interleaved, q, k, v, cs, positions, k_pool, v_pool, slots):
    """The custom call: (q rotated, the pools with the new tokens), the pools aliased to operands 5 and 6."""
    results = [_sds(q.shape, q.dtype), _sds(k_pool.shape, k_pool.dtype), _sds(v_pool.shape, v_pool.dtype)]
    return tuple(_ffi("rotary_kv_append", results, q, k, v, cs, positions, k_pool, v_pool, slots, aliases={5: 1, 6: 2},
                      interleaved=bool(interleaved)))


_rka_fwd.defvjp(lambda interleaved, *a: (_rka_fwd(interleaved, *a), None), lambda interleaved, res, ct: (
    _ for _ in ()).throw(NotImplementedError("rotary_kv_append: no gradient; it is inference-only")))


@functools.partial(jax.jit, static_argnames=("interleaved", "platform"))
def _rotary_kv_append(q, k, v, cs, positions, k_pool, v_pool, slots, interleaved, platform):
    return _rka_fwd(interleaved, q, k, v, cs, positions, k_pool, v_pool, slots)


def rotary_kv_append(q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True, backend=None):
    """(q rotated, new k_pool, new v_pool): q and k rotated at positions by cos_sin [max_pos, D/2, 2] as
    rotary_emb rotates them, k rotated and v written into the pools' rows slots.  The new pools alias the
    old ones in the custom call, so donated pools (jax.jit's donate_argnums) are updated in place.
    Index values are checked on cpu (XlaRuntimeError naming the op).  Forward-only."""
    op = "rotary_kv_append"
    arrays = tuple(map(_arr, (q, k, v, cos_sin, positions, k_pool, v_pool, slots)))
    _check_rka(op, *arrays)
    return _rotary_kv_append(*arrays, interleaved=bool(interleaved), platform=_platform(op, arrays[0], backend))


# ---- message_passing ------------------------------------------------------------------------------

def _mp_composed(eps, x, e, ei, rp, ci, de, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o, gamma_x, beta_x, gamma_e,
                 beta_e):
    """The layer as the differentiable graph ops and matmuls (the fused op's definition): its vjp is the
    fused op's.  The pieces are the ops' custom_vjp forms: the call's platform was resolved once, for
    message_passing, and its arguments checked."""
    mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)  # fp32 products, as the kernels
    (N, H), K = x.shape, w_att.shape[1]
    h = jax.nn.relu(mm(_fe_diff(x, ei, jnp.zeros((0,), jnp.int32), e), w1) + b1)
    msg = mm(h, w_msg) + b_msg
    att = jax.nn.sigmoid(mm(h, w_att) + b_att)
    agg = _sa_diff(rp, ci, jnp.take(att, de, axis=0), mm(x, w_v).reshape(N, K, H // K))
    static, seed = _nr_static(0.0, False, eps, None), jnp.zeros((2,), jnp.uint32)
    return (_nr_diff(static, mm(agg.reshape(N, H), w_o), x, gamma_x, beta_x, seed),
            _nr_diff(static, msg, e, gamma_e, beta_e, seed))


# Outside differentiation the fused handler runs; jax.grad and jax.vjp differentiate the composition,
# whose forward values they also take (the op has no backward kernels).  Under vmap the handler runs
# once per batch element (the custom call's sequential rule): a batch cannot fold into one graph call
# without rewriting the indices.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mp_diff(eps, *arrays):
    x, e = arrays[0], arrays[1]
    return tuple(_ffi("message_passing", [_sds(x.shape, x.dtype), _sds(e.shape, e.dtype)], *arrays,
                      eps=np.float32(eps)))


def _mp_fwd(eps, *arrays):
    return jax.vjp(functools.partial(_mp_composed, eps), *arrays)


def _mp_bwd(eps, vjp, g):
    return vjp(g)


_mp_diff.defvjp(_mp_fwd, _mp_bwd)


@functools.partial(jax.jit, static_argnames=("eps", "platform"))
def _message_passing(*arrays, eps, platform):
    return _mp_diff(eps, *arrays)


def message_passing(x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o,
                    gamma_x, beta_x, gamma_e, beta_e, *, eps=1e-5, backend=None):
    """One message-passing layer of a gated graph network, fused: (x_out [N, H], e_out [E, H]), float32
    (see qkernels.message_passing).  Differentiable in every float argument, through the composition of
    fused_edge_features, sparse_aggregate, fused_norm_residual and matmuls it computes."""
    op = "message_passing"
    arrays = tuple(map(_arr, (x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v,
                              w_o, gamma_x, beta_x, gamma_e, beta_e)))
    _mp.check({n: tuple(a.shape) for n, a in zip(_mp.ARGS, arrays)}, {n: _dt(a) for n, a in zip(_mp.ARGS, arrays)})
    return _message_passing(*arrays, eps=_rn_eps(op, eps), platform=_platform(op, arrays[0], backend))
