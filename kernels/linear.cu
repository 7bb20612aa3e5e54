// linear and swiglu (skinny GEMM).  Placeholder until the kernels land: the binding and the CPU
// path come first.
#include "common.cuh"

extern "C" int qk_linear_cuda(const qk_linear_args *a, void *stream) {
    (void)a;
    (void)stream;
    return QK_E_UNSUPPORTED;
}

extern "C" int qk_swiglu_cuda(const qk_linear_args *a, void *stream) {
    (void)a;
    (void)stream;
    return QK_E_UNSUPPORTED;
}
