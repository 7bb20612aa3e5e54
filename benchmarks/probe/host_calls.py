"""Which CUDA API calls each op makes per call, and their host time: every op on its sample call
(as benchmarks/overhead.py runs it) under torch.profiler, 50 calls after a warm-up, beside torch.add.
Prints per op the kernels launched per call and each runtime/driver API entry (calls per op call,
µs per op call), so a host cost above torch.add's can be traced to a query or a launch.
  python3 benchmarks/probe/host_calls.py [--calls 50] [--ops a,b]"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: F401,E402  (first: the checkout's qkernels)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from overhead import op_call  # noqa: E402  (the sample calls overhead.py times)
from qkernels.testing import OPS  # noqa: E402


def api_table(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    api = collections.defaultdict(lambda: [0, 0.0])
    kernels = 0
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not name.startswith("Memcpy") and not name.startswith("Memset"):
                kernels += 1
            continue
        if name.startswith(("cuda", "cu")) and name != "cudaDeviceSynchronize":
            api[name][0] += 1
            api[name][1] += e.cpu_time_total
    return kernels / calls, {k: (n / calls, t / calls) for k, (n, t) in api.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--ops", default=",".join(op for op in OPS if not op.endswith("_backward")))
    a = p.parse_args()
    dev = torch.device("cuda")
    x, y = torch.randn(64, 2, 8, device=dev), torch.randn(64, 2, 8, device=dev)
    cases = [("torch.add", lambda: torch.add(x, y))] + [(op, op_call(op, dev)) for op in a.ops.split(",")]
    print(f"{'call':<22} {'kernels':>7}  API entries per call (calls x, µs)")
    for name, fn in cases:
        k, api = api_table(fn, a.calls)
        entries = ", ".join(f"{n} {c:g}x {t:.2f}" for n, (c, t) in sorted(api.items(), key=lambda kv: -kv[1][1]))
        print(f"{name:<22} {k:>7.2f}  {entries}")


if __name__ == "__main__":
    main()
