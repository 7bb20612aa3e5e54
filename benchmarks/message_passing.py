"""message_passing (one fused layer) beside the same layer op by op, eager PyTorch and torch.compile.

The layer is the QEC decoder's (examples/eval_gnn.py): edge features, a two-layer MLP with sigmoid
gates, gated aggregation over the CSR, out projection, and two LayerNorm + residual.  Inference: no
gradients, no dropout.  Rows: qkernels.message_passing; the same layer from qkernels' graph ops and
torch matmuls (what a model calls without the fused op); the layer in PyTorch alone, eager and under
torch.compile (default mode).  Every call is captured in a CUDA graph and replayed (CUDA events,
median over replays), so host cost is out; at the decoder's size everything sits in L2, and what
is measured is the kernels and the gaps between them.  Outputs checked against the float64
reference (qkernels.testing) in relative 2-norm.

    python3 benchmarks/message_passing.py [--quick] [--samples N] [--markdown FILE]
"""

import common  # first: it puts the checkout's qkernels on sys.path
import numpy as np
import qkernels
import qkernels.torch  # noqa: F401  the operators, registered before torch.compile traces
import torch
import torch.nn.functional as F
from common import gpu_replay_time_us, release_gpu_memory
from qkernels.testing import reference, sample

REL_TOL = 1e-4
COLUMNS = ["op", "case", "impl", "µs", "GB/s", "% copy", "anchor/ours", "target", "check"]
NAMES = ("x", "e", "edge_index", "row_ptr", "col_idx", "dir_edge", "w1", "b1", "w_msg", "b_msg", "w_att", "b_att",
         "w_v", "w_o", "gamma_x", "beta_x", "gamma_e", "beta_e")


def layer_torch(s, heads):
    """The layer in PyTorch alone."""
    x, e = s["x"], s["e"]
    src, dst = s["edge_index"]
    xs, xd = x[src], x[dst]
    h = torch.relu(torch.cat([xs + xd, (xs - xd).abs(), e], 1) @ s["w1"] + s["b1"])
    msg = h @ s["w_msg"] + s["b_msg"]
    att = torch.sigmoid(h @ s["w_att"] + s["b_att"])
    N, H = x.shape
    v = (x @ s["w_v"]).view(N, heads, H // heads)
    agg = torch.zeros_like(v).index_add(0, s["rows"], att[s["dir_edge"]][:, :, None] * v[s["col_idx"]])
    x_out = F.layer_norm(agg.view(N, H) @ s["w_o"], (H,), s["gamma_x"], s["beta_x"], 1e-5) + x
    return x_out, F.layer_norm(msg, (H,), s["gamma_e"], s["beta_e"], 1e-5) + e


def layer_ops(s, heads):
    """The layer from qkernels' graph ops and torch matmuls: the composition qkernels.torch runs under
    autograd."""
    return qkernels.torch.COMPOSED["message_passing"](dict(s, eps=1e-5), None)


def layer_fused(s, heads):
    return qkernels.message_passing(*(s[n] for n in NAMES))


def parse_args(argv=None):
    p = common.argument_parser(__doc__.split("\n\n")[0], 20)
    return common.parse_args(p, argv)


def collect(args, copy_gbps=None):
    device = torch.device("cuda")
    header = common.header("message_passing (one fused layer, inference)",
                           "the layer op by op, PyTorch eager and torch.compile",
                           f"float32; CUDA-graph replay, median of {args.samples} replays; check: relative error "
                           f"of both outputs against the float64 reference < {REL_TOL:g}")
    # (label, sample options): the decoder's batch (d = 5, 5 rounds, batch 256) and a larger graph
    cases = [("decoder N=18688 E=42240 H=32 heads=4", dict(n=18688, e=42240, h=32, f=32, heads=4))]
    if not args.quick:
        cases.append(("N=200000 E=800000 H=64 heads=8", dict(n=200_000, e=800_000, h=64, f=64, heads=8)))
    rows = []
    for label, options in cases:
        print(f"\nmessage_passing | {label}", flush=True)
        a, kw = sample("message_passing", np.random.default_rng(0), **options)
        want = [np.asarray(w) for w in reference("message_passing", *a, **kw)]
        s = {n: torch.from_numpy(np.ascontiguousarray(v)).to(device) for n, v in zip(NAMES, a)}
        counts = torch.diff(s["row_ptr"].long())
        s["rows"] = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        for n in ("edge_index", "col_idx", "dir_edge"):
            s[n] = s[n].long()
        heads = s["w_att"].shape[1]
        impls = [("qkernels", layer_fused), ("qkernels op by op", layer_ops), ("pytorch eager", layer_torch),
                 ("torch.compile", torch.compile(layer_torch))]
        times, verdict = {}, {}
        with torch.no_grad():
            for name, fn in impls:
                got = fn(s, heads)
                err = max(np.linalg.norm(g.double().cpu().numpy() - w) / max(np.linalg.norm(w), 1e-30)
                          for g, w in zip(got, want))
                verdict[name] = f"{'PASS' if err <= REL_TOL else 'FAIL'} {err:.1e}"
                times[name] = gpu_replay_time_us(lambda t, fn=fn: fn(t, heads), [s], args.samples)
                print(f"  {name:<18} {common.fmt_us(times[name]):>9} µs  {verdict[name]}", flush=True)
        base = times["qkernels"]
        for name, _ in impls:
            ratio = None if name == "qkernels" else times[name] / base
            rows.append(common.Row("message_passing", label, name, times[name], None, None, ratio, "", verdict[name]))
        del s
        release_gpu_memory()
    return header, rows, []


if __name__ == "__main__":
    raise SystemExit(common.main(parse_args, collect, COLUMNS))
