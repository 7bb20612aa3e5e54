"""float64 NumPy references for the graph ops, and a NumPy Philox4x32-10 for the dropout mask."""

import numpy as np

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32(counter, seed):
    """Philox4x32-10 of counters (uint64 array) with key seed: [len, 4] uint32 words."""
    c = np.asarray(counter, dtype=np.uint64)
    c0, c1 = c & MASK32, c >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & MASK32), np.uint64((seed >> 32) & MASK32)
    for _ in range(10):
        p0 = np.uint64(M0) * c0
        p1 = np.uint64(M1) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(MASK32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + np.uint64(W0)) & np.uint64(MASK32)
        k1 = (k1 + np.uint64(W1)) & np.uint64(MASK32)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_keep(seed, shape, p):
    """The documented mask: element i keeps iff word i%4 of philox(i//4, seed) >= p * 2^32."""
    n = int(np.prod(shape))
    idx = np.arange(n, dtype=np.uint64)
    words = philox4x32(idx >> np.uint64(2), seed & 0xFFFFFFFFFFFFFFFF)
    draw = words[np.arange(n), (idx & np.uint64(3)).astype(np.int64)]
    threshold = min(int(np.ldexp(p, 32)), MASK32)
    return (draw >= threshold).reshape(shape)


def edge_features_ref(x, edge_index, edge_attr=None):
    x = np.asarray(x, dtype=np.float64)
    src, dst = np.asarray(edge_index)[0], np.asarray(edge_index)[1]
    parts = [x[src] + x[dst], np.abs(x[src] - x[dst])]
    if edge_attr is not None:
        parts.append(np.asarray(edge_attr, dtype=np.float64))
    return np.concatenate(parts, axis=1)


def norm_residual_ref(x, residual, gamma, beta, eps=1e-5, keep=None, p=0.0):
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    if keep is not None:
        y = np.where(keep, y / (1.0 - p) if p < 1 else 0.0, 0.0)
    return y + np.asarray(residual, np.float64)


def graph_bce_ref(logits, target, edge_graph, num_graphs, pos_weight=None):
    lg = np.asarray(logits, np.float64)
    t = np.asarray(target, np.float64)
    v = np.maximum(lg, 0) - lg * t + np.log1p(np.exp(-np.abs(lg)))
    if pos_weight is not None:
        v = v * (1 + (pos_weight - 1) * t)
    g = np.asarray(edge_graph, np.int64)
    sums = np.bincount(g, weights=v, minlength=num_graphs)
    counts = np.bincount(g, minlength=num_graphs)
    return float(np.mean(sums / np.maximum(counts, 1)))
