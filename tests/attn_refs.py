"""float64 NumPy references for decode and prefill attention, the naive same-precision torch yardsticks,
and the random inputs the tests share."""

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


def token_pool(rng, lens, Hkv, D, R=None, extra_slots=5, index_dtype=np.int32, dtype=np.float32):
    """A token pool with the tokens of each sequence at randomly permuted slots; sequence b is
    request req_pool_indices[b] (a random choice of rows of req_to_token, never the identity for B > 1).
    -> (k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr)."""
    lens = np.asarray(lens, np.int64)
    B = len(lens)
    max_ctx = int(lens.max(initial=0)) + 3
    R = R or B + 2
    S = int(lens.sum()) + extra_slots
    slots = rng.permutation(S)
    rows = rng.permutation(R)[:B]
    if B > 1 and np.array_equal(rows, np.arange(B)):  # 1 draw in 20160 at B=6, R=8: make it a real test
        rows = np.roll(rows, 1)
    req_to_token = np.full((R, max_ctx), -1, np.int64)  # unused entries are out of range: never read
    start = 0
    for b in range(B):
        req_to_token[rows[b], :lens[b]] = slots[start:start + lens[b]]
        start += lens[b]
    kv_indptr = np.concatenate([[0], np.cumsum(lens)])
    k_cache = rng.standard_normal((S, Hkv, D)).astype(dtype)
    v_cache = rng.standard_normal((S, Hkv, D)).astype(dtype)
    return (k_cache, v_cache, req_to_token.astype(index_dtype), rows.astype(index_dtype),
            kv_indptr.astype(index_dtype))


def paged_inputs(rng, lens, Hkv, ratio, D, R=None, extra_slots=5, index_dtype=np.int32, dtype=np.float32):
    """attn_paged_decode's arguments: q [B, Hq, D] and a token_pool."""
    q = rng.standard_normal((len(lens), Hkv * ratio, D)).astype(dtype)
    return (q,) + token_pool(rng, lens, Hkv, D, R, extra_slots, index_dtype, dtype)


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


# ---- prefill --------------------------------------------------------------------------------

def prefill_keep(B, Hq, Lq, Lkv, is_causal=False, mask=None):
    """bool [B, Hq, Lq, Lkv] (broadcast): query i sits at key position i + Lkv - Lq; causal keeps keys
    j <= that (bottom-right); mask [B, Lkv] or [B, 1|Hq, Lq, Lkv], True = keep."""
    keep = np.ones((1, 1, Lq, Lkv), bool)
    if is_causal:
        keep = keep & (np.arange(Lkv)[None, :] <= np.arange(Lq)[:, None] + (Lkv - Lq))
    if mask is not None:
        m = np.asarray(mask, bool)
        keep = keep & (m[:, None, None, :] if m.ndim == 2 else m)
    return np.broadcast_to(keep, (B, Hq, Lq, Lkv))


def attn_prefill_ref(q, k, v, is_causal=False, mask=None, scale=None):
    """q [B, Lq, Hq, D], k/v [B, Lkv, Hkv, D] -> [B, Lq, Hq, D] in float64; a query with no kept key
    gives 0."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    keep = prefill_keep(B, Hq, Lq, Lkv, is_causal, mask)
    k = np.repeat(k, Hq // Hkv, axis=2).transpose(0, 2, 3, 1)  # [B, Hq, D, Lkv]: head h uses kv head h // G
    v = np.repeat(v, Hq // Hkv, axis=2).transpose(0, 2, 1, 3)  # [B, Hq, Lkv, D]
    s = np.where(keep, (q.transpose(0, 2, 1, 3) @ k) * scale, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    return ((p @ v) / np.where(den > 0, den, 1.0)).transpose(0, 2, 1, 3)


def attn_paged_prefill_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr,
                           is_causal=False, mask=None, scale=None):
    """q [total_q, Hq, D] -> [total_q, Hq, D] in float64: request b's rows qo_indptr[b] ..
    qo_indptr[b+1] - 1 are the last queries of its keys; rows of no request are 0."""
    q = np.asarray(q, dtype=np.float64)
    r2t, rpi, kv_indptr, qo_indptr = (np.asarray(a, np.int64) for a in (req_to_token, req_pool_indices, kv_indptr,
                                                                           qo_indptr))
    out = np.zeros(q.shape)
    for b in range(len(rpi)):
        n = kv_indptr[b + 1] - kv_indptr[b]
        slots = r2t[rpi[b], :n]
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        m = None if mask is None else np.asarray(mask, bool)[b:b + 1, :n]
        out[rows] = attn_prefill_ref(q[None, rows], np.asarray(k_cache)[slots][None], np.asarray(v_cache)[slots][None],
                                     is_causal, m, scale)[0]
    return out


def prefill_inputs(rng, B, Lq, Lkv, Hkv, ratio, D, dtype=np.float32):
    q = rng.standard_normal((B, Lq, Hkv * ratio, D)).astype(dtype)
    k = rng.standard_normal((B, Lkv, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, Lkv, Hkv, D)).astype(dtype)
    return q, k, v


def paged_prefill_inputs(rng, q_lens, kv_lens, Hkv, ratio, D, index_dtype=np.int32, dtype=np.float32, lead=0,
                         tail=0):
    """attn_paged_prefill's arguments: a token_pool for kv_lens and q [total_q, Hq, D] whose rows
    lead .. total_q - tail - 1 are the requests' queries, q_lens[b] of them for request b."""
    k_cache, v_cache, r2t, rpi, kv_indptr = token_pool(rng, kv_lens, Hkv, D, index_dtype=index_dtype, dtype=dtype)
    qo_indptr = (lead + np.concatenate([[0], np.cumsum(q_lens)])).astype(index_dtype)
    q = rng.standard_normal((int(qo_indptr[-1]) + tail, Hkv * ratio, D)).astype(dtype)
    return q, k_cache, v_cache, r2t, rpi, kv_indptr, qo_indptr


def naive_prefill(q, k, v, keep, scale):
    """Prefill attention computed in the inputs' own precision (torch tensors), the yardstick for
    fp16/bf16: q [B, Lq, Hq, D], k/v [B, Lkv, Hkv, D], keep bool broadcastable to [B, Hq, Lq, Lkv]."""
    import torch

    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    s = s.masked_fill(~torch.as_tensor(keep), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, vv)
