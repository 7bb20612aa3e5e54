"""Gradients through qkernels' torch operators: every differentiable input of every op against
autograd of a float64 torch formulation of the op, directional finite differences, torch.compile
forward+backward without graph breaks, and no gradient ever dropped silently, on cpu and (where a
GPU is present) cuda."""

import pytest

from conftest import assert_compiles_like_eager, requires_cuda, requires_torch, torch_sample
from qkernels import testing

pytestmark = requires_torch
pytest.importorskip("qkernels.torch")  # registers the operators these tests call directly


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    return request.param


# ---- float64 torch formulations of the ops (autograd gives their reference gradients) -----------

def _t_sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat):
    import torch

    lo, hi = int(row_ptr[0]), int(row_ptr[-1])
    rows = torch.repeat_interleave(torch.arange(len(row_ptr) - 1, device=row_ptr.device),
                                   torch.diff(row_ptr).long())
    out = node_feat.new_zeros((len(row_ptr) - 1, *node_feat.shape[1:]))
    return out.index_add(0, rows, edge_weight[lo:hi, :, None] * node_feat[col_idx[lo:hi].long()])


def _t_fused_edge_features(x, edge_index, edge_attr=None):
    import torch

    xs, xd = x[edge_index[0].long()], x[edge_index[1].long()]
    return torch.cat([xs + xd, (xs - xd).abs()] + ([] if edge_attr is None else [edge_attr]), dim=1)


def _t_fused_norm_residual(x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None):
    import torch

    y = torch.nn.functional.layer_norm(x, x.shape[-1:], gamma, beta, eps)
    if training and p > 0:
        keep = torch.from_numpy(testing.dropout_keep(int(seed), tuple(y.shape), p))
        y = torch.where(keep, y / (1 - p), torch.zeros_like(y))
    return y + residual


def _t_graph_norm_bce(logits, target, edge_graph, num_graphs, *, pos_weight=None):
    import torch

    loss = torch.clamp(logits, min=0) - logits * target + torch.log1p(torch.exp(-logits.abs()))
    if pos_weight is not None:
        loss = loss * (1 + (pos_weight - 1) * target)
    g = edge_graph.long()
    sums = loss.new_zeros(num_graphs).index_add(0, g, loss)
    counts = torch.bincount(g, minlength=num_graphs).clamp(min=1)
    return (sums / counts).mean()


def _t_rotary_emb(x, freqs_cis, *, interleaved=True):
    import torch

    c, s = freqs_cis[..., None, :, 0], freqs_cis[..., None, :, 1]
    half = x.shape[-1] // 2
    xe, xo = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    ye, yo = xe * c - xo * s, xe * s + xo * c
    if interleaved:
        return torch.stack([ye, yo], dim=-1).flatten(-2)
    return torch.cat([ye, yo], dim=-1)


def _t_linear(x, weight, bias=None):
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def _t_swiglu(x, up_weight, gate_weight):
    import torch

    F = torch.nn.functional
    return F.linear(x, up_weight) * F.silu(F.linear(x, gate_weight))


