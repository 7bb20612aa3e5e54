"""Dense LLM ops beside their anchors: time, bandwidth and speed-up per op and case.

What is measured.  bfloat16 throughout; qkernels and its anchors run on the same inputs in one
process:
  linear      cuBLAS through F.linear(x, w) (no bias), M x K activations against an N x K weight
  swiglu      eager F.linear(x, up) * F.silu(F.linear(x, gate)): two cuBLAS calls and two
              elementwise kernels
  rotary_emb  the complex-multiply rotary (Llama's: view_as_complex(x) * freqs_cis, back to real)
              eager and under torch.compile; qkernels reads the same table as view_as_real(freqs_cis)
  linear_backward   each product alone against the same GEMM on cuBLAS (torch.matmul): grad_x =
              grad_out @ W (reads the weight once), grad_weight = grad_out^T @ x (writes it once)
  swiglu_backward   every gradient against eager autograd's formulation: a, b recomputed by F.linear,
              ga and gb by elementwise ops, then the two products of each gradient on cuBLAS
  rotary_emb_backward   as rotary_emb, the rotation by the negated angle
Every result, the anchors' too, is first checked against the float64 reference of qkernels.testing
on the same inputs (the first CHECK_COLUMNS output columns, the first CHECK_TOKENS rotary tokens;
relative error in the 2-norm below REL_TOL: PASS/FAIL; a bfloat16 output rounded once is ~2e-3
off), then timed.

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
column holds the bar and whether it is met.

    python3 benchmarks/dense_ops.py [--quick] [--ops linear,swiglu,rotary_emb,...] [--markdown FILE]
"""

import math
import os

import common  # first: it puts the checkout's qkernels on sys.path
import qkernels
import torch
import torch.nn.functional as F
from common import COLD_FOOTPRINT_BYTES, F32, Case, Impl, gpu_copy_ceiling_gbps, gpu_replay_time_us, reference

OPS = ("linear", "swiglu", "rotary_emb", "linear_backward", "swiglu_backward", "rotary_emb_backward")

BF16 = 2  # bytes per bfloat16 element
MAX_INPUT_SETS = 64
REL_TOL = 1e-2  # bfloat16 outputs against the float64 reference: one rounding, ~2e-3 expected
CHECK_COLUMNS = 1024  # linear and swiglu: the output columns (weight rows) checked against the reference
CHECK_TOKENS = 1024  # rotary_emb: the tokens checked

# Llama-3-8B-like model shapes: hidden 4096, MLP 14336; 28672 = fused up+gate.
LINEAR_WEIGHTS = ((14336, 4096), (4096, 14336), (28672, 4096))
LINEAR_MS = (1, 8, 16, 32, 64)
SQUARE_MS = (1, 8, 16)
SWIGLU_MS = (1, 4, 8, 16)
LARGE_MS = (128, 512)  # M past 64: cuBLASLt (kernels/linear_lt.cu)


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
        Impl("cuBLAS (F.linear)", lambda s: F.linear(s["x"], s["w"]), min_ratio=target),
    ]
    # Beside the launcher's pick (on sm_90 the row kernel): the mma.sync tile kernel, and at M = 1
    # the CUDA-core GEMV forced (the pick there before the row kernel became a programmatic dependent).
    impls.insert(1, Impl("qkernels, mma.sync kernel", on_linear_kernel("linear", "mma", "x", "w")))
    if m == 1:
        impls.insert(1, Impl("qkernels, GEMV (forced)", on_linear_kernel("linear", "gemv", "x", "w")))
    return Case("linear", f"M={m} W={n}x{k}", make_inputs, nbytes, impls,
                lambda s: reference("linear", s["x"], s["w"][:CHECK_COLUMNS]), lambda out: out[:, :CHECK_COLUMNS])


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
        Impl("eager linear*silu(linear)", lambda s: swiglu_eager(s["x"], s["up"], s["gate"]), min_ratio=target),
    ]
    impls.insert(1, Impl("qkernels, mma.sync kernel", on_linear_kernel("swiglu", "mma", "x", "up", "gate")))
    if m == 1:  # beside the row kernel, the GEMV forced (see linear)
        impls.insert(1, Impl("qkernels, GEMV (forced)", on_linear_kernel("swiglu", "gemv", "x", "up", "gate")))
    return Case("swiglu", f"M={m} up/gate={n}x{k}", make_inputs, nbytes, impls,
                lambda s: reference("swiglu", s["x"], s["up"][:CHECK_COLUMNS], s["gate"][:CHECK_COLUMNS]),
                lambda out: out[:, :CHECK_COLUMNS])


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


