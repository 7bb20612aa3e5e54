// attn_prefill / attn_paged_prefill on tensor cores (work in progress: no kernel yet).
#include "common.cuh"

extern "C" int qk_attn_prefill_cuda(const qk_attn_prefill_args *a, void *stream) {
    (void)a;
    (void)stream;
    return QK_E_UNSUPPORTED;
}