def _t_message_passing(x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o,
                       gamma_x, beta_x, gamma_e, beta_e, *, eps=1e-5):
    import torch

    (N, H), K = x.shape, w_att.shape[1]
    h = torch.relu(_t_fused_edge_features(x, edge_index, e) @ w1 + b1)
    att = torch.sigmoid(h @ w_att + b_att)[dir_edge.long()]
    agg = _t_sparse_aggregate(row_ptr, col_idx, att, (x @ w_v).reshape(N, K, H // K)).reshape(N, H)
    return (_t_fused_norm_residual(agg @ w_o, x, gamma_x, beta_x, eps=eps),
            _t_fused_norm_residual(h @ w_msg + b_msg, e, gamma_e, beta_e, eps=eps))


REFS = {name[3:]: fn for name, fn in globals().items() if name.startswith("_t_")}
DIFFERENTIABLE = {  # op -> positions of the inputs with gradients
    "sparse_aggregate": (2, 3), "fused_edge_features": (0, 2), "fused_norm_residual": (0, 1, 2, 3),
    "graph_norm_bce": (0,), "rotary_emb": (0,), "linear": (0, 1, 2), "swiglu": (0, 1, 2),
    "message_passing": (0, 1) + tuple(range(6, 18)),  # every float input, through its composition
}
DENSE = ("rotary_emb", "linear", "swiglu")
COMPOSED = ("message_passing",)  # no backward kernels: under autograd the public op runs its composition
# Finite differences over the inputs past message_passing's relu and |x[src] - x[dst]|: a step across one
# of their kinks is off by percents; the gradients before them are checked against float64 autograd.
FD_POSITIONS = {"message_passing": tuple(range(8, 18))}


def _torch_call(op, rng, dtype=None, device="cpu", **sizes):
    """A sample call as torch tensors on device; the differentiable inputs in dtype (default: float32,
    and bfloat16 for the dense ops on cuda, whose CUDA kernels take 16-bit floats only)."""
    import torch

    if dtype is None:
        dtype = "bfloat16" if device == "cuda" and op in DENSE else "float32"
    args, kwargs = torch_sample(op, rng, device, **sizes)
    for i in testing.FLOAT_ARGS[op]:  # every float input (graph_norm_bce's target has the logits' dtype)
        if i < len(args) and args[i] is not None and (op, i) != ("rotary_emb", 1):
            args[i] = args[i].to(getattr(torch, dtype))
    return args, kwargs


def _outs(out):
    return out if isinstance(out, tuple) else (out,)


def _weights(out, **like):
    """A random float64 weight per output of the op (message_passing has two)."""
    import torch

    return tuple(torch.randn(o.shape, dtype=torch.float64, **like) for o in _outs(out))


def _grads(fn, args, kwargs, positions, weight):
    """The gradients of sum(fn(...) * weight) (summed over the op's outputs) with respect to args at positions."""
    args = list(args)
    leaves = []
    for i in positions:
        if i < len(args) and args[i] is not None:
            args[i] = args[i].detach().requires_grad_(True)
            leaves.append(args[i])
    out = fn(*args, **kwargs)
    sum((o * w.to(o.dtype)).sum() for o, w in zip(_outs(out), weight, strict=True)).backward()
    return out, [leaf.grad for leaf in leaves]


TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _check_against_reference(op, args, kwargs, dtype=None):
    import torch

    import qkernels

    positions = DIFFERENTIABLE[op]
    dtype = dtype or str(args[positions[0]].dtype).rpartition(".")[2]
    out = getattr(qkernels, op)(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    weight = _weights(out)
    got_out, got = _grads(getattr(qkernels, op), args, kwargs, positions, [w.to(args[0].device) for w in weight])
    assert all(o.grad_fn is not None for o in _outs(got_out)), f"{op}: the result is not connected to autograd"
    host = lambda a: a.detach().cpu() if isinstance(a, torch.Tensor) else a  # noqa: E731
    ref_args = [host(a).double() if isinstance(a, torch.Tensor) and a.is_floating_point() else host(a) for a in args]
    ref_out, want = _grads(REFS[op], ref_args, {k: host(v) for k, v in kwargs.items()}, positions, weight)
    for o, r in zip(_outs(got_out), _outs(ref_out), strict=True):
        torch.testing.assert_close(o.double().cpu(), r, rtol=TOL[dtype], atol=TOL[dtype])
    for g, w in zip(got, want):
        assert g is not None and g.dtype == getattr(torch, dtype)
        err = (g.double().cpu() - w).norm() / max(w.norm().item(), 1e-30)
        assert err <= 4 * TOL[dtype], (op, err.item())


SIZES = {  # awkward sizes per op
    "sparse_aggregate": [{}, dict(n_dst=13, n_src=9, heads=3, dim=5, avg_degree=7)],
    "fused_edge_features": [{}, dict(n=9, e=31, h=5), dict(n=4, e=7, h=3, edge_attr=False)],
    "fused_norm_residual": [{}, dict(rows=7, h=33)],
    "graph_norm_bce": [{}, dict(e=41, graphs=5, sort=False)],
    "rotary_emb": [{}, dict(lead=(2, 3), h=2, d=6, interleaved=False)],
    "linear": [{}, dict(m=5, k=17, n=9), dict(m=1, k=3, n=2, bias=False)],
    "swiglu": [{}, dict(m=4, k=13, n=6)],
    "message_passing": [{}, dict(n=9, e=17, h=6, f=5, heads=3), dict(n=1, e=3, h=4, f=7, heads=4)],
}


@pytest.mark.parametrize("op,sizes", [(op, s) for op in DIFFERENTIABLE for s in SIZES[op]])
def test_gradients_match_float64_autograd(op, sizes, device, rng):
    args, kwargs = _torch_call(op, rng, device=device, **sizes)
    _check_against_reference(op, args, kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", list(DIFFERENTIABLE))
def test_gradients_16bit(op, dtype, device, rng):
    if device == "cpu" and op not in DENSE or op in COMPOSED:
        pytest.skip("the CPU graph kernels and message_passing take float32 only")
    args, kwargs = _torch_call(op, rng, dtype=dtype, device=device)
    _check_against_reference(op, args, kwargs)


@pytest.mark.parametrize("op", list(DIFFERENTIABLE))
def test_gradients_of_strided_inputs(op, device, rng):
    """Every differentiable input as a non-contiguous view (every other element of a wider tensor)."""
    import torch

    args, kwargs = _torch_call(op, rng, device=device)
    for i in DIFFERENTIABLE[op]:
        a = args[i]
        if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[-1] > 0:
            wide = torch.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype=a.dtype, device=a.device)
            wide[..., ::2] = a
            if op in DENSE and i == 0 or (op, i) in (("linear", 1), ("swiglu", 1), ("swiglu", 2)):
                continue  # the dense ops' rows are unit-stride along K by contract
            args[i] = wide[..., ::2]
            assert not args[i].is_contiguous()
    _check_against_reference(op, args, kwargs)


def test_dropout_gradient_uses_the_forward_mask(device, rng):
    import torch

    import qkernels

    args, _ = _torch_call("fused_norm_residual", rng, device=device, rows=16, h=24)
    kwargs = dict(p=0.3, training=True, seed=77)
    _check_against_reference("fused_norm_residual", args, kwargs)
    # seed=None: the mask drawn from torch's generator is the one the backward regenerates
    x = args[0].detach().requires_grad_(True)
    torch.manual_seed(5)
    y = qkernels.fused_norm_residual(x, *args[1:], p=0.3, training=True)
    y.sum().backward()
    torch.manual_seed(5)
    y2 = qkernels.fused_norm_residual(x.detach(), *args[1:], p=0.3, training=True)
    torch.testing.assert_close(y.detach(), y2, rtol=0, atol=0)


@pytest.mark.parametrize("op", list(DIFFERENTIABLE))
def test_directional_finite_differences(op, device, rng):
    """<grad, v> against (f(x + h v) - f(x - h v)) / 2h in float32 for a random direction v over every
    differentiable input at once."""
    import torch

    import qkernels

    args, kwargs = _torch_call(op, rng, device=device)
    if device == "cuda" and op in DENSE:
        pytest.skip("16-bit only on cuda: a finite difference in bfloat16 resolves nothing")
    if op == "fused_norm_residual":
        kwargs = dict(p=0.25, training=True, seed=3)
    if op == "fused_edge_features":  # nodes 10 apart: no step of h crosses the kink of |x[src] - x[dst]|
        args[0] = args[0] + 10 * torch.arange(args[0].shape[0], device=device, dtype=args[0].dtype)[:, None]
    fn = getattr(qkernels, op)
    positions = [i for i in FD_POSITIONS.get(op, DIFFERENTIABLE[op]) if i < len(args) and args[i] is not None]
    weight = _weights(fn(*args, **kwargs), device=device)
    _, grads = _grads(fn, args, kwargs, positions, weight)
    dirs = [torch.randn_like(args[i]) for i in positions]
    h = 1e-3 if op in COMPOSED else 1e-2  # LayerNorms after sigmoids: a shorter step

    def at(sign):
        a = list(args)
        for i, d in zip(positions, dirs):
            a[i] = args[i].detach() + sign * h * d
        with torch.no_grad():
            return sum((o.double() * w).sum().item() for o, w in zip(_outs(fn(*a, **kwargs)), weight))

    fd = (at(1) - at(-1)) / (2 * h)
    an = sum((g.double() * d.double()).sum().item() for g, d in zip(grads, dirs))
    assert abs(fd - an) <= 2e-2 * max(abs(an), 1.0), (fd, an)


@pytest.mark.parametrize("op", list(DIFFERENTIABLE))
def test_compile_forward_backward_without_breaks(op, device, rng):
    import qkernels

    args, kwargs = _torch_call(op, rng, device=device)
    fn = getattr(qkernels, op)
    positions = [i for i in DIFFERENTIABLE[op] if i < len(args) and args[i] is not None]

    def step(*a):
        return sum((o ** 2).sum() for o in _outs(fn(*a, **kwargs)))

    def grads(f):
        a = list(args)
        for i in positions:
            a[i] = args[i].detach().requires_grad_(True)
        loss = f(*a)
        loss.backward()
        return loss, [a[i].grad for i in positions]

    assert_compiles_like_eager(step, grads, *[a.detach().requires_grad_(True) if i in positions else a
                                              for i, a in enumerate(args)])


@pytest.mark.parametrize("op", [op for op in DIFFERENTIABLE if op not in COMPOSED])  # theirs: no autograd formula
def test_opcheck_with_gradients(op, device, rng):
    import torch

    args, kwargs = _torch_call(op, rng, device=device)
    for i in DIFFERENTIABLE[op]:
        if i < len(args) and args[i] is not None:
            args[i] = args[i].requires_grad_(True)
    torch.library.opcheck(getattr(torch.ops.qkernels, op).default, tuple(args), kwargs)


@pytest.mark.parametrize("op", list(DIFFERENTIABLE))
def test_no_grad_keeps_the_c_path(op, device, rng):
    import torch

    import qkernels

    args, kwargs = _torch_call(op, rng, device=device)
    for i in DIFFERENTIABLE[op]:
        if i < len(args) and args[i] is not None:
            args[i].requires_grad_(True)
    with torch.no_grad():
        out = getattr(qkernels, op)(*args, **kwargs)
    assert all(o.grad_fn is None and not o.requires_grad for o in _outs(out))
    with torch.inference_mode():
        getattr(qkernels, op)(*args, **kwargs)


def test_training_a_linear_in_front_of_sparse_aggregate(rng):
    """A Linear, then sparse_aggregate, plus a skip connection: the weight gradient equals the
    float64 reference's (it was once silently missing the aggregation's share)."""
    import torch

    import qkernels

    (row_ptr, col_idx, ew, nf), _ = _torch_call("sparse_aggregate", rng, n_dst=6, n_src=6, heads=1, dim=4)
    lin = torch.nn.Linear(4, 4)
    x = nf[:, 0, :]

    def model(agg):
        h = lin(x)
        return (agg(row_ptr, col_idx, ew, h[:, None, :])[:, 0, :] + h).square().sum()

    model(qkernels.sparse_aggregate).backward()
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    lin.bias.grad = None
    model(_t_sparse_aggregate).backward()
    torch.testing.assert_close(got, lin.weight.grad, rtol=1e-5, atol=1e-5)


# ---- graph plans: built once, passed through the forward to the backward -------------------------

def _planned_calls(rng, device):
    """(sparse_aggregate args, its plan, fused_edge_features args, its plan) as torch tensors."""
    import qkernels

    sa, _ = _torch_call("sparse_aggregate", rng, device=device, n_dst=40, n_src=30, heads=2, dim=8)
    ef, _ = _torch_call("fused_edge_features", rng, device=device, n=30, e=90, h=8)
    ef[1][1, ::4] = ef[1][0, ::4]  # self loops
    return (sa, qkernels.sparse_aggregate_plan(sa[0], sa[1], sa[3].shape[0]),
            ef, qkernels.fused_edge_features_plan(ef[1], ef[0].shape[0]))


def _loss_and_grads(fn, sa, sa_plan, ef, ef_plan):
    import torch

    ew, nf = sa[2].detach().requires_grad_(True), sa[3].detach().requires_grad_(True)
    x, ea = ef[0].detach().requires_grad_(True), ef[2].detach().requires_grad_(True)
    loss = fn(sa[0], sa[1], ew, nf, sa_plan, x, ef[1], ea, ef_plan)
    loss.backward()
    return loss.detach(), [t.grad for t in (ew, nf, x, ea)]


def _planned_step(row_ptr, col_idx, ew, nf, sa_plan, x, ei, ea, ef_plan):
    import qkernels

    a = qkernels.sparse_aggregate(row_ptr, col_idx, ew, nf, plan=sa_plan)
    b = qkernels.fused_edge_features(x, ei, ea, plan=ef_plan)
    return (a ** 2).sum() + (b ** 2).sum()


def test_plan_gives_the_same_gradient_bits(device, rng):
    import torch

    sa, sa_plan, ef, ef_plan = _planned_calls(rng, device)
    loss_p, g_p = _loss_and_grads(_planned_step, sa, sa_plan, ef, ef_plan)
    loss_n, g_n = _loss_and_grads(_planned_step, sa, None, ef, None)
    assert torch.equal(loss_p, loss_n)
    for a, b in zip(g_p, g_n):
        assert torch.equal(a, b)
    ref = _loss_and_grads(lambda rp, ci, ew, nf, _p, x, ei, ea, _q: (_t_sparse_aggregate(rp, ci, ew, nf) ** 2).sum()
                          + (_t_fused_edge_features(x, ei, ea) ** 2).sum(),
                          [t.double() if t.is_floating_point() else t for t in sa], None,
                          [t.double() if t.is_floating_point() else t for t in ef], None)[1]
    for a, b in zip(g_p, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_plan_compiles_without_breaks(device, rng):
    sa, sa_plan, ef, ef_plan = _planned_calls(rng, device)
    args = [*sa, sa_plan, *ef, ef_plan]
    args = [args[0], args[1], args[2].detach().requires_grad_(True), args[3].detach().requires_grad_(True), args[4],
            args[5].detach().requires_grad_(True), args[6], args[7].detach().requires_grad_(True), args[8]]
    assert_compiles_like_eager(_planned_step, lambda f: _loss_and_grads(f, sa, sa_plan, ef, ef_plan), *args)


def test_opcheck_with_plans(device, rng):
    import torch

    sa, sa_plan, ef, ef_plan = _planned_calls(rng, device)
    sa = [t.requires_grad_(True) if t.is_floating_point() else t for t in sa]
    ef = [t.requires_grad_(True) if t.is_floating_point() else t for t in ef]
    torch.library.opcheck(torch.ops.qkernels.sparse_aggregate.default, (*sa, sa_plan), {})
    torch.library.opcheck(torch.ops.qkernels.fused_edge_features.default, (*ef, ef_plan), {})
    torch.library.opcheck(torch.ops.qkernels.sparse_aggregate_plan.default, (sa[0], sa[1], sa[3].shape[0]), {})
    torch.library.opcheck(torch.ops.qkernels.fused_edge_features_plan.default, (ef[1], ef[0].shape[0]), {})


# ---- message_passing: no backward kernels, so under autograd the public op runs its composition -----

MP_SIZES = dict(n=9, e=17, h=6, f=5, heads=3)


def _qkernels_ops(fn, *args):
    """The qkernels operators of the one graph Dynamo traces from fn(*args)."""
    import torch

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    return {str(n.target) for n in explained.graphs[0].graph.nodes if str(n.target).startswith("qkernels.")}


def test_message_passing_is_fused_without_gradients_and_composed_with_them(rng):
    import torch

    import qkernels

    args, _ = _torch_call("message_passing", rng, **MP_SIZES)

    def f(*a):
        return qkernels.message_passing(*a, eps=1e-3)

    gamma_e = 16
    with_grad = [a.detach().requires_grad_(i == gamma_e) for i, a in enumerate(args)]
    assert _qkernels_ops(f, *args) == {"qkernels.message_passing"}
    assert _qkernels_ops(f, *with_grad) == {"qkernels.fused_edge_features", "qkernels.sparse_aggregate",
                                           "qkernels.fused_norm_residual"}
    with torch.no_grad():
        assert _qkernels_ops(f, *with_grad) == {"qkernels.message_passing"}

    fused = f(*args)
    x_out, e_out = f(*with_grad)
    assert x_out.grad_fn is None and e_out.grad_fn is not None  # x_out does not depend on gamma_e
    for got, want in zip((x_out, e_out), fused):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
    weight = torch.randn(e_out.shape, dtype=torch.float64)
    (e_out * weight.float()).sum().backward()
    ref = [a.double() if a.is_floating_point() else a for a in args]
    ref[gamma_e].requires_grad_(True)
    (_t_message_passing(*ref, eps=1e-3)[1] * weight).sum().backward()  # eps reaches the composition
    torch.testing.assert_close(with_grad[gamma_e].grad.double(), ref[gamma_e].grad, rtol=1e-5, atol=1e-5)
    assert [i for i, a in enumerate(with_grad) if a.grad is not None] == [gamma_e]


def _with_extra_head(a):
    import torch

    a[10] = torch.cat([a[10], a[10][:, :1]], 1)  # w_att [F, K + 1], b_att [K + 1]: K + 1 = 4 does not divide H = 6
    a[11] = torch.cat([a[11], a[11][:1]])


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a.__setitem__(0, a[0].double()), TypeError, "message_passing: x must be float32, got float64"),
    (lambda a: a.__setitem__(4, a[4].long() if a[3].element_size() == 4 else a[4].int()), TypeError,
     "message_passing: col_idx must have row_ptr's dtype"),
    (lambda a: a.__setitem__(1, a[1][:, :-1]), ValueError, r"message_passing: e must have shape \[E, H\]"),
    (lambda a: a.__setitem__(8, a[8][:, None]), ValueError, "message_passing: w_msg must have 2 dimensions"),
    (_with_extra_head, ValueError, "message_passing: the number of heads K = w_att.shape.1. = 4 must be >= 1 and "
     "divide H = 6"),
])
@pytest.mark.parametrize("grad", [False, True])
def test_message_passing_errors_with_and_without_gradients(change, exc, match, grad, rng):
    """The composition's checks raise the binding's errors: the same kind, op and argument."""
    import qkernels

    args, _ = _torch_call("message_passing", rng, **MP_SIZES)
    change(args)
    if grad:
        args[6].requires_grad_(True)
    with pytest.raises(exc, match=match):
        qkernels.message_passing(*args)


def test_message_passing_operator_refuses_gradients_it_cannot_record(rng):
    """The operator has no autograd formula: called directly with an input that requires grad it raises,
    naming the public op, which records them."""
    import torch

    import qkernels

    args, _ = _torch_call("message_passing", rng, **MP_SIZES)
    args[6].requires_grad_(True)
    with pytest.raises(qkernels._C.GradRequiredError, match="message_passing: w1 requires grad.*call qkernels.mess"):
        torch.ops.qkernels.message_passing(*args)
