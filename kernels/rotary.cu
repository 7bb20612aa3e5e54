// rotary_emb.  Placeholder until the kernel lands: the binding and the CPU path come first.
#include "common.cuh"

extern "C" int qk_rotary_cuda(const qk_rotary_args *a, void *stream) {
    (void)a;
    (void)stream;
    return QK_E_UNSUPPORTED;
}
