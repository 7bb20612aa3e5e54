"""Sample inputs for every op, for tests, benchmarks and the self-check of ``python -m qkernels``.

``sample(op, rng)`` returns ``(args, kwargs)`` of small NumPy arrays that the op accepts: float32
data, int64 indices, sizes that are not multiples of anything.  ``FLOAT_ARGS[op]`` names the
positions of the floating-point tensor arguments (the ones that could carry gradients).
"""

from __future__ import annotations

import numpy as np


def _csr(rng, n_dst, n_src, e):
    row_ptr = np.sort(rng.integers(0, e + 1, n_dst + 1))
    row_ptr[0], row_ptr[-1] = 0, e
    return row_ptr.astype(np.int64), rng.integers(0, n_src, e).astype(np.int64)


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _freqs(rng, *lead, half):
    angle = rng.uniform(0, 6.3, (*lead, half)).astype(np.float32)
    return np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)


def _pages(rng, lens, max_ctx, pool):
    """req_to_token [R, max_ctx] with distinct slots, req_pool_indices [B], kv_indptr [B + 1]."""
    b = len(lens)
    r2t = rng.permutation(pool)[: b * max_ctx].reshape(b, max_ctx).astype(np.int64)
    rpi = rng.permutation(b).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return r2t, rpi, indptr


def sample(op, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    if op == "sparse_aggregate":
        row_ptr, col_idx = _csr(rng, 7, 5, 13)
        return (row_ptr, col_idx, _f32(rng, 13, 2), _f32(rng, 5, 2, 3)), {}
    if op == "fused_edge_features":
        return (_f32(rng, 6, 4), rng.integers(0, 6, (2, 11)).astype(np.int64), _f32(rng, 11, 4)), {}
    if op == "fused_norm_residual":
        return (_f32(rng, 5, 12), _f32(rng, 5, 12), _f32(rng, 12), _f32(rng, 12)), {}
    if op == "graph_norm_bce":
        return (_f32(rng, 17), (rng.random(17) < 0.3).astype(np.float32), np.sort(rng.integers(0, 3, 17)), 3), {}
    if op == "rotary_emb":
        return (_f32(rng, 5, 3, 8), _freqs(rng, 5, half=4)), {}
    if op == "linear":
        return (_f32(rng, 3, 10), _f32(rng, 7, 10), _f32(rng, 7)), {}
    if op == "swiglu":
        return (_f32(rng, 3, 10), _f32(rng, 7, 10), _f32(rng, 7, 10)), {}
    if op == "attn_decode":
        return (_f32(rng, 2, 1, 4, 8), _f32(rng, 2, 9, 2, 8), _f32(rng, 2, 9, 2, 8)), {}
    if op == "attn_prefill":
        return (_f32(rng, 2, 3, 4, 8), _f32(rng, 2, 9, 2, 8), _f32(rng, 2, 9, 2, 8)), {}
    if op == "attn_paged_decode":
        r2t, rpi, indptr = _pages(rng, [5, 3], 6, 16)
        return (_f32(rng, 2, 4, 8), _f32(rng, 16, 2, 8), _f32(rng, 16, 2, 8), r2t, rpi, indptr), {}
    if op == "attn_paged_prefill":
        r2t, rpi, indptr = _pages(rng, [5, 3], 6, 16)
        qo = np.array([0, 2, 5], np.int64)
        return (_f32(rng, 5, 4, 8), _f32(rng, 16, 2, 8), _f32(rng, 16, 2, 8), r2t, rpi, indptr, qo), {}
    raise ValueError(f"sample: unknown op {op!r}")


FLOAT_ARGS = {
    "sparse_aggregate": (2, 3), "fused_edge_features": (0, 2), "fused_norm_residual": (0, 1, 2, 3),
    "graph_norm_bce": (0, 1), "rotary_emb": (0, 1), "linear": (0, 1, 2), "swiglu": (0, 1, 2),
    "attn_decode": (0, 1, 2), "attn_prefill": (0, 1, 2), "attn_paged_decode": (0, 1, 2),
    "attn_paged_prefill": (0, 1, 2),
}

OPS = tuple(FLOAT_ARGS)
