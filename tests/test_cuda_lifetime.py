"""10^5 calls of the CUDA ops leave device memory, host memory, the Python heap and the
extension's live storages where they were (issue 8's lifetime item on the GPU; the CPU backend's
counterpart is test_lifetime.py).  Every op of test_multi_gpu's table, torch CUDA tensors, the
cuda backend, with and without out=.  Skipped without a GPU."""

import gc
import importlib.util
import resource
import tracemalloc

import pytest

import qkernels
from conftest import requires_cuda
from test_multi_gpu import OPS, host_inputs, to_device

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = [requires_cuda, pytest.mark.skipif(torch is None, reason="torch is not installed")]


def test_100k_cuda_calls_keep_memory_flat(rng):
    calls = []
    for op in OPS:
        args, kw = host_inputs(op, rng)
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
    live0 = qkernels._C._live_storages()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(100_000):
        calls[i % len(calls)]()
        if i % 10_000 == 9_999:
            torch.cuda.synchronize()  # bounded queue; stream-ordered frees run
    torch.cuda.synchronize()
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert grown < 256 * 1024, f"Python heap grew by {grown} bytes over 1e5 calls"
    assert qkernels._C._live_storages() == live0
    assert torch.cuda.memory_allocated() == alloc0, "torch's allocator holds more than before"
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 < 64 << 20, f"device free memory fell by {(free0 - free1) >> 20} MiB"
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assert rss1 - rss0 < 64 * 1024, f"peak RSS grew by {rss1 - rss0} KiB"
