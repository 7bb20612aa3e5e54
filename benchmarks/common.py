"""What the benchmark scripts share: the checkout's qkernels first on sys.path, their command-line
options and header lines, device time by CUDA-graph replay, the copy and GEMM ceilings, the host's
CPU model, copy rate and wall-clock batches, the check of each result against qkernels.testing's
float64 reference, the case loop, and the result table (graph_ops.py, dense_ops.py, attn_decode.py,
attn_prefill.py, cpu_dense.py, overhead.py, run.py)."""

import argparse
import gc
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

# Run from a checkout: its qkernels, built in place, comes before an installed one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import qkernels  # noqa: E402
from qkernels import testing  # noqa: E402

F32 = 4  # bytes per float32 element
# The input sets one graph cycles through span at least this much: 17x the H200's 60 MB L2, so a
# call never finds the inputs of the previous pass over the sets still cached.
COLD_FOOTPRINT_BYTES = 1 << 30
WARMUP_CALLS = 3
# Work captured per graph: the replay's own launch (a few µs) stays well under 1% of the figure.
GRAPH_WORK_US = 5000.0
MAX_CALLS_PER_GRAPH = 512
GPU_COPY_BYTES = 2 << 30


def calls_per_graph(estimate_us, n_sets, work_us=GRAPH_WORK_US):
    """Enough calls for work_us of work, in whole passes over the input sets."""
    wanted = min(MAX_CALLS_PER_GRAPH, max(1, math.ceil(work_us / max(estimate_us, 1e-3))))
    return n_sets * math.ceil(wanted / n_sets)


def gpu_replay_time_us(fn, sets, replays, work_us=GRAPH_WORK_US):
    """Device time per call: N calls captured in a CUDA graph, replays timed with CUDA events."""
    capture_stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Warm up on the stream the capture will use: lazy initialisation (library handles, workspaces,
    # compiled kernels, autotuning) must happen before capture, where it cannot run.
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        for i in range(WARMUP_CALLS):
            fn(sets[i % len(sets)])
        start.record()
        fn(sets[0])
        end.record()
    end.synchronize()
    calls = calls_per_graph(start.elapsed_time(end) * 1e3, len(sets), work_us)
    torch.cuda.current_stream().wait_stream(capture_stream)

    # The inputs are static tensors the graph reads at replay; each call's output and temporaries
    # come from the graph's private pool, where a block freed by one call is reused by the next.
    graph = torch.cuda.CUDAGraph()
    caller_stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, stream=capture_stream):
            for i in range(calls):
                fn(sets[i % len(sets)])
    finally:
        torch.cuda.set_stream(caller_stream)  # a capture_end that raises leaves the capture stream current
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    per_call = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(per_call)


def release_gpu_memory():
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except (RuntimeError, AssertionError):
        # a sticky CUDA error, reported where it happened: the rest reads n/a, the table still prints;
        # AssertionError: torch built without CUDA (a CPU run)
        pass


