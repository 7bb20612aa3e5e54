"""The cpu backend's linear, swiglu and rotary_emb beside PyTorch CPU: time, bandwidth, speed-up.

What is measured.  For each dtype (float32, bfloat16, float16), op and shape, qkernels' raw op on
the cpu backend (the best instruction-set path of this machine, or --isa) and PyTorch CPU run on the
same inputs in one process, with the same thread count (--threads, default torch's):
  linear      torch.nn.functional.linear(x, w)
  swiglu      F.linear(x, up) * F.silu(F.linear(x, gate)), eager
  rotary_emb  Llama's complex-multiply rotary, eager (benchmarks/dense_ops.py's anchor); qkernels
              reads the same table as view_as_real(freqs_cis); float32 and bfloat16
Each result is first checked against qkernels.testing's float64 reference (relative error in the
2-norm, PASS below a tolerance from the dtype), then timed.

How.  Warm-up, then ROUNDS rounds; a round times one batch of qkernels calls and one batch of torch
calls (each ~CPU_BATCH_S of calls, time.perf_counter, after SETTLE_S idle), alternating which goes first, so that both
sides see the same moments of a machine shared with other jobs.  The figure is the median per-call
time over the rounds; the spread column is (slowest - fastest) / median of our rounds: the noise.
The weights stay the same between calls (as in a model's decode loop), so on a machine whose last
level cache holds them they are read from there; the header states the copy rates of a buffer of
the weights' size (cache) and of 1 GiB (memory), read + written; "% copy" is a row's GB/s as a share
of the memory one.

GB/s is the weight bytes (N x K, twice for swiglu; rotary: x read, the output written, the table
read) over the time: what bounds M = 1.  GFLOP/s is 2 M N K (twice for swiglu) over the time: what
bounds M = 512.  anchor/ours > 1: qkernels faster.

    python3 benchmarks/cpu_dense.py [--quick] [--threads 2] [--isa amx] [--ops linear,swiglu,rotary_emb]
                                    [--markdown FILE]
"""

import os
import statistics
import time
from dataclasses import dataclass

import common
from common import reference, relative_error

import torch
import torch.nn.functional as F

import qkernels
from qkernels import _C
from dense_ops import rotary_complex

SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (64, 4096, 4096), (512, 1024, 1024)]  # (M, N, K)
QUICK_SHAPES = [(1, 1024, 1024), (64, 1024, 1024)]
TINY_SHAPES = [(1, 256, 256), (8, 256, 256)]
ROTARY_TOKENS, QUICK_ROTARY_TOKENS, TINY_ROTARY_TOKENS = (32, 1024), (32, 128), (4, 64)  # H = 32, D = 128
DTYPES = ["float32", "bfloat16", "float16"]
ROTARY_DTYPES = ("float32", "bfloat16")
OPS = ["linear", "swiglu", "rotary_emb"]
CPU_BATCH_S = 0.05
SETTLE_S = 0.01
CACHE_COPY_BYTES = 32 << 20  # a bfloat16 4096 x 4096 weight
MEMORY_COPY_BYTES = 1 << 30
ROUNDS = 9
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
COLUMNS = ["op", "case", "impl", "µs", "GB/s", "% copy", "GFLOP/s", "anchor/ours", "spread", "target", "check"]


@dataclass
class Row(common.Row):
    gflops: float = None
    spread: str = ""


def row_cells(row):
    return [row.op, row.case, row.impl, common.fmt_us(row.us), f"{row.gbps:.1f}",
            "" if row.pct_copy is None else f"{row.pct_copy:.0f}%", "" if row.gflops is None else f"{row.gflops:.1f}",
            "" if row.ratio is None else f"{row.ratio:.2f}x", row.spread, row.target, row.check]


def make_case(op, dtype, m, n, k, gen):
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dt)
    g = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dt) if op == "swiglu" else None
    return x, w, g


def dense_case(op, dtype, shape, isa, gen):
    """-> (label, ours, theirs, want, bytes, flops) of linear or swiglu."""
    m, n, k = shape
    x, w, g = make_case(op, dtype, m, n, k, gen)
    if op == "linear":
        ours = lambda: _C.linear_raw(x, w, _isa=isa)  # noqa: E731
        theirs = lambda: F.linear(x, w)  # noqa: E731
        want = reference("linear", x, w)
    else:
        ours = lambda: _C.swiglu_raw(x, w, g, _isa=isa)  # noqa: E731
        theirs = lambda: F.linear(x, w) * F.silu(F.linear(x, g))  # noqa: E731
        want = reference("swiglu", x, w, g)
    terms = 2 if op == "swiglu" else 1
    return f"{dtype} M={m} N={n} K={k}", ours, theirs, want, terms * n * k * x.element_size(), 2 * terms * m * n * k


