"""Decode attention beside torch SDPA: time, KV bandwidth and speed-up per case.

What is measured.  Head config Hq=32, Hkv=8 (GQA 4), D=128, bfloat16, one query token per sequence.
  contiguous  qkernels.attn_decode(q [B,1,Hq,D], k/v [B,L,Hkv,D], backend="cuda") beside
              torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) with the default
              backend choice and with each of FLASH_ATTENTION, EFFICIENT_ATTENTION and CUDNN_ATTENTION
              forced (torch.nn.attention.sdpa_kernel).  SDPA gets its preferred layout: q [B,Hq,1,D]
              and k/v [B,Hkv,L,D], contiguous copies of the same data made once per input set, outside
              the timed region.  A backend that refuses enable_gqa is retried on k/v with the kv heads
              repeated (repeat_interleave, made outside the timed region; it reads Hq/Hkv times the KV
              bytes) and labelled so; a backend that refuses both reads n/a.
              B in {1, 8, 32, 64} x L in {1k, 4k, 32k}, plus B=64 L=8k.
  paged       qkernels.attn_paged_decode(q [B,Hq,D], k/v pools [S,Hkv,D], req_to_token int32 [R,L],
              req_pool_indices int32 [B] (a random permutation of the rows), kv_indptr int32 [B+1],
              uniform lengths L, page size 1, every token at a randomly permuted pool slot) beside
              (a) our contiguous kernel on the equivalent contiguous KV (the pool gathered once, outside
                  the timing) and
              (b) gather + SDPA: req_to_token rows picked by index_select, the pool gathered by
                  index_select into [B,L,Hkv,D] and handed to SDPA as the [B,Hkv,L,D] view (no extra
                  transposing copy: the fastest form of this anchor; a backend that refuses the strided
                  view is retried on a contiguous copy, timed too), both steps inside the timed region,
                  with each forced SDPA backend; the best one is the anchor.
              Also the paged op with each of its kernels forced (rows: a CTA per sequence and split
              reading whole token rows; heads: a CTA per sequence, kv head and split), ratio to the
              launcher's pick.  B in {1, 8, 32} at L=4k, plus B=8 L=32k.
Every result is first checked against the float64 reference of qkernels.testing on the same (bf16)
data, for the first sequence of the batch (its tokens gathered into a pool of their own for the
paged case): max|out - ref| / max|ref| below 2e-2 is PASS.  An impl that raises shows the error in
the check column and is not timed; the anchors go on.

How.  As benchmarks/graph_ops.py: N calls are captured in one CUDA graph after warm-up on the
capture stream, replays are timed with CUDA events, the figure is the median per-call time over
the replays: device time, host launch cost out (per-call Python timing makes SDPA look several
times slower than it is at B=1).  Outputs are allocated by the ops (torch's graph pool).  Call i
reads input set i mod K; the K sets span at least 1 GiB (17x the 60 MB L2), so the KV is cold at
every call; a set of 1 GiB or more is used alone (each call streams all of it, so the next call
finds none of its start in L2).  All inputs are random normal (never zeros).

GB/s = minimal bytes / time: K and V read once, q read once, the output written once (paged: plus
the req_to_token entries, req_pool_indices and kv_indptr).  The copy ceiling is a 2 GiB
device-to-device copy timed the same way in the same run (bytes read + written); "% copy" is a
row's GB/s as a share of it.  anchor/ours = anchor time / qkernels time (>1: qkernels faster).
Targets: ours >= 1.0x the best SDPA backend on every contiguous case (on the best SDPA
row); <= 5 us at B=1 L=1k and <= 7 us at B=1 L=4k; >= 4.4 TB/s when the KV is >= 1 GB; paged >= 85%
of our contiguous kernel's GB/s (on that row) and >= 3x the best gather + SDPA.

--cpu: the same kinds on the host, float32 and bfloat16, smaller sizes: backend="cpu" beside torch's
CPU SDPA (its own backend choice, enable_gqa, on the [B,H,L,D] layout) and gather + SDPA, each result
checked the same way, wall-clock median of --samples calls (benchmarks/common.py's time_cases).

    python3 benchmarks/attn_decode.py [--quick] [--cpu] [--cases contiguous,paged] [--markdown FILE] [--samples N]
"""

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import common  # first: it puts the checkout's qkernels on sys.path
import numpy as np
import qkernels
import torch
import torch.nn.functional as F
from common import (COLD_FOOTPRINT_BYTES, first_line, gpu_copy_ceiling_gbps, gpu_replay_time_us, reference,
                    release_gpu_memory)
