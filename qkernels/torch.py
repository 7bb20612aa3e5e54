"""qkernels as PyTorch operators: ``torch.ops.qkernels.<op>`` for every op of the C op table.

Each op is a ``torch.library`` operator with a fake implementation (its shape rule), an ``out``
overload that mutates ``out`` (and so also carries the in-place forms ``out=x``), an autograd
formula that calls the op's backward op (``<op>_backward``, itself an operator), and a Dynamo
substitution for the C entry point ``qkernels.<op>``: under ``torch.compile`` and ``torch.export``
a call becomes one node of the graph, with the backend chosen at trace time.

Registration happens when torch is present: at the first torch tensor a qkernels op sees, or here,
on ``import qkernels.torch``.  Import it before ``torch.compile`` traces a function if qkernels was
imported before torch.  ``import qkernels`` itself never imports torch.

Eager calls without gradients keep the C path (see docs/dispatch.md); a call whose tensors need
autograd, or that runs under a tracer (fake or functional tensors), comes here through ``route``.
"""

from __future__ import annotations

import torch

from . import _C, _dispatch, _flash
from . import _message_passing as _mp
from ._frameworks import run

NAMESPACE = "qkernels"

# The functional form of every op as a torch schema (without the trailing backend argument), and
# what it returns.  Every tensor of a differentiable op is positional: autograd.Function sees only those.
# A public argument that takes a number or a tensor is two schema arguments (see _UNIONS).
SCHEMAS = {
    "sparse_aggregate": ("Tensor row_ptr, Tensor col_idx, Tensor edge_weight, Tensor node_feat, Tensor? plan=None",
                         "Tensor"),
    "fused_edge_features": ("Tensor x, Tensor edge_index, Tensor? edge_attr=None, Tensor? plan=None", "Tensor"),
    "sparse_aggregate_plan": ("Tensor row_ptr, Tensor col_idx, int num_src", "Tensor"),
    "fused_edge_features_plan": ("Tensor edge_index, int num_nodes", "Tensor"),
    "fused_norm_residual": ("Tensor x, Tensor residual, Tensor gamma, Tensor beta, Tensor? seed_tensor=None, "
                            "Tensor? batch=None, *, float p=0.0, bool training=False, float eps=1e-05, int? seed=None, "
                            "int? num_graphs=None", "Tensor"),
    "graph_norm_bce": ("Tensor logits, Tensor target, Tensor edge_graph, int num_graphs, "
                       "Tensor? pos_weight_tensor=None, *, float? pos_weight=None", "Tensor"),
    "rotary_emb": ("Tensor x, Tensor freqs_cis, *, bool interleaved=True", "Tensor"),
    "linear": ("Tensor x, Tensor weight, Tensor? bias=None", "Tensor"),
    "swiglu": ("Tensor x, Tensor up_weight, Tensor gate_weight", "Tensor"),
    "attn_decode": ("Tensor q, Tensor k, Tensor v, *, Tensor? kv_lens=None, Tensor? mask=None, float? scale=None",
                    "Tensor"),
    "attn_paged_decode": ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
                          "Tensor kv_indptr, *, Tensor? new_k=None, Tensor? new_v=None, Tensor? mask=None, "
                          "float? scale=None", "Tensor"),
    "attn_prefill": ("Tensor q, Tensor k, Tensor v, *, bool is_causal=False, Tensor? mask=None, float? scale=None",
                     "Tensor"),
    "attn_paged_prefill": ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
                           "Tensor kv_indptr, Tensor qo_indptr, *, bool is_causal=False, Tensor? mask=None, "
                           "float? scale=None", "Tensor"),
    "rmsnorm": ("Tensor x, Tensor weight, *, float eps=1e-06", "Tensor"),
    "fused_add_rmsnorm": ("Tensor x, Tensor residual, Tensor weight, *, float eps=1e-06", "Tensor"),
    "rotary_kv_append": ("Tensor q, Tensor k, Tensor v, Tensor cos_sin, Tensor positions, Tensor k_pool, "
                         "Tensor v_pool, Tensor slots, *, bool interleaved=True", "Tensor"),
    "message_passing": ("Tensor x, Tensor e, Tensor edge_index, Tensor row_ptr, Tensor col_idx, Tensor dir_edge, "
                        "Tensor w1, Tensor b1, Tensor w_msg, Tensor b_msg, Tensor w_att, Tensor b_att, Tensor w_v, "
                        "Tensor w_o, Tensor gamma_x, Tensor beta_x, Tensor gamma_e, Tensor beta_e, *, float eps=1e-05",
                        "(Tensor, Tensor)"),
    # backward ops: a gradient not asked for comes back as an empty tensor (schemas have no optional returns)
    "sparse_aggregate_backward": ("Tensor grad_out, Tensor row_ptr, Tensor col_idx, Tensor edge_weight, "
                                  "Tensor node_feat, *, bool edge_weight_grad=True, bool node_feat_grad=True, "
                                  "bool deterministic=True, Tensor? plan=None", "(Tensor, Tensor)"),
    "fused_edge_features_backward": ("Tensor grad_out, Tensor x, Tensor edge_index, *, Tensor? plan=None",
                                     "(Tensor, Tensor)"),
    "fused_norm_residual_backward": ("Tensor grad_out, Tensor x, Tensor gamma, *, float p=0.0, bool training=False, "
                                     "float eps=1e-05, int? seed=None, Tensor? seed_tensor=None, Tensor? batch=None, "
                                     "int? num_graphs=None", "(Tensor, Tensor, Tensor)"),
    "graph_norm_bce_backward": ("Tensor grad, Tensor logits, Tensor target, Tensor edge_graph, int num_graphs, *, "
                                "float? pos_weight=None, Tensor? pos_weight_tensor=None", "Tensor"),
    "rotary_emb_backward": ("Tensor grad_out, Tensor freqs_cis, *, bool interleaved=True", "Tensor"),
    "linear_backward": ("Tensor grad_out, Tensor x, Tensor weight, *, bool x_grad=True, bool weight_grad=True, "
                        "bool bias_grad=False", "(Tensor, Tensor, Tensor)"),
    "swiglu_backward": ("Tensor grad_out, Tensor x, Tensor up_weight, Tensor gate_weight, *, bool x_grad=True, "
                        "bool weight_grad=True", "(Tensor, Tensor, Tensor)"),
}

