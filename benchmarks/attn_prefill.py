"""Prefill attention on the GPU: qkernels attn_prefill / attn_paged_prefill beside
torch.nn.functional.scaled_dot_product_attention with the FLASH (FlashAttention-2 inside PyTorch)
and CUDNN backends forced, on the same inputs, in one run (issue 5).

bf16, Hq=Hkv=32 and D=128 unless the case says otherwise.  Time: CUDA-graph replay, median of the
replays, a few input sets cycled.  TFLOP/s count 4·B·H·Lq·Lkv·D flops, half of that for causal
Lq = Lkv (the work a causal kernel must do); the GEMM ceiling is a bf16 8192³ torch.matmul in the
same run.  Check: max|err|/max|ref| against float32 SDPA math on one input set.

  python3 benchmarks/attention_prefill.py [--quick] [--markdown FILE]
"""

import argparse
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
import qkernels

DEVICE = "cuda"
DT = torch.bfloat16
CHECK_TOL = 0.02
COLUMNS = ["kind", "case", "impl", "µs", "TFLOP/s", "% GEMM", "anchor/ours", "target", "check"]


@dataclass
class Impl:
    name: str
    fn: Callable[[dict], torch.Tensor]  # output reshapes to [B, Lq, Hq, D] (paged: [total_q, Hq, D])
    ours: bool = False
    to_blhd: bool = False  # output is SDPA's [B, H, L, D]
    min_ratio: Optional[float] = None  # target on this anchor: its time / ours >= min_ratio
    min_share: Optional[float] = None  # target: our TFLOP/s / this anchor's >= min_share


@dataclass
class Case:
    kind: str
    label: str
    make: Callable[[torch.Generator], dict]
    flops: float
    impls: list = field(default_factory=list)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(DT)


def sdpa(backend, causal):
    def fn(s):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                s["q_s"], s["k_s"], s["v_s"], is_causal=causal, enable_gqa=s["q_s"].shape[1] != s["k_s"].shape[1])
    return fn


def flops_of(B, Hq, Lq, Lkv, D, causal):
    work = 4.0 * B * Hq * Lq * Lkv * D
    if causal:  # bottom-right: query i sees i + Lkv - Lq + 1 keys
        work *= (Lkv - Lq + (Lq + 1) / 2) / Lkv
    return work


def dense_case(B, L, D=128, Hq=32, Hkv=32, causal=True, Lq=None, required=True):
    Lq = Lq or L

    def make(gen):
        q, k, v = randn(gen, B, Lq, Hq, D), randn(gen, B, L, Hkv, D), randn(gen, B, L, Hkv, D)
        return {"q": q, "k": k, "v": v, "q_s": q.transpose(1, 2).contiguous(),
                "k_s": k.transpose(1, 2).contiguous(), "v_s": v.transpose(1, 2).contiguous(), "causal": causal}

    def ours(s):
        return qkernels.attn_prefill(s["q"], s["k"], s["v"], is_causal=causal, backend="cuda")

    flash_bar = 1.0 if required else None
    cudnn_bar = 0.9 if required and causal and D == 128 and Hq == Hkv and Lq == L else None
    label = f"B={B} Lq={Lq} Lkv={L} Hq={Hq} Hkv={Hkv} D={D}{' causal' if causal else ''}"
    impls = [Impl("qkernels attn_prefill", ours, ours=True),
             Impl("SDPA FLASH", sdpa(SDPBackend.FLASH_ATTENTION, causal and Lq == L), to_blhd=True, min_ratio=flash_bar),
             Impl("SDPA CUDNN", sdpa(SDPBackend.CUDNN_ATTENTION, causal and Lq == L), to_blhd=True, min_ratio=cudnn_bar)]
    if causal and Lq != L:  # SDPA's is_causal is top-left aligned: no like-for-like anchor
        impls = impls[:1]
    return Case("dense", label, make, flops_of(B, Hq, Lq, L, D, causal), impls)


def paged_case(B, L, D=128, H=32, causal=True):
    S = B * L + 1

    def make(gen):
        q = randn(gen, B * L, H, D)
        k_cache, v_cache = randn(gen, S, H, D), randn(gen, S, H, D)
        slots = torch.randperm(S, generator=gen, device=DEVICE)[:B * L]
        rows = torch.randperm(B, generator=gen, device=DEVICE)
        req_to_token = torch.empty(B, L, dtype=torch.int32, device=DEVICE)
        req_to_token[rows] = slots.view(B, L).to(torch.int32)
        indptr = (torch.arange(B + 1, device=DEVICE) * L).to(torch.int32)
        k = k_cache.index_select(0, slots).view(B, L, H, D)
        v = v_cache.index_select(0, slots).view(B, L, H, D)
        return {"q_flat": q, "q": q.view(B, L, H, D), "k_cache": k_cache, "v_cache": v_cache,
                "req_to_token": req_to_token, "rpi": rows.to(torch.int32), "kv_indptr": indptr, "qo_indptr": indptr,
                "k": k, "v": v, "q_s": q.view(B, L, H, D).transpose(1, 2).contiguous(),
                "k_s": k.transpose(1, 2).contiguous(), "v_s": v.transpose(1, 2).contiguous()}

    def ours(s):
        return qkernels.attn_paged_prefill(s["q_flat"], s["k_cache"], s["v_cache"], s["req_to_token"], s["rpi"],
                                           s["kv_indptr"], s["qo_indptr"], is_causal=causal, backend="cuda")

    def ours_dense(s):
        return qkernels.attn_prefill(s["q"], s["k"], s["v"], is_causal=causal, backend="cuda")

    label = f"B={B} L={L} H={H} D={D}{' causal' if causal else ''}, slots permuted"
    impls = [Impl("qkernels attn_paged_prefill", ours, ours=True),
             Impl("qkernels attn_prefill, contiguous KV", ours_dense, min_share=0.8),
             Impl("SDPA CUDNN on contiguous KV", sdpa(SDPBackend.CUDNN_ATTENTION, causal), to_blhd=True)]
    return Case("paged", label, make, flops_of(B, H, L, L, D, causal), impls)


