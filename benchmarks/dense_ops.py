"""Dense LLM ops beside their anchors (issue 6): time, bandwidth and speed-up per op and case.

What is measured.  bfloat16 throughout; qkernels and its anchors run on the same inputs in one
process:
  linear      cuBLAS through F.linear(x, w) (no bias), M x K activations against an N x K weight
  swiglu      eager F.linear(x, up) * F.silu(F.linear(x, gate)): two cuBLAS calls and two
              elementwise kernels
  rotary_emb  the complex-multiply rotary (Llama's: view_as_complex(x) * freqs_cis, back to real)
              eager and under torch.compile; qkernels reads the same table as view_as_real(freqs_cis)
Every result is first checked against the eager anchor on the same inputs (relative error in the
float64 2-norm below REL_TOL: PASS/FAIL; bfloat16 outputs rounded once by both sides differ by an
occasional last-place unit, ~1e-3), then timed.

How.  N calls are captured in one CUDA graph after warm-up on the capture stream; the replay is
timed with CUDA events and divided by N; the figure is the median over replays.  Host overhead
(Python, dispatch, launch) is therefore out of the figure: it is device time.  Call i of the graph
reads input set i mod K; the K sets (each its own weight copies) together span at least 1 GiB
(17x the H200's 60 MB L2), so every call streams its weights from HBM, as it does in a model
where the other layers' weights pass through L2 in between.  All inputs are random (never zeros).
The decode-sized rotary case cannot be made cold that way (64 sets of 256 KB): it measures latency.

GB/s is the op's minimal byte count over the time: every input read once and the output written
once (the formula sits next to each case below).  The copy ceiling is a 2 GiB device-to-device
copy timed the same way in the same run (bytes read + written); "% copy" is an op's GB/s as a
share of it.  The ratio is anchor time / qkernels time (>1: qkernels is faster); the target
column holds the issue's bar and whether it is met.

    python3 benchmarks/dense_ops.py [--quick] [--ops linear,swiglu,rotary_emb] [--markdown FILE]
"""

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qkernels  # noqa: E402
from common import (COLD_FOOTPRINT_BYTES, F32, GPU_COPY_BYTES, Row, describe, gpu_copy_ceiling_gbps,  # noqa: E402
                    gpu_replay_time_us, write_markdown, relative_error, release_gpu_memory, text_table)

OPS = ("linear", "swiglu", "rotary_emb")

BF16 = 2  # bytes per bfloat16 element
MAX_INPUT_SETS = 64
REL_TOL = 1e-2  # bfloat16 outputs: one rounding each side, ~1e-3 expected

# The model shapes of issue 6 (Llama-3-8B-like: hidden 4096, MLP 14336; 28672 = fused up+gate).
LINEAR_WEIGHTS = ((14336, 4096), (4096, 14336), (28672, 4096))
LINEAR_MS = (1, 8, 16, 32, 64)
SQUARE_MS = (1, 8, 16)
SWIGLU_MS = (1, 4, 8, 16)
LARGE_MS = (128, 512)  # M past 64: cuBLASLt (kernels/linear_lt.cu)


@dataclass
class Impl:
    name: str
    fn: Callable[[dict], torch.Tensor]  # one call on one input set
    ours: bool = False
    reference: bool = False  # the eager anchor the others are checked against
    min_ratio: Optional[float] = None  # target: this anchor's time / ours >= min_ratio
    min_gbps: Optional[float] = None  # target: our bandwidth >= min_gbps


@dataclass
class Case:
    op: str
    label: str
    make_inputs: Callable[[torch.Generator], dict]  # one random input set on the GPU
    nbytes: int  # minimal bytes moved by one call
    impls: list


# ---------------------------------------------------------------------------------------------
# Inputs


def generator(seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return gen


def randn(gen, *shape, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, device="cuda")).to(torch.bfloat16)


def input_sets(case, seed):
    """Enough random input sets that cycling through them spans COLD_FOOTPRINT_BYTES."""
    first = case.make_inputs(generator(seed))
    set_bytes = sum(t.nbytes for t in first.values() if isinstance(t, torch.Tensor))
    n_sets = min(MAX_INPUT_SETS, max(1, math.ceil(COLD_FOOTPRINT_BYTES / max(set_bytes, 1))))
    return [first] + [case.make_inputs(generator(seed + k)) for k in range(1, n_sets)]