# Public arguments that take a number or a tensor -> the schema argument that carries the tensor.
_UNIONS = {"seed": "seed_tensor", "pos_weight": "pos_weight_tensor"}

# Inputs written besides out, by overload (from _dispatch.WRITES): an op that writes only when a
# keyword is given (attn_paged_decode's new_k/new_v) has an "append" overload that marks them.
_MUTATED = {op: {("append" if when else ""): tuple(n for _, n in args)} for op, (when, args) in _dispatch.WRITES.items()}


def _empty(like):
    return like.new_empty((0,))


def _maybe(flag, like, shape=None, dtype=None):
    if not flag:
        return _empty(like)
    return like.new_empty(like.shape if shape is None else shape, dtype=dtype)


# Shape rules: the fake implementation of each op, from its bound arguments.
FAKES = {
    "sparse_aggregate": lambda c: c["node_feat"].new_empty((c["row_ptr"].shape[0] - 1, *c["node_feat"].shape[1:])),
    "fused_edge_features": lambda c: c["x"].new_empty(
        (c["edge_index"].shape[1], (2 if c["edge_attr"] is None else 3) * c["x"].shape[1])),
    "sparse_aggregate_plan": lambda c: c["row_ptr"].new_empty(
        (c["num_src"] + 1 + 3 * c["col_idx"].shape[0],), dtype=torch.int32),
    "fused_edge_features_plan": lambda c: c["edge_index"].new_empty(
        (c["num_nodes"] + 1 + 4 * c["edge_index"].shape[1],), dtype=torch.int32),
    "fused_norm_residual": lambda c: c["x"].new_empty(c["x"].shape),
    "graph_norm_bce": lambda c: c["logits"].new_empty((), dtype=torch.float32),
    "rotary_emb": lambda c: c["x"].new_empty(c["x"].shape),
    "linear": lambda c: c["x"].new_empty((*c["x"].shape[:-1], c["weight"].shape[0])),
    "swiglu": lambda c: c["x"].new_empty((*c["x"].shape[:-1], c["up_weight"].shape[0])),
    "attn_decode": lambda c: c["q"].new_empty(c["q"].shape),
    "attn_paged_decode": lambda c: c["q"].new_empty(c["q"].shape),
    "attn_prefill": lambda c: c["q"].new_empty(c["q"].shape),
    "attn_paged_prefill": lambda c: c["q"].new_empty(c["q"].shape),
    "rmsnorm": lambda c: c["x"].new_empty(c["x"].shape),
    "fused_add_rmsnorm": lambda c: c["x"].new_empty(c["x"].shape),
    "rotary_kv_append": lambda c: c["q"].new_empty(c["q"].shape),
    "message_passing": lambda c: (c["x"].new_empty(c["x"].shape),
                                  c["x"].new_empty((c["e"].shape[0], c["x"].shape[1]))),
    "sparse_aggregate_backward": lambda c: (_maybe(c["edge_weight_grad"], c["edge_weight"]),
                                            _maybe(c["node_feat_grad"], c["node_feat"])),
    "fused_edge_features_backward": lambda c: (
        c["x"].new_empty(c["x"].shape),
        _maybe(c["grad_out"].shape[1] == 3 * c["x"].shape[1], c["grad_out"],
               (c["grad_out"].shape[0], c["x"].shape[1]))),
    "fused_norm_residual_backward": lambda c: (c["x"].new_empty(c["x"].shape), c["gamma"].new_empty(c["gamma"].shape),
                                               c["gamma"].new_empty(c["gamma"].shape)),
    "graph_norm_bce_backward": lambda c: c["logits"].new_empty(c["logits"].shape),
    "rotary_emb_backward": lambda c: c["grad_out"].new_empty(c["grad_out"].shape),
    "linear_backward": lambda c: (_maybe(c["x_grad"], c["x"]), _maybe(c["weight_grad"], c["weight"]),
                                  _maybe(c["bias_grad"], c["weight"], (c["weight"].shape[0],))),
    "swiglu_backward": lambda c: (_maybe(c["x_grad"], c["x"]), _maybe(c["weight_grad"], c["up_weight"]),
                                  _maybe(c["weight_grad"], c["gate_weight"])),
}


