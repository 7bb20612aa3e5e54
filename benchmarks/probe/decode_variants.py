"""attn_decode alone at a few shapes (Hq=32, Hkv=8, D=128, bf16), CUDA-graph replay over rotating
inputs: for comparing builds or launch settings of the decode kernel quickly.

--paged: the same KV three ways at B=8 L=32k and B=1, 8 at L=4k: attn_paged_decode on a shuffled
token pool with each paged kernel forced (heads: a CTA per sequence, kv head and split; rows: a CTA
per sequence and split reading whole token rows) and as the launcher picks, and attn_decode on the
contiguous copy; GB/s of K+V and the ratio to the contiguous time, each checked against the float64
reference on the first sequence first; --rows-splits 8,16,32 adds the row kernel at those forced
split counts."""
import sys

import torch

sys.path.insert(0, "benchmarks")
import common  # noqa: E402

import qkernels  # noqa: E402

HQ, HKV, D = 32, 8, 128


def contiguous_sweep(tag):
    shapes = [(1, 1024), (1, 4096), (1, 32768), (8, 4096), (8, 32768), (32, 4096), (64, 8192)]
    cells = []
    for B, L in shapes:
        kv = 2 * B * L * HKV * D * 2
        nsets = max(1, min(64, int(2e9 // kv)))
        sets = []
        for _ in range(nsets):
            sets.append((torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16),
                         torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16),
                         torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16)))
        us = common.gpu_replay_time_us(lambda s: qkernels.attn_decode(*s, backend="cuda"), sets, 9)
        cells.append(f"B{B}L{L // 1024}k {us:7.1f}us {kv / us / 1e3:5.0f}GB/s")
        del sets
        common.release_gpu_memory()
    print(f"{tag:>14} | " + " | ".join(cells), flush=True)


def paged_set(B, L):
    """A shuffled token pool of B sequences of L tokens and the same KV as one contiguous cache."""
    S = B * L + 1
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(S, device="cuda")[:B * L]
    rows = torch.randperm(B, device="cuda")
    r2t = torch.empty(B, L, dtype=torch.int32, device="cuda")
    r2t[rows] = slots.view(B, L).to(torch.int32)
    indptr = (torch.arange(B + 1, device="cuda") * L).to(torch.int32)
    return {"q": q, "k_cache": kc, "v_cache": vc, "req_to_token": r2t, "req_pool_indices": rows.to(torch.int32),
            "kv_indptr": indptr, "k": kc.index_select(0, slots).view(B, L, HKV, D),
            "v": vc.index_select(0, slots).view(B, L, HKV, D)}


def paged_fn(variant, splits=0):
    def fn(s):
        out = torch.empty_like(s["q"])
        qkernels._C.attn_paged_decode_raw(s["q"], s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"],
                                          s["kv_indptr"], out=out, stream=torch.cuda.current_stream().cuda_stream,
                                          _variant=variant, _splits=splits)
        return out

    return fn


def contiguous_fn(s):
    return qkernels.attn_decode(s["q"].unsqueeze(1), s["k"], s["v"], backend="cuda")[:, 0]


def paged_sweep(tag, rows_splits=()):
    impls = [("contiguous", contiguous_fn), ("paged heads", paged_fn("heads")), ("paged rows", paged_fn("rows")),
             ("paged auto", paged_fn("auto"))] + [(f"rows s={n}", paged_fn("rows", n)) for n in rows_splits]
    for B, L in [(8, 32768), (1, 4096), (8, 4096)]:
        kv = 2 * B * L * HKV * D * 2
        # two layouts of the KV per set; sets cycled to span >= 2 GB so every call reads cold KV
        sets = [paged_set(B, L) for _ in range(max(1, min(64, int(2e9 // kv))))]
        s0 = sets[0]
        pool = common.one_sequence_pool(s0["k_cache"], s0["v_cache"], s0["req_to_token"], s0["req_pool_indices"],
                                        s0["kv_indptr"])
        ref = common.reference("attn_paged_decode", s0["q"][:1], *pool)
        cells, base = [], None
        for name, fn in impls:
            got = fn(s0)[:1].double().cpu().numpy()
            err = abs(got - ref).max() / abs(ref).max()
            us = common.gpu_replay_time_us(fn, sets, 9)
            base = base or us
            cells.append(f"{name} {us:7.1f}us {kv / us / 1e3:5.0f}GB/s {base / us:4.2f}x"
                         + ("" if err < 2e-2 else f" CHECK FAILED {err:.1e}"))
        print(f"{tag:>10} B{B}L{L // 1024}k | " + " | ".join(cells), flush=True)
        del sets, s0
        common.release_gpu_memory()


if __name__ == "__main__":
    # decode_variants.py [--paged [--rows-splits 8,16,32]] [tag]
    argv, rows_splits = sys.argv[1:], ()
    if "--rows-splits" in argv:
        i = argv.index("--rows-splits")
        rows_splits = tuple(int(n) for n in argv[i + 1].split(","))
        del argv[i:i + 2]
    args = [a for a in argv if a != "--paged"]
    tag = args[0] if args else ""
    paged_sweep(tag, rows_splits) if "--paged" in argv else contiguous_sweep(tag)
