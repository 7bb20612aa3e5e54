"""Prefill attention on the GPU: qkernels attn_prefill / attn_paged_prefill beside
torch.nn.functional.scaled_dot_product_attention with the FLASH (FlashAttention-2 inside PyTorch)
and CUDNN backends forced, on the same inputs, in one run.

bf16, Hq=Hkv=32 and D=128 unless the case says otherwise.  Time: CUDA-graph replay, median of the
replays, a few input sets cycled.  TFLOP/s count 4·B·H·Lq·Lkv·D flops, half of that for causal
Lq = Lkv (the work a causal kernel must do); the GEMM ceiling is a bf16 8192³ torch.matmul in the
same run.  Check: max|err|/max|ref| against the float64 reference of qkernels.testing on one input set,
for the last CHECK_QUERIES queries of the first sequence (with causal bottom-right alignment they
see the keys they see in the whole call; paged: the sequence's tokens gathered into a pool of their
own).

--cpu: the same kinds on the host, float32 and bfloat16, smaller (L = 1024, a non-causal GQA case, a
paged one): backend="cpu" beside torch's CPU SDPA with its own backend choice, each result checked the
same way, wall-clock median of --samples calls (benchmarks/common.py's time_cases); GFLOP/s.

  python3 benchmarks/attn_prefill.py [--quick] [--cpu] [--markdown FILE]
"""

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Callable

import common  # first: it puts the checkout's qkernels on sys.path
import qkernels
import torch
from common import reference
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE = "cuda"
DT = torch.bfloat16
CHECK_TOL = 0.02  # max|err| / max|ref|, bf16 inputs and output against the float64 reference
CHECK_QUERIES = 128
COLUMNS = ["kind", "case", "impl", "µs", "TFLOP/s", "% GEMM", "anchor/ours", "target", "check"]
CPU_COLUMNS = ["kind", "case", "impl", "µs", "GFLOP/s", "", "anchor/ours", "target", "check"]


@dataclass
class Impl(common.Impl):  # fn's output reshapes to [B, Lq, Hq, D] (paged: [total_q, Hq, D])
    to_blhd: bool = False  # output is SDPA's [B, H, L, D]


@dataclass
class Case:
    kind: str
    label: str
    make: Callable[[torch.Generator], dict]
    flops: float
    reference: Callable[[dict], object]  # float64 [1, CHECK_QUERIES, Hq, D]: the checked queries of one input set
    impls: list = field(default_factory=list)
    nbytes: int = 0  # --cpu: q, k, v and the output (progress lines only)

    op = property(lambda self: self.kind)  # the table's first column
    make_inputs = property(lambda self: self.make)  # common.time_cases' name


def randn(gen, *shape, device=DEVICE, dtype=DT):
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def dense_inputs(gen, B, Lq, L, Hq, Hkv, D, device=DEVICE, dtype=DT):
    """One input set of a dense case: ours [B,L,H,D] and SDPA's [B,H,L,D] copies of the same data."""
    q, k, v = (randn(gen, B, n, h, D, device=device, dtype=dtype) for n, h in ((Lq, Hq), (L, Hkv), (L, Hkv)))
    return {"q": q, "k": k, "v": v, "q_s": q.transpose(1, 2).contiguous(),
            "k_s": k.transpose(1, 2).contiguous(), "v_s": v.transpose(1, 2).contiguous()}


