"""How does the way a kernel walks a weight matrix change the DRAM read rate on this GPU?  A
read-only reference for linear's kernels (they reach ~85% of the copy rate on the tile kernels,
~97% on the GEMV, which streams whole rows).

A CuPy kernel reads a [rows, 4096] bf16 matrix of 1.1 GB (past the 50 MB L2).  Every warp reads
8 KB, as R rows x 8/R KB (a K slice of each; R = 1: one whole row), and there is one warp per row,
so every shape launches the same warps with the same bytes each and only the shape of a load
changes: one warp-wide 16-byte load covers R rows x 512/R bytes, and U loads along K are issued
before any is used (XOR-folded into a register, one word stored per thread).  R=1 is the GEMV's
pattern, R=8 the tile kernel's fragments (64 bytes of 8 rows per load).  The first version of
this probe gave each warp R whole rows, so the shapes differed in warps and waves too; its
figures (4 rows x 128 B fastest) did not carry over to two kernels built on them.

    python3 benchmarks/probe/weight_roofline.py

Prints µs (median of 15, CUDA events) and TB/s per (R, U)."""
import cupy as cp
import numpy as np

K = 4096
ROWS = 8448 * 16  # one warp per row: 16 waves of 132 SMs x 64 warps
SRC = r"""
extern "C" __global__ void __launch_bounds__(256) rd(const uint4 *__restrict__ w, long long rows, unsigned *__restrict__ sink) {
    constexpr int R = %(R)d, U = %(U)d, LPR = 32 / R;   // lanes per row
    constexpr int KV = %(K)d / 8, SV = KV / R;           // 16-byte vectors per row, per row in a warp's slice
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const long long row = (warp / R) * R + lane / LPR;   // rows of the warp's group
    if (warp >= rows) return;
    const uint4 *p = w + row * KV + (warp %% R) * SV + (lane %% LPR);
    unsigned acc = 0;
    for (int k0 = 0; k0 < SV; k0 += U * LPR) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = k0 + u * LPR;
            if (k < SV) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
                                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + k));
            else v[u] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    sink[warp * 32 + lane] = acc;
}
"""


def main():
    w = cp.random.randint(0, 1 << 15, size=(ROWS, K), dtype=np.int16)
    sink = cp.zeros(ROWS * 32, dtype=np.uint32)
    nbytes = w.nbytes
    start, end = cp.cuda.Event(), cp.cuda.Event()
    grid = (ROWS * 32 + 255) // 256  # one warp per row whatever the shape
    args = (w, np.int64(ROWS), sink)
    print(f"{'R':>3} {'U':>3} {'B/row/load':>11} {'us':>8} {'TB/s':>6}")
    for r, u in [(1, 4), (1, 8), (1, 16), (2, 8), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8), (32, 4)]:
        kern = cp.RawKernel(SRC % {"R": r, "U": u, "K": K}, "rd", options=("-std=c++17",))
        for _ in range(3):
            kern((grid,), (256,), args)
        ts = []
        for _ in range(15):
            start.record()
            kern((grid,), (256,), args)
            end.record()
            end.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        t = float(np.median(ts))
        print(f"{r:>3} {u:>3} {512 // r:>11} {t:8.1f} {nbytes / t / 1e6:6.2f}", flush=True)


if __name__ == "__main__":
    main()
