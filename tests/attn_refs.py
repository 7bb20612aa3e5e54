"""float64 NumPy references for decode attention, and the random inputs the tests share."""

import numpy as np


def attn_decode_ref(q, k, v, kv_lens=None, mask=None, scale=None):
    """q [B, 1, Hq, D], k/v [B, L, Hkv, D] -> [B, 1, Hq, D]; kept keys: j < clip(kv_lens[b], 0, L) and
    mask[b, j]; a sequence with no kept key gives 0."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, _, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    keep = np.ones((B, L), bool)
    if kv_lens is not None:
        keep &= np.arange(L)[None, :] < np.asarray(kv_lens, np.int64)[:, None]
    if mask is not None:
        keep &= np.asarray(mask, bool).reshape(B, L)
    k = np.repeat(k, Hq // Hkv, axis=2)  # query head h uses kv head h // (Hq / Hkv)
    v = np.repeat(v, Hq // Hkv, axis=2)
    s = np.einsum("bhd,blhd->bhl", q[:, 0], k) * scale
    s = np.where(keep[:, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    p = np.where(keep[:, None, :], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    out = np.einsum("bhl,blhd->bhd", p, v) / np.where(den > 0, den, 1.0)
    return out[:, None]


def attn_paged_decode_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, new_k=None, new_v=None,
                          mask=None, scale=None):
    """-> (out [B, Hq, D], k_cache, v_cache after new_k/new_v were written at position len_b - 1)."""
    q = np.asarray(q, dtype=np.float64)
    k_cache = np.array(k_cache, dtype=np.float64)
    v_cache = np.array(v_cache, dtype=np.float64)
    req_to_token, rpi, indptr = (np.asarray(a, np.int64) for a in (req_to_token, req_pool_indices, kv_indptr))
    lens = np.diff(indptr)
    B = q.shape[0]
    if new_k is not None:
        for b in range(B):
            if lens[b] > 0:
                slot = req_to_token[rpi[b], lens[b] - 1]
                k_cache[slot] = new_k[b]
                v_cache[slot] = new_v[b]
    out = np.zeros(q.shape)
    for b in range(B):
        slots = req_to_token[rpi[b], :lens[b]]
        m = None if mask is None else np.asarray(mask, bool)[b:b + 1, :lens[b]]
        out[b] = attn_decode_ref(q[b:b + 1, None], k_cache[slots][None], v_cache[slots][None], mask=m,
                                 scale=scale)[0, 0]
    return out, k_cache, v_cache


def decode_inputs(rng, B, L, Hkv, ratio, D, dtype=np.float32):
    q = rng.standard_normal((B, 1, Hkv * ratio, D)).astype(dtype)
    k = rng.standard_normal((B, L, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, L, Hkv, D)).astype(dtype)
    return q, k, v


def paged_inputs(rng, lens, Hkv, ratio, D, R=None, extra_slots=5, index_dtype=np.int32, dtype=np.float32):
    """A token pool with the tokens of each sequence at randomly permuted slots; sequence b is
    request req_pool_indices[b] (a random, non-identity choice of rows of req_to_token)."""
    lens = np.asarray(lens, np.int64)
    B = len(lens)
    max_ctx = int(lens.max(initial=0)) + 3
    R = R or B + 2
    S = int(lens.sum()) + extra_slots
    slots = rng.permutation(S)
    rows = rng.permutation(R)[:B]
    req_to_token = np.full((R, max_ctx), -1, np.int64)  # unused entries are out of range: never read
    start = 0
    for b in range(B):
        req_to_token[rows[b], :lens[b]] = slots[start:start + lens[b]]
        start += lens[b]
    kv_indptr = np.concatenate([[0], np.cumsum(lens)])
    q = rng.standard_normal((B, Hkv * ratio, D)).astype(dtype)
    k_cache = rng.standard_normal((S, Hkv, D)).astype(dtype)
    v_cache = rng.standard_normal((S, Hkv, D)).astype(dtype)
    return (q, k_cache, v_cache, req_to_token.astype(index_dtype), rows.astype(index_dtype),
            kv_indptr.astype(index_dtype))


def naive_decode(q, k, v, keep, scale):
    """Decode attention computed in the inputs' own precision (torch tensors), the yardstick for
    fp16/bf16: q [B,1,Hq,D], k/v [B,L,Hkv,D], keep bool [B,L]."""
    import torch

    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q[:, 0], kk) * scale
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhl,blhd->bhd", p, vv)[:, None]
