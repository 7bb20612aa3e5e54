"""rotary_kv_append beside torch: time, bandwidth and share of the copy rate per case.

What is measured.  One Llama-3-8B attention layer's step (Hq = 32, Hkv = 8, D = 128, bfloat16, the
rotate-half convention of Hugging Face's Llama): q and k rotated at each token's position by a cos/sin
table on the device, k and v appended to token pools at random distinct slots (a paged server's
scatter).  qkernels and its anchors run on the same inputs:
  unfused        eager torch: the table rows gathered by position, q and k rotated in fp32 (rotate_half),
                 then k_pool.index_copy_(0, slots, k) and v_pool.index_copy_(0, slots, v)
  torch.compile  the same function compiled (dynamic=False)
Rows: decode (T = 1, 8, 64 tokens: latency) and prefill (T = 4096, 32768: bandwidth).  Every impl's
result is first checked on a copy of the first input set against the float64 references of
qkernels.testing, on the first CHECK_TOKENS tokens: the rotated q, and the pool rows at their slots
(relative error in the 2-norm below REL_TOL: PASS/FAIL).

How (GPU).  N calls captured in one CUDA graph, replays timed with CUDA events (benchmarks/common.py):
device time.  Input sets are cycled so that their footprint spans 1 GiB (cold L2) where they are large;
the decode cases are L2-resident, as in a model.  The calls append at the same slots on every replay.
The CUDA kernels are timed whether or not the dispatcher has enabled them yet (_dispatch.CUDA_PENDING
is cleared here).

GB/s is the minimal byte count over the time: read q, k, v, write the rotated q and the k and v rows
(2 T (Hq + 2 Hkv) D elements), the table once per token (T D float32) and the two index vectors.
"% copy" is that rate as a share of a 2 GiB device-to-device copy timed the same way; the target at
T = 32768 is 3.5 TB/s.

--cpu: the same comparison on the host (qkernels' C kernels on every core against torch's CPU kernels,
wall-clock median of --samples runs; float32 and bfloat16, smaller sizes).

    python3 benchmarks/rotary_kv_append.py [--quick] [--cpu] [--markdown FILE]
"""


import common  # first: it puts the checkout's qkernels on sys.path
import numpy as np
import qkernels
import torch
from common import Case, Impl
from qkernels import _dispatch, testing

OP = "rotary_kv_append"
HQ, HKV, D = 32, 8, 128
REL_TOL = 1e-2  # a bfloat16 result rounded once is ~2e-3 off the float64 reference
CHECK_TOKENS = 256
TARGET_GBPS = 3500.0


def unfused(q, k, v, cos_sin, positions, k_pool, v_pool, slots):
    """The step as separate torch ops: rotate-half in fp32, one rounding, then index_copy_ into the pools."""
    f = cos_sin[positions]  # [T, D/2, 2]
    c, s = f[:, None, :, 0], f[:, None, :, 1]

    def rotate(x):
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)

    k_pool.index_copy_(0, slots, rotate(k))
    v_pool.index_copy_(0, slots, v)
    return rotate(q)


ARGS = ("q", "k", "v", "cs", "pos", "kp", "vp", "slots")


def impls():
    compiled = torch.compile(unfused, dynamic=False)
    return [Impl("qkernels", lambda s: qkernels.rotary_kv_append(*(s[a] for a in ARGS), interleaved=False), ours=True),
            Impl("unfused", lambda s: unfused(*(s[a] for a in ARGS))),
            Impl("torch.compile", lambda s: compiled(*(s[a] for a in ARGS)))]


def make_case(tokens, dtype, device, min_gbps=None):
    tdt = getattr(torch, dtype)
    pool = max(2 * tokens, 1024)
    max_pos = max(tokens, 8192)

    def make_inputs(gen):
        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(tdt)

        angle = 10 * torch.rand(max_pos, D // 2, generator=gen, device=device, dtype=torch.float64)
        return {"q": randn(tokens, HQ, D), "k": randn(tokens, HKV, D), "v": randn(tokens, HKV, D),
                "cs": torch.stack([angle.cos(), angle.sin()], -1).float(),
                "pos": torch.randint(0, max_pos, (tokens,), generator=gen, device=device),
                "kp": randn(pool, HKV, D), "vp": randn(pool, HKV, D),
                "slots": torch.randperm(pool, generator=gen, device=device)[:tokens]}

    size = torch.tensor([], dtype=tdt).element_size()
    nbytes = 2 * tokens * (HQ + 2 * HKV) * D * size + tokens * D * 4 + 2 * tokens * 8
    im = impls()
    im[0].min_gbps = min_gbps
    phase = "decode" if tokens <= 64 else "prefill"
    return Case(OP, f"{phase} T={tokens} Hq={HQ} Hkv={HKV} D={D} {dtype}", make_inputs, nbytes, im, None)


def cases(quick, device, copy_gbps=None, tiny=False):
    if device == "cpu":
        tokens = (1, 8) if tiny else (1, 512) if quick else (1, 64, 4096)
        return [make_case(t, dt, device) for dt in ("float32", "bfloat16") for t in tokens]
    decode = (8,) if quick else (1, 8, 64)
    prefill = (4096,) if quick else (4096, 32768)
    return [make_case(t, "bfloat16", device) for t in decode] + \
        [make_case(t, "bfloat16", device, TARGET_GBPS if t >= 32768 else None) for t in prefill]


def check(case, inputs):
    """Verdicts per impl, each on its own copy of the input set (every impl writes the pools): the first
    CHECK_TOKENS tokens' rotated q and pool rows against the float64 references."""
    n = min(CHECK_TOKENS, inputs["q"].shape[0])
    h = {a: common.host(inputs[a][:n]) for a in ("q", "k", "v", "pos", "slots")}
    table = common.host(inputs["cs"])
    want_q = testing.reference("rotary_emb", h["q"], table[h["pos"]], interleaved=False)
    want_k = testing.reference("rotary_emb", h["k"], table[h["pos"]], interleaved=False)
    verdicts, failures = {}, {}
    for impl in case.impls:
        fresh = {a: t.clone() for a, t in inputs.items()}
        try:
            got = impl.fn(fresh)
            rows = fresh["slots"][:n]
            err = max(common.relative_error(got[:n], want_q), common.relative_error(fresh["kp"][rows], want_k),
                      common.relative_error(fresh["vp"][rows], h["v"].astype(np.float64)))
            verdicts[impl.name] = f"{'PASS' if err < REL_TOL else 'FAIL'} {err:.1e}"
        except Exception as exc:
            failures[impl.name] = exc
    return verdicts, failures


def parse_args(argv=None):
    p = common.argument_parser(__doc__, 15, tiny=True)
    p.add_argument("--cpu", action="store_true", help="time the CPU kernels against torch's on the host")
    return common.parse_args(p, argv, no_gpu_hint="; pass --cpu to time the CPU kernels")


def collect(args, copy_gbps=None):
    """-> (header, rows, footer); copy_gbps: the host's copy rate when benchmarks/run.py --cpu measured it."""
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        _dispatch.CUDA_PENDING.pop(OP, None)  # time the kernels even before the dispatcher enables them
        _dispatch.reload_env()
    header, copy_gbps = common.bandwidth_header(OP, args, copy_gbps)
    seeded = [(100 * n, case) for n, case in enumerate(cases(args.quick, device, copy_gbps, args.tiny))]
    rows, footer = common.time_cases(seeded, check, args.samples, args.cpu, copy_gbps)
    return header, rows, footer


if __name__ == "__main__":
    common.main(parse_args, collect)
