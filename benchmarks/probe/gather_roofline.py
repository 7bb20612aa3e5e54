"""How fast can the H200 read a token pool at page size 1?  A read-only reference for
attn_paged_decode, whose target is >= 85% of the contiguous kernel's bandwidth.

A CuPy kernel reads what attn_paged_decode reads, in its order: one block per (sequence b, kv
head hk, split of the keys), the K and V rows of D=128 bf16 (256 bytes each) at pool slots
req_to_token[b, j], each slot index loaded first (int32); 16 lanes per row, 16 keys' K and V
rows per warp in flight, XOR-folded into a register so that nothing is written but one word per
thread.  Slots are the identity (the pool read in order) or a random permutation (page size 1,
scattered): the ratio of the two says how much of the in-order bandwidth scattered 256-byte rows
keep on this GPU with no attention arithmetic at all.

    python3 benchmarks/probe/gather_roofline.py [B L ...]      (default: 8 4096 32 4096 8 32768)

Prints µs (median of 25, CUDA events; KV of 134 MB and more, past the 50 MB L2) and TB/s of K+V
read."""
import sys

import cupy as cp
import numpy as np

HKV, D = 8, 128
SRC = r"""
extern "C" __global__ void __launch_bounds__(128) gather(const uint4 *__restrict__ k, const uint4 *__restrict__ v,
        const int *__restrict__ r2t, int L, int hkv, int chunk, unsigned *__restrict__ sink) {
    const int b = blockIdx.y, hk = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j_begin = blockIdx.z * chunk, j_end = min(L, j_begin + chunk);
    const int half = lane >> 4, c = lane & 15;            // row within a pair, 16-byte chunk of the row
    unsigned acc = 0;
    for (int j0 = j_begin + warp * 16; j0 < j_end; j0 += 4 * 16) {  // 16 keys per warp and round
        int slot[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int j = j0 + 2 * u + half;
            slot[u] = j < j_end ? __ldg(r2t + (size_t)b * L + j) : -1;
        }
        uint4 kv[16];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const size_t row = ((size_t)(slot[u] < 0 ? 0 : slot[u]) * hkv + hk) * 16 + c;
            kv[2 * u] = __ldg(k + row);
            kv[2 * u + 1] = __ldg(v + row);
        }
#pragma unroll
        for (int u = 0; u < 16; u++)
            if (slot[u / 2] >= 0) acc ^= kv[u].x ^ kv[u].y ^ kv[u].z ^ kv[u].w;
    }
    sink[(((size_t)blockIdx.z * gridDim.y + b) * gridDim.x + hk) * blockDim.x + threadIdx.x] = acc;
}
"""
kernel = cp.RawKernel(SRC, "gather")


def time_us(fn, reps=25):
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(out))


def case(B, L):
    S = B * L
    k = cp.random.randint(0, 2**31, size=(S, HKV, D // 8, 4), dtype=cp.uint32)
    v = cp.random.randint(0, 2**31, size=(S, HKV, D // 8, 4), dtype=cp.uint32)
    # splits of each sequence so that ~8 blocks per SM run (the decode kernel splits the same way)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    nsplit = max(1, min(L // 256, -(-8 * sms // (B * HKV))))
    chunk = -(-L // nsplit)
    sink = cp.empty((nsplit, B, HKV, 128), dtype=cp.uint32)
    kv_bytes = 2 * S * HKV * D * 2
    row = []
    for slots in (cp.arange(S, dtype=cp.int32), cp.random.permutation(S).astype(cp.int32)):
        r2t = slots.reshape(B, L)
        row.append(time_us(lambda: kernel((HKV, B, nsplit), (128,), (k, v, r2t, np.int32(L), np.int32(HKV), np.int32(chunk), sink))))
    print(f"{B:>3} {L:>6} {kv_bytes / 1e6:7.0f} {row[0]:8.1f} µs {kv_bytes / row[0] / 1e6:4.2f} TB/s"
          f" {row[1]:8.1f} µs {kv_bytes / row[1] / 1e6:4.2f} TB/s {row[0] / row[1]:6.2f}", flush=True)


args = [int(x) for x in sys.argv[1:]] or [8, 4096, 32, 4096, 8, 32768]
print(f"{'B':>3} {'L':>6} {'KV MB':>7} {'in order':>16} {'scattered':>16} {'ratio':>6}")
for B, L in zip(args[::2], args[1::2]):
    case(B, L)
    cp.get_default_memory_pool().free_all_blocks()