from torch.nn.attention import SDPBackend, sdpa_kernel

CASE_KINDS = ("contiguous", "paged")

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16 element
IDX = 4  # bytes per int32 index
K = 1024
DEVICE = "cuda"

MAX_INPUT_SETS = 256  # B=1 L=1k: 4.2 MB of KV per set, 256 sets span 1.07 GB
DEVICE_BUDGET_BYTES = 40e9  # a case whose input sets (all layouts) need more is skipped
REPEAT_BUDGET_BYTES = 24e9  # the repeated-kv-heads fallback anchor is skipped beyond this
GRAPH_WORK_US = 4000.0  # device work captured per graph: the replay's own launch stays well under 1%
REL_TOL = 2e-2  # max|err| / max|ref|, bf16 inputs and output against the float64 reference

SDPA_BACKENDS = (("FLASH", SDPBackend.FLASH_ATTENTION), ("EFFICIENT", SDPBackend.EFFICIENT_ATTENTION),
                 ("CUDNN", SDPBackend.CUDNN_ATTENTION))


@dataclass
class Impl:
    name: str
    fn: Callable[[dict], torch.Tensor]  # one call on one input set; any output that reshapes to [B,Hq,D]
    ours: bool = False
    prepare: Optional[Callable[[list], list]] = None  # derives this impl's input sets (outside the timing)
    fallback: Optional["Impl"] = None  # tried when this one raises at the check
    nbytes: Optional[int] = None  # minimal bytes of one call when not the case's
    group: Optional[str] = None  # the bar applies to the fastest row of the group
    min_ratio: Optional[float] = None  # target: (best of group) anchor time / ours >= min_ratio
    min_share: Optional[float] = None  # target: ours GB/s / this anchor's GB/s >= min_share
    max_us: Optional[float] = None  # target (ours): time <= max_us
    min_gbps: Optional[float] = None  # target (ours): GB/s >= min_gbps


@dataclass
class Case:
    kind: str
    label: str
    make_inputs: Callable[[torch.Generator], dict]  # one random input set on the device
    reference: Callable[[dict], np.ndarray]  # float64 [1, Hq, D]: the first sequence of one input set
    nbytes: int  # minimal bytes moved by one call
    impls: list


@dataclass
class Row(common.Row):  # the first column (op) holds the case's kind
    verdict: Optional[bool]  # whether the row's targets are met (None: no target or not measured)


COLUMNS = ["kind"] + common.COLUMNS[1:]


# ---------------------------------------------------------------------------------------------
# Inputs


def generator(seed):
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    return gen


def randn(gen, *shape, device=DEVICE, dtype=DTYPE):
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def contiguous_inputs(gen, B, L, device=DEVICE, dtype=DTYPE):
    """One input set of a contiguous case: ours [B,L,H,D] and SDPA's layout of the same data."""
    q, k, v = (randn(gen, B, n, h, D, device=device, dtype=dtype) for n, h in ((1, HQ), (L, HKV), (L, HKV)))
    return {"q": q, "k": k, "v": v,
            # SDPA's layout: [B,H,L,D] contiguous (q's length-1 axis moves without a copy)
            "q_s": q.transpose(1, 2).contiguous(),
            "k_s": k.transpose(1, 2).contiguous(), "v_s": v.transpose(1, 2).contiguous()}


