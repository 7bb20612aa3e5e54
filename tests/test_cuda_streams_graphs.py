"""Streams and CUDA graphs for every op, on one GPU: each op captured in a torch CUDA
graph recomputes from the new contents of its inputs at replay; each op runs on the caller's
current torch stream, ordered after work already queued there, while another stream runs the same
op on other inputs.  Inputs at conftest's DEVICE_SIZES.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from qkernels.testing import MUTATED, OPS, sample
from conftest import DEVICE_SIZES, LLM, capture_graph, requires_cuda, outputs, to_device

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = [requires_cuda, pytest.mark.skipif(torch is None, reason="torch is not installed")]


def float_tensors(op, args):
    """The arguments whose contents can change freely (not indices, not lengths)."""
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]


def close(a, b, op):
    """Every result of a (a tensor, or a tuple of them for the backward ops) close to b's."""
    a, b = outputs(a), outputs(b)
    tol = 1e-2 if op in LLM else 1e-5
    return len(a) == len(b) and all((x.float() - y.float()).abs().max().item() <=
                                    tol * max(1.0, y.float().abs().max().item()) for x, y in zip(a, b))


def clone(r):
    return tuple(t.clone() for t in r) if isinstance(r, tuple) else r.clone()


def before(op, args):
    """The arguments as a call is about to find them: copies, taken now, of those the op updates in
    place (so that a later call on them recomputes what that call computed), the others as they are."""
    return [a.clone() if i in MUTATED.get(op, ()) else a for i, a in enumerate(args)]


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(outputs(a), outputs(b)))


@pytest.mark.parametrize("op", OPS)
def test_graph_replay_recomputes_from_new_contents(op):
    rng = np.random.default_rng(OPS.index(op))
    host, kw = sample(op, rng, **DEVICE_SIZES[op])
    args = to_device(op, host, "cuda")
    if not float_tensors(op, args):
        pytest.skip("no float inputs to change (tests/test_cuda_graph_plan.py replays the plan ops)")
    fn = getattr(qkernels, op)
    g, out = capture_graph(lambda: fn(*args, backend="cuda", **kw))
    found = before(op, args)
    g.replay()
    torch.cuda.synchronize()
    first = clone(out)
    assert close(first, fn(*found, backend="cuda", **kw), op)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    for t in float_tensors(op, args):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
    found = before(op, args)
    g.replay()
    torch.cuda.synchronize()
    expected = fn(*found, backend="cuda", **kw)
    assert close(out, expected, op), "the replay used the new contents"
    assert not equal(out, first), "the inputs changed, so must the result"


@pytest.mark.parametrize("op", OPS)
def test_runs_on_the_callers_stream_beside_another(op):
    rng = np.random.default_rng(100 + OPS.index(op))
    host_a, kw = sample(op, rng, **DEVICE_SIZES[op])
    host_b, _ = sample(op, rng, **DEVICE_SIZES[op])
    a, b = to_device(op, host_a, "cuda"), to_device(op, host_b, "cuda")
    fn = getattr(qkernels, op)
    fresh = [torch.randn(t.shape, device="cuda").to(t.dtype) for t in float_tensors(op, a)]
    torch.cuda.synchronize()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(sa):
        torch.cuda._sleep(20_000_000)  # ~10 ms: anything not ordered on sa would run first
        for t, f in zip(float_tensors(op, a), fresh):
            t.copy_(f)
        found_a = before(op, a)
        out_a = fn(*a, backend="cuda", **kw)
    with torch.cuda.stream(sb):
        found_b = before(op, b)
        out_b = fn(*b, backend="cuda", **kw)
    torch.cuda.synchronize()
    assert close(out_a, fn(*found_a, backend="cuda", **kw), op), "ran after the copies queued on the caller's stream"
    assert close(out_b, fn(*found_b, backend="cuda", **kw), op)