def paged_inputs(gen, B, L, H, D, device=DEVICE, dtype=DT):
    """One input set of a paged case: B requests of L tokens at permuted slots of a pool of B L + 1,
    and the same KV contiguous (ours and SDPA's layouts)."""
    S = B * L + 1
    q = randn(gen, B * L, H, D, device=device, dtype=dtype)
    k_cache, v_cache = (randn(gen, S, H, D, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(S, generator=gen, device=device)[:B * L]
    rows = torch.randperm(B, generator=gen, device=device)
    req_to_token = torch.empty(B, L, dtype=torch.int32, device=device)
    req_to_token[rows] = slots.view(B, L).to(torch.int32)
    indptr = (torch.arange(B + 1, device=device) * L).to(torch.int32)
    k = k_cache.index_select(0, slots).view(B, L, H, D)
    v = v_cache.index_select(0, slots).view(B, L, H, D)
    return {"q_flat": q, "q": q.view(B, L, H, D), "k_cache": k_cache, "v_cache": v_cache,
            "req_to_token": req_to_token, "rpi": rows.to(torch.int32), "kv_indptr": indptr, "qo_indptr": indptr,
            "k": k, "v": v, "q_s": q.view(B, L, H, D).transpose(1, 2).contiguous(),
            "k_s": k.transpose(1, 2).contiguous(), "v_s": v.transpose(1, 2).contiguous()}


def sdpa(backend, causal):
    """SDPA on the input set's [B,H,L,D] tensors with backend forced (None: torch's choice)."""
    def fn(s):
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                s["q_s"], s["k_s"], s["v_s"], is_causal=causal, enable_gqa=s["q_s"].shape[1] != s["k_s"].shape[1])
    return fn


def flops_of(B, Hq, Lq, Lkv, D, causal):
    work = 4.0 * B * Hq * Lq * Lkv * D
    if causal:  # bottom-right: query i sees i + Lkv - Lq + 1 keys
        work *= (Lkv - Lq + (Lq + 1) / 2) / Lkv
    return work


def dense_case(B, L, D=128, Hq=32, Hkv=32, causal=True, Lq=None, required=True, host=None):
    """host: a dtype name for --cpu (backend cpu against SDPA's own choice on the host)."""
    Lq = Lq or L
    device, dtype, backend = ("cpu", getattr(torch, host), "cpu") if host else (DEVICE, DT, "cuda")

    def make(gen):
        return dense_inputs(gen, B, Lq, L, Hq, Hkv, D, device, dtype)

    def ours(s):
        return qkernels.attn_prefill(s["q"], s["k"], s["v"], is_causal=causal, backend=backend)

    flash_bar = 1.0 if required else None
    cudnn_bar = 0.9 if required and causal and D == 128 and Hq == Hkv and Lq == L else None
    label = f"B={B} Lq={Lq} Lkv={L} Hq={Hq} Hkv={Hkv} D={D}{' causal' if causal else ''}"
    impls = [Impl("qkernels attn_prefill", ours, ours=True),
             Impl("SDPA FLASH", sdpa(SDPBackend.FLASH_ATTENTION, causal and Lq == L), to_blhd=True, min_ratio=flash_bar),
             Impl("SDPA CUDNN", sdpa(SDPBackend.CUDNN_ATTENTION, causal and Lq == L), to_blhd=True, min_ratio=cudnn_bar)]
    if host:
        label += f" {host}"
        impls = impls[:1] + [Impl("SDPA", sdpa(None, causal and Lq == L), to_blhd=True, min_ratio=1.0)]
    if causal and Lq != L:  # SDPA's is_causal is top-left aligned: no like-for-like anchor
        impls = impls[:1]

    def check(s):
        return reference("attn_prefill", s["q"][:1, -CHECK_QUERIES:], s["k"][:1], s["v"][:1], is_causal=causal)

    return Case("dense", label, make, flops_of(B, Hq, Lq, L, D, causal), check, impls,
                B * (2 * Lq * Hq + 2 * L * Hkv) * D * dtype.itemsize)


def paged_case(B, L, D=128, H=32, causal=True, host=None):
    """host: as dense_case's."""
    device, dtype, backend = ("cpu", getattr(torch, host), "cpu") if host else (DEVICE, DT, "cuda")

    def make(gen):
        return paged_inputs(gen, B, L, H, D, device, dtype)

    def ours(s):
        return qkernels.attn_paged_prefill(s["q_flat"], s["k_cache"], s["v_cache"], s["req_to_token"], s["rpi"],
                                           s["kv_indptr"], s["qo_indptr"], is_causal=causal, backend=backend)

    def ours_dense(s):
        return qkernels.attn_prefill(s["q"], s["k"], s["v"], is_causal=causal, backend=backend)

    def check(s):  # request 0's last queries (rows L - n .. L - 1 of q) against its L tokens
        n = min(CHECK_QUERIES, L)
        pool = common.one_sequence_pool(s["k_cache"], s["v_cache"], s["req_to_token"], s["rpi"], s["kv_indptr"])
        return reference("attn_paged_prefill", s["q_flat"][L - n:L], *pool, torch.tensor([0, n]),
                         is_causal=causal)[None]

    label = f"B={B} L={L} H={H} D={D}{' causal' if causal else ''}, slots permuted"
    impls = [Impl("qkernels attn_paged_prefill", ours, ours=True),
             Impl("qkernels attn_prefill, contiguous KV", ours_dense, min_share=0.8),
             Impl("SDPA CUDNN on contiguous KV", sdpa(SDPBackend.CUDNN_ATTENTION, causal), to_blhd=True)]
    if host:
        label += f" {host}"
        impls[2] = Impl("SDPA on contiguous KV", sdpa(None, causal), to_blhd=True, min_ratio=1.0)
    return Case("paged", label, make, flops_of(B, H, L, L, D, causal), check, impls,
                4 * B * L * H * D * dtype.itemsize)


def cases(quick, cpu=False, tiny=False):
    if cpu:  # float32 and bfloat16 on the host, smaller
        L, H, D = (32, 4, 64) if tiny else (256, 32, 128) if quick else (1024, 32, 128)
        return [case for host in ("float32", "bfloat16") for case in (
            dense_case(1, L, D, H, H, host=host),
            dense_case(1, L // 2, D, H, H // 4, causal=False, host=host),  # GQA 4
            paged_case(2, L // 2, D, H, host=host))]
    if quick:
        return [dense_case(1, 1024), paged_case(2, 1024)]
    return [dense_case(1, 4096), dense_case(4, 4096), dense_case(1, 16384),
            dense_case(4, 4096, causal=False), dense_case(4, 4096, D=64), dense_case(4, 4096, D=256),
            dense_case(4, 4096, Hkv=8, required=False), dense_case(4, 4096, Lq=1024, required=False),
            paged_case(4, 4096)]


def check(impl, s, ref):
    """'PASS 3.1e-03' / 'FAIL ...': the checked queries of impl's output against the reference."""
    got = impl.fn(s)
    if impl.to_blhd:  # SDPA's [B, H, L, D]
        got = got.transpose(1, 2)
    elif got.dim() == 3:  # paged [total_q, H, D]: request 0's rows first
        got = got[:s["q"].shape[1]][None]
    err = common.max_error(got[:1, -ref.shape[1]:], ref)
    return f"{'PASS' if err < CHECK_TOL else 'FAIL'} {err:.1e}"


def run_case(case, gemm, samples):
    print(f"\n{case.kind} | {case.label} | {case.flops / 1e12:.2f} TFLOP per call", flush=True)
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(len(case.label))
    sets = [case.make(gen) for _ in range(2)]
    ref = case.reference(sets[0])
    times, verdicts, failures = {}, {}, {}
    for impl in case.impls:
        try:
            verdicts[impl.name] = check(impl, sets[0], ref)
            times[impl.name] = common.gpu_replay_time_us(impl.fn, sets, samples)
        except Exception as exc:  # a backend that refuses the shape, a missing kernel: report and go on
            failures[impl.name] = exc
        common.release_gpu_memory()
        us, failure = times.get(impl.name), failures.get(impl.name)
        print(f"  {impl.name:<38} " + (f"{us:9.1f} µs {case.flops / us / 1e6:6.0f} TFLOP/s  {verdicts[impl.name]}"
                                        if us else f"n/a: {type(failure).__name__}: {common.first_line(failure, 80)}"),
              flush=True)
    del sets, ref
    common.release_gpu_memory()
    return common.case_rows(case, times, verdicts, failures, gemm, rate=lambda us: case.flops / us / 1e6)


def parse_args(argv=None):
    p = common.argument_parser(__doc__, 10, tiny=True)
    p.add_argument("--only", help="run only the cases whose kind or label contains this text")
    p.add_argument("--cpu", action="store_true", help="the cpu backend against torch's CPU SDPA on the host")
    return common.parse_args(p, argv, no_gpu_hint="; pass --cpu to time the CPU kernels")


def columns(args):
    return CPU_COLUMNS if args.cpu else COLUMNS


def collect_cpu(args):
    """--cpu: the cases on the host, timed with the wall clock: -> (header, rows, footer)."""
    header = common.header("prefill attention", "torch SDPA", f"cpu: {qkernels.info()['cpu_threads']} qkernels "
                           f"threads, {torch.get_num_threads()} torch threads; wall-clock median of {args.samples} "
                           "runs; SDPA: torch's CPU choice", "GFLOP/s count causal as the work below the diagonal; "
                           f"check: max|err|/max|ref| of the last {CHECK_QUERIES} queries of the first sequence vs "
                           "the float64 reference", machine="the host CPU")

    def check_case(case, s):
        ref = case.reference(s)
        verdicts, failures = {}, {}
        for impl in case.impls:
            try:
                verdicts[impl.name] = check(impl, s, ref)
            except Exception as exc:  # a refused shape: reported in the row
                failures[impl.name] = exc
        return verdicts, failures

    seeded = [(len(case.label), case) for case in cases(args.quick, True, args.tiny)
              if not args.only or args.only in case.kind or args.only in case.label]
    rows, footer = common.time_cases(seeded, check_case, args.samples, True, None,
                                     lambda case: lambda us: case.flops / us / 1e3)
    return header, rows, footer


def collect(args, gemm=None):
    """Every case (or those --only picks), progress printed as it goes: -> (header, rows, footer); gemm:
    the GEMM ceiling (TFLOP/s) when benchmarks/run.py measured it already."""
    if args.cpu:
        return collect_cpu(args)
    if gemm is None:
        gemm = common.gpu_gemm_ceiling_tflops(args.samples)
    header = common.header("prefill attention", "SDPA", f"GEMM ceiling: {gemm:.0f} TFLOP/s (bf16 8192^3 torch.matmul)",
                           "bf16; CUDA-graph replay; TFLOP/s count causal as the work below the diagonal; "
                           f"anchor/ours > 1: qkernels faster; check: max|err|/max|ref| of the last {CHECK_QUERIES} "
                           "queries of the first sequence vs the float64 reference")
    rows = []
    for case in cases(args.quick):
        if args.only and args.only not in case.kind and args.only not in case.label:
            continue
        rows += run_case(case, gemm, args.samples)
    return header, rows, []


if __name__ == "__main__":
    sys.exit(common.main(parse_args, collect, columns))
