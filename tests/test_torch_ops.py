"""qkernels as PyTorch operators (qkernels/torch.py): registration, fake implementations, opcheck,
torch.compile without graph breaks, torch.export, out= and in-place mutation, and the refusals of
inputs that need a gradient the op does not have.  Gradients themselves: test_torch_autograd.py."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import DEVICE_SIZES, capture_graph, requires_cuda, requires_torch, to_device, torch_sample, with_traced
from qkernels import testing
from qkernels.testing import FLOAT_ARGS

pytestmark = requires_torch
pytest.importorskip("qkernels.torch")  # registers the operators these tests call directly
torch = pytest.importorskip("torch")

FORWARD = [op for op in testing.OPS if not op.endswith("_backward")]


def fresh(args):
    """Clones of a sample's tensors: an op that updates an argument in place (testing.MUTATED) sees the
    sample's values on every call."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def test_import_leaves_torch_unimported():
    code = "import sys, qkernels, numpy as np; qkernels.linear(np.ones((2, 3), np.float32), np.ones((4, 3), " \
           "np.float32)); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_operators_registered_at_first_torch_tensor():
    code = ("import qkernels, torch, numpy as np\n"
            "x = torch.ones(2, 3)\n"
            "qkernels.linear(x, torch.ones(4, 3))\n"
            "print(torch.ops.qkernels.linear.default(x, torch.ones(4, 3)).shape)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "torch.Size([2, 4])"


@pytest.mark.parametrize("op", FORWARD)
def test_operator_matches_public_op(op, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    want = getattr(qkernels, op)(*fresh(args), **kwargs)
    got = getattr(torch.ops.qkernels, op)(*fresh(args), **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op", testing.OPS)  # the backward ops too: autograd traces them
def test_opcheck(op, rng):
    import torch

    args, kwargs = torch_sample(op, rng)
    torch.library.opcheck(getattr(torch.ops.qkernels, op).default, tuple(args), kwargs)


@pytest.mark.parametrize("op", [op for op in FORWARD if "out" in __import__("qkernels")._dispatch.params(op)])
def test_opcheck_out(op, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    out = torch.full_like(getattr(qkernels, op)(*args, **kwargs), float("nan"))
    torch.library.opcheck(getattr(torch.ops.qkernels, op).out, tuple(args), dict(kwargs, out=out))


@pytest.mark.parametrize("op", FORWARD)
def test_compile_fullgraph_without_breaks(op, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    fn = getattr(qkernels, op)

    def f(*a):
        out = fn(*a, **kwargs)
        return tuple(o * 2 for o in out) if isinstance(out, tuple) else out * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    got = torch.compile(f, fullgraph=True)(*fresh(args))
    torch.testing.assert_close(got, f(*fresh(args)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("op", FORWARD)
def test_export(op, strict, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    fn = getattr(qkernels, op)

    class M(torch.nn.Module):
        def forward(self, *ts):
            return with_traced(fn, args, kwargs, tensors)(*ts)

    ep = torch.export.export(M(), tuple(args[i] for i in tensors), strict=strict)
    nodes = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.qkernels, op).default in nodes
    torch.testing.assert_close(ep.module()(*(fresh(args)[i] for i in tensors)), fn(*fresh(args), **kwargs))


def test_backend_resolved_at_trace_time(rng):
    import torch

    import qkernels

    args, kwargs = torch_sample("linear", rng)
    with qkernels.use_backend(linear="cpu"):
        ep = torch.export.export(_Call("linear", kwargs), tuple(args))
    (node,) = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert node.kwargs["backend"] == "cpu"
    with pytest.raises(qkernels.ExplicitSelectionError, match="linear: backend 'cuda'"):
        torch.export.export(_Call("linear", dict(kwargs, backend="cuda")), tuple(args))


class _Call(torch.nn.Module):
    def __init__(self, op, kwargs):
        super().__init__()
        self.op, self.kwargs = op, kwargs

    def forward(self, *args):
        import qkernels

        return getattr(qkernels, self.op)(*args, **self.kwargs)


def test_in_place_rotary_under_compile(rng):
    import torch

    import qkernels

    (x, f), kw = torch_sample("rotary_emb", rng)
    want = qkernels.rotary_emb(x, f)

    def g(y, f):
        qkernels.rotary_emb(y, f, out=y)
        return y + 0

    y = x.clone()
    torch._dynamo.reset()
    got = torch.compile(g, fullgraph=True)(y, f)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(y, want)  # the input itself was written


def test_out_moves_version_counter(rng):
    import torch

    import qkernels

    (x, f), _ = torch_sample("rotary_emb", rng)
    v = x._version
    qkernels.rotary_emb(x, f, out=x)
    assert x._version > v
    (xl, w, b), _ = torch_sample("linear", rng)
    out = torch.empty(xl.shape[0], w.shape[0])
    v = out._version
    qkernels.linear(xl, w, b, out=out)
    assert out._version > v


def test_autograd_sees_in_place_write(rng):
    import torch

    import qkernels

    (x, f), _ = torch_sample("rotary_emb", rng)
    a = torch.randn(x.shape, requires_grad=True)
    y = a * 2  # saved by the multiplication below
    z = y * y
    with torch.no_grad():
        qkernels.rotary_emb(y, f, out=y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_paged_append_mutates_caches_under_compile(rng):
    import torch

    import qkernels

    args, _ = torch_sample("attn_paged_decode", rng)
    q, k_cache, v_cache = args[:3]
    new_k = torch.randn(q.shape[0], k_cache.shape[1], k_cache.shape[2])
    new_v = torch.randn_like(new_k)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = qkernels.attn_paged_decode(q, want_k, want_v, *args[3:], new_k=new_k, new_v=new_v)

    def g(*a):
        return qkernels.attn_paged_decode(*a, new_k=new_k, new_v=new_v) + 0

    torch._dynamo.reset()
    got = torch.compile(g, fullgraph=True)(*args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(k_cache, want_k)
    torch.testing.assert_close(v_cache, want_v)
    torch.library.opcheck(torch.ops.qkernels.attn_paged_decode.append, tuple(args),
                          dict(new_k=new_k, new_v=new_v))


@pytest.mark.parametrize("op", [op for op in FORWARD if op.startswith("attn_")])
def test_inference_only_ops_refuse_grad(op, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    args[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"^{op}: q requires grad, but {op} has no gradient for q .attention is inference-only"):
        getattr(qkernels, op)(*args, **kwargs)
    with torch.no_grad():
        getattr(qkernels, op)(*args, **kwargs)


@pytest.mark.parametrize("op", ["linear", "rotary_emb", "fused_norm_residual"])
def test_out_refuses_grad(op, rng):
    import torch

    import qkernels

    args, kwargs = torch_sample(op, rng)
    out = getattr(qkernels, op)(*args, **kwargs)
    args[FLOAT_ARGS[op][0]].requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"{op}: out= does not record gradients"):
        getattr(qkernels, op)(*args, **kwargs, out=out)
    with torch.no_grad():
        getattr(qkernels, op)(*args, **kwargs, out=out)


def test_raw_op_refuses_grad_with_the_public_op_named(rng):
    import qkernels

    (x, w, b), _ = torch_sample("linear", rng)
    x.requires_grad_(True)
    with pytest.raises(qkernels._C.GradRequiredError, match="call qkernels.linear"):
        qkernels._C.linear_raw(x, w, b)
    assert issubclass(qkernels._C.GradRequiredError, RuntimeError)


def test_dropout_follows_torch_manual_seed(rng):
    import torch

    import qkernels

    args, _ = torch_sample("fused_norm_residual", rng, rows=64, h=32)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append([qkernels.fused_norm_residual(*args, p=0.5, training=True) for _ in range(2)])
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)  # same torch seed, same mask
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    assert not torch.equal(runs[0][0], runs[0][1])  # the next call draws a new one


def test_stream_keyword_refused_on_the_operator_path(rng):
    import qkernels

    (x, w, b), _ = torch_sample("linear", rng)
    x.requires_grad_(True)
    with pytest.raises(TypeError, match="stream"):
        qkernels.linear(x, w, b, stream=None)


@requires_cuda
@pytest.mark.parametrize("op", FORWARD)
def test_reduce_overhead_on_cuda(op, rng):
    """torch.compile(mode="reduce-overhead"): the op inside CUDA graphs that torch captures."""
    import torch

    import qkernels

    args, kwargs = testing.sample(op, rng, **DEVICE_SIZES[op])  # sizes the cuda kernels take
    args = to_device(op, args, "cuda")
    kwargs = {k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    fn = getattr(qkernels, op)

    def f(*a):
        return fn(*a, **kwargs) * 2

    torch._dynamo.reset()
    g = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    want = f(*fresh(args))
    for _ in range(3):  # warm-up, record, replay
        got = g(*fresh(args))
    torch.testing.assert_close(got, want)


@requires_cuda
def test_cuda_graph_replays_draw_fresh_dropout_masks(rng):
    import torch

    import qkernels

    x, res, gamma, beta = (torch.randn(*s, device="cuda") for s in ((256, 64), (256, 64), (64,), (64,)))
    graph, out = capture_graph(lambda: qkernels.fused_norm_residual(x, res, gamma, beta, p=0.5, training=True))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)  # a new seed per replay: torch's generator advanced
    torch.manual_seed(9)
    a = qkernels.fused_norm_residual(x, res, gamma, beta, p=0.5, training=True)
    torch.manual_seed(9)
    torch.testing.assert_close(qkernels.fused_norm_residual(x, res, gamma, beta, p=0.5, training=True), a,
                               rtol=0, atol=0)
