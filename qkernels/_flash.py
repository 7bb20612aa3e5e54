"""The flash backend: the attention family through the flash_attn package.

Only what the dispatcher's flash predicate lets through reaches here (_dispatch._PREDICATES["flash"]):
torch CUDA float16/bfloat16 tensors, head_dim <= 256 and a multiple of 8, contiguous caches (no
token-pool paging), no mask.  flash_attn is imported at the first call, not with qkernels.
"""

from __future__ import annotations


def _check_inputs(op, flash_fn, mask, q, k, v):
    if mask is not None:
        raise ValueError(f"{op}: the flash backend takes no mask ({flash_fn} has none)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be unit-stride in its last dimension, got stride "
                             f"{t.stride(-1)}; pass a contiguous copy")


def _result(r, out):
    if out is None:
        return r
    out.copy_(r)
    return out


def attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None, out=None):
    """q [B, 1, Hq, D] and k/v [B, Lkv, Hkv, D] are flash_attn_with_kvcache's own layouts."""
    import flash_attn

    _check_inputs("attn_decode", "flash_attn_with_kvcache", mask, q, k, v)
    # Our kv_lens clamps to [0, Lkv]; flash would read past the cache for a longer length.
    seqlens = None if kv_lens is None else kv_lens.clamp(0, k.shape[1]).int()
    return _result(flash_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=scale), out)


def attn_prefill(q, k, v, *, is_causal=False, mask=None, scale=None, out=None):
    """q [B, Lq, Hq, D] and k/v [B, Lkv, Hkv, D] are flash_attn_func's own layouts (GQA included).

    Assumes flash-attn >= 2.1: from 2.1 its causal mask is aligned to the bottom-right corner when
    Lq != Lkv (query i keeps keys j <= i + Lkv - Lq, rows that keep nothing give 0), which is our
    contract; 2.0 aligned it top-left."""
    import flash_attn

    _check_inputs("attn_prefill", "flash_attn_func", mask, q, k, v)
    return _result(flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=bool(is_causal)), out)


OPS = {"attn_decode": attn_decode, "attn_prefill": attn_prefill}