def cases(quick):
    if quick:
        return [dense_case(1, 1024), paged_case(2, 1024)]
    return [dense_case(1, 4096), dense_case(4, 4096), dense_case(1, 16384),
            dense_case(4, 4096, causal=False), dense_case(4, 4096, D=64), dense_case(4, 4096, D=256),
            dense_case(4, 4096, Hkv=8, required=False), dense_case(4, 4096, Lq=1024, required=False),
            paged_case(4, 4096)]


def reference(s, causal):
    """float32 math, one query head at a time (a 16k x 16k score matrix per head is 1 GB)."""
    q, k, v = s["q_s"], s["k_s"], s["v_s"]
    G = q.shape[1] // k.shape[1]
    Lq, L = q.shape[2], k.shape[2]
    keep = torch.arange(L, device=DEVICE)[None, :] <= torch.arange(Lq, device=DEVICE)[:, None] + (L - Lq)
    out = torch.empty(q.shape, device=DEVICE, dtype=torch.float32)
    for h in range(q.shape[1]):
        scores = (q[:, h].float() @ k[:, h // G].float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:
            scores = scores.masked_fill(~keep, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, h // G].float()
        del scores
    return out  # [B, H, Lq, D]


def check(impl, s, ref):
    B, H, Lq, D = ref.shape
    got = impl.fn(s).float()
    if got.dim() == 3:  # paged [total_q, H, D]
        got = got.view(B, Lq, H, D)
    if not impl.to_blhd:
        got = got.transpose(1, 2)  # to [B, H, L, D]
    err = float((got - ref).abs().max() / ref.abs().max())
    return f"{'PASS' if err < CHECK_TOL else 'FAIL'} {err:.1e}"


def run_case(case, gemm, samples):
    print(f"\n{case.kind} | {case.label} | {case.flops / 1e12:.2f} TFLOP per call", flush=True)
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(len(case.label))
    sets = [case.make(gen) for _ in range(2)]
    causal = "causal" in case.label
    ref = reference(sets[0], causal)
    times, checks, fails = {}, {}, {}
    for impl in case.impls:
        try:
            checks[impl.name] = check(impl, sets[0], ref)
            times[impl.name] = common.gpu_replay_time_us(impl.fn, sets, samples)
        except Exception as exc:  # a backend that refuses the shape, a missing kernel: report and go on
            fails[impl.name] = f"n/a: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:80] if str(exc).strip() else ''}"
        common.release_gpu_memory()
        us = times.get(impl.name)
        print(f"  {impl.name:<38} " + (f"{us:9.1f} µs {case.flops / us / 1e6:6.0f} TFLOP/s  {checks[impl.name]}"
                                        if us else fails[impl.name]), flush=True)
    del sets, ref
    common.release_gpu_memory()
    ours_us = next((times.get(i.name) for i in case.impls if i.ours), None)
    rows = []
    for impl in case.impls:
        us = times.get(impl.name)
        tf = case.flops / us / 1e6 if us else None
        ratio = us / ours_us if us and ours_us and not impl.ours else None
        target = ""
        if impl.min_ratio is not None:
            target = f">={impl.min_ratio:.1f}x " + ("" if ratio is None else "met" if ratio >= impl.min_ratio else "MISSED")
        if impl.min_share is not None and ours_us and us:
            share = us / ours_us
            target = f"paged >={impl.min_share:.0%} of this: {share:.0%} " + ("met" if share >= impl.min_share else "MISSED")
        rows.append(common.Row(case.kind, case.label, impl.name, us, tf, 100 * tf / gemm if tf else None, ratio,
                               target.strip(), checks.get(impl.name, fails.get(impl.name, ""))))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="run only the cases whose kind or label contains this text")
    p.add_argument("--markdown")
    p.add_argument("--samples", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device visible to torch")
    return args


def collect(args, gemm=None):
    """Every case (or those --only picks), progress printed as it goes: -> (header lines, rows, footer lines).

    gemm: the GEMM ceiling (TFLOP/s) already measured in this process (benchmarks/run.py); None measures it here.
    """
    if gemm is None:
        gemm = common.gpu_gemm_ceiling_tflops(args.samples)
    header = [f"prefill attention: qkernels {qkernels.__version__} vs SDPA on {torch.cuda.get_device_name()} "
              f"(CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}); torch {torch.__version__}",
              f"GEMM ceiling: {gemm:.0f} TFLOP/s (bf16 8192^3 torch.matmul)",
              "bf16; CUDA-graph replay; TFLOP/s count causal as the work below the diagonal; "
              "anchor/ours > 1: qkernels faster; check vs float32 SDPA math"]
    print("\n".join(header), flush=True)
    rows = []
    for case in cases(args.quick):
        if args.only and args.only not in case.kind and args.only not in case.label:
            continue
        rows += run_case(case, gemm, args.samples)
    return header, rows, []


def main():
    args = parse_args()
    header, rows, _ = collect(args)
    print("\n" + "\n".join(header) + "\n")
    print("\n".join(common.text_table(rows, COLUMNS)))
    if args.markdown:
        common.write_markdown(args.markdown, header, rows, columns=COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
