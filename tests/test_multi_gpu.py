"""Device placement on a machine with two GPUs: every op runs on the device its tensors
live on, whichever device is current; the result lands there, matches the cpu backend, the
caller's current device is restored, and torch allocates nothing on the other device.  A call
mixing cuda:0 and cuda:1 raises a ValueError naming both.  Skipped with fewer than two GPUs."""

import importlib.util

import pytest

import qkernels
from qkernels.testing import OPS, sample
from conftest import DEVICE_SIZES, LLM, results, to_device

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = pytest.mark.skipif(
    torch is None or not qkernels.AVAILABLE or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("current,data", [(0, 1), (1, 0)])
def test_runs_on_the_tensors_device(rng, op, current, data):
    args, kw = sample(op, rng, **DEVICE_SIZES[op])
    fn = getattr(qkernels, op)
    on_cpu = to_device(op, args, "cpu")
    expected = [t.float() for t in results(fn(*on_cpu, backend="cpu", **kw))]
    with torch.cuda.device(current):
        on_gpu = to_device(op, args, f"cuda:{data}")
        torch.cuda.synchronize(current)
        before = torch.cuda.memory_allocated(current)
        outs = results(fn(*on_gpu, backend="cuda", **kw))
        torch.cuda.synchronize(data)
        assert torch.cuda.current_device() == current, "the caller's device is restored"
        assert torch.cuda.memory_allocated(current) == before, "nothing allocated on the other device"
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected):
        assert out.device == torch.device("cuda", data)
        tol = 2e-2 if op in LLM else 1e-5
        err = (out.float().cpu() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), err


def test_mixed_devices_are_rejected():
    x = torch.randn(50, 8, device="cuda:0")
    ei = torch.randint(0, 50, (2, 100), device="cuda:1")
    with pytest.raises(ValueError, match="fused_edge_features: all tensors must be on one device; x is on cuda:0 "
                                         "but edge_index is on cuda:1"):
        qkernels.fused_edge_features(x, ei)
