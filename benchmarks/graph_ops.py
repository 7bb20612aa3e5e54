"""Graph ops beside their anchors: time, bandwidth and speed-up per op and case.

What is measured.  For each graph op and case, qkernels and its anchors run on the same inputs
in one process:
  sparse_aggregate     cuSPARSE (torch.sparse.mm on one CSR matrix per head, results stacked) and
                       PyG-style gather + index_add_
  fused_edge_features  PyTorch eager and torch.compile (default mode) of the same function
  fused_norm_residual  PyTorch eager and torch.compile, inference and training (dropout p=0.1)
  graph_norm_bce       PyTorch eager, torch.compile, and a torch.segment_reduce version over the
                       sorted graph ids
Every result, the anchors' too, is first checked against the float64 reference of qkernels.testing
on the same inputs (the first CHECK_ROWS output rows; relative error in the 2-norm below REL_TOL:
PASS/FAIL), then timed.  In training mode only qkernels is checked: the reference draws qkernels'
documented dropout mask, PyTorch draws its own.

How (GPU).  N calls are captured in one CUDA graph after warm-up on the capture stream; the
replay is timed with CUDA events and divided by N; the figure is the median over replays.  Host
overhead (Python, dispatch, launch) is therefore out of the figure: it is device time.  Call i of
the graph reads input set i mod K, and the K sets together span at least 1 GiB (17x the H200's
60 MB L2), so inputs that would fit in L2 are cold at every call, as they are in a model where
other layers run in between.  All inputs are random (never zeros).

GB/s is the op's minimal byte count over the time: each input read once, each output written
once, gathered rows counted once per gather (the formula sits next to each case below).  The
copy ceiling is a 2 GiB device-to-device copy timed the same way in the same run (bytes read +
written); "% copy" is an op's GB/s as a share of it.  The ratio is anchor time / qkernels time
(>1: qkernels is faster); the target column holds the bar and whether it is met.

--cpu runs the same ops at 1/50 of the sizes on the CPU: qkernels backend="cpu" against PyTorch
CPU eager on the same inputs, timed with time.perf_counter (warm-up, then the median of batches).

    python3 benchmarks/graph_ops.py [--quick] [--ops sparse_aggregate,graph_norm_bce] [--markdown FILE]
    python3 benchmarks/graph_ops.py --cpu [--quick]
"""

import gc
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import common  # first: it puts the checkout's qkernels on sys.path
import qkernels
import torch
import torch.nn.functional as F
from common import (COLD_FOOTPRINT_BYTES, F32, GPU_COPY_BYTES, MAX_CALLS_PER_GRAPH, WARMUP_CALLS, Case, Impl,
                    gpu_replay_time_us, reference, release_gpu_memory)

OPS = ("sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce")

MAX_INPUT_SETS = 64
CPU_BATCH_S = 0.05  # one CPU sample: long enough for perf_counter to resolve, short enough to take many
CPU_COPY_BYTES = 1 << 30  # far beyond any last-level cache, yet cheap to fill on a small host
REL_TOL = 1e-4  # fp32 against the float64 reference: ~1e-6 expected
CHECK_ROWS = 4096  # the output rows (edges for fused_edge_features) checked against the reference
EPS = 1e-5
DROPOUT_P = 0.1
DROPOUT_SEED = 1234  # explicit, so no per-call seed drawing enters the timed region or the capture


