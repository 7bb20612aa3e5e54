"""Host overhead per call: every op on small torch CUDA tensors vs torch.add.

The tensors are tiny so the GPU idles.  Each case's time per call is the host time to issue a
batch of calls, read before the batch is synchronised: the batch (256 calls) stays well under the
CUDA launch queue's depth, so the host never waits for the GPU and the figure is pure host cost
(timing through the synchronisation would measure the GPU's per-kernel latency instead, about
6-7 µs for these kernels on the H200).  Cases are interleaved round by round so clock and load
drift hit all of them alike; the median over rounds is reported.  Every op runs on the sample
call of qkernels.testing (graph ops in float32, the LLM ops in bfloat16 with head_dim 64), through
the public entry point as a user calls it, and once more through its raw op (no dispatch).  Besides
the anchor, the table times each differentiable op once more with inputs that require grad, and
splits sparse_aggregate's call into its parts: the C entry point alone, the same with nothing to
launch (an empty graph),
the dispatcher lookup, and what a naive binding would pay per call (t.__dlpack__(),
torch.cuda.current_stream()).  Target: no op costs more host time than one torch.add.
"""

import argparse
import statistics
import time

import common  # noqa: F401  (first: it puts the checkout's qkernels on sys.path)
import numpy as np
import qkernels
import qkernels.torch
import torch
from qkernels import _dispatch
from qkernels.testing import DEVICE_DTYPES, OPS, sample


def op_call(op, dev, grad=False, raw=False):
    """qkernels.<op> on its sample call as torch CUDA tensors (in the dtypes its CUDA kernels take);
    grad: its differentiable inputs require grad (the call records itself for autograd); raw: the
    raw op _C.<op>_raw instead (no dispatch: what the binding and the launch cost alone)."""
    options = {"d": 64} if op.startswith("attn") else {}
    args, kwargs = sample(op, np.random.default_rng(1), **options)
    dtypes = DEVICE_DTYPES.get(op, ())

    def convert(i, a):
        if not isinstance(a, np.ndarray):
            return a
        t = torch.from_numpy(a).to(dev)
        return t.to(getattr(torch, dtypes[i])) if i < len(dtypes) and dtypes[i] else t
    args = [convert(i, a) for i, a in enumerate(args)]
    if grad:
        differentiable = qkernels.torch.GRADIENTS[op][2]
        names = _dispatch.params(op)
        args = [a.requires_grad_(True) if isinstance(a, torch.Tensor) and names[i] in differentiable else a
                for i, a in enumerate(args)]
    fn = getattr(qkernels._C, op + "_raw") if raw else getattr(qkernels, op)
    return lambda: fn(*args, **kwargs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=256, help="calls per batch (keep below the launch queue depth)")
    p.add_argument("--rounds", type=int, default=401)
    p.add_argument("--markdown", help="also write the table to this file")
    return p.parse_args(argv)


def collect(a):
    """Every case, interleaved round by round: -> (header lines, rows (name, median s, best s), footer lines).
    The first row is the anchor, the second qkernels' plain call."""
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
    empty_rows = torch.zeros(1, dtype=row_ptr.dtype, device=dev)  # N_dst = 0: everything but the launch
    empty_out = torch.empty(0, h, d, device=dev)
    C = qkernels._C

    cases = [("torch.add(x, y)  [anchor]", lambda: torch.add(x, y))]
    cases += [(f"qkernels.{op}", op_call(op, dev)) for op in OPS]
    cases += [(f"_C.{op}_raw (no dispatch)", op_call(op, dev, raw=True)) for op in OPS]
    # under grad mode with inputs that require grad: the torch operator, recorded for autograd
    cases += [(f"qkernels.{op} (inputs require grad)", op_call(op, dev, grad=True)) for op in qkernels.torch.GRADIENTS]
    cases += [
        ("qkernels.sparse_aggregate(4 tensors)", lambda: qkernels.sparse_aggregate(*args)),
        ("qkernels.sparse_aggregate(..., out=)", lambda: qkernels.sparse_aggregate(*args, out=out)),
        ("  with backend=\"cuda\" (Python dispatcher path)", lambda: qkernels.sparse_aggregate(*args, backend="cuda")),
        ("_C.sparse_aggregate_raw(4 tensors) (no dispatch)", lambda: C.sparse_aggregate_raw(*args)),
        ("_C.sparse_aggregate_raw(..., out=)", lambda: C.sparse_aggregate_raw(*args, out=out)),
        ("_C.sparse_aggregate_raw, empty graph, out= (no launch)",
         lambda: C.sparse_aggregate_raw(empty_rows, col_idx, ew, nf, out=empty_out)),
        ("dispatcher lookup alone", lambda: _dispatch.choose("sparse_aggregate", nf, None)),
        ("torch.empty(shape, device=)", lambda: torch.empty((n, h, d), device=dev)),
        ("t.__dlpack__() [naive: per tensor]", lambda: nf.__dlpack__(stream=-1)),
        ("torch.cuda.current_stream() [naive]", lambda: torch.cuda.current_stream()),
    ]
    for _, fn in cases:  # warm-up: module loads, caches, allocator pools
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name, _ in cases}
    for _ in range(a.rounds):
        for name, fn in cases:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / a.calls)
            torch.cuda.synchronize()
    results = [(name, statistics.median(samples[name]), min(samples[name])) for name, _ in cases]
    header = [f"Host overhead per call on {torch.cuda.get_device_name()} (torch {torch.__version__}; tensors "
              f"[{n},{h},{d}], E={e}; median and best of {a.rounds} interleaved rounds x {a.calls} calls)"]
    ops = [r for r in results if r[0].startswith("qkernels.") and r[0][len("qkernels."):] in OPS]
    worst = max(ops, key=lambda r: r[1])
    ratio = worst[1] / results[0][1]
    footer = [f"slowest op: {worst[0]} / torch.add = {ratio:.2f}x "
              f"({'every op meets' if ratio <= 1.0 else 'misses'} the <= 1.0x target)"]
    return header, results, footer


def markdown_table(results):
    anchor = results[0][1]
    lines = ["| call | µs per call (median) | best round | ratio to torch.add |", "|---|---:|---:|---:|"]
    for name, t, best in results:
        lines.append(f"| {name} | {t * 1e6:.2f} | {best * 1e6:.2f} | {t / anchor:.2f}x |")
    return lines


def main():
    a = parse_args()
    header, results, footer = collect(a)
    text = "\n".join(header + [""] + markdown_table(results) + [""] + footer)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
