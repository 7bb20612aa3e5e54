"""A profiling target for ncu: attn_decode and cuDNN's SDPA on the same KV ([B,L,Hkv,D] for ours,
SDPA's [B,H,L,D] for cuDNN), warmed up, then one call of each inside the profiler range:
  ncu --clock-control none --profile-from-start off python3 benchmarks/probe/decode_profile.py B L"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkernels

B, L = (int(x) for x in sys.argv[1:3])
HQ, HKV, D = 32, 8, 128
q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
qs, ks, vs = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)


for _ in range(3):
    qkernels.attn_decode(q, k, v, backend="cuda")
    cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
qkernels.attn_decode(q, k, v, backend="cuda")
cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