def _names(schema):
    """(positional names, keyword-only names) of a schema's arguments."""
    pos, kw, seen_star = [], [], False
    for part in schema.split(","):
        part = part.strip()
        if part == "*":
            seen_star = True
            continue
        name = part.split("=")[0].split()[-1]
        (kw if seen_star else pos).append(name)
    return pos, kw


# ---- gradients ----------------------------------------------------------------------------------

class _Direct:
    """The backward ops' implementations without the operator dispatch (~10 µs a call)."""

    def __getattr__(self, name):
        impl = _kernel(SPECS[name], "")
        setattr(self, name, impl)
        return impl


_DIRECT = _Direct()


def _backward_ops(ctx):
    """Where a gradient formula calls its backward op: directly in an eager backward that records
    nothing (_Eager, no create_graph), else the operator, which tracers and autograd see."""
    return _DIRECT if getattr(ctx, "eager", False) and not torch.is_grad_enabled() else torch.ops.qkernels


def _grad_sparse_aggregate(ctx, g):
    row_ptr, col_idx, ew, nf, plan = ctx.saved_tensors
    need = ctx.needs_input_grad
    gw, gn = _backward_ops(ctx).sparse_aggregate_backward(g, row_ptr, col_idx, ew, nf, edge_weight_grad=need[2],
                                                          node_feat_grad=need[3], plan=plan, backend=ctx.backend)
    return None, None, gw if need[2] else None, gn if need[3] else None, None


def _grad_fused_edge_features(ctx, g):
    x, edge_index, plan = ctx.saved_tensors
    gx, ga = _backward_ops(ctx).fused_edge_features_backward(g, x, edge_index, plan=plan, backend=ctx.backend)
    need = ctx.needs_input_grad
    return gx if need[0] else None, None, ga if ctx.has_attr and need[2] else None, None


def _grad_fused_norm_residual(ctx, g):
    x, gamma, seed_tensor, batch = ctx.saved_tensors
    gx, gg, gb = _backward_ops(ctx).fused_norm_residual_backward(
        g, x, gamma, p=ctx.p, training=ctx.training, eps=ctx.eps, seed=ctx.seed, seed_tensor=seed_tensor,
        batch=batch, num_graphs=ctx.num_graphs, backend=ctx.backend)
    need = ctx.needs_input_grad
    return (gx if need[0] else None, g if need[1] else None, gg if need[2] else None, gb if need[3] else None, None,
            None)


