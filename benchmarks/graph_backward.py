"""Graph ops forward + backward beside PyTorch eager and torch.compile of the same functions.

For each graph op, one training call: the forward, then the gradients of every differentiable input
for a random upstream gradient (torch.autograd.grad).  qkernels runs through its torch operators
(autograd calls the op's backward kernels); the anchors are the op written in PyTorch, eager and
under torch.compile (default mode), differentiated by autograd.  Sizes are graph_ops.py's.

How (GPU).  As graph_ops.py: the calls are captured in one CUDA graph and replayed (CUDA events,
median over replays), inputs rotate over sets spanning >= 1 GiB so they are cold in L2.  The
gradients of every implementation are first checked against those of a float64 PyTorch run of the
same function (relative error in the 2-norm).  The ratio is anchor time / qkernels time.

--cpu: 1/50 of the sizes on the CPU, qkernels backend cpu against PyTorch CPU eager, perf_counter;
each implementation is first called --warmup times (default 3): the first calls after the float64
check fault in fresh pages for their outputs (glibc hands freed memory back to the system), which
would otherwise land on whichever implementation is timed first.

    python3 benchmarks/graph_backward.py [--quick] [--cpu] [--samples N] [--markdown FILE]
"""

import statistics
import time

import common  # first: it puts the checkout's qkernels on sys.path
import qkernels
import qkernels.torch  # noqa: F401  the operators, registered before torch.compile traces
import torch
import torch.nn.functional as F
from common import COLD_FOOTPRINT_BYTES, gpu_replay_time_us, release_gpu_memory

REL_TOL = 1e-4
TARGET = 1.2  # qkernels forward + backward against torch.compile's


def sa_torch(row_ptr, col_idx, edge_weight, node_feat, rows):
    msg = edge_weight[:, :, None] * node_feat[col_idx]
    return torch.zeros(row_ptr.shape[0] - 1, *node_feat.shape[1:], device=node_feat.device,
                       dtype=node_feat.dtype).index_add(0, rows, msg)


def ef_torch(x, edge_index, edge_attr):
    xs, xd = x[edge_index[0]], x[edge_index[1]]
    return torch.cat([xs + xd, (xs - xd).abs(), edge_attr], dim=1)


def nr_torch(x, residual, gamma, beta):
    return F.layer_norm(x, x.shape[-1:], gamma, beta, 1e-5) + residual


def bce_torch(logits, target, edge_graph, num_graphs, counts):
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return (torch.zeros(num_graphs, device=logits.device, dtype=logits.dtype).index_add(0, edge_graph, loss) / counts).mean()


