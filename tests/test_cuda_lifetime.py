"""10^5 calls of the CUDA ops leave device memory, host memory, the Python heap and the
extension's live storages where they were (the GPU counterpart of test_lifetime.py).  Every op at
conftest's DEVICE_SIZES, torch CUDA tensors, the
cuda backend, with and without out=.  Skipped without a GPU."""

import gc
import os
import importlib.util

import pytest

import qkernels
from qkernels.testing import OPS, sample
from conftest import DEVICE_SIZES, memory_stays_flat, requires_cuda, to_device

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = [requires_cuda, pytest.mark.skipif(torch is None, reason="torch is not installed")]


@pytest.mark.skipif(bool(os.environ.get("PYTEST_XDIST_WORKER")),
                    reason="device-wide free memory moves with the other workers' tensors: run this file alone")
def test_100k_cuda_calls_keep_memory_flat(rng):
    calls = []
    for op in OPS:
        args, kw = sample(op, rng, **DEVICE_SIZES[op])
        dev = to_device(op, args, "cuda")
        fn = getattr(qkernels, op)
        calls.append(lambda fn=fn, dev=dev, kw=kw: fn(*dev, backend="cuda", **kw))
        out = fn(*dev, backend="cuda", **kw)
        if op in ("sparse_aggregate", "linear", "rotary_emb"):  # the out= path too
            calls.append(lambda fn=fn, dev=dev, kw=kw, out=torch.empty_like(out): fn(*dev, backend="cuda", out=out, **kw))
    for i in range(2000):  # warm the allocators, the dispatcher and the launch caches
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    gc.collect()
    free0, alloc0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
    with memory_stays_flat("1e5", rss_kib=64 * 1024):
        for i in range(100_000):
            calls[i % len(calls)]()
            if i % 10_000 == 9_999:
                torch.cuda.synchronize()  # bounded queue; stream-ordered frees run
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == alloc0, "torch's allocator holds more than before"
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 < 64 << 20, f"device free memory fell by {(free0 - free1) >> 20} MiB"