def _grad_graph_norm_bce(ctx, g):
    logits, target, edge_graph, pw_tensor = ctx.saved_tensors
    gl = _backward_ops(ctx).graph_norm_bce_backward(g, logits, target, edge_graph, ctx.num_graphs,
                                                    pos_weight=ctx.pos_weight, pos_weight_tensor=pw_tensor,
                                                    backend=ctx.backend)
    return gl, None, None, None, None


def _grad_rotary_emb(ctx, g):
    (freqs,) = ctx.saved_tensors
    return _backward_ops(ctx).rotary_emb_backward(g.contiguous(), freqs, interleaved=ctx.interleaved,
                                                  backend=ctx.backend), None


def _grad_linear(ctx, g):
    x, w = ctx.saved_tensors
    need = ctx.needs_input_grad
    has_bias = ctx.has_bias and need[2]
    gx, gw, gb = _backward_ops(ctx).linear_backward(g.contiguous(), x, w, x_grad=need[0], weight_grad=need[1], bias_grad=has_bias,
                                                    backend=ctx.backend)
    return gx if need[0] else None, gw if need[1] else None, gb if has_bias else None


def _grad_swiglu(ctx, g):
    x, up, gate = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx, gu, gg = _backward_ops(ctx).swiglu_backward(g.contiguous(), x, up, gate, x_grad=need[0], weight_grad=need[1] or need[2],
                                                    backend=ctx.backend)
    return gx if need[0] else None, gu if need[1] else None, gg if need[2] else None


def _save_sparse_aggregate(ctx, a, kw):
    ctx.save_for_backward(*a[:4], a[4] if len(a) > 4 else None)  # the plan, if any, for the backward


def _save_fused_edge_features(ctx, a, kw):
    ctx.save_for_backward(a[0], a[1], a[3] if len(a) > 3 else None)
    ctx.has_attr = a[2] is not None


def _save_fused_norm_residual(ctx, a, kw):
    ctx.save_for_backward(a[0], a[2], a[4], a[5])
    ctx.p, ctx.training, ctx.eps, ctx.seed = kw["p"], kw["training"], kw["eps"], kw.get("seed")
    ctx.num_graphs = kw.get("num_graphs")


def _save_graph_norm_bce(ctx, a, kw):
    ctx.save_for_backward(a[0], a[1], a[2], a[4])
    ctx.num_graphs, ctx.pos_weight = a[3], kw.get("pos_weight")


def _save_rotary_emb(ctx, a, kw):
    ctx.save_for_backward(a[1])
    ctx.interleaved = kw["interleaved"]


def _save_linear(ctx, a, kw):
    ctx.save_for_backward(a[0], a[1])
    ctx.has_bias = a[2] is not None


def _save_swiglu(ctx, a, kw):
    ctx.save_for_backward(*a[:3])


# op -> (setup_context, backward, the inputs it differentiates)
GRADIENTS = {
    "sparse_aggregate": (_save_sparse_aggregate, _grad_sparse_aggregate, ("edge_weight", "node_feat")),
    "fused_edge_features": (_save_fused_edge_features, _grad_fused_edge_features, ("x", "edge_attr")),
    "fused_norm_residual": (_save_fused_norm_residual, _grad_fused_norm_residual, ("x", "residual", "gamma", "beta")),
    "graph_norm_bce": (_save_graph_norm_bce, _grad_graph_norm_bce, ("logits",)),
    "rotary_emb": (_save_rotary_emb, _grad_rotary_emb, ("x",)),
    "linear": (_save_linear, _grad_linear, ("x", "weight", "bias")),
    "swiglu": (_save_swiglu, _grad_swiglu, ("x", "up_weight", "gate_weight")),
}


