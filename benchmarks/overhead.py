"""Host overhead per call: qkernels.sparse_aggregate on small torch CUDA tensors vs torch.add.

The tensors are tiny so the GPU idles and the host is the bottleneck: time per call is the
wall time of a long loop of calls (synchronised before and after) divided by the call count,
the median over several rounds.  Also shown: the pieces a naive binding would pay per call
(t.__dlpack__(), torch.cuda.current_stream()), the C entry point without the Python layer, and
the dispatcher lookup alone.  Target (issue 2): a qkernels call with 4 torch CUDA tensors costs
no more host time than one torch.add.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

import qkernels
from qkernels import _dispatch


def per_call(fn, calls, rounds):
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--markdown", help="also write the table to this file")
    a = p.parse_args()

    dev = torch.device("cuda")
    n, e, h, d = 64, 256, 2, 8
    g = torch.Generator().manual_seed(0)
    row_ptr = torch.sort(torch.randint(0, e + 1, (n + 1,), generator=g)).values
    row_ptr[0], row_ptr[-1] = 0, e
    row_ptr = row_ptr.to(dev)
    col_idx = torch.randint(0, n, (e,), generator=g).to(dev)
    ew = torch.randn(e, h, generator=g).to(dev)
    nf = torch.randn(n, h, d, generator=g).to(dev)
    x, y = torch.randn(n, h, d, device=dev), torch.randn(n, h, d, device=dev)
    out = torch.empty(n, h, d, device=dev)
    args = (row_ptr, col_idx, ew, nf)

    C = qkernels._C
    default = C._configure()["alloc_new_empty"]
    cases = [
        ("torch.add(x, y)  [anchor]", None, lambda: torch.add(x, y)),
        ("qkernels.sparse_aggregate(4 tensors)", default, lambda: qkernels.sparse_aggregate(*args)),
        ("qkernels.sparse_aggregate(..., out=)", default, lambda: qkernels.sparse_aggregate(*args, out=out)),
        ("  output via x.new_empty (in C)", True, lambda: qkernels.sparse_aggregate(*args)),
        ("  output via DLPack exchange allocator", False, lambda: qkernels.sparse_aggregate(*args)),
        ("_C.sparse_aggregate(..., out=) (no Python layer)", default, lambda: C.sparse_aggregate(*args, out=out)),
        ("dispatcher lookup alone", default, lambda: _dispatch.choose("sparse_aggregate", nf, None)),
        ("torch.empty(shape, device=)", None, lambda: torch.empty((n, h, d), device=dev)),
        ("x.new_empty(shape)", None, lambda: nf.new_empty((n, h, d))),
        ("t.__dlpack__() [naive: per tensor]", None, lambda: nf.__dlpack__(stream=-1)),
        ("torch.cuda.current_stream() [naive]", None, lambda: torch.cuda.current_stream()),
    ]
    results = []
    for name, mode, fn in cases:
        if mode is not None:
            _dispatch.configure(alloc_new_empty=mode)
        calls = a.calls if "dlpack" not in name else a.calls // 4
        results.append((name, per_call(fn, calls, a.rounds)))
    _dispatch.configure(alloc_new_empty=default)
    anchor = results[0][1]
    lines = [f"Host overhead per call on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
             f"median of {a.rounds} rounds x {a.calls} calls; tensors [{n},{h},{d}], E={e})", "",
             "| call | µs per call | ratio to torch.add |", "|---|---:|---:|"]
    for name, t in results:
        lines.append(f"| {name} | {t * 1e6:.2f} | {t / anchor:.2f}x |")
    ratio = results[1][1] / anchor
    lines += ["", f"qkernels.sparse_aggregate / torch.add = {ratio:.2f}x "
                  f"({'meets' if ratio <= 1.0 else 'misses'} the <= 1.0x target)"]
    text = "\n".join(lines)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