def count(n):
    """32768 -> '32k': case labels stay short."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------------------------
# linear


def linear_case(m, n, k, target):
    def make_inputs(gen):
        return {"x": randn(gen, m, k), "w": randn(gen, n, k, scale=k ** -0.5)}

    # Minimal bytes: the weight and x read once, the output written once.
    nbytes = (n * k + m * k + m * n) * BF16
    call = lambda s: qkernels.linear(s["x"], s["w"], backend="cuda")  # noqa: E731
    impls = [
        Impl("qkernels", call, ours=True),
        Impl("cuBLAS (F.linear)", lambda s: F.linear(s["x"], s["w"]), reference=True, min_ratio=target),
    ]
    # Beside the launcher's pick (on sm_90 the row kernel): the mma.sync tile kernel, and at M = 1
    # the CUDA-core GEMV forced (the pick there before the row kernel became a programmatic dependent).
    impls.insert(1, Impl("qkernels, mma.sync kernel", on_linear_kernel("linear", "mma", "x", "w")))
    if m == 1:
        impls.insert(1, Impl("qkernels, GEMV (forced)", on_linear_kernel("linear", "gemv", "x", "w")))
    return Case("linear", f"M={m} W={n}x{k}", make_inputs, nbytes, impls)


def on_linear_kernel(op, variant, *names):
    """One call of op (linear or swiglu) on the input set's tensors `names`, forced onto a kernel by
    the raw op's private keyword _variant= (kernels/qk_launch.h): mma, linear.cu's tile kernel; gemv,
    its CUDA-core GEMV; rows, linear_sm90.cu's row kernel (sm_90).  On torch's current stream (the
    capture stream under a CUDA graph), a torch result."""
    raw = getattr(qkernels._C, op + "_raw")

    def call(s):
        x = s[names[0]]
        r = raw(*(s[n] for n in names), stream=torch.cuda.current_stream(x.device).cuda_stream, _variant=variant)
        return r if isinstance(r, torch.Tensor) else torch.from_dlpack(r)
    return call


def linear_cases(quick):
    weights = LINEAR_WEIGHTS[:1] if quick else LINEAR_WEIGHTS
    ms, square_ms = ((1, 16), (1, 16)) if quick else (LINEAR_MS, SQUARE_MS)
    cases = [linear_case(m, n, k, 1.0) for n, k in weights for m in ms]
    cases += [linear_case(m, 4096, 4096, 1.2) for m in square_ms]
    if not quick:  # past the decode range, where cuBLASLt runs (no target: the same library as the anchor)
        cases += [linear_case(m, n, 4096, None) for n in (4096, 14336) for m in LARGE_MS]
    return cases


# ---------------------------------------------------------------------------------------------
# swiglu


def swiglu_eager(x, up, gate):
    return F.linear(x, up) * F.silu(F.linear(x, gate))


def swiglu_case(m, n, k, target=1.15):
    def make_inputs(gen):
        return {"x": randn(gen, m, k), "up": randn(gen, n, k, scale=k ** -0.5),
                "gate": randn(gen, n, k, scale=2 * k ** -0.5)}

    # Minimal bytes: both weights and x read once, the output written once (one fused pass).
    nbytes = (2 * n * k + m * k + m * n) * BF16
    call = lambda s: qkernels.swiglu(s["x"], s["up"], s["gate"], backend="cuda")  # noqa: E731
    impls = [
        Impl("qkernels", call, ours=True),
        Impl("eager linear*silu(linear)", lambda s: swiglu_eager(s["x"], s["up"], s["gate"]), reference=True,
             min_ratio=target),
    ]
    impls.insert(1, Impl("qkernels, mma.sync kernel", on_linear_kernel("swiglu", "mma", "x", "up", "gate")))
    if m == 1:  # beside the row kernel, the GEMV forced (see linear)
        impls.insert(1, Impl("qkernels, GEMV (forced)", on_linear_kernel("swiglu", "gemv", "x", "up", "gate")))
    return Case("swiglu", f"M={m} up/gate={n}x{k}", make_inputs, nbytes, impls)


def swiglu_cases(quick):
    cases = [swiglu_case(m, 14336, 4096) for m in ((1, 16) if quick else SWIGLU_MS)]
    if not quick:  # two cuBLASLt products in fp32 and the combine (no target)
        cases += [swiglu_case(m, 14336, 4096, None) for m in LARGE_MS[:1]]
    return cases


# ---------------------------------------------------------------------------------------------
# rotary_emb


def rotary_complex(x, freqs_cis, interleaved):
    """Llama's rotary: pairs as complex numbers times the per-token phase, fp32, one rounding."""
    if interleaved:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    else:  # rotate-half (NeoX): the pair is (x[i], x[i + D/2])
        half = x.shape[-1] // 2
        xc = torch.complex(x[..., :half].float(), x[..., half:].float())
    y = xc * freqs_cis.unsqueeze(-2)  # [T, D/2] -> [T, 1, D/2]: one phase for every head
    out = torch.view_as_real(y).flatten(-2) if interleaved else torch.cat([y.real, y.imag], -1)
    return out.to(x.dtype)