def cases(device, div, quick):
    """(op, label, make(gen) -> (inputs, differentiable names), qkernels fn, torch fn, qkernels fn with
    the graph's plan or None).  A plan is built with each input set, as a caller with a fixed graph
    builds it once."""
    idx = torch.int64

    def randn(gen, *shape):
        return torch.randn(*shape, generator=gen, device=device)

    def sparse(n, deg, heads, dim):
        n = max(1, n // div)

        def make(gen):
            counts = torch.full((n,), deg, device=device)
            row_ptr = torch.cat([torch.zeros(1, device=device, dtype=idx), counts.cumsum(0)])
            e = int(row_ptr[-1])
            col = torch.randint(0, n, (e,), generator=gen, device=device)
            rows = torch.repeat_interleave(torch.arange(n, device=device), counts)
            return dict(row_ptr=row_ptr, col_idx=col, edge_weight=randn(gen, e, heads),
                        node_feat=randn(gen, n, heads, dim), rows=rows,
                        plan=qkernels.sparse_aggregate_plan(row_ptr, col, n)), ("edge_weight", "node_feat")

        return ("sparse_aggregate", f"uniform N={n} deg={deg} H={heads} D={dim}", make,
                lambda s: qkernels.sparse_aggregate(s["row_ptr"], s["col_idx"], s["edge_weight"], s["node_feat"]),
                lambda s: sa_torch(s["row_ptr"], s["col_idx"], s["edge_weight"], s["node_feat"], s["rows"]),
                lambda s: qkernels.sparse_aggregate(s["row_ptr"], s["col_idx"], s["edge_weight"], s["node_feat"],
                                                    plan=s["plan"]))

    def edges(e, n, h):
        e, n = max(1, e // div), max(1, n // div)

        def make(gen):
            edge_index = torch.randint(0, n, (2, e), generator=gen, device=device)
            return dict(x=randn(gen, n, h), edge_index=edge_index, edge_attr=randn(gen, e, h),
                        plan=qkernels.fused_edge_features_plan(edge_index, n)), ("x", "edge_attr")

        return ("fused_edge_features", f"E={e} N={n} H={h}", make,
                lambda s: qkernels.fused_edge_features(s["x"], s["edge_index"], s["edge_attr"]),
                lambda s: ef_torch(s["x"], s["edge_index"], s["edge_attr"]),
                lambda s: qkernels.fused_edge_features(s["x"], s["edge_index"], s["edge_attr"], plan=s["plan"]))

    def norm(r, h):
        r = max(1, r // div)

        def make(gen):
            return dict(x=randn(gen, r, h), residual=randn(gen, r, h), gamma=1 + 0.1 * randn(gen, h),
                        beta=0.1 * randn(gen, h)), ("x", "residual", "gamma", "beta")

        return ("fused_norm_residual", f"R={r} H={h}", make,
                lambda s: qkernels.fused_norm_residual(s["x"], s["residual"], s["gamma"], s["beta"]),
                lambda s: nr_torch(s["x"], s["residual"], s["gamma"], s["beta"]), None)

    def bce(e, g):
        e = max(1, e // div)

        def make(gen):
            graph = torch.sort(torch.randint(0, g, (e,), generator=gen, device=device)).values
            return dict(logits=randn(gen, e), target=(torch.rand(e, generator=gen, device=device) < 0.1).float(),
                        edge_graph=graph, counts=torch.bincount(graph, minlength=g).clamp(min=1).float()), ("logits",)

        return ("graph_norm_bce", f"E={e} graphs={g}", make,
                lambda s: qkernels.graph_norm_bce(s["logits"], s["target"], s["edge_graph"], g),
                lambda s: bce_torch(s["logits"], s["target"], s["edge_graph"], g, s["counts"]), None)

    out = [sparse(1_000_000, 16, 8, 32), edges(4_000_000, 1_000_000, 32), norm(1_000_000, 128),
           bce(4_000_000, 128)]
    if not quick:
        out += [edges(1_000_000, 100_000, 64), norm(200_000, 512), bce(800_000, 4096)]
    return out


def train_call(fn, names):
    """A forward + backward of fn for the input set s: the gradients of the differentiable inputs."""
    def call(s):
        leaves = [s[n] for n in names]
        out = fn(s)
        return torch.autograd.grad(out, leaves, s["grad_out"] if out.dim() else None)
    return call


def reference_grads(op, theirs, names, s64):
    """The gradients of float64 autograd of the PyTorch function, on the host.  sparse_aggregate's
    heads are independent and run one at a time: at N=1M, deg=16 its whole float64 autograd holds
    ~130 GB of [E, H, D] temporaries."""
    if op != "sparse_aggregate":
        return [w.cpu() for w in train_call(theirs, names)(s64)]
    parts = []
    for h in range(s64["edge_weight"].shape[1]):
        one = {k: v[:, h:h + 1].detach().requires_grad_(k in names) for k, v in s64.items()
               if k in ("edge_weight", "node_feat", "grad_out")}
        parts.append([w.cpu() for w in train_call(theirs, names)(dict(s64, **one))])
    return [torch.cat(p, dim=1) for p in zip(*parts)]


def prepare(make, gen, device):
    s, names = make(gen)
    for n in names:
        s[n] = s[n].detach().requires_grad_(True)
    return s, names


COLUMNS = ["op", "case", "impl", "µs (fwd+bwd)", "GB/s", "% copy", "anchor/ours", "target", "check"]


def parse_args(argv=None):
    p = common.argument_parser(__doc__.split("\n\n")[0], 10, "replays (GPU) or timed calls (CPU) per figure",
                               tiny=True)
    p.add_argument("--cpu", action="store_true", help="1/50 of the sizes on the CPU, against PyTorch CPU eager")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed ones (CPU)")
    return common.parse_args(p, argv, need_gpu=False)


def collect(args, copy_gbps=None):
    """Every case, progress printed as it goes: -> (header, rows, footer) for common.main and
    benchmarks/run.py (no byte counts: copy_gbps is not used)."""
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    div = (5000 if args.tiny else 50) if device.type == "cpu" else 1
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    if device.type == "cpu":
        machine = f"the host CPU ({qkernels.info()['cpu_threads']} qkernels threads, {torch.get_num_threads()} torch " \
                  "threads)"
        timing = f"time.perf_counter, median of {args.samples} calls after {max(1, args.warmup)} untimed ones"
    else:
        machine, timing = None, f"CUDA-graph replay, median of {args.samples} replays"
    header = common.header("graph ops forward + backward", "PyTorch eager" + (" and torch.compile" if div == 1 else ""),
                           f"sizes: graph_ops.py's / {div}" + (" (--quick: a subset)" if args.quick else "")
                           + f"; float32; {timing}",
                           f"anchor/ours > 1: qkernels faster (the plan row: the target's anchor over its time); check: relative error of every gradient against "
                           f"float64 autograd of the PyTorch function < {REL_TOL:g}", machine=machine)
    for op, label, make, ours, theirs, planned in cases(device, div, args.quick):
        print(f"\n{op} | {label}", flush=True)
        s, names = prepare(make, gen, device)
        with torch.no_grad():
            out = theirs(s)
        s["grad_out"] = torch.randn(out.shape, generator=gen, device=device)
        # correctness: every implementation's gradients against float64 autograd of the PyTorch function
        s64 = {k: (v.detach().double().requires_grad_(k in names) if v.is_floating_point() else v)
               for k, v in s.items()}
        want = reference_grads(op, theirs, names, s64)
        del s64
        if device.type == "cuda":  # the float64 run's cached blocks would starve cudaMallocAsync
            release_gpu_memory()
        impls = [("qkernels", ours)] + ([("qkernels + plan", planned)] if planned else []) + [("pytorch eager", theirs)]
        if device.type == "cuda":
            impls.append(("torch.compile", torch.compile(theirs)))
        verdict = {}
        for name, fn in impls:
            got = train_call(fn, names)(s)
            err = max(((g.double().cpu() - w).norm() / w.norm().clamp(min=1e-30)).item() for g, w in zip(got, want))
            verdict[name] = f"{'PASS' if err <= REL_TOL else 'FAIL'} {err:.1e}"
            del got
            if device.type == "cuda":
                release_gpu_memory()
        # cold inputs: enough sets to span the footprint
        per_set = sum(v.numel() * v.element_size() for v in s.values())
        n_sets = max(1, min(16, COLD_FOOTPRINT_BYTES // max(per_set, 1))) if device.type == "cuda" else 1
        sets = [s] + [dict(prepare(make, gen, device)[0], grad_out=s["grad_out"]) for _ in range(n_sets - 1)]
        times = {}
        for name, fn in impls:
            call = train_call(fn, names)
            if device.type == "cuda":
                times[name] = gpu_replay_time_us(call, sets, args.samples)
            else:
                for _ in range(1 if args.tiny else max(1, args.warmup)):
                    call(s)
                samples = []
                for _ in range(args.samples):
                    t0 = time.perf_counter()
                    call(s)
                    samples.append((time.perf_counter() - t0) * 1e6)
                times[name] = statistics.median(samples)
            print(f"  {name:<14} {common.fmt_us(times[name]):>9} µs  {verdict[name]}", flush=True)
        base = times["qkernels"]
        # the planned row's ratio: the target's anchor (torch.compile, eager on the CPU) over its own time
        anchor = "torch.compile" if "torch.compile" in times else "pytorch eager"
        goal = TARGET if anchor == "torch.compile" else 1.0
        for name, _ in impls:
            if name == "qkernels + plan":
                ratio = times[anchor] / times[name]
                target = f">={goal}x {'met' if ratio >= goal else 'MISSED'}"
            else:
                ratio = times[name] / base
                target = "" if name == "qkernels" else (
                    f">={TARGET}x {'met' if ratio >= TARGET else 'MISSED'}" if name == "torch.compile"
                    else ">=1.0x " + ("met" if ratio >= 1.0 else "MISSED") if device.type == "cpu" else "")
            rows.append(common.Row(op, label, name, times[name], None, None, None if name == "qkernels" else ratio,
                                   target, verdict[name]))
        del sets, s
        if device.type == "cuda":
            release_gpu_memory()
    return header, rows, []


if __name__ == "__main__":
    raise SystemExit(common.main(parse_args, collect, COLUMNS))