def gpu_copy_ceiling_gbps(samples, work_us=GRAPH_WORK_US):
    """Bytes read + written per second by one large copy: the bandwidth a streaming op can hope for."""
    src = torch.rand(GPU_COPY_BYTES // F32, device="cuda")
    dst = torch.empty_like(src)
    # Under graph capture copy_ becomes a memcpy node on a copy engine; an elementwise kernel moves
    # the same bytes through the SMs, as the ops do: take the faster.
    us = min(gpu_replay_time_us(lambda _: dst.copy_(src), [{}], samples, work_us),
             gpu_replay_time_us(lambda _: torch.mul(src, 1.0, out=dst), [{}], samples, work_us))
    del src, dst
    release_gpu_memory()
    return 2 * GPU_COPY_BYTES / us / 1e3


def gpu_gemm_ceiling_tflops(samples, work_us=GRAPH_WORK_US):
    """bf16 8192^3 torch.matmul (cuBLAS): the tensor-core rate a compute-bound op can hope for."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = gpu_replay_time_us(lambda _: a @ b, [{}], samples, work_us)
    return 2 * 8192 ** 3 / us / 1e6


# ---------------------------------------------------------------------------------------------
# Command line and header


def argument_parser(doc, samples, samples_help="replays per figure", quick_help="a subset of the cases (smoke run)",
                    listed=None, tiny=False):
    """The options every family script takes: --quick, --markdown FILE, --samples N, with listed =
    (name, choices) --name, a comma list of choices (default: all), and with tiny --tiny."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    if tiny:
        p.add_argument("--tiny", action="store_true",
                       help="--cpu at the smallest sizes, figures meaningless (benchmarks/run.py --cpu --tiny, a test)")
    p.add_argument("--markdown", help="also write the final table to this file")
    p.add_argument("--samples", type=int, default=samples,
                   help=samples_help + (f" (default {samples})" if samples is not None else ""))
    if listed:
        p.add_argument(f"--{listed[0]}", default=",".join(listed[1]), help=f"comma list from {', '.join(listed[1])}")
    p.listed = listed
    return p


def parse_args(p, argv, need_gpu=True, no_gpu_hint=""):
    """p's arguments, checked: its listed option as a list of known names, --samples at least 1, a
    CUDA device visible to torch where need_gpu and the script's --cpu (if it has one) is not given."""
    args = p.parse_args(argv)
    if p.listed:
        name, choices = p.listed
        values = [v.strip() for v in getattr(args, name).split(",") if v.strip()]
        unknown = [v for v in values if v not in choices]
        if unknown or not values:
            p.error(f"--{name}: unknown {', '.join(unknown) or '(none given)'}; expected some of {', '.join(choices)}")
        setattr(args, name, values)
    if getattr(args, "tiny", False):
        args.quick = True
    if args.samples is not None and args.samples < 1:
        p.error("--samples must be at least 1")
    if need_gpu and not getattr(args, "cpu", False) and not torch.cuda.is_available():
        p.error("no CUDA device visible to torch: this benchmark times CUDA kernels" + no_gpu_hint)
    return args


def header(family, anchors, *lines, machine=None):
    """A family's header, printed: qkernels against what, on which machine (default: the GPU), with
    the versions, then lines."""
    if machine is None:
        cudnn = f", cuDNN {torch.backends.cudnn.version()}" if torch.backends.cudnn.is_available() else ""
        machine = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}{cudnn})"
    lines = [f"{family}: qkernels {qkernels.__version__} vs {anchors} on {machine}; torch {torch.__version__}",
             *lines]
    print("\n".join(lines), flush=True)
    return lines


def bandwidth_header(family, args, copy_gbps=None):
    """The header of a script that times a bandwidth-bound family on the GPU (against the copy rate)
    or with --cpu on the host (against copy_gbps, the host's copy rate, when benchmarks/run.py
    measured it): -> (header lines, copy rate in GB/s or None)."""
    if args.cpu:
        copy = [copy_line(copy_gbps, "host memory copy, measured by benchmarks/run.py")] if copy_gbps else []
        return header(family, "torch", *copy, f"cpu: {qkernels.info()['cpu_threads']} qkernels threads, "
                      f"{torch.get_num_threads()} torch threads; wall-clock median of {args.samples} runs",
                      machine="the host CPU"), copy_gbps
    copy_gbps = gpu_copy_ceiling_gbps(args.samples)
    return header(family, "torch", copy_line(copy_gbps),
                  f"CUDA-graph replay, median of {args.samples} replays; GB/s: minimal bytes / time"), copy_gbps


CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_fp16", "avx_vnni")


def cpu_model():
    """The host CPU's model name and those of CPU_FLAGS it has (/proc/cpuinfo)."""
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
    return fields.get("model name", "unknown CPU"), [f for f in CPU_FLAGS if f in flags]


def cpu_batch_us(fn, batch_s=0.05):
    """One batch on the host: calls of fn for about batch_s, -> µs per call."""
    import time

    start = time.perf_counter()
    n = 0
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= batch_s:
            return elapsed * 1e6 / n


