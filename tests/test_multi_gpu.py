"""Device placement on a machine with two GPUs (issue 9): every op runs on the device its tensors
live on, whichever device is current; the result lands there, matches the cpu backend, the
caller's current device is restored, and torch allocates nothing on the other device.  A call
mixing cuda:0 and cuda:1 raises a ValueError naming both.  Skipped with fewer than two GPUs."""

import importlib.util

import numpy as np
import pytest

import qkernels
from attn_refs import paged_inputs, paged_prefill_inputs
from conftest import random_inputs

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = pytest.mark.skipif(
    torch is None or not qkernels.AVAILABLE or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def host_inputs(op, rng):
    """(args, kwargs) as NumPy arrays (float32 for graph ops; float32 stand-ins for bf16 LLM inputs)."""
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    if op == "sparse_aggregate":
        return list(random_inputs(rng, 60, 40, 2, 16)), {}
    if op == "fused_edge_features":
        return [f32(50, 8), rng.integers(0, 50, (2, 100)), f32(100, 8)], {}
    if op == "fused_norm_residual":
        return [f32(30, 64), f32(30, 64), f32(64), f32(64)], {}
    if op == "graph_norm_bce":
        return [f32(500), (rng.random(500) < 0.3).astype(np.float32), np.sort(rng.integers(0, 7, 500)), 7], {}
    if op == "attn_decode":
        return [f32(2, 1, 8, 64), f32(2, 50, 2, 64), f32(2, 50, 2, 64)], {}
    if op == "attn_paged_decode":
        return list(paged_inputs(rng, [5, 40], 2, 4, 64)), {}
    if op == "attn_prefill":
        return [f32(2, 30, 8, 64), f32(2, 50, 2, 64), f32(2, 50, 2, 64)], {"is_causal": True}
    if op == "attn_paged_prefill":
        return list(paged_prefill_inputs(rng, [5, 30, 0], [40, 30, 7], 2, 4, 64)), {"is_causal": True}
    if op == "rotary_emb":
        ang = 10 * rng.random((10, 32))
        return [f32(10, 4, 64), np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)], {}
    if op == "linear":
        return [f32(4, 128), f32(64, 128), f32(64)], {}
    if op == "swiglu":
        return [f32(4, 128), f32(64, 128), f32(64, 128)], {}
    raise AssertionError(op)


LLM = {"attn_decode", "attn_paged_decode", "attn_prefill", "attn_paged_prefill", "rotary_emb", "linear", "swiglu"}
FLOAT_ARGS = {"attn_paged_decode": 3, "attn_paged_prefill": 3, "rotary_emb": 1}  # leading float arguments in the op's dtype


def host_tensors(op, args):
    """CPU torch tensors in the op's dtypes (bf16 for the LLM ops' leading float inputs), converted
    on the host; other arguments as they are."""
    n_float = FLOAT_ARGS.get(op, len(args))
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, np.ndarray):
            out.append(a)
            continue
        t = torch.from_numpy(np.ascontiguousarray(a))
        if op in LLM and t.is_floating_point() and i < n_float:
            t = t.to(torch.bfloat16)
        out.append(t)
    return out


def to_device(op, args, device):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in host_tensors(op, args)]


OPS = ["sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce", "attn_decode",
       "attn_paged_decode", "attn_prefill", "attn_paged_prefill", "rotary_emb", "linear", "swiglu"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("current,data", [(0, 1), (1, 0)])
def test_runs_on_the_tensors_device(rng, op, current, data):
    args, kw = host_inputs(op, rng)
    fn = getattr(qkernels, op)
    on_cpu = to_device(op, args, "cpu")
    expected = fn(*on_cpu, backend="cpu", **kw).float()
    with torch.cuda.device(current):
        on_gpu = to_device(op, args, f"cuda:{data}")
        torch.cuda.synchronize(current)
        before = torch.cuda.memory_allocated(current)
        out = fn(*on_gpu, backend="cuda", **kw)
        torch.cuda.synchronize(data)
        assert torch.cuda.current_device() == current, "the caller's device is restored"
        assert torch.cuda.memory_allocated(current) == before, "nothing allocated on the other device"
    assert out.device == torch.device("cuda", data)
    tol = 2e-2 if op in LLM else 1e-5
    err = (out.float().cpu() - expected).abs().max().item()
    assert err <= tol * max(1.0, expected.abs().max().item()), err


def test_mixed_devices_are_rejected():
    x = torch.randn(50, 8, device="cuda:0")
    ei = torch.randint(0, 50, (2, 100), device="cuda:1")
    with pytest.raises(ValueError, match="fused_edge_features: all tensors must be on one device; x is on cuda:0 "
                                         "but edge_index is on cuda:1"):
        qkernels.fused_edge_features(x, ei)
