// attn_decode / attn_paged_decode (split-KV flash decoding).  Placeholder until the kernel lands:
// the binding and the CPU path are built against qk_attn_decode_args first.
#include "common.cuh"

extern "C" int qk_attn_decode_cuda(const qk_attn_decode_args *a, void *stream) {
    (void)a;
    (void)stream;
    return QK_E_UNSUPPORTED;
}
