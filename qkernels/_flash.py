"""The flash backend: the attention family through the flash_attn package.

Only what the dispatcher's flash predicate lets through reaches here (_dispatch._PREDICATES["flash"]):
torch CUDA float16/bfloat16 tensors, head_dim <= 256 and a multiple of 8, contiguous caches (no
token-pool paging), no mask.  flash_attn is imported at the first call, not with qkernels.
"""

from __future__ import annotations


def attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None, out=None):
    """q [B, 1, Hq, D] and k/v [B, Lkv, Hkv, D] are flash_attn_with_kvcache's own layouts."""
    import flash_attn

    if mask is not None:
        raise ValueError("attn_decode: the flash backend takes no mask (flash_attn_with_kvcache has none)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"attn_decode: {name} must be unit-stride in its last dimension, got stride "
                             f"{t.stride(-1)}; pass a contiguous copy")
    # Our kv_lens clamps to [0, Lkv]; flash would read past the cache for a longer length.
    seqlens = None if kv_lens is None else kv_lens.clamp(0, k.shape[1]).int()
    r = flash_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=scale)
    if out is None:
        return r
    out.copy_(r)
    return out


OPS = {"attn_decode": attn_decode}