def _composed_message_passing(c, backend):
    """message_passing as its definition: qkernels' differentiable graph ops and torch's matmuls."""
    _mp.check({n: tuple(c[n].shape) for n in _mp.ARGS}, {n: _dtype_name(c[n].dtype) for n in _mp.ARGS})
    kw = {} if backend is None else {"backend": backend}
    x, e, w_att = c["x"], c["e"], c["w_att"]
    (N, H), K = x.shape, w_att.shape[1]
    h = torch.relu(_C.fused_edge_features(x, c["edge_index"], e, **kw) @ c["w1"] + c["b1"])
    msg = h @ c["w_msg"] + c["b_msg"]
    att = torch.sigmoid(h @ w_att + c["b_att"])
    agg = _C.sparse_aggregate(c["row_ptr"], c["col_idx"], att.index_select(0, c["dir_edge"]),
                              (x @ c["w_v"]).reshape(N, K, H // K), **kw)
    eps = c["eps"]
    return (_C.fused_norm_residual(agg.reshape(N, H) @ c["w_o"], x, c["gamma_x"], c["beta_x"], eps=eps, **kw),
            _C.fused_norm_residual(msg, e, c["gamma_e"], c["beta_e"], eps=eps, **kw))


# Ops without backward kernels whose results stay differentiable: with an input that requires grad
# (under grad mode) route() runs this composition of differentiable ops instead, so autograd records
# exact gradients of the op's definition.  op -> fn(bound public arguments, backend or None).
COMPOSED = {"message_passing": _composed_message_passing}


# ---- registration -------------------------------------------------------------------------------

class _Spec:
    """What route() and the kernels need to know of one op."""

    def __init__(self, op):
        self.op = op
        self.schema, self.returns = SCHEMAS[op]
        self.pos, self.kw = _names(self.schema)
        public = _dispatch.params(op)
        self.public = [p for p in public if p != "backend"]
        sig = getattr(_C, op).__text_signature__.strip("()")
        self.public_pos = [n for n in (p.split("=")[0].strip() for p in sig.split("*")[0].split(","))
                           if n and n not in ("out", "backend")]
        self.defaults = {}
        for part in sig.split(","):
            name, eq, value = part.strip(" *").partition("=")
            if eq and name not in ("out", "backend"):
                self.defaults[name] = None if value == "None" else eval(value, {}, {})  # literals only
        self.deciding = _dispatch.OPS[op][2]
        self.has_out = "out" in public
        self.raw = getattr(_C, op + "_raw")


SPECS = {}
_lib = None


def _schema_with(spec, mutated=(), out=False):
    """The schema's arguments with `mutated` marked written, and out= when asked."""
    parts, letters = [], iter("abcdefgh")
    for part in spec.schema.split(","):
        part = part.strip()
        if part.split("=")[0].split()[-1] in mutated:
            part = part.replace("Tensor", f"Tensor({next(letters)}!)", 1)
        parts.append(part)
    tail = []
    if "*" not in parts:
        tail.append("*")
    if out:
        tail.append(f"Tensor({next(letters)}!) out")
    tail.append('str backend=""')
    return ", ".join(parts + tail)


def _public(c):
    """Schema arguments -> the public op's: a union's tensor argument back under the public name."""
    for public, tensor_arg in _UNIONS.items():
        if tensor_arg in c:
            t = c.pop(tensor_arg)
            if t is not None:
                c[public] = t
    return c


def _kernel(spec, overload):
    """The implementation of one overload: the op on the chosen backend with the caller's tensors."""
    names = spec.pos + spec.kw + (["out"] if overload.endswith("out") else []) + ["backend"]

    def impl(*args, **kwargs):
        c = dict(zip(names, args))
        c.update(kwargs)
        backend = c.pop("backend", "") or None
        r = execute(spec.op, _public(c), backend)
        if overload.endswith("out"):
            return None
        if type(r) is tuple:
            like = c[spec.pos[0]]
            return tuple(_empty(like) if t is None else t for t in r)
        return r

    return impl


def _fake(spec, overload):
    names = spec.pos + spec.kw + (["out"] if overload.endswith("out") else []) + ["backend"]
    rule = FAKES[spec.op]

    def fake(*args, **kwargs):
        c = {n: None for n in names}
        c.update(spec.defaults)
        c.update(zip(names, args))
        c.update(kwargs)
        return None if overload.endswith("out") else rule(c)

    return fake


def _register():
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    for op in _C.OPS:
        if op not in SCHEMAS:
            continue
        spec = SPECS[op] = _Spec(op)
        for name, mutated in {"": (), **_MUTATED.get(op, {})}.items():
            variants = [(name, False)] + ([(name + "_out" if name else "out", True)] if spec.has_out else [])
            for overload, out in variants:
                returns = "()" if out else spec.returns
                qualified = f"{op}.{overload}" if overload else op
                lib.define(f"{qualified}({_schema_with(spec, mutated, out)}) -> {returns}")
                lib.impl(qualified, _kernel(spec, overload), "CompositeExplicitAutograd")
                torch.library.register_fake(f"{NAMESPACE}::{qualified}", _fake(spec, overload), lib=lib)
        grads = GRADIENTS.get(op)
        if grads and f"{op}_backward" in _C.OPS:
            save, grad, _ = grads

            def setup_context(ctx, inputs, output, keyword_only_inputs=None, _save=save):
                kw = dict(keyword_only_inputs or {})
                ctx.backend = kw.get("backend", "")
                _save(ctx, inputs, kw)

            torch.library.register_autograd(f"{NAMESPACE}::{op}", grad, setup_context=setup_context, lib=lib)
    _lib = lib
    _install_substitutions()


# ---- calls ----------------------------------------------------------------------------------------

def execute(op, c, backend):
    """Run op on backend (None: the dispatcher's choice) with the bound public arguments c."""
    spec = SPECS[op]
    args = [c.get(n) for n in spec.public_pos]
    while args and args[-1] is None and spec.public_pos[len(args) - 1] in spec.defaults:
        args.pop()
    kwargs = {k: v for k, v in c.items() if k not in spec.public_pos and v is not None}
    x = c[spec.deciding]
    if backend is None:
        backend = _dispatch.choose(op, x, None, _dispatch.CALL_AXES[op](args, kwargs)
                                   if op in _dispatch.CALL_AXES else ())[0]
    if backend == "flash":
        return _flash.OPS[op](*args, **kwargs)
    staged = backend == "cpu" and x.device.type != "cpu"
    # the staged copy-back the Python path does
    return run(op, spec.raw, args, kwargs, x, staged, _dispatch.written_args(op, kwargs) if staged else ())


def _dtype_name(dtype):
    return str(dtype).rpartition(".")[2]


@torch._dynamo.assume_constant_result
def _trace_backend(op, device, dtype, extra, explicit):
    """The backend of a call, decided once when it is traced (torch.compile, export)."""
    axes = {"framework": "torch", "device": device, "dtype": dtype}
    axes.update(extra)
    d = _dispatch.decide_axes(op, axes, explicit)
    if d.winner is None:
        raise _dispatch.ExplicitSelectionError(d.error)
    return d.winner


def _bind(spec, args, kwargs):
    if len(args) > len(spec.public_pos):
        raise TypeError(f"{spec.op}() takes at most {len(spec.public_pos)} positional arguments but "
                        f"{len(args)} were given")
    c = dict(spec.defaults)
    c["out"] = None
    for name, value in zip(spec.public_pos, args):
        c[name] = value
    for name, value in kwargs.items():
        if name not in spec.public or name == "stream":
            raise TypeError(f"{spec.op}() got an unexpected keyword argument '{name}'"
                            + (" (under autograd and torch.compile the op runs on torch's current stream)"
                               if name == "stream" else ""))
        c[name] = value
    return c


# Why an op or a family has no gradient, by op, then by family: the note of route()'s requires-grad error.
_NO_GRADIENT = {"attention": " (attention is inference-only)", "rmsnorm": " (the rmsnorm ops are forward-only)",
                "rotary_kv_append": " (it is inference-only)"}


def route(op, args, kwargs, backend):
    """A public call as a torch operator: autograd records it, tracers see one node."""
    _register()
    spec = SPECS[op]
    c = _bind(spec, args, kwargs)
    out = c.pop("out")
    x = c[spec.deciding]
    if x is None:
        raise TypeError(f"{op}() missing required argument '{spec.deciding}'")
    needs_grad = False
    if torch.is_grad_enabled():
        if out is not None and out.requires_grad:
            raise RuntimeError(f"{op}: out requires grad; out= forms do not record gradients, as torch's own do not")
        if op in COMPOSED and any(isinstance(v, torch.Tensor) and v.requires_grad for v in c.values()):
            return COMPOSED[op](c, backend)
        differentiable = GRADIENTS.get(op, (None, None, ()))[2]
        for name, value in c.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                if out is not None and name in differentiable:
                    raise RuntimeError(f"{op}: out= does not record gradients ({name} requires grad), as torch's own "
                                       f"out= forms do not; call {op} without out=")
                if name not in differentiable or f"{op}_backward" not in _C.OPS:
                    raise RuntimeError(
                        f"{op}: {name} requires grad, but {op} has no gradient for {name}"
                        + _NO_GRADIENT.get(op, _NO_GRADIENT.get(_dispatch.OPS[op][0], ""))
                        + f"; pass {name}.detach() or call it under torch.no_grad()")
                needs_grad = True
    if op == "fused_norm_residual" and c.get("training") and c.get("p", 0.0) > 0 and c.get("seed") is None:
        # torch's generator, as a tensor op: torch.manual_seed reproduces it, CUDA-graph replays redraw it
        c["seed"] = torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64, device=x.device)
    extra = _dispatch.CALL_AXES[op]((), c) if op in _dispatch.CALL_AXES else ()
    if torch.compiler.is_compiling() or type(x) not in _PLAIN:  # traced: decide once, from constants
        chosen = _trace_backend(op, x.device.type, _dtype_name(x.dtype), extra, backend)
    else:  # eager: the dispatcher's cached decision
        chosen = _dispatch.choose(op, x, backend, extra)[0]
    call = {}
    for name, value in c.items():
        if name in _UNIONS and isinstance(value, torch.Tensor):
            call[_UNIONS[name]] = value
        elif name == "seed" and isinstance(value, int) and not isinstance(value, bool):
            call[name] = (value + 2**63) % 2**64 - 2**63  # the low 64 bits, as torch's signed int
        else:
            call[name] = value
    if needs_grad and out is None and not torch.compiler.is_compiling() and type(x) in _PLAIN:
        # eager with gradients: the operator's own autograd formula without its dispatch (~4x the cost)
        return _Eager.apply(op, chosen, {n: call.get(n) for n in spec.kw}, *(call.get(n) for n in spec.pos))
    packet = getattr(torch.ops.qkernels, op)
    overload = "append" if op in _MUTATED and c.get("new_k") is not None else ""
    if out is not None:
        getattr(packet, overload + "_out" if overload else "out")(**call, out=out, backend=chosen)
        return out
    return (getattr(packet, overload) if overload else packet)(**call, backend=chosen)


class _Eager(torch.autograd.Function):
    """An eager call with gradients: the same setup and gradient functions as the operator's autograd
    registration (GRADIENTS), the kernels called directly.  Arguments: op, backend, the schema's
    keyword-only arguments, then its positional ones (the tensors autograd differentiates)."""

    @staticmethod
    def forward(ctx, op, backend, kw, *pos):
        spec = SPECS[op]
        c = dict(zip(spec.pos, pos))
        c.update(kw)
        out = execute(op, _public(c), backend)
        ctx.op, ctx.backend = op, backend
        GRADIENTS[op][0](ctx, pos, kw)
        return out

    @staticmethod
    def backward(ctx, g):
        ctx.needs_input_grad = ctx.needs_input_grad[3:]  # as the operator's formula sees them
        ctx.eager = True
        return (None, None, None, *GRADIENTS[ctx.op][1](ctx, g))


def needs_route(args, kwargs):
    """Whether a torch call must go through the operators: a tensor needs autograd, or is not a plain
    tensor with data (fake, functional or functorch-wrapped tensors of a tracer)."""
    if kwargs.get("training") is True and kwargs.get("seed") is None:
        return True  # dropout without a seed: route() draws it from torch's generator
    grad = torch.is_grad_enabled()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if type(value) not in _PLAIN or (grad and value.requires_grad) or _wrapped(value):
                return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _install_substitutions():
    for op in SPECS:
        entry = getattr(_C, op)

        def polyfill(*args, backend=None, _op=op, **kwargs):
            return route(_op, args, kwargs, backend)

        polyfill.__name__ = polyfill.__qualname__ = op
        torch.compiler.substitute_in_graph(entry, skip_signature_check=True)(polyfill)


_register()
