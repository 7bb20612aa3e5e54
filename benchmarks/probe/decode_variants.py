"""attn_decode alone at a few shapes (Hq=32, Hkv=8, D=128, bf16), CUDA-graph replay over rotating
inputs: for comparing builds or launch settings of the decode kernel quickly."""
import sys

import torch

sys.path.insert(0, "benchmarks")
import common  # noqa: E402

import qkernels  # noqa: E402

HQ, HKV, D = 32, 8, 128
shapes = [(1, 1024), (1, 4096), (1, 32768), (8, 4096), (8, 32768), (32, 4096), (64, 8192)]
tag = sys.argv[1] if len(sys.argv) > 1 else ""
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
