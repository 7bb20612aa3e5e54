"""The cpu backend's linear and swiglu beside PyTorch CPU: time, weight bandwidth, speed-up.

What is measured.  For each dtype (float32, bfloat16, float16), op and shape, qkernels' raw op on
the cpu backend (the best instruction-set path of this machine, or --isa) and PyTorch CPU run on the
same inputs in one process, with the same thread count (--threads, default 2):
  linear   torch.nn.functional.linear(x, w)
  swiglu   F.linear(x, up) * F.silu(F.linear(x, gate)), eager
Each result is first checked against qkernels.testing's float64 reference (relative error in the
2-norm, PASS below a tolerance from the dtype), then timed.

How.  Warm-up, then ROUNDS rounds; a round times one batch of qkernels calls and one batch of torch
calls (each ~CPU_BATCH_S of calls, time.perf_counter, after SETTLE_S idle), alternating which goes first, so that both
sides see the same moments of a machine shared with other jobs.  The figure is the median per-call
time over the rounds; the spread column is (slowest - fastest) / median of our rounds: the noise.
The weights stay the same between calls (as in a model's decode loop), so on a machine whose last
level cache holds them they are read from there; the header states the copy rates of a buffer of
the weights' size (cache) and of 1 GiB (memory), read + written.

GB/s is the weight bytes (N x K, twice for swiglu) over the time: what bounds M = 1.  GFLOP/s is
2 M N K (twice for swiglu) over the time: what bounds M = 512.  anchor/ours > 1: qkernels faster.

    python3 benchmarks/cpu_dense.py [--quick] [--threads 2] [--isa amx] [--markdown FILE]
"""

import os
import statistics
import time

import common
from common import Row, reference, relative_error

import numpy as np
import torch
import torch.nn.functional as F

import qkernels
from qkernels import _C

SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (64, 4096, 4096), (512, 1024, 1024)]  # (M, N, K)
QUICK_SHAPES = [(1, 1024, 1024), (64, 1024, 1024)]
DTYPES = ["float32", "bfloat16", "float16"]
OPS = ["linear", "swiglu"]
CPU_BATCH_S = 0.05
SETTLE_S = 0.01
CACHE_COPY_BYTES = 32 << 20  # a bfloat16 4096 x 4096 weight
ROUNDS = 9
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
COLUMNS = ["op", "case", "impl", "µs", "GB/s", "GFLOP/s", "anchor/ours", "spread", "check"]


def cpu_model():
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = line.split(":", 1)
                    fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile",
                         "amx_bf16", "amx_fp16", "avx_vnni") if f in flags]
    return fields.get("model name", "unknown CPU"), shown


def batch_us(fn):
    """one batch: calls for about CPU_BATCH_S, -> µs per call"""
    start = time.perf_counter()
    n = 0
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= CPU_BATCH_S:
            return elapsed * 1e6 / n


def copy_gbps(nbytes, rounds):
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = statistics.median(batch_us(lambda: dst.copy_(src)) for _ in range(rounds))
    return 2 * nbytes / best / 1e3


def make_case(op, dtype, m, n, k, gen):
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dt)
    g = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dt) if op == "swiglu" else None
    return x, w, g


def run_case(op, dtype, shape, isa, rounds, gen):
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
            times[name].append(batch_us(fn))
    terms = 2 if op == "swiglu" else 1
    wbytes = terms * n * k * x.element_size()
    flops = 2 * terms * m * n * k
    label = f"{dtype} M={m} N={n} K={k}"
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name in ("qkernels", "torch"):
        t = times[name]
        spread = f"{(max(t) - min(t)) / med[name]:.0%}"
        ratio = med["torch"] / med["qkernels"] if name == "torch" else None
        rows.append(Row(op, label, name, med[name], wbytes / med[name] / 1e3, flops / med[name] / 1e3, ratio,
                        spread, checks[name]))
    print(f"  {label:32s} qkernels {med['qkernels']:9.1f} µs  torch {med['torch']:9.1f} µs  "
          f"{med['torch'] / med['qkernels']:.2f}x  ({checks['qkernels']})", flush=True)
    return rows


def cells(row):
    return [row.op, row.case, row.impl, common.fmt_us(row.us), f"{row.gbps:.1f}", f"{row.pct_copy:.0f}",
            "" if row.ratio is None else f"{row.ratio:.2f}x", row.target, row.check]


def table(rows, markdown):
    out = [cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if i in (3, 4, 5, 6, 7) else "---"
                                                                  for i in range(len(COLUMNS))) + "|"]
        return lines + ["| " + " | ".join(c) + " |" for c in out]
    widths = [max([len(c)] + [len(r[i]) for r in out]) for i, c in enumerate(COLUMNS)]
    return ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in [COLUMNS] + out]


def main(argv=None):
    p = common.argument_parser(__doc__, ROUNDS, "rounds per figure", "smaller shapes (smoke run)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--isa", default=None, help="qkernels' instruction-set level (default: the best here)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of " + ", ".join(DTYPES))
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    args = common.parse_args(p, argv, need_gpu=False)
    torch.set_num_threads(args.threads)
    old = _C._configure(num_threads=args.threads)
    try:
        model, flags = cpu_model()
        shapes = QUICK_SHAPES if args.quick else SHAPES
        cache = copy_gbps(CACHE_COPY_BYTES, args.samples)
        memory = copy_gbps(1 << 30, 3)
        header = common.header(
            "cpu dense", "PyTorch CPU", f"copy: {cache:.0f} GB/s for {CACHE_COPY_BYTES >> 20} MB (a bfloat16 "
            f"4096 x 4096 weight; last-level cache), {memory:.0f} GB/s for 1 GiB (memory); bytes read + written, "
            f"torch copy_ on {args.threads} threads",
            f"qkernels path: {args.isa or _C._cpu_isa()} (best here: {_C._cpu_isa()}); threads: {args.threads} "
            f"each; median of {args.samples} interleaved rounds of ~{CPU_BATCH_S * 1e3:.0f} ms; spread: (slowest - "
            f"fastest) / median of our rounds; check: relative error against the float64 reference",
            machine=f"{model} ({os.cpu_count()} cores; {' '.join(flags)})")
        rows = []
        gen = torch.Generator().manual_seed(0)
        for dtype in [d for d in args.dtypes.split(",") if d]:
            for op in [o for o in args.ops.split(",") if o]:
                print(f"\n{op} {dtype}", flush=True)
                for shape in shapes:
                    rows += run_case(op, dtype, shape, args.isa, args.samples, gen)
    finally:
        _C._configure(num_threads=old["num_threads"])
    print("\n" + "\n".join(header + [""] + table(rows, False)))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n\n".join(header + ["\n".join(table(rows, True))]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