def rotary_case(tokens, heads, dim, interleaved, min_ratio, min_gbps):
    def make_inputs(gen):
        angles = 10 * torch.rand(tokens, dim // 2, generator=gen, device="cuda")
        return {"x": randn(gen, tokens, heads, dim), "freqs_cis": torch.polar(torch.ones_like(angles), angles)}

    # Minimal bytes: x read and the output written once, the (cos, sin) table read once.
    nbytes = 2 * tokens * heads * dim * BF16 + tokens * (dim // 2) * 2 * F32
    compiled = torch.compile(rotary_complex, dynamic=False)
    impls = [
        Impl("qkernels", lambda s: qkernels.rotary_emb(s["x"], torch.view_as_real(s["freqs_cis"]),
                                                       interleaved=interleaved, backend="cuda"),
             ours=True, min_gbps=min_gbps),
        Impl("eager complex multiply", lambda s: rotary_complex(s["x"], s["freqs_cis"], interleaved), reference=True),
        Impl("torch.compile", lambda s: compiled(s["x"], s["freqs_cis"], interleaved), min_ratio=min_ratio),
    ]
    convention = "interleaved" if interleaved else "rotate-half"
    return Case("rotary_emb", f"T={count(tokens)} H={heads} D={dim} {convention}", make_inputs, nbytes, impls)


def rotary_emb_cases(quick):
    tokens = 4096 if quick else 32768
    cases = [rotary_case(tokens, 32, 128, interleaved, 1.5, None if quick else 3500.0)
             for interleaved in (True, False)]
    # Decode: a handful of tokens, latency-bound; the bar is torch.compile's time (ratio >= 1.0).
    cases.append(rotary_case(32, 32, 128, True, 1.0, None))
    return cases


CASE_BUILDERS = {"linear": linear_cases, "swiglu": swiglu_cases, "rotary_emb": rotary_emb_cases}


# ---------------------------------------------------------------------------------------------
# Timing


# ---------------------------------------------------------------------------------------------
# One case: check, time, rows


def first_line(exc):
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def check_results(case, inputs):
    """Verdict per impl against the reference on one input set, and the impls that raised."""
    reference = next(impl for impl in case.impls if impl.reference)
    want = reference.fn(inputs)
    verdicts, failures = {reference.name: "reference"}, {}
    for impl in case.impls:
        if impl is reference:
            continue
        try:
            got = impl.fn(inputs)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
            err = relative_error(got, want)
        except Exception as exc:  # a missing kernel, a compile failure: report it, keep benchmarking
            failures[impl.name] = exc
            continue
        verdicts[impl.name] = f"{'PASS' if err < REL_TOL else 'FAIL'} {err:.1e}"
    return verdicts, failures


def run_case(case, seed, copy_gbps, samples):
    print(f"\n{case.op} | {case.label} | {case.nbytes / 1e6:.1f} MB minimal per call", flush=True)
    torch._dynamo.reset()  # each case compiles afresh; earlier cases' guards never pile up
    sets = input_sets(case, seed)
    print(f"  {len(sets)} input set(s)", flush=True)
    verdicts, failures = check_results(case, sets[0])
    release_gpu_memory()
    times = {}
    for impl in case.impls:
        if impl.name not in failures:
            try:
                times[impl.name] = gpu_replay_time_us(impl.fn, sets, samples)
            except Exception as exc:  # capture refused (a host sync inside), compile failure, ...
                failures[impl.name] = exc
            release_gpu_memory()
        report_progress(case, impl, times.get(impl.name), verdicts.get(impl.name, ""), failures.get(impl.name))
    del sets
    release_gpu_memory()
    return case_rows(case, times, verdicts, failures, copy_gbps)


def report_progress(case, impl, us, verdict, failure):
    if failure is not None:
        print(f"  {impl.name:<28} {describe(failure)}: {first_line(failure)}", flush=True)
    else:
        print(f"  {impl.name:<28} {us:>9.2f} µs {case.nbytes / us / 1e3:>7.0f} GB/s  {verdict}", flush=True)


def target_text(impl, ratio, gbps):
    parts = []
    if impl.min_ratio is not None:
        bar = f">={impl.min_ratio:.2f}x"
        parts.append(bar if ratio is None else f"{bar} {'met' if ratio >= impl.min_ratio else 'MISSED'}")
    if impl.min_gbps is not None:
        bar = f">={impl.min_gbps / 1e3:.1f} TB/s"
        parts.append(bar if gbps is None else f"{bar} {'met' if gbps >= impl.min_gbps else 'MISSED'}")
    return "; ".join(parts)


def case_rows(case, times, verdicts, failures, copy_gbps):
    ours_us = next((times.get(impl.name) for impl in case.impls if impl.ours), None)
    rows = []
    for impl in case.impls:
        us = times.get(impl.name)
        gbps = case.nbytes / us / 1e3 if us else None
        ratio = us / ours_us if us and ours_us and not impl.ours else None
        failure = describe(failures[impl.name]) if impl.name in failures else ""
        check = "; ".join(text for text in (verdicts.get(impl.name, ""), failure) if text)
        rows.append(Row(case.op, case.label, impl.name, us, gbps, 100.0 * gbps / copy_gbps if gbps else None,
                        ratio, target_text(impl, ratio, gbps), check))
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def header_lines(copy_gbps, quick, samples):
    machine = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    scale = "--quick: a subset of the cases and 4k-token rotary (targets are for full sizes)" if quick else \
        "issue 6 sizes"
    return [
        f"dense ops: qkernels {qkernels.__version__} vs anchors on {machine}; torch {torch.__version__}",
        f"copy ceiling: {copy_gbps:.0f} GB/s ({GPU_COPY_BYTES >> 30} GiB device-to-device copy, bytes read + written)",
        f"{scale}; bfloat16; CUDA-graph replay, median of {samples} replays; inputs (weights included) cycled to "
        f"span {COLD_FOOTPRINT_BYTES >> 30} GiB",
        "GB/s: minimal bytes (formulas in benchmarks/dense_ops.py) / time; anchor/ours > 1: qkernels faster",
    ]


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a subset of the cases, smaller rotary (smoke run)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {', '.join(OPS)}")
    p.add_argument("--markdown", help="also write the final table to this file")
    p.add_argument("--samples", type=int, default=15, help="replays per figure (default 15)")
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; expected some of {', '.join(OPS)}")
    if not torch.cuda.is_available():
        p.error("no CUDA device visible to torch: this benchmark times the cuda backend")
    return args


def collect(args, copy_gbps=None):
    """Every case of args.ops, progress printed as it goes: -> (header lines, rows, footer lines).

    copy_gbps: the copy ceiling already measured in this process (benchmarks/run.py); None measures it here.
    """
    if copy_gbps is None:
        copy_gbps = gpu_copy_ceiling_gbps(args.samples)
    header = header_lines(copy_gbps, args.quick, args.samples)
    print("\n".join(header), flush=True)

    rows, skipped = [], []
    for op_no, op in enumerate(args.ops):
        if not hasattr(qkernels, op):
            print(f"\n{op}: skipped, qkernels has no attribute {op!r} yet", flush=True)
            skipped.append(op)
            continue
        for case_no, case in enumerate(CASE_BUILDERS[op](args.quick)):
            seed = 1000 * op_no + 100 * case_no
            try:
                rows += run_case(case, seed, copy_gbps, args.samples)
            except Exception as exc:  # the reference itself or the inputs failed: report, go on
                print(f"  case failed: {type(exc).__name__}: {first_line(exc)}", flush=True)
                release_gpu_memory()

    footer = [f"skipped (not in qkernels yet): {', '.join(skipped)}"] if skipped else []
    return header, rows, footer


def main():
    args = parse_args()
    if not qkernels.AVAILABLE:
        print(f"warning: qkernels CUDA backend unavailable ({qkernels.info()['cuda_reason']}); our rows will be n/a")

    header, rows, footer = collect(args)
    print("\n" + "\n".join(header + [""] + text_table(rows) + footer))
    if args.markdown:
        write_markdown(args.markdown, header, rows, footer)


if __name__ == "__main__":
    main()
