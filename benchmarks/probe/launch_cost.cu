// Probe: host cost of one kernel launch by parameter size, stream kind and API (notes for METHOD.md).
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>

struct Big { char b[216]; };
__global__ void k_small(int x) { if (x == 12345) printf("x"); }
__global__ void k_big(Big a) { if (a.b[3] == 123) printf("x"); }

template <class F> double host_us(F f, int n = 256, int rounds = 201) {
    double best = 1e9;
    for (int r = 0; r < rounds; r++) {
        cudaDeviceSynchronize();
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) f();
        auto t1 = std::chrono::steady_clock::now();
        double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
        if (us < best) best = us;
    }
    cudaDeviceSynchronize();
    return best;
}

int main() {
    cudaFree(0);
    cudaStream_t nb; cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking);
    Big big = {};
    int dev; cudaGetDevice(&dev);
    CUfunction fbig; cudaGetFuncBySymbol((cudaFunction_t *)&fbig, (const void *)k_big);
    for (int warm = 0; warm < 2; warm++) {
        double a = host_us([&] { k_small<<<16, 256, 0, 0>>>(1); });
        double b = host_us([&] { k_big<<<16, 256, 0, 0>>>(big); });
        double c = host_us([&] { k_big<<<16, 256, 0, nb>>>(big); });
        double d = host_us([&] { void *args[] = {&big}; cuLaunchKernel(fbig, 16, 1, 1, 256, 1, 1, 0, nb, args, nullptr); });
        double e = host_us([&] { k_big<<<16, 256, 0, nb>>>(big); cudaGetLastError(); int x; cudaGetDevice(&x); });
        if (warm) printf("small params legacy %.2f | 216B legacy %.2f | 216B nonblocking %.2f | cuLaunchKernel %.2f | +getlasterror+getdevice %.2f (us, best of 201x256)\n", a, b, c, d, e);
    }
    return 0;
}