def paged_inputs(gen, B, L, device=DEVICE, dtype=DTYPE):
    """One input set of a paged case: B sequences of L tokens at permuted slots of a pool of B L + 1."""
    S = B * L + 1  # one spare slot, as pools keep a padding slot
    q = randn(gen, B, HQ, D, device=device, dtype=dtype)
    k_cache, v_cache = (randn(gen, S, HKV, D, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(S, generator=gen, device=device)[:B * L]
    rows = torch.randperm(B, generator=gen, device=device)
    req_to_token = torch.empty(B, L, dtype=torch.int32, device=device)
    req_to_token[rows] = slots.view(B, L).to(torch.int32)  # sequence b's tokens live in row rows[b]
    gathered = slots.view(B * L)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "req_to_token": req_to_token,
            "req_pool_indices": rows.to(torch.int32),
            "kv_indptr": (torch.arange(B + 1, device=device) * L).to(torch.int32),
            "q4": q.unsqueeze(1), "q_s": q.unsqueeze(2),  # [B,1,Hq,D] and SDPA's [B,Hq,1,D]: views
            # the same KV as one contiguous cache [B,L,Hkv,D], for our contiguous kernel
            "k": k_cache.index_select(0, gathered).view(B, L, HKV, D),
            "v": v_cache.index_select(0, gathered).view(B, L, HKV, D)}


def length_label(n):
    return f"{n // K}k" if n % K == 0 else str(n)


def storage_bytes(inputs):
    """Device bytes held by one input set: views of one storage count once."""
    seen = {}
    for t in inputs.values():
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def input_sets(case, seed):
    """Enough random input sets that cycling through them spans COLD_FOOTPRINT_BYTES of what one call reads."""
    n_sets = min(MAX_INPUT_SETS, max(1, math.ceil(COLD_FOOTPRINT_BYTES / case.nbytes)))
    first = case.make_inputs(generator(seed))
    need = n_sets * storage_bytes(first)
    if need > DEVICE_BUDGET_BYTES:
        raise MemoryError(f"{n_sets} input set(s) would hold {need / 1e9:.1f} GB (budget {DEVICE_BUDGET_BYTES / 1e9:.0f})")
    return [first] + [case.make_inputs(generator(seed + k)) for k in range(1, n_sets)]


# ---------------------------------------------------------------------------------------------
# Anchors


def sdpa(backend, q, k, v, enable_gqa=True):
    """One SDPA call, with `backend` forced (None: torch's default choice)."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def sdpa_impls(group, min_ratio, kv_bytes):
    """SDPA with the default choice and each backend forced, on the SDPA layout of each set;
    a backend that refuses enable_gqa gets a fallback on kv heads repeated GROUP times."""

    def repeated_sets(sets):
        need = len(sets) * GROUP * kv_bytes
        if need > REPEAT_BUDGET_BYTES:
            raise MemoryError(f"repeated kv heads would take {need / 1e9:.0f} GB")
        return [{"q_s": s["q_s"], "k_s": s["k_s"].repeat_interleave(GROUP, dim=1),
                 "v_s": s["v_s"].repeat_interleave(GROUP, dim=1)} for s in sets]

    impls = [Impl("SDPA default (enable_gqa)", lambda s: sdpa(None, s["q_s"], s["k_s"], s["v_s"]),
                  group=group, min_ratio=min_ratio)]
    for label, backend in SDPA_BACKENDS:
        repeated = Impl(f"SDPA {label}, kv heads repeated x{GROUP}",
                        lambda s, b=backend: sdpa(b, s["q_s"], s["k_s"], s["v_s"], enable_gqa=False),
                        prepare=repeated_sets, group=group, min_ratio=min_ratio)
        impls.append(Impl(f"SDPA {label} (enable_gqa)", lambda s, b=backend: sdpa(b, s["q_s"], s["k_s"], s["v_s"]),
                          fallback=repeated, group=group, min_ratio=min_ratio))
    return impls


# ---------------------------------------------------------------------------------------------
# Cases


def kv_bytes_of(B, L):
    return 2 * B * L * HKV * D * ELEM


def contiguous_case(B, L):
    kv_bytes = kv_bytes_of(B, L)
    # Minimal bytes: K and V read once, q read once, the output written once.
    nbytes = kv_bytes + 2 * B * HQ * D * ELEM

    def make_inputs(gen):
        return contiguous_inputs(gen, B, L)

    def ours(s):
        return qkernels.attn_decode(s["q"], s["k"], s["v"], backend="cuda")

    max_us = {1 * K: 5.0, 4 * K: 7.0}.get(L) if B == 1 else None
    min_gbps = 4400.0 if kv_bytes >= 1e9 else None
    def ours_hnd(s):  # the same call on SDPA's head-major memory, seen as [B,L,Hkv,D] views
        return qkernels.attn_decode(s["q"], s["k_s"].transpose(1, 2), s["v_s"].transpose(1, 2), backend="cuda")

    impls = [Impl("qkernels attn_decode", ours, ours=True, max_us=max_us, min_gbps=min_gbps),
             Impl("qkernels attn_decode, KV head-major", ours_hnd)]
    impls += sdpa_impls("SDPA", 1.0, kv_bytes)
    label = f"B={B} L={length_label(L)} KV {kv_bytes / 1e6:.0f} MB"
    return Case("contiguous", label, make_inputs,
                lambda s: reference("attn_decode", s["q"][:1], s["k"][:1], s["v"][:1]).reshape(1, HQ, D), nbytes, impls)


def gather_sdpa(backend, contiguous):
    """Gather + SDPA: the rows of req_to_token, the pool gathered at those slots, then SDPA."""

    def fn(s):
        B = s["req_pool_indices"].numel()
        L = s["req_to_token"].shape[1]
        slots = s["req_to_token"].index_select(0, s["req_pool_indices"]).reshape(-1)  # uniform lengths L
        k = s["k_cache"].index_select(0, slots).view(B, L, HKV, D).transpose(1, 2)
        v = s["v_cache"].index_select(0, slots).view(B, L, HKV, D).transpose(1, 2)
        if contiguous:
            k, v = k.contiguous(), v.contiguous()
        return sdpa(backend, s["q_s"], k, v)

    return fn


def paged_variant(variant):
    """attn_paged_decode with one of its kernels forced (the raw op's private _variant keyword)."""
    def fn(s):
        out = torch.empty_like(s["q"])
        qkernels._C.attn_paged_decode_raw(s["q"], s["k_cache"], s["v_cache"], s["req_to_token"],
                                          s["req_pool_indices"], s["kv_indptr"], out=out,
                                          stream=torch.cuda.current_stream().cuda_stream, _variant=variant)
        return out

    return fn


def paged_case(B, L):
    kv_bytes = kv_bytes_of(B, L)
    # Minimal bytes: K and V read once, one req_to_token entry per token, q, req_pool_indices and
    # kv_indptr read once, the output written once.
    nbytes = kv_bytes + B * L * IDX + 2 * B * HQ * D * ELEM + B * IDX + (B + 1) * IDX
    contiguous_nbytes = kv_bytes + 2 * B * HQ * D * ELEM

    def make_inputs(gen):
        return paged_inputs(gen, B, L)

    def ours(s):
        return qkernels.attn_paged_decode(s["q"], s["k_cache"], s["v_cache"], s["req_to_token"],
                                          s["req_pool_indices"], s["kv_indptr"], backend="cuda")

    def ours_contiguous(s):
        return qkernels.attn_decode(s["q4"], s["k"], s["v"], backend="cuda")

    impls = [Impl("qkernels attn_paged_decode", ours, ours=True),
             Impl("qkernels paged, row kernel forced", paged_variant("rows")),
             Impl("qkernels paged, per-head kernel forced", paged_variant("heads")),
             Impl("qkernels attn_decode, contiguous KV", ours_contiguous, nbytes=contiguous_nbytes, min_share=0.85)]
    for label, backend in SDPA_BACKENDS:
        copy = Impl(f"gather + SDPA {label}, contiguous copy", gather_sdpa(backend, True),
                    group="gather + SDPA", min_ratio=3.0)
        impls.append(Impl(f"gather + SDPA {label}", gather_sdpa(backend, False), fallback=copy,
                          group="gather + SDPA", min_ratio=3.0))
    label = f"B={B} L={length_label(L)} KV {kv_bytes / 1e6:.0f} MB"
    def check(s):
        pool = common.one_sequence_pool(s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"],
                                        s["kv_indptr"])
        return reference("attn_paged_decode", s["q"][:1], *pool)

    return Case("paged", label, make_inputs, check, nbytes, impls)


def contiguous_shapes(quick):
    if quick:
        return [(1, 1 * K), (1, 4 * K), (8, 4 * K)]
    shapes = [(B, L) for B in (1, 8, 32, 64) for L in (1 * K, 4 * K, 32 * K)]
    shapes.insert(shapes.index((64, 32 * K)), (64, 8 * K))  # the largest batch at a mid length too
    return shapes


def paged_shapes(quick):
    return [(1, 4 * K), (8, 4 * K)] if quick else [(1, 4 * K), (8, 4 * K), (32, 4 * K), (8, 32 * K)]


def build_cases(kinds, quick):
    cases = []
    if "contiguous" in kinds:
        cases += [contiguous_case(B, L) for B, L in contiguous_shapes(quick)]
    if "paged" in kinds:
        cases += [paged_case(B, L) for B, L in paged_shapes(quick)]
    return cases


# ---------------------------------------------------------------------------------------------
# --cpu: the cpu backend beside SDPA on the host


def cpu_case(kind, B, L, dtype):
    """A common.Case on the host: ours (backend="cpu") beside torch's CPU SDPA with enable_gqa on its
    preferred layout (paged: gather + SDPA, and our contiguous kernel on the gathered KV)."""
    dt = getattr(torch, dtype)
    kv_bytes = 2 * B * L * HKV * D * dt.itemsize
    qo_bytes = 2 * B * HQ * D * dt.itemsize
    label = f"B={B} L={length_label(L)} {dtype} KV {kv_bytes / 1e6:.1f} MB"
    if kind == "contiguous":
        impls = [common.Impl("qkernels attn_decode",
                             lambda s: qkernels.attn_decode(s["q"], s["k"], s["v"], backend="cpu"), ours=True),
                 common.Impl("SDPA (enable_gqa)", lambda s: sdpa(None, s["q_s"], s["k_s"], s["v_s"]), min_ratio=1.0)]
        return common.Case(kind, label, lambda gen: contiguous_inputs(gen, B, L, "cpu", dt), kv_bytes + qo_bytes, impls,
                           lambda s: reference("attn_decode", s["q"][:1], s["k"][:1], s["v"][:1]).reshape(1, HQ, D),
                           lambda out: out.reshape(-1, HQ, D)[:1])
    impls = [common.Impl("qkernels attn_paged_decode", lambda s: qkernels.attn_paged_decode(
                 s["q"], s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"], s["kv_indptr"],
                 backend="cpu"), ours=True),
             common.Impl("qkernels attn_decode, contiguous KV",
                         lambda s: qkernels.attn_decode(s["q4"], s["k"], s["v"], backend="cpu")),
             common.Impl("gather + SDPA (enable_gqa)", gather_sdpa(None, False), min_ratio=1.0)]

    def check(s):
        pool = common.one_sequence_pool(s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"],
                                        s["kv_indptr"])
        return reference("attn_paged_decode", s["q"][:1], *pool)

    return common.Case(kind, label, lambda gen: paged_inputs(gen, B, L, "cpu", dt), kv_bytes + qo_bytes + 4 * B * L,
                       impls, check, lambda out: out.reshape(-1, HQ, D)[:1])


def cpu_cases(kinds, quick, tiny):
    shapes = {"contiguous": [(1, 64)] if tiny else [(1, 1 * K), (2, 2 * K)] if quick else
              [(1, 1 * K), (1, 4 * K), (4, 4 * K)],
              "paged": [(2, 32)] if tiny else [(2, 1 * K)] if quick else [(1, 4 * K), (4, 4 * K)]}
    return [cpu_case(kind, B, L, dtype) for kind in kinds for dtype in ("float32", "bfloat16")
            for B, L in shapes[kind]]


def collect_cpu(args, copy_gbps=None):
    """--cpu: the cases on the host, timed with the wall clock: -> (header, rows, footer)."""
    header, copy_gbps = common.bandwidth_header("decode attention", args, copy_gbps)
    header.append(f"Hq={HQ} Hkv={HKV} D={D}; SDPA: torch's CPU choice; GB/s: (K+V + q + out [+ indices]) bytes / "
                  f"time; check: max|err|/max|ref| of the first sequence vs the float64 reference < {REL_TOL:g}")
    seeded = [(1000 * n, case) for n, case in enumerate(cpu_cases(args.cases, args.quick, args.tiny))]
    rows, footer = common.time_cases(seeded, lambda case, s: common.check_results(case, s, REL_TOL, common.max_error),
                                     args.samples, True, copy_gbps)
    return header, rows, footer


# ---------------------------------------------------------------------------------------------
# Timing


# ---------------------------------------------------------------------------------------------
# One case: check, time, rows


def failure_text(exc, width=None):
    text = f"n/a: {type(exc).__name__}: {first_line(exc, 120)}"
    return text if width is None or len(text) <= width else text[:width - 3] + "..."


def check(impl, inputs, want):
    """'PASS 3.1e-03' / 'FAIL ...' of the first sequence against the reference; raises what the impl raises.

    SDPA explains a refused backend in UserWarnings before raising; the first such reason is
    attached to the exception for the progress line.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = impl.fn(inputs)
            torch.cuda.synchronize()
        except Exception as exc:
            reasons = [str(w.message).strip().splitlines()[0] for w in caught if "not used because" in str(w.message)]
            try:
                exc.sdpa_reasons = reasons
            except AttributeError:  # an exception type without a __dict__
                pass
            raise
    got = got.reshape(-1, HQ, D)[:len(want)]
    err = common.max_error(got, want)
    ok = math.isfinite(err) and bool(torch.isfinite(got).all()) and err < REL_TOL
    return f"{'PASS' if ok else 'FAIL'} {err:.1e}"


def run_case(case, seed, samples, copy_gbps):
    print(f"\n{case.kind} | {case.label} | {case.nbytes / 1e6:.1f} MB minimal per call", flush=True)
    sets = input_sets(case, seed)
    print(f"  {len(sets)} input set(s), {len(sets) * storage_bytes(sets[0]) / 1e9:.2f} GB on the device", flush=True)
    want = case.reference(sets[0])
    release_gpu_memory()

    results = []  # (impl, us, verdict text, failure)
    queue = list(case.impls)
    while queue:
        impl = queue.pop(0)
        us, verdict, failure = None, "", None
        isets = sets
        try:
            if impl.prepare is not None:
                isets = impl.prepare(sets)
            verdict = check(impl, isets[0], want)
        except Exception as exc:  # not implemented yet, a backend refusing the case, memory: report, go on
            failure = exc
            if impl.fallback is not None:
                queue.insert(0, impl.fallback)
        release_gpu_memory()
        if failure is None:
            try:
                us = gpu_replay_time_us(impl.fn, isets, samples, GRAPH_WORK_US)
            except Exception as exc:  # capture refused (a host sync inside), ...
                failure = exc
        del isets
        release_gpu_memory()
        results.append((impl, us, verdict, failure))
        report_progress(case, impl, us, verdict, failure)
    del sets, want
    release_gpu_memory()
    return case_rows(case, results, copy_gbps)


def report_progress(case, impl, us, verdict, failure):
    if failure is not None:
        reasons = getattr(failure, "sdpa_reasons", None)
        why = f" [{reasons[0][:160]}]" if reasons else ""
        print(f"  {impl.name:<40} {failure_text(failure)}{why}", flush=True)
    else:
        nbytes = impl.nbytes or case.nbytes
        print(f"  {impl.name:<40} {us:>10.2f} µs {nbytes / us / 1e3:>7.0f} GB/s  {verdict}", flush=True)


def met(ok):
    return "met" if ok else "MISSED"


def case_rows(case, results, copy_gbps):
    ours = next(((impl, us) for impl, us, _, _ in results if impl.ours), (None, None))
    ours_us = ours[1]
    ours_gbps = case.nbytes / ours_us / 1e3 if ours_us else None
    # The fastest timed row of each group carries the group's bar.
    best_of_group = {}
    for impl, us, _, _ in results:
        if impl.group and us is not None and (impl.group not in best_of_group or us < best_of_group[impl.group][1]):
            best_of_group[impl.group] = (impl, us)
    first_of_group = {}
    for impl, _, _, _ in results:
        if impl.group:
            first_of_group.setdefault(impl.group, impl)

    rows = []
    for impl, us, verdict, failure in results:
        nbytes = impl.nbytes or case.nbytes
        gbps = nbytes / us / 1e3 if us else None
        ratio = us / ours_us if us and ours_us and not impl.ours else None
        bars, verdicts = [], []
        if impl.group and impl.min_ratio is not None:
            best = best_of_group.get(impl.group)
            if best is not None and best[0] is impl:
                bar = f">={impl.min_ratio:.1f}x (best {impl.group})"
                if ratio is not None:
                    verdicts.append(ratio >= impl.min_ratio)
                    bar += f" {met(verdicts[-1])}"
                bars.append(bar)
            elif best is None and first_of_group[impl.group] is impl:
                bars.append(f">={impl.min_ratio:.1f}x (best {impl.group}) n/a: no {impl.group} ran")
        if impl.min_share is not None:
            bar = f"paged >={impl.min_share:.0%} of this GB/s"
            if gbps and ours_gbps:
                share = ours_gbps / gbps
                verdicts.append(share >= impl.min_share)
                bar += f": {share:.0%} {met(verdicts[-1])}"
            bars.append(bar)
        if impl.max_us is not None:
            bar = f"<={impl.max_us:.0f} µs"
            if us is not None:
                verdicts.append(us <= impl.max_us)
                bar += f" {met(verdicts[-1])}"
            bars.append(bar)
        if impl.min_gbps is not None:
            bar = f">={impl.min_gbps / 1e3:.1f} TB/s"
            if gbps is not None:
                verdicts.append(gbps >= impl.min_gbps)
                bar += f" {met(verdicts[-1])}"
            bars.append(bar)
        check_text = "; ".join(t for t in (verdict, failure_text(failure, 90) if failure is not None else "") if t)
        rows.append(Row(case.kind, case.label, impl.name, us, gbps, 100.0 * gbps / copy_gbps if gbps else None,
                        ratio, ", ".join(bars), check_text, all(verdicts) if verdicts else None))
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def summary_lines(rows, failed_cases):
    judged = [row for row in rows if row.target]
    missed = [f"{row.case} / {row.impl}" for row in judged if row.verdict is False]
    unmeasured = [row for row in judged if row.verdict is None]
    checks = [row.check.split()[0] for row in rows if row.check.startswith(("PASS", "FAIL"))]
    lines = [f"targets: {sum(row.verdict is True for row in judged)} met, {len(missed)} MISSED, "
             f"{len(unmeasured)} not measured; checks: {checks.count('PASS')} PASS, {checks.count('FAIL')} FAIL"]
    if missed:
        lines.append("MISSED: " + "; ".join(missed))
    if failed_cases:
        lines.append("cases that failed: " + "; ".join(failed_cases))
    return lines


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = common.argument_parser(__doc__, 15, quick_help="a few small cases (smoke run)", listed=("cases", CASE_KINDS),
                               tiny=True)
    p.add_argument("--cpu", action="store_true", help="the cpu backend against torch's CPU SDPA on the host")
    return common.parse_args(p, argv, no_gpu_hint="; pass --cpu to time the CPU kernels")


def collect(args, copy_gbps=None):
    """Every case of args.cases, progress printed as it goes: -> (header, rows, footer); copy_gbps:
    the copy ceiling when benchmarks/run.py measured it already."""
    if args.cpu:
        return collect_cpu(args, copy_gbps)
    copy_gbps = copy_gbps or gpu_copy_ceiling_gbps(args.samples, GRAPH_WORK_US)
    header = common.header(
        "decode attention", "torch SDPA", common.copy_line(copy_gbps),
        f"Hq={HQ} Hkv={HKV} D={D} bf16; CUDA-graph replay, median of {args.samples} replays; inputs cycled to "
        f"span >= {COLD_FOOTPRINT_BYTES >> 30} GiB" + (" (--quick)" if args.quick else ""),
        "GB/s: (K+V + q + out [+ indices]) bytes / time; anchor/ours > 1: qkernels faster; "
        f"check: max|err|/max|ref| of the first sequence vs the float64 reference < {REL_TOL:g}")

    rows, failed_cases = [], []
    for case_no, case in enumerate(build_cases(args.cases, args.quick)):
        try:
            rows += run_case(case, 1000 * case_no, args.samples, copy_gbps)
        except Exception as exc:  # the inputs or the reference failed (memory, ...): report, go on
            print(f"  case failed: {type(exc).__name__}: {first_line(exc)}", flush=True)
            failed_cases.append(f"{case.kind} {case.label}: {type(exc).__name__}: {first_line(exc)}")
            release_gpu_memory()

    footer = summary_lines(rows, failed_cases)
    return header, rows, footer


if __name__ == "__main__":
    common.main(parse_args, collect, COLUMNS)