def rotary_op_case(op, arg, tokens, heads, dim, interleaved, impls):
    """The Case of rotary_emb or its backward: arg (x or g) [T, H, D] bfloat16 and freqs_cis [T, D/2]
    complex64; checked against qkernels.testing on the first CHECK_TOKENS tokens."""
    def make_inputs(gen):
        angles = 10 * torch.rand(tokens, dim // 2, generator=gen, device="cuda")
        return {arg: randn(gen, tokens, heads, dim), "freqs_cis": torch.polar(torch.ones_like(angles), angles)}

    # Minimal bytes: the tensor read and the output written once, the (cos, sin) table read once.
    nbytes = 2 * tokens * heads * dim * BF16 + tokens * (dim // 2) * 2 * F32
    convention = "interleaved" if interleaved else "rotate-half"
    check = CHECK_TOKENS
    return Case(op, f"T={count(tokens)} H={heads} D={dim} {convention}", make_inputs, nbytes, impls,
                lambda s: reference(op, s[arg][:check], torch.view_as_real(s["freqs_cis"][:check]),
                                    interleaved=interleaved), lambda out: out[:check])


def rotary_case(tokens, heads, dim, interleaved, min_ratio, min_gbps):
    compiled = torch.compile(rotary_complex, dynamic=False)
    impls = [
        Impl("qkernels", lambda s: qkernels.rotary_emb(s["x"], torch.view_as_real(s["freqs_cis"]),
                                                       interleaved=interleaved, backend="cuda"),
             ours=True, min_gbps=min_gbps),
        Impl("eager complex multiply", lambda s: rotary_complex(s["x"], s["freqs_cis"], interleaved)),
        Impl("torch.compile", lambda s: compiled(s["x"], s["freqs_cis"], interleaved), min_ratio=min_ratio),
    ]
    return rotary_op_case("rotary_emb", "x", tokens, heads, dim, interleaved, impls)


def rotary_emb_cases(quick):
    tokens = 4096 if quick else 32768
    cases = [rotary_case(tokens, 32, 128, interleaved, 1.5, None if quick else 3500.0)
             for interleaved in (True, False)]
    # Decode: a handful of tokens, latency-bound; the bar is torch.compile's time (ratio >= 1.0).
    cases.append(rotary_case(32, 32, 128, True, 1.0, None))
    return cases


# ---------------------------------------------------------------------------------------------
# the backward ops

BWD_WEIGHTS = ((14336, 4096), (4096, 14336))
BWD_MS = (1, 8, 16, 32, 64)


def on_backward(op, variant, *names, **flags):
    """One call of the raw backward op on the input set's tensors `names` with _variant= (tiles: the
    tile kernels at every M; lt: cuBLASLt at every M), on torch's current stream."""
    raw = getattr(qkernels._C, op + "_raw")

    def call(s):
        x = s[names[1]]
        r = raw(*(s[n] for n in names), stream=torch.cuda.current_stream(x.device).cuda_stream, _variant=variant,
                **flags)
        return tuple(t if t is None or isinstance(t, torch.Tensor) else torch.from_dlpack(t) for t in r)
    return call


def linear_backward_case(m, n, k, grad, target=0.95):
    """grad "x": grad_x = grad_out @ W, the weight read once; "weight": grad_weight = grad_out^T x, N x K
    written once.  The anchor is the same product on cuBLAS."""
    def make_inputs(gen):
        return {"g": randn(gen, m, n), "x": randn(gen, m, k), "w": randn(gen, n, k, scale=k ** -0.5)}

    nbytes = (n * k + m * n + m * k) * BF16  # the weight (read or written), grad_out and x (or grad_x)
    pick = 0 if grad == "x" else 1
    flags = {"x_grad": grad == "x", "weight_grad": grad == "weight"}
    ours = lambda s: qkernels.linear_backward(s["g"], s["x"], s["w"], backend="cuda", **flags)[pick]  # noqa: E731
    tiles, lt = (on_backward("linear_backward", v, "g", "x", "w", **flags) for v in ("tiles", "lt"))
    if grad == "x":  # the first CHECK_COLUMNS columns of grad_x
        anchor = lambda s: torch.matmul(s["g"], s["w"])  # noqa: E731
        ref = lambda s: reference("linear_backward", s["g"], s["x"][:, :CHECK_COLUMNS], s["w"][:, :CHECK_COLUMNS],  # noqa: E731
                                  weight_grad=False)[0]
        part = lambda out: out[:, :CHECK_COLUMNS]  # noqa: E731
    else:  # the first CHECK_COLUMNS rows of grad_weight
        anchor = lambda s: torch.matmul(s["g"].t(), s["x"])  # noqa: E731
        ref = lambda s: reference("linear_backward", s["g"][:, :CHECK_COLUMNS], s["x"], s["w"][:CHECK_COLUMNS],  # noqa: E731
                                  x_grad=False)[1]
        part = lambda out: out[:CHECK_COLUMNS]  # noqa: E731
    impls = [Impl("qkernels", ours, ours=True),
             Impl("qkernels, tile kernels", lambda s: tiles(s)[pick]),
             Impl("qkernels, cuBLASLt", lambda s: lt(s)[pick]),
             Impl("cuBLAS (torch.matmul)", anchor, min_ratio=target)]
    return Case("linear_backward", f"grad_{grad} M={m} W={n}x{k}", make_inputs, nbytes, impls, ref, part)


def linear_backward_cases(quick):
    weights, ms = (BWD_WEIGHTS[:1], (1, 16)) if quick else (BWD_WEIGHTS, BWD_MS)
    cases = [linear_backward_case(m, n, k, grad) for grad in ("x", "weight") for n, k in weights for m in ms]
    if not quick:  # past the decode range: cuBLASLt on both sides (no target)
        cases += [linear_backward_case(m, 14336, 4096, grad, None) for grad in ("x", "weight") for m in LARGE_MS]
    return cases


def swiglu_backward_eager(g, x, up, gate):
    """Autograd's work for linear(x, up) * silu(linear(x, gate)) given its saved inputs."""
    a, b = F.linear(x, up), F.linear(x, gate)
    s = torch.sigmoid(b)
    ga, gb = g * (b * s), g * a * (s * (1 + b * (1 - s)))
    return ga @ up + gb @ gate, ga.t() @ x, gb.t() @ x


def swiglu_backward_case(m, n, k, target=0.95):
    def make_inputs(gen):
        return {"g": randn(gen, m, n), "x": randn(gen, m, k), "up": randn(gen, n, k, scale=k ** -0.5),
                "gate": randn(gen, n, k, scale=2 * k ** -0.5)}

    # Minimal bytes: both weights read twice (the products a, b and grad_x) and both gradients written.
    nbytes = (6 * n * k + 2 * m * n + 2 * m * k) * BF16
    names = ("g", "x", "up", "gate")
    impls = [Impl("qkernels", lambda s: qkernels.swiglu_backward(*(s[n] for n in names), backend="cuda"), ours=True),
             Impl("qkernels, tile kernels", on_backward("swiglu_backward", "tiles", *names)),
             Impl("qkernels, cuBLASLt", on_backward("swiglu_backward", "lt", *names)),
             Impl("eager (cuBLAS)", lambda s: swiglu_backward_eager(*(s[n] for n in names)), min_ratio=target)]
    return Case("swiglu_backward", f"M={m} up/gate={n}x{k}", make_inputs, nbytes, impls,
                lambda s: reference("swiglu_backward", *(s[n] for n in names), weight_grad=False)[0][:, :CHECK_COLUMNS],
                lambda out: out[0][:, :CHECK_COLUMNS])


def swiglu_backward_cases(quick):
    return [swiglu_backward_case(m, 14336, 4096) for m in ((1, 16) if quick else SWIGLU_MS + (64,))]


def rotary_backward_case(tokens, heads, dim, interleaved):
    conj = lambda s: s["freqs_cis"].conj()  # noqa: E731  the inverse rotation
    impls = [
        Impl("qkernels", lambda s: qkernels.rotary_emb_backward(s["g"], torch.view_as_real(s["freqs_cis"]),
                                                                interleaved=interleaved, backend="cuda"), ours=True),
        Impl("eager complex multiply", lambda s: rotary_complex(s["g"], conj(s), interleaved)),
    ]
    return rotary_op_case("rotary_emb_backward", "g", tokens, heads, dim, interleaved, impls)


def rotary_emb_backward_cases(quick):
    tokens = 4096 if quick else 32768
    return [rotary_backward_case(tokens, 32, 128, interleaved) for interleaved in (True, False)]


CASE_BUILDERS = {"linear": linear_cases, "swiglu": swiglu_cases, "rotary_emb": rotary_emb_cases,
                 "linear_backward": linear_backward_cases, "swiglu_backward": swiglu_backward_cases,
                 "rotary_emb_backward": rotary_emb_backward_cases}


# ---------------------------------------------------------------------------------------------
# Timing


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    return common.parse_args(common.argument_parser(__doc__, 15, quick_help="a subset of the cases, smaller rotary "
                                                    "(smoke run)", listed=("ops", OPS)), argv)


def collect(args, copy_gbps=None):
    """Every case of args.ops, progress printed as it goes: -> (header, rows, footer); copy_gbps: the
    copy ceiling when benchmarks/run.py measured it already."""
    copy_gbps = copy_gbps or gpu_copy_ceiling_gbps(args.samples)
    scale = "--quick: a subset of the cases and 4k-token rotary (targets are for full sizes)" if args.quick else \
        "full sizes"
    header = common.header(
        "dense ops", "anchors", common.copy_line(copy_gbps),
        f"{scale}; bfloat16; CUDA-graph replay, median of {args.samples} replays; inputs (weights included) "
        f"cycled to span {COLD_FOOTPRINT_BYTES >> 30} GiB",
        "GB/s: minimal bytes (formulas in benchmarks/dense_ops.py) / time; anchor/ours > 1: qkernels faster; "
        f"check: relative error against the float64 reference < {REL_TOL:g}")

    def run_one(case, seed):
        return common.run_case(case, lambda: input_sets(case, seed),
                               lambda fn, sets: gpu_replay_time_us(fn, sets, args.samples), REL_TOL, copy_gbps)

    builders = {op: (lambda b=CASE_BUILDERS[op]: b(args.quick)) for op in args.ops}
    rows, footer = common.run_ops(args.ops, builders, run_one)
    return header, rows, footer


if __name__ == "__main__":
    common.main(parse_args, collect)
