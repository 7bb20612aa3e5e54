"""rmsnorm and fused_add_rmsnorm beside torch: time, bandwidth and share of the copy rate per case.

What is measured.  bfloat16 (and one float32 case); qkernels and its anchors run on the same inputs:
  rmsnorm            eager x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w in fp32
                     (Llama's RMSNorm), the same under torch.compile, and torch.nn.functional.rms_norm
                     where torch has it
  fused_add_rmsnorm  the unfused decode step: residual.add_(x) then the RMSNorm above of residual
                     (eager, torch.compile of both, and add_ + F.rms_norm)
Rows: decode (a batch of 1 to 256 tokens, latency-bound) and prefill (4096 to 32768 tokens,
bandwidth-bound), H = 4096 (Llama-3-8B) and 8192 (70B).  Every impl's output is first checked against
the float64 reference of qkernels.testing on a copy of the first input set (relative error in the
2-norm below REL_TOL: PASS/FAIL; the fused anchors' residual update is part of what they run).

How (GPU).  N calls captured in one CUDA graph, replays timed with CUDA events (benchmarks/common.py):
device time.  The input sets are cycled so that their footprint spans 1 GiB (cold L2) where they are
large; the decode cases are L2-resident, as in a model.  fused_add_rmsnorm's calls update the residual
in place, as in a model: its values grow over the replays, which changes nothing timed.

GB/s is the minimal byte count over the time: rmsnorm reads x and writes out (2 R H elements),
fused_add_rmsnorm reads x and residual and writes residual and out (4 R H elements), weight once.
"% copy" is that rate as a share of a 2 GiB device-to-device copy timed the same way; the target for
H >= 4096 at prefill sizes is 90% of it.

--cpu: the same comparison on the host (qkernels' C kernels on every core against torch's CPU kernels,
wall-clock median of --samples runs; float32 and bfloat16).

    python3 benchmarks/rmsnorm.py [--quick] [--cpu] [--ops rmsnorm,fused_add_rmsnorm] [--markdown FILE]
"""


import common  # first: it puts the checkout's qkernels on sys.path
import qkernels
import torch
import torch.nn.functional as F
from common import Case, Impl

OPS = ("rmsnorm", "fused_add_rmsnorm")
EPS = 1e-6
REL_TOL = 1e-2  # a bfloat16 output rounded once is ~2e-3 off the float64 reference
HAS_RMS_NORM = hasattr(F, "rms_norm")


