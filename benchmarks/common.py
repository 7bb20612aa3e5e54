"""What the benchmark scripts share: device time by CUDA-graph replay, the copy and GEMM ceilings,
and the result table (graph_ops.py, dense_ops.py, attention_decode.py, attention_prefill.py, run.py)."""

import gc
import math
import statistics
from dataclasses import dataclass
from typing import Optional

import torch

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
    except RuntimeError:
        pass  # a sticky CUDA error, reported where it happened: the rest reads n/a, the table still prints


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


def relative_error(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def describe(exc):
    return f"n/a ({type(exc).__name__})"


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


def fmt_us(us):
    if us is None:
        return "n/a"
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def row_cells(row):
    return [row.op, row.case, row.impl, fmt_us(row.us),
            "" if row.gbps is None else f"{row.gbps:.0f}",
            "" if row.pct_copy is None else f"{row.pct_copy:.0f}%",
            "" if row.ratio is None else f"{row.ratio:.2f}x",
            row.target, row.check]


def write_markdown(path, header, rows, footer=(), columns=COLUMNS):
    """A family's results file: the header lines, the markdown table, the footer lines."""
    with open(path, "w") as f:
        f.write("\n\n".join(list(header) + ["\n".join(markdown_table(rows, columns))] + list(footer)) + "\n")


def text_table(rows, columns=COLUMNS):
    cells = [row_cells(row) for row in rows]
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


def markdown_table(rows, columns=COLUMNS):
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if i in NUMERIC else "---" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row_cells(row)) + " |" for row in rows]
    return lines