def rotary_case(dtype, tokens, interleaved, gen, heads=32, dim=128):
    """-> (label, ours, theirs, want, bytes, None) of rotary_emb on x [T, H, D]."""
    x = torch.randn(tokens, heads, dim, generator=gen).to(getattr(torch, dtype))
    angles = 10 * torch.rand(tokens, dim // 2, generator=gen)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    table = torch.view_as_real(freqs_cis)
    ours = lambda: qkernels.rotary_emb(x, table, interleaved=interleaved, backend="cpu")  # noqa: E731
    theirs = lambda: rotary_complex(x, freqs_cis, interleaved)  # noqa: E731
    want = reference("rotary_emb", x, table, interleaved=interleaved)
    nbytes = 2 * x.numel() * x.element_size() + table.numel() * 4
    convention = "interleaved" if interleaved else "rotate-half"
    return f"{dtype} T={tokens} H={heads} D={dim} {convention}", ours, theirs, want, nbytes, None


def measure(op, dtype, case, rounds, copy_gbps, batch_s=CPU_BATCH_S):
    """Check both sides of case, time them in interleaved rounds: -> the two table rows."""
    label, ours, theirs, want, nbytes, flops = case
    checks = {}
    for name, fn in (("qkernels", ours), ("torch", theirs)):
        err = relative_error(torch.from_dlpack(fn()), want)
        checks[name] = f"{'PASS' if err < TOL[dtype] else 'FAIL'} {err:.1e}"
    for _ in range(3):
        ours()
        theirs()
    times = {"qkernels": [], "torch": []}
    for r in range(rounds):
        order = (("qkernels", ours), ("torch", theirs)) if r % 2 == 0 else (("torch", theirs), ("qkernels", ours))
        for name, fn in order:
            time.sleep(SETTLE_S)  # the other side's idle threads stop spinning first
            times[name].append(common.cpu_batch_us(fn, batch_s))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["torch"] / med["qkernels"]
    rows = []
    for name in ("qkernels", "torch"):
        t, gbps = times[name], nbytes / med[name] / 1e3
        target = f">=1.0x {'met' if ratio >= 1.0 else 'MISSED'}" if name == "torch" else ""
        rows.append(Row(op, label, name, med[name], gbps, 100.0 * gbps / copy_gbps, ratio if name == "torch" else None,
                        target, checks[name], flops / med[name] / 1e3 if flops else None,
                        f"{(max(t) - min(t)) / med[name]:.0%}"))
    print(f"  {label:40s} qkernels {med['qkernels']:9.1f} µs  torch {med['torch']:9.1f} µs  "
          f"{ratio:.2f}x  ({checks['qkernels']})", flush=True)
    return rows


def parse_args(argv=None):
    p = common.argument_parser(__doc__, ROUNDS, "rounds per figure", "smaller shapes (smoke run)", tiny=True)
    p.add_argument("--threads", type=int, default=None, help="threads for both sides (default: torch's count)")
    p.add_argument("--isa", default=None, help="qkernels' instruction-set level (default: the best here)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of " + ", ".join(DTYPES))
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    return common.parse_args(p, argv, need_gpu=False)


def collect(args, copy_gbps=None):
    """Every case, progress printed as it goes: -> (header, rows, footer); copy_gbps: the host's
    memory copy rate when benchmarks/run.py measured it already."""
    threads = args.threads or torch.get_num_threads()
    old_torch = torch.get_num_threads()
    torch.set_num_threads(threads)
    old = _C._configure(num_threads=threads)
    try:
        model, flags = common.cpu_model()
        shapes, tokens = ((TINY_SHAPES, TINY_ROTARY_TOKENS) if args.tiny else (QUICK_SHAPES, QUICK_ROTARY_TOKENS)
                          if args.quick else (SHAPES, ROTARY_TOKENS))
        cache = common.host_copy_gbps(CACHE_COPY_BYTES >> (4 if args.tiny else 0), args.samples)
        memory = copy_gbps or common.host_copy_gbps(MEMORY_COPY_BYTES >> (4 if args.tiny else 0), 3)
        header = common.header(
            "cpu dense", "PyTorch CPU", f"copy: {cache:.0f} GB/s for {CACHE_COPY_BYTES >> 20} MB (a bfloat16 "
            f"4096 x 4096 weight; last-level cache), {memory:.0f} GB/s for 1 GiB (memory; '% copy' is a share of "
            f"it); bytes read + written, torch copy_ on {threads} threads",
            f"qkernels path: {args.isa or _C._cpu_isa()} (best here: {_C._cpu_isa()}); threads: {threads} "
            f"each; median of {args.samples} interleaved rounds of ~{CPU_BATCH_S * 1e3:.0f} ms; spread: (slowest - "
            f"fastest) / median of our rounds; check: relative error against the float64 reference",
            machine=f"{model} ({os.cpu_count()} cores; {' '.join(flags)})")
        rows = []
        batch_s = CPU_BATCH_S / 10 if args.tiny else CPU_BATCH_S
        gen = torch.Generator().manual_seed(0)
        ops = [o for o in args.ops.split(",") if o]
        for dtype in [d for d in args.dtypes.split(",") if d]:
            for op in ops:
                if op == "rotary_emb" and dtype not in ROTARY_DTYPES:
                    continue
                print(f"\n{op} {dtype}", flush=True)
                if op == "rotary_emb":
                    cases = (rotary_case(dtype, t, interleaved, gen)  # made one at a time: the weights are large
                             for t in tokens for interleaved in ((True,) if t <= 32 else (True, False)))
                else:
                    cases = (dense_case(op, dtype, shape, args.isa, gen) for shape in shapes)
                for case in cases:
                    rows += measure(op, dtype, case, args.samples, memory, batch_s)
    finally:
        _C._configure(num_threads=old["num_threads"])
        torch.set_num_threads(old_torch)
    return header, rows, []


if __name__ == "__main__":
    raise SystemExit(common.main(parse_args, collect, COLUMNS, row_cells))