@dataclass
class Setup:
    """Where and how large: the full GPU sizes divided by `divisor`."""
    device: torch.device
    backend: str  # qkernels backend= for our rows: strict, so a call it cannot take fails instead of falling back
    divisor: int
    index_dtype: torch.dtype
    on_gpu: bool
    samples: int
    tiny: bool = False  # --tiny: one input set, short CPU batches (a smoke run)

    def size(self, n):
        return max(1, n // self.divisor)

    @property
    def index_bytes(self):
        return self.index_dtype.itemsize


# ---------------------------------------------------------------------------------------------
# Inputs


def generator(setup, seed):
    gen = torch.Generator(device=setup.device)
    gen.manual_seed(seed)
    return gen


def randn(setup, gen, *shape):
    return torch.randn(shape, generator=gen, device=setup.device)


def count(n):
    """1_000_000 -> '1M', 1_600 -> '1.6k': case labels stay short."""
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return str(n)


def uniform_degrees(setup, n_rows, degree):
    return torch.full((n_rows,), degree, dtype=torch.int64, device=setup.device)


def zipf_degrees(setup, gen, n_rows, n_edges):
    """Degrees proportional to 1/rank (Zipf, s=1), summing to n_edges, assigned to rows at random.

    With 1M rows and 16M edges the top row gets ~1.1M edges and about ten rows more than 1e5,
    while most rows get a handful: the skew that breaks one-row-per-warp kernels.
    """
    share = 1.0 / torch.arange(1, n_rows + 1, dtype=torch.float64, device=setup.device)
    degrees = torch.floor(share * (n_edges / share.sum())).long()
    remainder = n_edges - int(degrees.sum())
    extra = torch.randint(0, n_rows, (remainder,), generator=gen, device=setup.device)
    degrees += torch.bincount(extra, minlength=n_rows)
    return degrees[torch.randperm(n_rows, generator=gen, device=setup.device)]


def csr_from_degrees(setup, gen, degrees, n_src):
    """row_ptr, col_idx (uniform random, sorted within each row as CSR builders leave them) and the row of each edge."""
    n_edges = int(degrees.sum())
    row_ptr = torch.cat([degrees.new_zeros(1), degrees.cumsum(0)])
    row_of_edge = torch.repeat_interleave(torch.arange(degrees.numel(), device=setup.device), degrees,
                                          output_size=n_edges)
    cols = torch.randint(0, n_src, (n_edges,), generator=gen, device=setup.device)
    cols = torch.sort(row_of_edge * n_src + cols).values % n_src
    return row_ptr.to(setup.index_dtype), cols.to(setup.index_dtype), row_of_edge.to(setup.index_dtype)


def input_sets(setup, case, seed):
    """Enough random input sets that cycling through them spans COLD_FOOTPRINT_BYTES."""
    first = case.make_inputs(generator(setup, seed))
    set_bytes = sum(t.nbytes for t in first.values() if isinstance(t, torch.Tensor))
    n_sets = 1 if setup.tiny else min(MAX_INPUT_SETS, max(1, math.ceil(COLD_FOOTPRINT_BYTES / max(set_bytes, 1))))
    return [first] + [case.make_inputs(generator(setup, seed + k)) for k in range(1, n_sets)]


# ---------------------------------------------------------------------------------------------
# sparse_aggregate


def sparse_aggregate_gather_index_add(s):
    """PyG's message passing: gather a message per edge, scale it, scatter-add it into its row."""
    node_feat = s["node_feat"]
    messages = node_feat.index_select(0, s["col_idx"])
    # In place: the same bytes as `edge_weight[:, :, None] * node_feat[col_idx]`, half the peak
    # memory (the messages alone are 16 GiB at full size).
    messages.mul_(s["edge_weight"].unsqueeze(-1))
    out = node_feat.new_zeros((s["row_ptr"].numel() - 1,) + node_feat.shape[1:])
    return out.index_add_(0, s["row_of_edge"], messages)


def sparse_aggregate_sparse_mm(s):
    """One CSR matrix per head through torch.sparse.mm (cuSPARSE SpMM on CUDA), stacked to [N_dst, H, D]."""
    node_feat = s["node_feat"]
    shape = (s["row_ptr"].numel() - 1, node_feat.shape[0])
    per_head = []
    for h in range(node_feat.shape[1]):
        adjacency = torch.sparse_csr_tensor(s["row_ptr"], s["col_idx"], s["weight_by_head"][h], size=shape,
                                            check_invariants=False)
        per_head.append(torch.sparse.mm(adjacency, node_feat[:, h, :]))
    return torch.stack(per_head, dim=1)


def sparse_aggregate_case(setup, label, degrees_of, n_nodes, heads, dim, targets):
    """targets: the bars (anchor time / ours) for the sparse.mm and the gather + index_add_ anchors."""
    sparse_mm_target, gather_target = targets
    n_edges = 16 * n_nodes  # both cases: the uniform case's degree 16

    def make_inputs(gen):
        row_ptr, col_idx, row_of_edge = csr_from_degrees(setup, gen, degrees_of(gen), n_nodes)
        edge_weight = randn(setup, gen, n_edges, heads)
        return {
            "row_ptr": row_ptr, "col_idx": col_idx, "edge_weight": edge_weight,
            "node_feat": randn(setup, gen, n_nodes, heads, dim),
            # Anchor layouts, made once per input set as a user of each library stores them: PyG keeps
            # edge_index (COO), so each edge's row is given; cuSPARSE takes one contiguous value array per matrix.
            "row_of_edge": row_of_edge,
            "weight_by_head": edge_weight.t().contiguous(),
        }

    idx = setup.index_bytes
    # Minimal bytes: per edge its column index and H weights, one gathered node_feat row (H*D) per
    # edge, the output written once, row_ptr read once.
    nbytes = (n_edges * (idx + heads * F32) + n_edges * heads * dim * F32 + n_nodes * heads * dim * F32
              + (n_nodes + 1) * idx)

    def ours(s):
        return qkernels.sparse_aggregate(s["row_ptr"], s["col_idx"], s["edge_weight"], s["node_feat"],
                                         backend=setup.backend)

    def check(s):
        """The first rows: their edges, each edge's source row gathered on the device (edge e reads row e)."""
        rows = min(CHECK_ROWS, n_nodes)
        edges = int(s["row_ptr"][rows])
        return reference("sparse_aggregate", s["row_ptr"][:rows + 1], torch.arange(edges), s["edge_weight"][:edges],
                         s["node_feat"].index_select(0, s["col_idx"][:edges]))

    impls = [
        Impl("qkernels", ours, ours=True),
        Impl("cuSPARSE: sparse.mm per head" if setup.on_gpu else "torch.sparse.mm per head",
             sparse_aggregate_sparse_mm, min_ratio=sparse_mm_target),
        Impl("gather + index_add_ (PyG)", sparse_aggregate_gather_index_add, min_ratio=gather_target),
    ]
    return Case("sparse_aggregate", label.format(N=count(n_nodes), E=count(n_edges)), make_inputs, nbytes, impls,
                check, lambda out: out[:CHECK_ROWS])


def sparse_aggregate_cases(setup):
    n = setup.size(1_000_000)
    # The GPU bars (anchor time / ours); on the CPU every eager anchor's bar is 1.0x.
    uniform_targets = (1.5, 10.0) if setup.on_gpu else (1.0, 1.0)
    power_law_targets = (1.0, None) if setup.on_gpu else (1.0, 1.0)
    return [
        sparse_aggregate_case(setup, "uniform N={N} E={E} H=8 D=32", lambda gen: uniform_degrees(setup, n, 16), n,
                              heads=8, dim=32, targets=uniform_targets),
        sparse_aggregate_case(setup, "power-law N={N} E={E} H=4 D=64", lambda gen: zipf_degrees(setup, gen, n, 16 * n),
                              n, heads=4, dim=64, targets=power_law_targets),
    ]


# ---------------------------------------------------------------------------------------------
# fused_edge_features


def edge_features_eager(x, edge_index, edge_attr):
    x_src, x_dst = x[edge_index[0]], x[edge_index[1]]
    return torch.cat([x_src + x_dst, (x_src - x_dst).abs(), edge_attr], dim=1)


def edge_features_case(setup, n_edges, n_nodes, hidden):
    def make_inputs(gen):
        return {
            "x": randn(setup, gen, n_nodes, hidden),
            "edge_index": torch.randint(0, n_nodes, (2, n_edges), generator=gen, device=setup.device,
                                        dtype=setup.index_dtype),
            "edge_attr": randn(setup, gen, n_edges, hidden),
        }

    # Minimal bytes: both rows of edge_index, the two gathered x rows per edge, edge_attr read once,
    # the [E, 3H] output written once.
    nbytes = 2 * n_edges * setup.index_bytes + 2 * n_edges * hidden * F32 + n_edges * hidden * F32 \
        + n_edges * 3 * hidden * F32

    def ours(s):
        return qkernels.fused_edge_features(s["x"], s["edge_index"], s["edge_attr"], backend=setup.backend)

    def bind(fn, s):
        return fn(s["x"], s["edge_index"], s["edge_attr"])

    impls = [Impl("qkernels", ours, ours=True)] + eager_and_compiled(setup, edge_features_eager, bind, 1.2)
    return Case("fused_edge_features", f"E={count(n_edges)} N={count(n_nodes)} H={hidden} +edge_attr",
                make_inputs, nbytes, impls,
                lambda s: reference("fused_edge_features", s["x"], s["edge_index"][:, :CHECK_ROWS],
                                    s["edge_attr"][:CHECK_ROWS]), lambda out: out[:CHECK_ROWS])


def fused_edge_features_cases(setup):
    return [
        edge_features_case(setup, setup.size(4_000_000), setup.size(1_000_000), hidden=32),
        edge_features_case(setup, setup.size(1_000_000), setup.size(100_000), hidden=64),
    ]


# ---------------------------------------------------------------------------------------------
# fused_norm_residual


def norm_residual_eager(x, residual, gamma, beta, p, training):
    normed = F.layer_norm(x, (x.shape[-1],), gamma, beta, EPS)
    return F.dropout(normed, p, training) + residual


def norm_residual_case(setup, rows, hidden, training):
    def make_inputs(gen):
        return {
            "x": randn(setup, gen, rows, hidden) * 2.0 + 0.5,  # a non-zero row mean, as activations have
            "residual": randn(setup, gen, rows, hidden),
            "gamma": 1.0 + 0.1 * randn(setup, gen, hidden),
            "beta": 0.1 * randn(setup, gen, hidden),
        }

    # Minimal bytes: x and residual read once, the output written once, gamma and beta read once.
    # The dropout mask is generated in registers (counter-based), so it moves no bytes.
    nbytes = 3 * rows * hidden * F32 + 2 * hidden * F32

    def ours(s):
        return qkernels.fused_norm_residual(s["x"], s["residual"], s["gamma"], s["beta"], p=DROPOUT_P,
                                            training=training, eps=EPS, seed=DROPOUT_SEED, backend=setup.backend)

    def bind(fn, s):
        return fn(s["x"], s["residual"], s["gamma"], s["beta"], DROPOUT_P, training)

    def check(s):
        """The first rows: dropout's element i is the same element in them (a row-major prefix)."""
        return reference("fused_norm_residual", s["x"][:CHECK_ROWS], s["residual"][:CHECK_ROWS], s["gamma"], s["beta"],
                         p=DROPOUT_P, training=training, eps=EPS, seed=DROPOUT_SEED)

    anchors = eager_and_compiled(setup, norm_residual_eager, bind, 1.0)
    for impl in anchors if training else ():
        impl.skip_check = "its own dropout mask"
    mode = f"training p={DROPOUT_P}" if training else "inference"
    return Case("fused_norm_residual", f"R={count(rows)} H={hidden} {mode}", make_inputs, nbytes,
                [Impl("qkernels", ours, ours=True)] + anchors, check, lambda out: out[:CHECK_ROWS])


def fused_norm_residual_cases(setup):
    return [norm_residual_case(setup, setup.size(rows), hidden, training)
            for rows, hidden in ((1_000_000, 128), (200_000, 512)) for training in (False, True)]


# ---------------------------------------------------------------------------------------------
# graph_norm_bce


def weighted_bce(logits, target, pos_weight):
    # weight = 1 + (pos_weight - 1) * t times the plain BCE is the op's definition for any target.
    weight = target * (pos_weight - 1.0) + 1.0
    return F.binary_cross_entropy_with_logits(logits, target, weight=weight, reduction="none")


def graph_norm_bce_eager(logits, target, edge_graph, num_graphs, pos_weight):
    loss = weighted_bce(logits, target, pos_weight)
    sums = logits.new_zeros(num_graphs).index_add_(0, edge_graph, loss)
    # Counts by index_add_ rather than bincount: bincount reads the max id back to the host, which
    # graph capture forbids.
    counts = logits.new_zeros(num_graphs).index_add_(0, edge_graph, torch.ones_like(loss))
    return (sums / counts.clamp_min(1.0)).mean()


def graph_norm_bce_segment_reduce(logits, target, edge_graph, num_graphs, pos_weight):
    loss = weighted_bce(logits, target, pos_weight)
    graph_ids = torch.arange(num_graphs + 1, dtype=edge_graph.dtype, device=edge_graph.device)
    lengths = torch.searchsorted(edge_graph, graph_ids).diff()  # edge_graph is sorted: graph g owns one run
    # unsafe=True skips the lengths check, which reads values back to the host: a sync capture forbids.
    sums = torch.segment_reduce(loss, "sum", lengths=lengths, unsafe=True)
    return (sums / lengths.clamp_min(1)).mean()


def graph_norm_bce_case(setup, n_edges, num_graphs, max_us):
    num_graphs = min(num_graphs, n_edges)
    pos_weight = 2.0

    def make_inputs(gen):
        graph_of_edge = torch.randint(0, num_graphs, (n_edges,), generator=gen, device=setup.device)
        return {
            "logits": 2.0 * randn(setup, gen, n_edges),
            "target": (torch.rand(n_edges, generator=gen, device=setup.device) < 0.3).float(),
            "edge_graph": torch.sort(graph_of_edge).values.to(setup.index_dtype),  # sorted, as PyG batches are
        }

    # Minimal bytes: logits, target and edge_graph read once; the 0-d result written once.
    nbytes = n_edges * (2 * F32 + setup.index_bytes) + F32

    def ours(s):
        return qkernels.graph_norm_bce(s["logits"], s["target"], s["edge_graph"], num_graphs, pos_weight=pos_weight,
                                       backend=setup.backend)

    def bind(fn, s):
        return fn(s["logits"], s["target"], s["edge_graph"], num_graphs, pos_weight)

    impls = [Impl("qkernels", ours, ours=True, max_us=max_us if setup.on_gpu else None)]
    impls += eager_and_compiled(setup, graph_norm_bce_eager, bind, None)
    impls.append(Impl("segment_reduce (sorted lengths)", lambda s: bind(graph_norm_bce_segment_reduce, s),
                      min_ratio=None if setup.on_gpu else 1.0))
    return Case("graph_norm_bce", f"E={count(n_edges)} graphs={num_graphs} pos_weight={pos_weight}", make_inputs,
                nbytes, impls, lambda s: reference("graph_norm_bce", s["logits"], s["target"], s["edge_graph"],
                                                   num_graphs, pos_weight=pos_weight))


def graph_norm_bce_cases(setup):
    return [
        graph_norm_bce_case(setup, setup.size(4_000_000), 128, max_us=40.0),
        graph_norm_bce_case(setup, setup.size(800_000), 4096, max_us=None),
    ]


CASE_BUILDERS = {
    "sparse_aggregate": sparse_aggregate_cases,
    "fused_edge_features": fused_edge_features_cases,
    "fused_norm_residual": fused_norm_residual_cases,
    "graph_norm_bce": graph_norm_bce_cases,
}


def eager_and_compiled(setup, eager_fn, bind, compile_target):
    """The eager anchor and, on the GPU, torch.compile of the same function.

    dynamic=False: each case compiles for its own static shapes, as a model with fixed-size batches
    gets; otherwise the second case's recompile would turn to dynamic-shape kernels.
    """
    impls = [Impl("PyTorch eager", lambda s: bind(eager_fn, s), min_ratio=None if setup.on_gpu else 1.0)]
    if setup.on_gpu:
        compiled_fn = torch.compile(eager_fn, dynamic=False)
        impls.append(Impl("torch.compile", lambda s: bind(compiled_fn, s), min_ratio=compile_target))
    return impls


# ---------------------------------------------------------------------------------------------
# Timing


def cpu_time_us(fn, sets, samples, batch_s=CPU_BATCH_S):
    """Wall time per call: warm-up, then the median over batches of calls cycling through the input sets."""
    for i in range(WARMUP_CALLS):
        fn(sets[i % len(sets)])
    start = time.perf_counter()
    fn(sets[0])
    estimate_s = time.perf_counter() - start
    calls = min(MAX_CALLS_PER_GRAPH, max(1, math.ceil(batch_s / max(estimate_s, 1e-7))))
    per_call = []
    next_set = 0
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn(sets[next_set])
            next_set = (next_set + 1) % len(sets)
        per_call.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(per_call)


def time_per_call_us(setup, fn, sets):
    if setup.on_gpu:
        return gpu_replay_time_us(fn, sets, setup.samples)
    return cpu_time_us(fn, sets, setup.samples, CPU_BATCH_S / 10 if setup.tiny else CPU_BATCH_S)


def copy_ceiling_gbps(setup):
    """Bytes read + written per second by one large copy: the bandwidth a streaming op can hope for."""
    nbytes = GPU_COPY_BYTES if setup.on_gpu else CPU_COPY_BYTES
    src = torch.rand(nbytes // F32, device=setup.device)
    dst = torch.empty_like(src)
    # Under graph capture copy_ becomes a memcpy node on a copy engine (~2.8 TB/s on the H200); an
    # elementwise kernel moves the same bytes through the SMs, as the ops do: take the faster.
    us = min(time_per_call_us(setup, lambda _: dst.copy_(src), [{}]),
             time_per_call_us(setup, lambda _: torch.mul(src, 1.0, out=dst), [{}]))
    del src, dst
    release_memory(setup)
    return 2 * nbytes / us / 1e3


def release_memory(setup):
    if setup.on_gpu:
        release_gpu_memory()
    else:
        gc.collect()


# ---------------------------------------------------------------------------------------------
# Report


def header_lines(setup, copy_gbps, quick, measured=True):
    """measured: the copy ceiling was timed here (else benchmarks/run.py gave it)."""
    if setup.on_gpu:
        machine, copy = None, f"{GPU_COPY_BYTES >> 30} GiB device-to-device copy"
        timing = f"CUDA-graph replay, median of {setup.samples} replays"
    else:
        machine = f"{common.cpu_model()[0]}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
        copy = f"{CPU_COPY_BYTES >> 30} GiB host-memory copy" if measured else \
            "host memory copy, measured by benchmarks/run.py"
        timing = f"time.perf_counter, median of {setup.samples} batches"
    scale = f"full sizes / {setup.divisor}" + (" (--quick; targets are for full sizes)" if quick else "")
    return common.header(
        "graph ops", "anchors", common.copy_line(copy_gbps, copy),
        f"{scale}; float32; {str(setup.index_dtype).replace('torch.', '')} indices; {timing}; "
        f"inputs cycled to span {COLD_FOOTPRINT_BYTES >> 30} GiB",
        "GB/s: minimal bytes (formulas in benchmarks/graph_ops.py) / time; anchor/ours > 1: qkernels faster; "
        f"check: relative error against the float64 reference < {REL_TOL:g}", machine=machine)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = common.argument_parser(__doc__, None, "replays (GPU, default 15) or batches (CPU, default 7) per figure",
                               "sizes 10x smaller (smoke run)", listed=("ops", OPS), tiny=True)
    p.add_argument("--cpu", action="store_true", help="CPU backend at 1/50 of the sizes, against PyTorch CPU eager")
    p.add_argument("--index-dtype", choices=("int64", "int32"), default="int64",
                   help="dtype of row_ptr/col_idx/edge_index/edge_graph (PyG uses int64)")
    return common.parse_args(p, argv, no_gpu_hint="; use --cpu")


def make_setup(args):
    on_gpu = not args.cpu
    return Setup(
        device=torch.device("cuda" if on_gpu else "cpu"),
        backend="cuda" if on_gpu else "cpu",
        divisor=(1 if on_gpu else 50) * (1000 if args.tiny else 10 if args.quick else 1),
        index_dtype=getattr(torch, args.index_dtype),
        on_gpu=on_gpu,
        samples=args.samples or (15 if on_gpu else 7),
        tiny=args.tiny,
    )


def collect(args, copy_gbps=None):
    """Every case of args.ops, progress printed as it goes: -> (header, rows, footer); copy_gbps: the
    copy ceiling when benchmarks/run.py measured it already."""
    setup = make_setup(args)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    measured = copy_gbps is None
    copy_gbps = copy_gbps or copy_ceiling_gbps(setup)
    header = header_lines(setup, copy_gbps, args.quick, measured)

    def run_one(case, seed):
        return common.run_case(case, lambda: input_sets(setup, case, seed),
                               lambda fn, sets: time_per_call_us(setup, fn, sets), REL_TOL, copy_gbps,
                               lambda: release_memory(setup))

    builders = {op: (lambda b=CASE_BUILDERS[op]: b(setup)) for op in args.ops}
    rows, footer = common.run_ops(args.ops, builders, run_one, lambda: release_memory(setup))
    return header, rows, footer


if __name__ == "__main__":
    common.main(parse_args, collect)