def host_copy_gbps(nbytes, rounds):
    """Bytes read + written per second by torch's copy_ of an nbytes float32 buffer on the host
    (torch's thread count), the median of rounds batches."""
    src = torch.rand(nbytes // F32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    us = statistics.median(cpu_batch_us(lambda: dst.copy_(src)) for _ in range(rounds))
    return 2 * nbytes / us / 1e3


def copy_line(copy_gbps, what=f"{GPU_COPY_BYTES >> 30} GiB device-to-device copy"):
    return f"copy ceiling: {copy_gbps:.0f} GB/s ({what}, bytes read + written)"


def main(parse, collect, columns=None, cells=None):
    """A family script's main: its table printed (and written with --markdown); 1 when a check FAILs.
    columns: the table's, or a function of the arguments giving them."""
    args = parse()
    if not getattr(args, "cpu", False) and not qkernels.AVAILABLE:
        print(f"warning: qkernels CUDA backend unavailable ({qkernels.info()['cuda_reason']}); our rows will be n/a")
    header, rows, footer = collect(args)
    columns = (columns(args) if callable(columns) else columns) or COLUMNS  # callable: the columns of these args
    cells = cells or row_cells
    print("\n" + "\n".join(header + [""] + text_table(rows, columns, cells) + ([""] + footer if footer else [])))
    if args.markdown:
        write_markdown(args.markdown, header, rows, footer, columns, cells)
    return 1 if any(row.check.startswith("FAIL") for row in rows) else 0


# ---------------------------------------------------------------------------------------------
# Checks against qkernels.testing.reference


def host(t):
    """A tensor as NumPy on the host, 16-bit floats widened to float32 (exactly)."""
    t = t.detach()
    return (t.float() if t.is_floating_point() and t.element_size() < 4 else t).cpu().numpy()


def reference(op, *args, **kwargs):
    """qkernels.testing.reference of op on host copies of the tensors among args and kwargs."""
    def h(a):
        return host(a) if isinstance(a, torch.Tensor) else a
    return testing.reference(op, *map(h, args), **{k: h(v) for k, v in kwargs.items()})


def one_sequence_pool(k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, b=0):
    """Sequence b of a token pool as a pool of its own (slot i holds its token i): the arguments
    k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr of that sequence alone, gathered on
    the device, small enough to copy to the host for the reference."""
    n = int(kv_indptr[b + 1] - kv_indptr[b])
    slots = req_to_token[int(req_pool_indices[b]), :n].long()
    dev = k_cache.device
    return (k_cache.index_select(0, slots), v_cache.index_select(0, slots), torch.arange(n, device=dev)[None],
            torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([0, n], device=dev))


def relative_error(got, want):
    """|got - want| / |want| in the 2-norm: got a tensor, want float64 NumPy."""
    err = np.linalg.norm(host(got).astype(np.float64) - want)
    return float(err / max(np.linalg.norm(want), 1e-300))


def max_error(got, want):
    """max |got - want| / max |want|: got a tensor, want float64 NumPy."""
    err = np.abs(host(got).astype(np.float64) - want).max(initial=0)
    return float(err / max(np.abs(want).max(initial=0), 1e-30))


def describe(exc):
    return f"n/a ({type(exc).__name__})"


def first_line(exc, width=200):
    text = str(exc).strip().splitlines()
    return text[0][:width] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Cases of one op beside its anchors (graph_ops.py, dense_ops.py)


@dataclass
class Impl:
    name: str
    fn: Callable[[dict], Any]  # one call on one input set
    ours: bool = False
    min_ratio: Optional[float] = None  # target: this anchor's time / ours >= min_ratio
    min_gbps: Optional[float] = None  # target (ours): GB/s >= min_gbps
    max_us: Optional[float] = None  # target (ours): time <= max_us
    min_share: Optional[float] = None  # target: ours' rate / this impl's rate >= min_share
    skip_check: Optional[str] = None  # why its result is not compared with the reference


@dataclass
class Case:
    op: str
    label: str
    make_inputs: Callable[[torch.Generator], dict]  # one random input set on the device
    nbytes: int  # minimal bytes moved by one call
    impls: list
    reference: Callable[[dict], np.ndarray]  # float64 of the part of the output checked, from one input set
    part: Callable[[Any], Any] = lambda out: out  # that part of an impl's output


def check_results(case, inputs, tol, error=relative_error):
    """Verdict per impl against the case's reference on one input set, and the impls that raised."""
    want = case.reference(inputs)
    verdicts, failures = {}, {}
    for impl in case.impls:
        if impl.skip_check:
            verdicts[impl.name] = f"skip: {impl.skip_check}"
            continue
        try:
            got = case.part(impl.fn(inputs))
            if tuple(got.shape) != want.shape:
                raise ValueError(f"got {tuple(got.shape)}, want {want.shape}")
            err = error(got, want)
        except Exception as exc:  # a missing kernel, a compile failure: report it, keep benchmarking
            failures[impl.name] = exc
            continue
        verdicts[impl.name] = f"{'PASS' if err < tol else 'FAIL'} {err:.1e}"
    return verdicts, failures


def target_text(impl, ratio, gbps, us, ours_rate=None):
    parts = []
    if impl.min_ratio is not None:
        bar = f">={impl.min_ratio:g}x"
        parts.append(bar if ratio is None else f"{bar} {'met' if ratio >= impl.min_ratio else 'MISSED'}")
    if impl.min_gbps is not None:
        bar = f">={impl.min_gbps / 1e3:.1f} TB/s"
        parts.append(bar if gbps is None else f"{bar} {'met' if gbps >= impl.min_gbps else 'MISSED'}")
    if impl.max_us is not None:
        bar = f"<={impl.max_us:.0f} µs"
        parts.append(bar if us is None else f"{bar} {'met' if us <= impl.max_us else 'MISSED'}")
    if impl.min_share is not None:
        bar = f"ours >={impl.min_share:.0%} of this"
        share = ours_rate / gbps if ours_rate and gbps else None
        parts.append(bar if share is None else f"{bar}: {share:.0%} {'met' if share >= impl.min_share else 'MISSED'}")
    return "; ".join(parts)


def case_rows(case, times, verdicts, failures, ceiling, rate=None):
    """The case's table rows; rate(us) gives the rate column (default: GB/s of case.nbytes), shown as a
    share of ceiling too."""
    rate = rate or (lambda us: case.nbytes / us / 1e3)
    ours_us = next((times.get(impl.name) for impl in case.impls if impl.ours), None)
    ours_rate = rate(ours_us) if ours_us else None
    rows = []
    for impl in case.impls:
        us = times.get(impl.name)
        r = rate(us) if us else None
        ratio = us / ours_us if us and ours_us and not impl.ours else None
        failure = describe(failures[impl.name]) if impl.name in failures else ""
        check = "; ".join(text for text in (verdicts.get(impl.name, ""), failure) if text)
        rows.append(Row(case.op, case.label, impl.name, us, r, 100.0 * r / ceiling if r and ceiling else None,
                        ratio, target_text(impl, ratio, r, us, ours_rate), check))
    return rows


def run_case(case, make_sets, time_us, tol, copy_gbps, release=None):
    """Check every impl against the reference on the first input set, time those that ran, one
    progress line each: -> the case's rows.  make_sets() -> the input sets; time_us(fn, sets)."""
    release = release or release_gpu_memory
    print(f"\n{case.op} | {case.label} | {case.nbytes / 1e6:.1f} MB minimal per call", flush=True)
    torch._dynamo.reset()  # each case compiles afresh; earlier cases' guards never pile up
    sets = make_sets()
    print(f"  {len(sets)} input set(s)", flush=True)
    verdicts, failures = check_results(case, sets[0], tol)
    release()
    times = {}
    width = max(len(impl.name) for impl in case.impls)
    for impl in case.impls:
        if impl.name not in failures:
            try:
                times[impl.name] = time_us(impl.fn, sets)
            except Exception as exc:  # capture refused (a host sync inside), compile failure, ...
                failures[impl.name] = exc
            release()
        failure, us = failures.get(impl.name), times.get(impl.name)
        if failure is not None:
            print(f"  {impl.name:<{width}} {describe(failure)}: {first_line(failure)}", flush=True)
        else:
            print(f"  {impl.name:<{width}} {fmt_us(us):>9} µs {case.nbytes / us / 1e3:>8.0f} GB/s  "
                  f"{verdicts.get(impl.name, '')}", flush=True)
    del sets
    release()
    return case_rows(case, times, verdicts, failures, copy_gbps)


def run_ops(ops, builders, run_one, release=None):
    """Every case of each op in ops (builders[op]() -> cases), run_one(case, seed) -> rows, with the
    seed 1000 * op + 100 * case; a case that fails outside its impls (inputs, reference) is reported
    and skipped: -> (rows, footer lines)."""
    rows, skipped = [], []
    for op_no, op in enumerate(ops):
        if not hasattr(qkernels, op):
            print(f"\n{op}: skipped, qkernels has no attribute {op!r} yet", flush=True)
            skipped.append(op)
            continue
        for case_no, case in enumerate(builders[op]()):
            try:
                rows += run_one(case, 1000 * op_no + 100 * case_no)
            except Exception as exc:  # the reference itself or the inputs failed: report, go on
                print(f"  case failed: {type(exc).__name__}: {first_line(exc)}", flush=True)
                (release or release_gpu_memory)()
    return rows, [f"skipped (not in qkernels yet): {', '.join(skipped)}"] if skipped else []


# ---------------------------------------------------------------------------------------------
# The table: one row per implementation of a case


@dataclass
class Row:
    op: str  # the first column: the op, or the kind of case
    case: str
    impl: str
    us: Optional[float]
    gbps: Optional[float]
    pct_copy: Optional[float]
    ratio: Optional[float]
    target: str
    check: str


COLUMNS = ["op", "case", "impl", "µs", "GB/s", "% copy", "anchor/ours", "target", "check"]
NUMERIC = {3, 4, 5, 6}


def seeded_input_sets(make_inputs, seed, device, max_sets=64):
    """make_inputs(generator) for seeds seed, seed + 1, ...: one set on the host, and on a GPU as many
    as span COLD_FOOTPRINT_BYTES (cold L2), at most max_sets."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    first = make_inputs(gen)
    set_bytes = sum(t.nbytes for t in first.values())
    n = 1 if device == "cpu" else min(max_sets, max(1, math.ceil(COLD_FOOTPRINT_BYTES / set_bytes)))
    sets = [first]
    for k in range(1, n):
        gen.manual_seed(seed + k)
        sets.append(make_inputs(gen))
    return sets


def cpu_time_us(fn, sets, samples):
    """Wall-clock median of fn over samples calls on the host, after two warm-up calls (where
    torch.compile compiles)."""
    import time

    for s in sets[:1] * 2:
        fn(s)
    times = []
    for i in range(samples):
        t0 = time.perf_counter()
        fn(sets[i % len(sets)])
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_checked_case(case, sets, verdicts, failures, samples, on_cpu, copy_gbps, rate=None):
    """Time every impl of case that passed its check (CUDA-graph replay, or the host's wall clock),
    print a line per impl and return the case's table rows; '% copy' against copy_gbps, or on the
    host against the fastest impl; rate(us): the rate column when not GB/s (then no share)."""
    times = {}
    for impl in case.impls:
        if impl.name in failures:
            continue
        try:
            times[impl.name] = cpu_time_us(impl.fn, sets, samples) if on_cpu else \
                gpu_replay_time_us(impl.fn, sets, samples)
        except Exception as exc:
            failures[impl.name] = exc
        us = times.get(impl.name)
        print(f"  {impl.name:<20} {fmt_us(us):>9} µs  {verdicts.get(impl.name, '')}", flush=True)
    if rate is not None:
        return case_rows(case, times, verdicts, failures, None, rate)
    ceiling = copy_gbps or max((case.nbytes / us / 1e3 for us in times.values()), default=1.0)
    return case_rows(case, times, verdicts, failures, ceiling)


def time_cases(seeded_cases, check, samples, on_cpu, copy_gbps, rate_of=None):
    """For each (seed, case): its input sets, check(case, first set) -> (verdicts, failures), then
    time_checked_case (rate_of(case): its rate function, where the rate is not GB/s).  -> (rows,
    footer) for common.main."""
    rows = []
    for seed, case in seeded_cases:
        print(f"\n{case.op} | {case.label} | {case.nbytes / 1e6:.2f} MB minimal per call", flush=True)
        torch._dynamo.reset()
        sets = seeded_input_sets(case.make_inputs, seed, "cpu" if on_cpu else "cuda")
        verdicts, failures = check(case, sets[0])
        rows += time_checked_case(case, sets, verdicts, failures, samples, on_cpu, copy_gbps,
                                  rate_of(case) if rate_of else None)
        del sets
        if not on_cpu:
            release_gpu_memory()
    footer = ["--cpu: '% copy' is relative to the fastest impl of the case (no copy ceiling is timed)"] \
        if on_cpu and not copy_gbps and not rate_of else []
    return rows, footer


def fmt_us(us):
    if us is None:
        return "n/a"
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def row_cells(row):
    return [row.op, row.case, row.impl, fmt_us(row.us),
            "" if row.gbps is None else f"{row.gbps:.1f}" if row.gbps < 10 else f"{row.gbps:.0f}",
            "" if row.pct_copy is None else f"{row.pct_copy:.0f}%",
            "" if row.ratio is None else f"{row.ratio:.2f}x",
            row.target, row.check]


def write_markdown(path, header, rows, footer=(), columns=COLUMNS, cells=row_cells):
    """A family's results file: the header lines, the markdown table, the footer lines."""
    with open(path, "w") as f:
        f.write("\n\n".join(list(header) + ["\n".join(markdown_table(rows, columns, cells))] + list(footer)) + "\n")


def text_table(rows, columns=COLUMNS, cells=row_cells):
    """cells(row): a row's column texts (default: COLUMNS')."""
    cells = [cells(row) for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = []
    previous = (None, None)
    for r, row in zip([columns] + cells, [None] + rows):
        if row is not None and (row.op, row.case) == previous:
            r = ["", ""] + r[2:]  # the first column and case once per group
        if row is not None:
            previous = (row.op, row.case)
        lines.append("  ".join(c.rjust(w) if i in NUMERIC else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return lines


def markdown_table(rows, columns=COLUMNS, cells=row_cells):
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if i in NUMERIC else "---" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells(row)) + " |" for row in rows]
    return lines