def eager_rmsnorm(x, w, eps=EPS):
    """Llama's RMSNorm in torch: fp32 statistics, the output in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def eager_add_rmsnorm(x, r, w, eps=EPS):
    r.add_(x)
    return eager_rmsnorm(r, w, eps)


def f_add_rmsnorm(x, r, w, eps=EPS):
    r.add_(x)
    return F.rms_norm(r, (r.shape[-1],), w, eps)


def impls(op):
    compiled = torch.compile(eager_rmsnorm if op == "rmsnorm" else eager_add_rmsnorm, dynamic=False)
    if op == "rmsnorm":
        out = [Impl("qkernels", lambda s: qkernels.rmsnorm(s["x"], s["w"], eps=EPS), ours=True),
               Impl("eager", lambda s: eager_rmsnorm(s["x"], s["w"])),
               Impl("torch.compile", lambda s: compiled(s["x"], s["w"]))]
        if HAS_RMS_NORM:
            out.append(Impl("F.rms_norm", lambda s: F.rms_norm(s["x"], (s["x"].shape[-1],), s["w"], EPS)))
        return out
    out = [Impl("qkernels", lambda s: qkernels.fused_add_rmsnorm(s["x"], s["r"], s["w"], eps=EPS), ours=True),
           Impl("eager add_ + norm", lambda s: eager_add_rmsnorm(s["x"], s["r"], s["w"])),
           Impl("torch.compile", lambda s: compiled(s["x"], s["r"], s["w"]))]
    if HAS_RMS_NORM:
        out.append(Impl("add_ + F.rms_norm", lambda s: f_add_rmsnorm(s["x"], s["r"], s["w"])))
    return out


def make_case(op, rows, h, dtype, device, min_gbps=None):
    tdt = getattr(torch, dtype)

    def make_inputs(gen):
        s = {"x": torch.randn(rows, h, generator=gen, device=device).to(tdt),
             "w": (1 + 0.5 * torch.randn(h, generator=gen, device=device)).to(tdt)}
        if op == "fused_add_rmsnorm":
            s["r"] = (2 * torch.randn(rows, h, generator=gen, device=device)).to(tdt)
        return s

    size = torch.tensor([], dtype=tdt).element_size()
    nbytes = (2 if op == "rmsnorm" else 4) * rows * h * size + h * size
    im = impls(op)
    im[0].min_gbps = min_gbps
    ref = (lambda s: common.reference("rmsnorm", s["x"], s["w"], eps=EPS)) if op == "rmsnorm" else \
        (lambda s: common.reference("fused_add_rmsnorm", s["x"], s["r"], s["w"], eps=EPS))
    phase = "decode" if rows <= 256 else "prefill"
    return Case(op, f"{phase} R={rows} H={h} {dtype}", make_inputs, nbytes, im, ref)


def cases(op, quick, device, copy_gbps=None, tiny=False):
    if device == "cpu":
        rows, h = ((1, 16), 256) if tiny else ((1, 64, 4096), 4096) if not quick else ((1, 512), 4096)
        return [make_case(op, r, h, dt, device) for dt in ("float32", "bfloat16") for r in rows]
    decode = (1, 16, 256) if not quick else (16,)
    prefill = (4096, 32768) if not quick else (4096,)
    out = [make_case(op, r, h, "bfloat16", device) for h in (4096, 8192) for r in decode]
    bar = 0.9 * copy_gbps if copy_gbps else None  # the 90%-of-copy target at bandwidth-bound sizes
    out += [make_case(op, r, h, "bfloat16", device, bar) for h in (4096, 8192) for r in prefill]
    out.append(make_case(op, prefill[0], 4096, "float32", device, bar))
    return out


def check(case, inputs):
    """Verdicts per impl, each on its own copy of the input set (the fused impls write the residual)."""
    want = case.reference(inputs)
    verdicts, failures = {}, {}
    for impl in case.impls:
        fresh = {k: v.clone() for k, v in inputs.items()}
        try:
            got = impl.fn(fresh)
            err = common.relative_error(got, want)
            if case.op == "fused_add_rmsnorm":  # and the residual each leaves behind
                err = max(err, common.relative_error(fresh["r"], common.host(inputs["x"]).astype("float64") +
                                                     common.host(inputs["r"])))
            verdicts[impl.name] = f"{'PASS' if err < REL_TOL else 'FAIL'} {err:.1e}"
        except Exception as exc:
            failures[impl.name] = exc
    return verdicts, failures


def parse_args(argv=None):
    p = common.argument_parser(__doc__, 15, listed=("ops", OPS), tiny=True)
    p.add_argument("--cpu", action="store_true", help="time the CPU kernels against torch's on the host")
    return common.parse_args(p, argv, no_gpu_hint="; pass --cpu to time the CPU kernels")


def collect(args, copy_gbps=None):
    """-> (header, rows, footer); copy_gbps: the host's copy rate when benchmarks/run.py --cpu measured it."""
    device = "cpu" if args.cpu else "cuda"
    header, copy_gbps = common.bandwidth_header("rmsnorm", args, copy_gbps)
    seeded = [(1000 * op_no + 100 * n, case) for op_no, op in enumerate(args.ops)
              for n, case in enumerate(cases(op, args.quick, device, copy_gbps, args.tiny))]
    rows, footer = common.time_cases(seeded, check, args.samples, args.cpu, copy_gbps)
    return header, rows, footer


if __name__ == "__main__":
    common.main(parse_args, collect)
