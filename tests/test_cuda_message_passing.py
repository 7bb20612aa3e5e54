"""message_passing on the cuda backend: both outputs against the float64 reference (qkernels.testing)
over the shapes its kernels take, strided inputs, the cpu backend, determinism, bad indices
contained, the shapes it declines, and CUDA-graph capture.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import reference, sample
from conftest import capture_graph, cuda, f64, rel_err, requires_cuda

pytestmark = [requires_cuda,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

if importlib.util.find_spec("torch"):
    import torch

TOL = 2e-5  # fp32 products of depth <= 3H = 384 and two LayerNorms


def call(rng, index_dtype=np.int64, **options):
    """A sample call as CUDA tensors: -> (NumPy args, torch args, kwargs)."""
    args, kwargs = sample("message_passing", rng, index_dtype=index_dtype, **options)
    return list(args), [cuda(a) for a in args], kwargs


def check(outs, args, kwargs, tol=TOL):
    want = reference("message_passing", *args, **kwargs)
    assert len(outs) == 2
    for got, w, like in zip(outs, want, (args[0], args[1])):
        assert got.device.type == "cuda" and got.dtype == torch.float32 and tuple(got.shape) == like.shape
        assert rel_err(f64(got), w) < tol


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n,e,h,f,heads", [
    (1, 1, 1, 1, 1), (7, 19, 8, 8, 2), (300, 1000, 32, 32, 4), (200, 700, 64, 96, 8), (50, 113, 128, 128, 32),
    (100, 300, 30, 17, 5), (33, 0, 32, 32, 4), (64, 200, 96, 33, 3), (1168, 2640, 32, 32, 4)])
def test_matches_reference(rng, index_dtype, n, e, h, f, heads):
    args, t, kw = call(rng, index_dtype, n=n, e=e, h=h, f=f, heads=heads)
    check(qkernels.message_passing(*t, **kw), args, kw)


def test_cpu_backend_agrees_and_cuda_is_deterministic(rng):
    args, t, kw = call(rng, n=500, e=1500, h=32, f=32, heads=4)
    a = qkernels.message_passing(*t, **kw)
    b = qkernels.message_passing(*t, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = qkernels.message_passing(*args, **kw)  # NumPy in: the cpu kernels
    for x, y in zip(a, c):
        assert rel_err(f64(x), np.asarray(y, dtype=np.float64)) < TOL


def test_strided_inputs(rng):
    args, t, kw = call(rng, n=120, e=400, h=32, f=32, heads=4)
    # every float tensor and index tensor as a non-contiguous view of the same values
    views = []
    for a in t:
        if a.dim() == 2:
            views.append(a.t().contiguous().t())  # column-major
        else:
            views.append(torch.stack([a, torch.zeros_like(a)], -1)[..., 0])  # stride 2
    check(qkernels.message_passing(*views, **kw), args, kw)


def test_bad_indices_are_contained(rng):
    args, t, kw = call(rng, n=60, e=200, h=32, f=32, heads=4)
    names = ("edge_index", "row_ptr", "col_idx", "dir_edge")
    for k, name in zip((2, 3, 4, 5), names):
        bad = [a.clone() for a in t]
        flat = bad[k].view(-1)
        flat[min(3, flat.numel() - 1)] = 10**9 if name != "row_ptr" else -5
        x_out, e_out = qkernels.message_passing(*bad, **kw)
        torch.cuda.synchronize()  # no fault
        assert torch.isfinite(x_out).all() and torch.isfinite(e_out).all(), name


@pytest.mark.parametrize("h,f,heads", [(129, 32, 1), (32, 129, 4), (64, 64, 64)])
def test_declined_shapes_raise(rng, h, f, heads):
    _, t, kw = call(rng, n=10, e=20, h=h, f=f, heads=heads)
    with pytest.raises(Exception, match="message_passing"):
        qkernels.message_passing(*t, backend="cuda", **kw)


def test_cuda_graph_replay_reads_new_inputs(rng):
    args, t, kw = call(rng, n=256, e=700, h=32, f=32, heads=4)
    graph, outs = capture_graph(lambda: qkernels.message_passing(*t, **kw))
    fresh, _ = sample("message_passing", np.random.default_rng(7), n=256, e=700, h=32, f=32, heads=4)
    for k in (0, 1, 6, 13):  # x, e, w1, w_o: new values in the captured tensors
        t[k].copy_(cuda(fresh[k]))
        args[k] = fresh[k]
    graph.replay()
    torch.cuda.synchronize()
    check(outs, args, kw)
