"""Sample calls and float64 references of every op, for tests, benchmarks and ``python -m qkernels``.

``sample(op, rng, **options)`` returns ``(args, kwargs)``: a valid call of ``qkernels.<op>`` on
random NumPy arrays (float32 data unless ``dtype=``, int64 indices unless ``index_dtype=``, small
sizes that are multiples of nothing; each op's keyword options below set the sizes).

``reference(op, *args, **kwargs)`` is what ``qkernels.<op>(*args, **kwargs)`` returns, computed in
float64 NumPy from the same arguments (a tuple, with None for a gradient not asked for, where the op
returns several): NumPy arrays, or anything ``np.asarray`` takes (convert
bfloat16 and device tensors first, e.g. ``t.double().cpu().numpy()``).  ``out=``, ``stream=`` and
``backend=`` are accepted and ignored.  The ``_ref_<op>`` functions below are the statement of each
op's semantics.

``FLOAT_ARGS[op]`` names the positions of the floating-point tensor arguments (the ones that could
carry gradients); ``OPS`` lists the ops.  ``MUTATED[op]`` names the arguments an op updates in place
(fused_add_rmsnorm's residual, rotary_kv_append's pools) and ``written(op, *args, **kwargs)`` their float64 values after the call.
"""

from __future__ import annotations

import numpy as np

from ._dispatch import WRITES as _WRITES


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _idx(a):
    return np.asarray(a).astype(np.int64)


# ---- references: graph ops ------------------------------------------------------------------

def _ref_sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, plan=None):
    """out[i, h] = sum of edge_weight[e, h] * node_feat[col_idx[e], h] over row_ptr[i] <= e < row_ptr[i + 1]
    (offsets absolute: a CSR slice keeps them); [N_dst, H, D]."""
    row_ptr, col_idx = _idx(row_ptr), _idx(col_idx)
    lo, hi = row_ptr[0], row_ptr[-1]
    node_feat = np.asarray(node_feat)
    out = np.zeros((len(row_ptr) - 1,) + node_feat.shape[1:])
    rows = np.repeat(np.arange(len(row_ptr) - 1), np.diff(row_ptr))
    np.add.at(out, rows, _f64(edge_weight)[lo:hi, :, None] * _f64(node_feat[col_idx[lo:hi]]))
    return out

def _ref_sparse_aggregate_backward(grad_out, row_ptr, col_idx, edge_weight, node_feat, *, edge_weight_grad=True,
                                   node_feat_grad=True, deterministic=True, plan=None):
    """(grad_edge_weight [E, H], grad_node_feat [N_src, H, D]) of sparse_aggregate for grad_out [N_dst, H, D],
    None where not wanted: grad_edge_weight[e, h] = grad_out[i, h] . node_feat[col_idx[e], h] for the row i
    holding e (0 outside [row_ptr[0], row_ptr[-1])); grad_node_feat[j, h] = sum of edge_weight[e, h] *
    grad_out[i, h] over the edges e of column j."""
    row_ptr, col_idx = _idx(row_ptr), _idx(col_idx)
    lo, hi = row_ptr[0], row_ptr[-1]
    go, ew, nf = _f64(grad_out), _f64(edge_weight), _f64(node_feat)
    rows = np.repeat(np.arange(len(row_ptr) - 1), np.diff(row_ptr))
    cols = col_idx[lo:hi]
    gew = gnf = None
    if edge_weight_grad:
        gew = np.zeros(ew.shape)
        gew[lo:hi] = np.einsum("ehd,ehd->eh", go[rows], nf[cols])
    if node_feat_grad:
        gnf = np.zeros(nf.shape)
        np.add.at(gnf, cols, ew[lo:hi, :, None] * go[rows])
    return gew, gnf

def _ref_sparse_aggregate_plan(row_ptr, col_idx, num_src):
    """int [N_src + 1 + 3E]: ptr, then src, edge and row per entry, the edges in [row_ptr[0], row_ptr[-1])
    sorted stably by column and the others after them (src N_src, row 0)."""
    row_ptr, col_idx = _idx(row_ptr), _idx(col_idx)
    e = len(col_idx)
    lo, hi = row_ptr[0], row_ptr[-1]
    ids = np.arange(e)
    inside = (ids >= lo) & (ids < hi)
    key = np.where(inside, col_idx, num_src)
    row = np.zeros(e, np.int64)
    row[inside] = np.searchsorted(row_ptr, ids[inside], side="right") - 1
    order = np.argsort(key, kind="stable")
    ptr = np.searchsorted(key[order], np.arange(num_src + 1), side="left")
    return np.concatenate([ptr, key[order], order, row[order]])


def _ref_fused_edge_features(x, edge_index, edge_attr=None, *, plan=None):
    """[x[src] + x[dst], |x[src] - x[dst]|, edge_attr] side by side: [E, 2H] or [E, 3H]."""
    src, dst = _idx(edge_index)
    x = np.asarray(x)
    xs, xd = _f64(x[src]), _f64(x[dst])
    return np.concatenate([xs + xd, np.abs(xs - xd)] + ([] if edge_attr is None else [_f64(edge_attr)]), axis=1)

def _ref_fused_edge_features_backward(grad_out, x, edge_index, *, plan=None):
    """(grad_x [N, H], grad_edge_attr [E, H] or None) of fused_edge_features for grad_out [E, 3H] (with
    edge_attr) or [E, 2H]: x[src] and x[dst] get g_sum +- sign(x[src] - x[dst]) * g_abs (sign 0 at a tie, and
    at NaN as torch.sign)."""
    src, dst = _idx(edge_index)
    x, go = _f64(x), _f64(grad_out)
    h = x.shape[1]
    g_sum, g_abs = go[:, :h], go[:, h:2 * h]
    d = x[src] - x[dst]
    s = (d > 0).astype(np.float64) - (d < 0)
    gx = np.zeros(x.shape)
    np.add.at(gx, src, g_sum + s * g_abs)
    np.add.at(gx, dst, g_sum - s * g_abs)
    return gx, (go[:, 2 * h:].copy() if h and go.shape[1] == 3 * h else None)

def _ref_fused_edge_features_plan(edge_index, num_nodes):
    """int [N + 1 + 4E]: ptr, then node and item (2e + side) per entry, the incidences sorted stably by node."""
    key = _idx(edge_index).T.reshape(-1)  # item 2e + side
    order = np.argsort(key, kind="stable")
    ptr = np.searchsorted(key[order], np.arange(num_nodes + 1), side="left")
    return np.concatenate([ptr, key[order], order])


def philox4x32(counter, key):
    """Philox4x32-10 of 64-bit counters (the high two words 0) under a 64-bit key: [len, 4] uint32."""
    m0, m1, w0, w1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, np.uint64(0xFFFFFFFF)
    c = np.asarray(counter, dtype=np.uint64)
    c0, c1 = c & mask, c >> np.uint64(32)
    c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64((key >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = np.uint64(m0) * c0, np.uint64(m1) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + np.uint64(w0)) & mask, (k1 + np.uint64(w1)) & mask
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_keep(seed, shape, p):
    """fused_norm_residual's dropout mask: element i (row-major) is kept iff word i % 4 of
    philox4x32(i // 4, seed) >= p * 2^32 (any int seed: its low 64 bits are the key)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    draw = philox4x32(i >> np.uint64(2), seed & 0xFFFFFFFFFFFFFFFF)[np.arange(n), (i & np.uint64(3)).astype(np.int64)]
    return (draw >= min(int(np.ldexp(p, 32)), 0xFFFFFFFF)).reshape(shape)


def _dropped(op, a, p, training, seed):
    """a with fused_norm_residual's dropout applied (seed: an int or a one-element integer array)."""
    if not (training and p > 0):
        return a
    if seed is None:
        raise ValueError(f"reference: {op} with dropout needs the seed= of the call")
    seed = int(np.asarray(seed).reshape(-1)[0])
    return np.where(dropout_keep(seed, a.shape, p), a / (1.0 - p) if p < 1 else 0.0, 0.0)


def _norm_rows(x, eps):
    """(xhat, rstd) of each row of x (float64, biased variance)."""
    x = _f64(x)
    mean = x.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(axis=1, keepdims=True) + eps)
    return (x - mean) * rstd, rstd


def _graph_mean(v, batch, num_graphs, h):
    """Per row, the mean over its graph's rows and h channels of the row sums v [R] (batch [R]);
    an empty graph's mean is 0 and taken by no row."""
    n = np.maximum(np.bincount(batch, minlength=num_graphs), 1) * max(h, 1)
    return (np.bincount(batch, weights=v, minlength=num_graphs) / n)[batch, None]


def _norm_graphs(x, eps, batch, num_graphs):
    """(xhat, rstd) with mean and biased variance over all rows and channels of each graph (PyG's
    LayerNorm(mode="graph"): eps on the variance); rstd per row [R, 1]."""
    x, b = _f64(x), _idx(batch)
    d = x - _graph_mean(x.sum(axis=1), b, num_graphs, x.shape[1])
    rstd = 1 / np.sqrt(_graph_mean((d * d).sum(axis=1), b, num_graphs, x.shape[1]) + eps)
    return d * rstd, rstd


def _ref_fused_norm_residual(x, residual, gamma, beta, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None,
                             num_graphs=None):
    """LayerNorm of each row of x (biased variance), or with batch of each graph's rows and channels
    together, * gamma + beta, dropout when training (the dropout_keep mask, kept values scaled by
    1 / (1 - p)), + residual."""
    xhat = _norm_rows(x, eps)[0] if batch is None else _norm_graphs(x, eps, batch, num_graphs)[0]
    y = xhat * _f64(gamma) + _f64(beta)
    return _dropped("fused_norm_residual", y, p, training, seed) + _f64(residual)


def _ref_fused_norm_residual_backward(grad_out, x, gamma, *, p=0.0, training=False, eps=1e-5, seed=None, batch=None,
                                      num_graphs=None):
    """(grad_x, grad_gamma, grad_beta) of fused_norm_residual's output against grad_out: with g =
    grad_out through the forward's dropout, grad_beta = sum_r g, grad_gamma = sum_r g * xhat,
    grad_x = rstd * (g*gamma - mean(g*gamma) - xhat * mean(g*gamma*xhat)), the means over the row,
    or with batch over the row's graph (all its rows and channels)."""
    g = _dropped("fused_norm_residual_backward", _f64(grad_out), p, training, seed)
    gg = g * _f64(gamma)
    if batch is None:
        xhat, rstd = _norm_rows(x, eps)
        grad_x = rstd * (gg - gg.mean(axis=1, keepdims=True) - xhat * (gg * xhat).mean(axis=1, keepdims=True))
    else:
        xhat, rstd = _norm_graphs(x, eps, batch, num_graphs)
        b, h = _idx(batch), gg.shape[1]
        grad_x = rstd * (gg - _graph_mean(gg.sum(axis=1), b, num_graphs, h)
                         - xhat * _graph_mean((gg * xhat).sum(axis=1), b, num_graphs, h))
    return grad_x, (g * xhat).sum(axis=0), g.sum(axis=0)


def _ref_message_passing(x, e, edge_index, row_ptr, col_idx, dir_edge, w1, b1, w_msg, b_msg, w_att, b_att, w_v, w_o,
                         gamma_x, beta_x, gamma_e, beta_e, *, eps=1e-5):
    """(x_out [N, H], e_out [E, H]): one gated message-passing layer as the composition of the graph ops
    with K = w_att.shape[1] heads of H/K channels each (examples/eval_gnn.py's layer)."""
    x, e = _f64(x), _f64(e)
    n, h = x.shape
    k = np.shape(w_att)[1]
    hid = np.maximum(_ref_fused_edge_features(x, edge_index, e) @ _f64(w1) + _f64(b1), 0)
    msg = hid @ _f64(w_msg) + _f64(b_msg)
    att = 1 / (1 + np.exp(-(hid @ _f64(w_att) + _f64(b_att))))
    v = (x @ _f64(w_v)).reshape(n, k, h // k)
    agg = _ref_sparse_aggregate(row_ptr, col_idx, att[_idx(dir_edge)], v)
    return (_ref_fused_norm_residual(agg.reshape(n, h) @ _f64(w_o), x, gamma_x, beta_x, eps=eps),
            _ref_fused_norm_residual(msg, e, gamma_e, beta_e, eps=eps))


def _bce_weight(target, pos_weight):
    """1 + (pos_weight - 1) * target per edge (pos_weight a float or an array broadcasting to [E])."""
    return 1.0 if pos_weight is None else 1 + (_f64(pos_weight) - 1) * _f64(target)


def _ref_graph_norm_bce(logits, target, edge_graph, num_graphs, *, pos_weight=None):
    """The mean over graphs 0 .. num_graphs - 1 of each graph's mean BCE-with-logits over its edges
    (weighted 1 + (pos_weight - 1) * target, pos_weight a float or [E], [1], [] array); a graph
    without edges counts as 0.  A 0-d array."""
    lg, t = _f64(logits), _f64(target)
    loss = (np.maximum(lg, 0) - lg * t + np.log1p(np.exp(-np.abs(lg)))) * _bce_weight(t, pos_weight)
    g = _idx(edge_graph)
    sums = np.bincount(g, weights=np.broadcast_to(loss, g.shape), minlength=num_graphs)
    return np.array(np.mean(sums / np.maximum(np.bincount(g, minlength=num_graphs), 1)))


def _ref_graph_norm_bce_backward(grad, logits, target, edge_graph, num_graphs, *, pos_weight=None):
    """d graph_norm_bce / d logits times grad (one element): grad * w_e * (sigmoid(l_e) - t_e) /
    (max(count_g, 1) * num_graphs), g = edge_graph[e]; [E]."""
    lg, t, g = _f64(logits), _f64(target), _idx(edge_graph)
    e = np.exp(-np.abs(lg))
    sig = np.where(lg >= 0, 1, e) / (1 + e)
    count = np.maximum(np.bincount(g, minlength=num_graphs), 1)
    grad = float(_f64(grad).reshape(-1)[0])
    return grad * _bce_weight(t, pos_weight) * (sig - t) / (count[g] * num_graphs)


# ---- references: dense LLM ops --------------------------------------------------------------

def _ref_rotary_emb(x, freqs_cis, *, interleaved=True):
    """x [..., H, D] with each pair rotated by freqs_cis [..., D/2, 2] = (cos, sin) of the same leading
    dims: pairs (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + D/2])."""
    x, f = _f64(x), _f64(freqs_cis)
    c, s = f[..., None, :, 0], f[..., None, :, 1]  # [..., 1, D/2]: one angle per pair, every head
    half = x.shape[-1] // 2
    xe, xo = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    out = np.empty_like(x)
    ye, yo = xe * c - xo * s, xe * s + xo * c
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ye, yo
    else:
        out[..., :half], out[..., half:] = ye, yo
    return out


def _ref_linear(x, weight, bias=None):
    """x @ weight.T (+ bias): x [K] or [M, K], weight [N, K]."""
    out = _f64(x) @ _f64(weight).T
    return out if bias is None else out + _f64(bias)


def _ref_swiglu(x, up_weight, gate_weight):
    """(x @ up.T) * silu(x @ gate.T), silu(g) = g / (1 + e^-g)."""
    g = _ref_linear(x, gate_weight)
    with np.errstate(over="ignore"):  # e^-g overflows for g < -709: silu is -0 there
        return _ref_linear(x, up_weight) * g / (1 + np.exp(-g))


def _rms_rows(s, weight, eps):
    return s / np.sqrt((s * s).mean(axis=-1, keepdims=True) + eps) * _f64(weight)


def _ref_rmsnorm(x, weight, *, eps=1e-6):
    """x [*, H] / sqrt(mean(x^2 over H) + eps) * weight [H]."""
    return _rms_rows(_f64(x), weight, eps)


def _ref_fused_add_rmsnorm(x, residual, weight, *, eps=1e-6):
    """rmsnorm of s = x + residual, the exact (unrounded) sum; the op also writes s, rounded to residual's
    dtype, into residual (``written``)."""
    return _rms_rows(_f64(x) + _f64(residual), weight, eps)


def _written_fused_add_rmsnorm(x, residual, weight, *, eps=1e-6):
    return (_f64(x) + _f64(residual),)


def _ref_rotary_kv_append(q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True):
    """q [T, Hq, D] rotated as rotary_emb rotates it with freqs_cis = cos_sin[positions] ([max_pos, D/2, 2]
    gathered per token); the op also writes k rotated and v into the pools' rows slots ([S, Hkv, D],
    ``written``)."""
    return _ref_rotary_emb(q, _f64(cos_sin)[_idx(positions)], interleaved=interleaved)


def _written_rotary_kv_append(q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True):
    kp, vp, s = _f64(k_pool).copy(), _f64(v_pool).copy(), _idx(slots)
    kp[s] = _ref_rotary_emb(k, _f64(cos_sin)[_idx(positions)], interleaved=interleaved)
    vp[s] = _f64(v)
    return kp, vp


# ---- references: gradients of the dense LLM ops (float64, analytic) ------------------------

def _ref_rotary_emb_backward(grad_out, freqs_cis, *, interleaved=True):
    """rotary_emb's gradient with respect to x: each pair of grad_out [..., H, D] times the transposed
    rotation, (ge, go) -> (ge c + go s, go c - ge s)."""
    g, f = _f64(grad_out), _f64(freqs_cis)
    c, s = f[..., None, :, 0], f[..., None, :, 1]
    half = g.shape[-1] // 2
    ge, go = (g[..., 0::2], g[..., 1::2]) if interleaved else (g[..., :half], g[..., half:])
    out = np.empty_like(g)
    ye, yo = ge * c + go * s, go * c - ge * s
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ye, yo
    else:
        out[..., :half], out[..., half:] = ye, yo
    return out


def _rows(a, n):
    """a [*, n] as float64 rows [M, n]."""
    return _f64(a).reshape(int(np.prod(np.shape(a)[:-1])), n)


def _ref_linear_backward(grad_out, x, weight, *, x_grad=True, weight_grad=True, bias_grad=False):
    """(grad_out @ weight [*, K], grad_out^T @ x over all leading positions [N, K], grad_out summed over
    the rows [N]), each None unless asked for: grad_out [*, N], x [*, K], weight [N, K]."""
    w = _f64(weight)
    n, k = w.shape
    g, xr = _rows(grad_out, n), _rows(x, k)
    return ((g @ w).reshape(np.shape(x)) if x_grad else None, g.T @ xr if weight_grad else None,
            g.sum(0) if bias_grad else None)


def _ref_swiglu_backward(grad_out, x, up_weight, gate_weight, *, x_grad=True, weight_grad=True):
    """With a = x up^T, b = x gate^T, s = sigmoid(b): ga = grad_out * b * s, gb = grad_out * a * s * (1 + b (1 - s))
    -> (ga @ up + gb @ gate [*, K], ga^T x [N, K], gb^T x [N, K]), None where not asked for."""
    up, gate = _f64(up_weight), _f64(gate_weight)
    n, k = up.shape
    g, xr = _rows(grad_out, n), _rows(x, k)
    a, b = xr @ up.T, xr @ gate.T
    with np.errstate(over="ignore"):  # e^-b overflows for b < -709: s is 0 there
        s = 1 / (1 + np.exp(-b))
    ga, gb = g * b * s, g * a * s * (1 + b * (1 - s))
    return ((ga @ up + gb @ gate).reshape(np.shape(x)) if x_grad else None, ga.T @ xr if weight_grad else None,
            gb.T @ xr if weight_grad else None)


# ---- references: attention ------------------------------------------------------------------

def _softmax_attend(q, k, v, keep, scale, bias=0.0):
    """q [B, H, Lq, D], k/v [B, H, Lkv, D], keep and bias (added to the scaled scores) broadcastable to
    [B, H, Lq, Lkv] -> [B, H, Lq, D]; a query that keeps no key gives 0."""
    s = np.where(keep, (q @ k.transpose(0, 1, 3, 2)) * scale + np.where(keep, bias, 0.0), -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    return (p @ v) / np.where(den > 0, den, 1.0)


def _heads_first(q, k, v):
    """[B, L, H, D] -> [B, H, L, D] in float64, kv heads repeated: query head h uses kv head h // (Hq / Hkv)."""
    group = q.shape[2] // max(k.shape[2], 1)
    return (_f64(q).transpose(0, 2, 1, 3), np.repeat(_f64(k), group, axis=2).transpose(0, 2, 1, 3),
            np.repeat(_f64(v), group, axis=2).transpose(0, 2, 1, 3))


def _mask_parts(mask):
    """A bool mask (True = keep) or an additive float one (-inf = drop) -> (keep bool, bias float64)."""
    m = np.asarray(mask)
    if m.dtype == bool:
        return m, np.zeros(m.shape)
    bias = np.asarray(m, np.float64)
    return bias != -np.inf, bias


def prefill_keep(B, Hq, Lq, Lkv, is_causal=False, mask=None):
    """attn_prefill's kept keys, bool [B, Hq, Lq, Lkv]: query i sits at key position i + Lkv - Lq and
    causal keeps keys j <= that (bottom-right); mask [B, Lkv], or [1|Hq, Lq|1, Lkv] or
    [B|1, 1|Hq, Lq|1, Lkv] broadcast as scaled_dot_product_attention does, True = keep (a float
    mask: its entries other than -inf)."""
    keep = np.ones((1, 1, Lq, Lkv), bool)
    if is_causal:
        keep = keep & (np.arange(Lkv)[None, :] <= np.arange(Lq)[:, None] + (Lkv - Lq))
    if mask is not None:
        m = _mask_parts(mask)[0]
        keep = keep & (m[:, None, None, :] if m.ndim == 2 else m)  # 3-D: NumPy aligns it to [Hq, Lq, Lkv]
    return np.broadcast_to(keep, (B, Hq, Lq, Lkv))


def _ref_attn_prefill(q, k, v, *, mask=None, is_causal=False, scale=None):
    """softmax(q k^T * scale + mask) v over the prefill_keep keys: q [B, Lq, Hq, D], k/v [B, Lkv, Hkv, D]
    -> [B, Lq, Hq, D]; scale defaults to 1/sqrt(D); a float mask is added (as SDPA's attn_mask)."""
    B, Lq, Hq, D = np.shape(q)
    scale = D ** -0.5 if scale is None else scale
    keep = prefill_keep(B, Hq, Lq, np.shape(k)[1], is_causal, mask)
    bias = 0.0 if mask is None else _mask_parts(mask)[1]
    bias = bias[:, None, None, :] if np.ndim(bias) == 2 else bias
    return _softmax_attend(*_heads_first(q, k, v), keep, scale, bias).transpose(0, 2, 1, 3)


def _ref_attn_decode(q, k, v, *, kv_lens=None, mask=None, scale=None):
    """One query per sequence: q [B, 1, Hq, D], k/v [B, L, Hkv, D] -> [B, 1, Hq, D]; the kept keys are
    j < kv_lens[b] (negative: none) and mask[b, j] (mask [B|1, L], [B|1, 1, L] or [B|1, 1, 1, L],
    broadcast over B; bool, or float added to the scores)."""
    B, L = np.shape(k)[:2]
    keep, bias = np.ones((B, L), bool), np.zeros((B, L))
    if kv_lens is not None:
        keep &= np.arange(L)[None, :] < _idx(kv_lens)[:, None]
    if mask is not None:
        m, b = _mask_parts(mask)
        keep &= m.reshape(m.shape[0], L)  # [B|1, L] after the size-1 middle dimensions
        bias = bias + b.reshape(b.shape[0], L)
    return _ref_attn_prefill(q, k, v, mask=np.where(keep, bias, -np.inf), scale=scale)


def _gather(cache, req_to_token, req_pool_indices, b, n):
    """The n tokens of sequence b from a [S, Hkv, D] pool, as float64 [n, Hkv, D]."""
    return _f64(np.asarray(cache)[req_to_token[req_pool_indices[b], :n]])


def _request_mask(mask, b, n, q_len=None):
    """A paged op's mask for request b over its n positions, for the dense reference: [1, n] from a
    key mask [B, W] ([B|1, 1, W], [B|1, 1, 1, W] with q_len None: decode), or [1, 1|Hq, q_len|1, n] from
    a per-query [B|1, 1|Hq, Mq, W] / [1|Hq, Mq, W]; positions from W on are dropped."""
    m = np.asarray(mask)
    if q_len is None or m.ndim == 2:
        m = m.reshape(m.shape[0], -1)
        m = m[b if m.shape[0] > 1 else 0][None]
    else:
        m = m[b if m.shape[0] > 1 else 0] if m.ndim == 4 else m
        m = m[None, :, :q_len] if m.shape[1] > 1 else m[None]
    pad = np.full(m.shape[:-1] + (max(n - m.shape[-1], 0),), False if m.dtype == bool else -np.inf, m.dtype)
    return np.concatenate([m[..., :n], pad], axis=-1)


def appended(cache, new, req_to_token, req_pool_indices, kv_indptr):
    """The pool attn_paged_decode(new_k=new) leaves behind: a float64 copy of cache [S, Hkv, D] with
    new[b] at slot req_to_token[req_pool_indices[b], len_b - 1] for every sequence b with len_b > 0."""
    out = _f64(cache).copy()
    r2t, rpi, lens = _idx(req_to_token), _idx(req_pool_indices), np.diff(_idx(kv_indptr))
    for b in np.flatnonzero(lens > 0):
        out[r2t[rpi[b], lens[b] - 1]] = _f64(new[b])
    return out


def _ref_attn_paged_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None,
                           new_v=None, mask=None, scale=None):
    """attn_decode per sequence b over its len_b = kv_indptr[b + 1] - kv_indptr[b] tokens at slots
    req_to_token[req_pool_indices[b], :len_b] of the pools [S, Hkv, D], with new_k[b] / new_v[b] as its
    last token (the op writes them there: see appended) and mask [B, W <= max_ctx] (or [B, 1, W],
    [B, 1, 1, W]; bool or float, as attn_decode's): q [B, Hq, D] -> [B, Hq, D]."""
    r2t, rpi, lens = _idx(req_to_token), _idx(req_pool_indices), np.diff(_idx(kv_indptr))
    out = np.zeros(np.shape(q))
    for b, n in enumerate(lens):
        if n <= 0:
            continue
        k, v = _gather(k_cache, r2t, rpi, b, n), _gather(v_cache, r2t, rpi, b, n)
        if new_k is not None:
            k[-1], v[-1] = _f64(new_k[b]), _f64(new_v[b])
        m = None if mask is None else _request_mask(mask, b, n)
        out[b] = _ref_attn_decode(np.asarray(q)[b:b + 1, None], k[None], v[None], mask=m, scale=scale)[0, 0]
    return out


def _ref_attn_paged_prefill(q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr, *,
                            mask=None, is_causal=False, scale=None):
    """attn_prefill per request b: query rows qo_indptr[b] .. qo_indptr[b + 1] - 1 of q [total_q, Hq, D]
    against the request's kv_indptr[b + 1] - kv_indptr[b] tokens in the pools (as attn_paged_decode),
    mask [B, W] or per query [B|1, 1|Hq, Mq, W] / [1|Hq, Mq, W] (row i: query i of the request), W <=
    max_ctx, bool or float; rows of no request are 0."""
    r2t, rpi, kv, qo = _idx(req_to_token), _idx(req_pool_indices), _idx(kv_indptr), _idx(qo_indptr)
    out = np.zeros(np.shape(q))
    for b in range(len(rpi)):
        n = kv[b + 1] - kv[b]
        m = None if mask is None else _request_mask(mask, b, n, qo[b + 1] - qo[b])
        out[qo[b]:qo[b + 1]] = _ref_attn_prefill(np.asarray(q)[None, qo[b]:qo[b + 1]],
                                                 _gather(k_cache, r2t, rpi, b, n)[None],
                                                 _gather(v_cache, r2t, rpi, b, n)[None],
                                                 mask=m, is_causal=is_causal, scale=scale)[0]
    return out


def reference(op, *args, **kwargs):
    """float64 NumPy of what qkernels.<op>(*args, **kwargs) returns (see the module docstring)."""
    fn = globals().get(f"_ref_{op}")
    if op not in FLOAT_ARGS or fn is None:
        raise ValueError(f"reference: unknown op {op!r}; ops: {', '.join(OPS)}")
    for ignored in ("out", "stream", "backend"):
        kwargs.pop(ignored, None)
    return fn(*args, **kwargs)


def written(op, *args, **kwargs):
    """float64 NumPy of the values qkernels.<op>(*args, **kwargs) leaves in the arguments it updates in
    place (``MUTATED[op]``, in that order), computed from the arguments before the call."""
    if op not in MUTATED:
        raise ValueError(f"written: {op!r} updates no argument in place; ops that do: {', '.join(MUTATED)}")
    for ignored in ("out", "stream", "backend"):
        kwargs.pop(ignored, None)
    return globals()[f"_written_{op}"](*args, **kwargs)


# ---- samples --------------------------------------------------------------------------------

def _randn(rng, dtype, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _sample_sparse_aggregate(rng, dt, ix, n_dst=7, n_src=5, heads=2, dim=3, degrees=None, avg_degree=4):
    """A CSR graph: row i has degrees[i] edges (Poisson(avg_degree) unless given) to random sources."""
    degrees = rng.poisson(avg_degree, n_dst) if degrees is None else np.asarray(degrees, np.int64)
    row_ptr = np.concatenate([[0], np.cumsum(degrees)]).astype(ix)
    e = int(row_ptr[-1])
    col_idx = rng.integers(0, max(n_src, 1), e).astype(ix)
    return (row_ptr, col_idx, _randn(rng, dt, e, heads), _randn(rng, dt, n_src, heads, dim)), {}

def _sample_sparse_aggregate_backward(rng, dt, ix, n_dst=7, n_src=5, heads=2, dim=3, degrees=None, avg_degree=4,
                                      edge_weight_grad=None, node_feat_grad=None, deterministic=None):
    """grad_out [N_dst, H, D] and sparse_aggregate's sample; the flags are passed when not None."""
    (row_ptr, col_idx, ew, nf), _ = _sample_sparse_aggregate(rng, dt, ix, n_dst, n_src, heads, dim, degrees, avg_degree)
    kwargs = {k: v for k, v in (("edge_weight_grad", edge_weight_grad), ("node_feat_grad", node_feat_grad),
                                ("deterministic", deterministic)) if v is not None}
    return (_randn(rng, dt, n_dst, heads, dim), row_ptr, col_idx, ew, nf), kwargs


def _sample_sparse_aggregate_plan(rng, dt, ix, n_dst=7, n_src=5, degrees=None, avg_degree=4):
    """sparse_aggregate's graph and its N_src."""
    (row_ptr, col_idx, _, _), _ = _sample_sparse_aggregate(rng, dt, ix, n_dst, n_src, 1, 1, degrees, avg_degree)
    return (row_ptr, col_idx, n_src), {}


def _sample_fused_edge_features(rng, dt, ix, n=6, e=11, h=4, edge_attr=True):
    x, ei = _randn(rng, dt, n, h), rng.integers(0, n, (2, e)).astype(ix)
    return (x, ei) + ((_randn(rng, dt, e, h),) if edge_attr else ()), {}

def _sample_fused_edge_features_backward(rng, dt, ix, n=6, e=11, h=4, edge_attr=True):
    """grad_out [E, 3H] (edge_attr) or [E, 2H], x [N, H], edge_index [2, E]."""
    (x, ei), _ = _sample_fused_edge_features(rng, dt, ix, n, e, h, edge_attr=False)
    return (_randn(rng, dt, e, (3 if edge_attr else 2) * h), x, ei), {}

def _sample_fused_edge_features_plan(rng, dt, ix, n=6, e=11):
    """edge_index [2, E] and N."""
    return (rng.integers(0, n, (2, e)).astype(ix), n), {}


def both_ways_csr(edge_index, num_nodes, ix=np.int64):
    """(row_ptr [N + 1], col_idx [2E], dir_edge [2E]): each edge of edge_index listed under both of its
    ends (in edge order within a node, a self-loop twice), pointing at the other end."""
    src, dst = _idx(edge_index)
    ends, others = np.concatenate([src, dst]), np.concatenate([dst, src])
    order = np.argsort(ends, kind="stable")
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(ends, minlength=num_nodes))])
    dir_edge = np.concatenate([np.arange(len(src)), np.arange(len(src))])[order]
    return row_ptr.astype(ix), others[order].astype(ix), dir_edge.astype(ix)


def _sample_message_passing(rng, dt, ix, n=7, e=11, h=8, f=6, heads=2, edge_index_dtype=None):
    """x [N, H], e [E, H], random edges (edge_index_dtype, else the index dtype) with both_ways_csr's
    CSR, the weights scaled by their fan-in^-1/2, gammas near 1 and betas near 0."""
    ei = rng.integers(0, max(n, 1), (2, e)).astype(edge_index_dtype or ix)
    csr = both_ways_csr(ei, n, ix)

    def weight(rows, cols):
        return _randn(rng, dt, rows, cols, scale=max(rows, 1) ** -0.5)

    def near(c, size):
        return (c + _randn(rng, np.float64, size, scale=0.1)).astype(dt)

    return (_randn(rng, dt, n, h), _randn(rng, dt, e, h), ei) + csr + (
        weight(3 * h, f), near(0, f), weight(f, h), near(0, h), weight(f, heads), near(0, heads), weight(h, h),
        weight(h, h), near(1, h), near(0, h), near(1, h), near(0, h)), {}


def graph_batch(rng, rows, graphs, ix=np.int64, sort=True):
    """A batch vector [R] of ids in [0, graphs), sorted (a PyG batch) unless sort=False."""
    b = rng.integers(0, graphs, rows).astype(ix)
    if sort:
        b.sort()
    return b


def _sample_fused_norm_residual(rng, dt, ix, rows=5, h=12, mean=0.0, graphs=None, sort=True):
    """x with row mean ~mean; gamma near 1, beta near 0; graphs=G: graph mode (batch=, num_graphs=G,
    a graph_batch sorted unless sort=False)."""
    kwargs = {} if graphs is None else {"batch": graph_batch(rng, rows, graphs, ix, sort), "num_graphs": graphs}
    return ((mean + rng.standard_normal((rows, h))).astype(dt), _randn(rng, dt, rows, h),
            (1 + _randn(rng, np.float64, h, scale=0.1)).astype(dt), _randn(rng, dt, h, scale=0.1)), kwargs


def _sample_graph_norm_bce(rng, dt, ix, e=17, graphs=3, sort=True):
    """logits ~3 N(0, 1), targets 0/1 (30% ones), edge_graph sorted unless sort=False."""
    eg = rng.integers(0, graphs, e).astype(ix)
    if sort:
        eg.sort()
    return (_randn(rng, dt, e, scale=3.0), (rng.random(e) < 0.3).astype(dt), eg, graphs), {}


def _sample_fused_norm_residual_backward(rng, dt, ix, rows=5, h=12, mean=0.0, p=0.0, graphs=None, sort=True):
    """grad_out ~N(0, 1) and the forward sample's x and gamma (and batch, num_graphs with graphs=);
    p > 0: training with dropout p (seed=)."""
    (x, _, gamma, _), kwargs = _sample_fused_norm_residual(rng, dt, ix, rows, h, mean, graphs, sort)
    if p > 0:
        kwargs.update(p=p, training=True, seed=int(rng.integers(0, 2**63)))
    return (_randn(rng, dt, rows, h), x, gamma), kwargs


def _sample_graph_norm_bce_backward(rng, dt, ix, e=17, graphs=3, sort=True):
    """grad: float32 [1] (the loss's gradient), then the forward sample's arguments."""
    return (_randn(rng, np.float32, 1),) + _sample_graph_norm_bce(rng, dt, ix, e, graphs, sort)[0], {}


def freqs_cis(rng, lead, d):
    """(cos, sin) of random angles in [0, 10): float32 [*lead, D/2, 2], rotary_emb's table."""
    angle = 10 * rng.random(tuple(lead) + (d // 2,))
    return np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)


def _sample_rotary_emb(rng, dt, ix, lead=(5,), h=3, d=8, interleaved=None):
    """x [*lead, H, D]; interleaved=None leaves the keyword out (the op's default)."""
    kwargs = {} if interleaved is None else {"interleaved": interleaved}
    return (_randn(rng, dt, *lead, h, d), freqs_cis(rng, lead, d)), kwargs


def _sample_linear(rng, dt, ix, m=3, k=10, n=7, bias=True):
    """x [M, K] (M=None: [K]), weight [N, K] scaled by K^-1/2, bias [N]."""
    x = _randn(rng, dt, *((k,) if m is None else (m, k)))
    return (x, _randn(rng, dt, n, k, scale=max(k, 1) ** -0.5)) + ((_randn(rng, dt, n),) if bias else ()), {}


def _sample_swiglu(rng, dt, ix, m=3, k=10, n=7):
    x = _randn(rng, dt, *((k,) if m is None else (m, k)))
    return (x, _randn(rng, dt, n, k, scale=max(k, 1) ** -0.5), _randn(rng, dt, n, k, scale=2 * max(k, 1) ** -0.5)), {}


def _sample_rotary_emb_backward(rng, dt, ix, lead=(5,), h=3, d=8, interleaved=None):
    """grad_out [*lead, H, D] and its freqs_cis; interleaved=None leaves the keyword out."""
    return _sample_rotary_emb(rng, dt, ix, lead, h, d, interleaved)


def _sample_rmsnorm(rng, dt, ix, lead=(5,), h=24):
    """x [*lead, H], weight [H] around 1."""
    return (_randn(rng, dt, *lead, h), (1 + 0.5 * rng.standard_normal(h)).astype(dt)), {}


def _sample_fused_add_rmsnorm(rng, dt, ix, lead=(5,), h=24):
    """x, residual [*lead, H] (the residual stream twice x's scale), weight [H] around 1."""
    x, w = _sample_rmsnorm(rng, dt, ix, lead, h)[0]
    return (x, _randn(rng, dt, *lead, h, scale=2.0), w), {}


def _sample_rotary_kv_append(rng, dt, ix, t=5, hq=4, hkv=2, d=8, pool=9, max_pos=11, interleaved=None):
    """q [T, Hq, D], k and v [T, Hkv, D], cos_sin [max_pos, D/2, 2], positions [T] in [0, max_pos), pools
    [pool, Hkv, D] of random values (rows not appended to keep them), T distinct slots."""
    kwargs = {} if interleaved is None else {"interleaved": interleaved}
    args = (_randn(rng, dt, t, hq, d), _randn(rng, dt, t, hkv, d), _randn(rng, dt, t, hkv, d),
            freqs_cis(rng, (max_pos,), d), rng.integers(0, max_pos, t).astype(ix), _randn(rng, dt, pool, hkv, d),
            _randn(rng, dt, pool, hkv, d), rng.permutation(pool)[:t].astype(ix))
    return args, kwargs


def _lead_shape(lead, m):
    return tuple(lead) + (() if m is None else (m,))


def _sample_linear_backward(rng, dt, ix, m=3, k=10, n=7, lead=(), bias_grad=True, x_grad=None, weight_grad=None):
    """grad_out [*lead, M, N], x [*lead, M, K] (m=None: no M dimension), weight [N, K] scaled by K^-1/2;
    the flags are passed when not None (bias_grad=True by default: every gradient)."""
    rows = _lead_shape(lead, m)
    args = (_randn(rng, dt, *rows, n), _randn(rng, dt, *rows, k), _randn(rng, dt, n, k, scale=max(k, 1) ** -0.5))
    flags = {"x_grad": x_grad, "weight_grad": weight_grad, "bias_grad": bias_grad}
    return args, {key: v for key, v in flags.items() if v is not None}


def _sample_swiglu_backward(rng, dt, ix, m=3, k=10, n=7, lead=(), x_grad=None, weight_grad=None):
    """grad_out [*lead, M, N], x [*lead, M, K], up and gate [N, K] as swiglu's sample."""
    rows = _lead_shape(lead, m)
    args = (_randn(rng, dt, *rows, n), _randn(rng, dt, *rows, k), _randn(rng, dt, n, k, scale=max(k, 1) ** -0.5),
            _randn(rng, dt, n, k, scale=2 * max(k, 1) ** -0.5))
    flags = {"x_grad": x_grad, "weight_grad": weight_grad}
    return args, {key: v for key, v in flags.items() if v is not None}


def _sample_attn_decode(rng, dt, ix, b=2, l=9, hkv=2, ratio=2, d=8):
    """q [B, 1, Hkv * ratio, D], k/v [B, L, Hkv, D]."""
    return (_randn(rng, dt, b, 1, hkv * ratio, d), _randn(rng, dt, b, l, hkv, d), _randn(rng, dt, b, l, hkv, d)), {}


def _sample_attn_prefill(rng, dt, ix, b=2, lq=3, lkv=9, hkv=2, ratio=2, d=8, is_causal=False):
    """q [B, Lq, Hkv * ratio, D], k/v [B, Lkv, Hkv, D]; is_causal=True passes it."""
    return ((_randn(rng, dt, b, lq, hkv * ratio, d), _randn(rng, dt, b, lkv, hkv, d), _randn(rng, dt, b, lkv, hkv, d)),
            {"is_causal": True} if is_causal else {})


def token_pool(rng, lens, hkv, d, dtype=np.float32, index_dtype=np.int64, requests=None, extra_slots=5):
    """A KV pool holding sequence b's lens[b] tokens at randomly permuted slots; sequence b is row
    req_pool_indices[b] of req_to_token [R, max(lens) + 3] (R = requests, default B + 2; a random
    choice of rows, never the identity for B > 1; unused entries -1, out of range, never read).
    -> (k_cache [S, Hkv, D], v_cache, req_to_token, req_pool_indices, kv_indptr)."""
    lens = np.asarray(lens, np.int64)
    b = len(lens)
    r = requests or b + 2
    slots = rng.permutation(int(lens.sum()) + extra_slots)
    rows = rng.permutation(r)[:b]
    if b > 1 and np.array_equal(rows, np.arange(b)):
        rows = np.roll(rows, 1)
    r2t = np.full((r, int(lens.max(initial=0)) + 3), -1, np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(lens)])
    for i in range(b):
        r2t[rows[i], :lens[i]] = slots[kv_indptr[i]:kv_indptr[i + 1]]
    pool = (len(slots), hkv, d)
    return (_randn(rng, dtype, *pool), _randn(rng, dtype, *pool), r2t.astype(index_dtype), rows.astype(index_dtype),
            kv_indptr.astype(index_dtype))


def _sample_attn_paged_decode(rng, dt, ix, lens=(5, 3), hkv=2, ratio=2, d=8, requests=None, extra_slots=5):
    """q [B, Hkv * ratio, D] and a token_pool for lens."""
    q = _randn(rng, dt, len(lens), hkv * ratio, d)
    return (q,) + token_pool(rng, lens, hkv, d, dt, ix, requests, extra_slots), {}


def _sample_attn_paged_prefill(rng, dt, ix, q_lens=(2, 3), kv_lens=(5, 3), hkv=2, ratio=2, d=8, lead=0, tail=0,
                               is_causal=False):
    """A token_pool for kv_lens and q [total_q, Hkv * ratio, D] whose rows lead .. total_q - tail - 1
    are the requests' queries, q_lens[b] of them for request b (q_lens[b] <= kv_lens[b])."""
    k_cache, v_cache, r2t, rpi, kv_indptr = token_pool(rng, kv_lens, hkv, d, dt, ix)
    qo_indptr = (lead + np.concatenate([[0], np.cumsum(q_lens)])).astype(ix)
    q = _randn(rng, dt, int(qo_indptr[-1]) + tail, hkv * ratio, d)
    return (q, k_cache, v_cache, r2t, rpi, kv_indptr, qo_indptr), {"is_causal": True} if is_causal else {}


def sample(op, rng=None, *, dtype=np.float32, index_dtype=np.int64, **options):
    """A valid call of op on random NumPy arrays: -> (args tuple, kwargs dict).  dtype is the float
    tensors' (not freqs_cis's, which is float32 always), index_dtype the index tensors'; the options
    are the keyword arguments of _sample_<op> (sizes, and a few keywords of the op)."""
    make = globals().get(f"_sample_{op}")
    if op not in FLOAT_ARGS or make is None:
        raise ValueError(f"sample: unknown op {op!r}; ops: {', '.join(OPS)}")
    return make(np.random.default_rng(0) if rng is None else rng, dtype, index_dtype, **options)


# The call of each op for the self-check and timing table of `python -m qkernels`: sample() options
# at sizes where the kernels do real work (several blocks, GQA 4, head_dim 128, ragged token pools).
WORK_SIZES = {
    "sparse_aggregate": dict(n_dst=2000, n_src=2000, heads=4, dim=32, avg_degree=8),
    "sparse_aggregate_backward": dict(n_dst=2000, n_src=2000, heads=4, dim=32, avg_degree=8),
    "fused_edge_features": dict(n=2000, e=16000, h=32),
    "fused_edge_features_backward": dict(n=2000, e=16000, h=32),
    "sparse_aggregate_plan": dict(n_dst=2000, n_src=2000, avg_degree=8),
    "fused_edge_features_plan": dict(n=2000, e=16000),
    "fused_norm_residual": dict(rows=2000, h=128),
    "fused_norm_residual_backward": dict(rows=2000, h=128, p=0.1),
    "graph_norm_bce": dict(e=50000, graphs=32),
    "graph_norm_bce_backward": dict(e=50000, graphs=32),
    "message_passing": dict(n=4000, e=8000, h=32, f=32, heads=4, index_dtype=np.int32),  # the decoder's layer
    "rotary_emb": dict(lead=(64,), h=8, d=128),
    "linear": dict(m=16, k=1024, n=1024),
    "swiglu": dict(m=16, k=1024, n=2048),
    "rotary_emb_backward": dict(lead=(64,), h=8, d=128),
    "linear_backward": dict(m=16, k=1024, n=1024),
    "swiglu_backward": dict(m=16, k=1024, n=2048),
    "rmsnorm": dict(lead=(64,), h=4096),
    "fused_add_rmsnorm": dict(lead=(64,), h=4096),
    "rotary_kv_append": dict(t=64, hq=32, hkv=8, d=128, pool=4096, max_pos=8192, interleaved=False),
    "attn_decode": dict(b=4, l=1024, hkv=8, ratio=4, d=128),
    "attn_paged_decode": dict(lens=[1000, 300, 64, 700], hkv=8, ratio=4, d=128, index_dtype=np.int32),
    # a prefix cache (the queries are the last of their keys, causal bottom-right), one a single query
    "attn_prefill": dict(b=2, lq=256, lkv=384, hkv=8, ratio=4, d=128, is_causal=True),
    "attn_paged_prefill": dict(q_lens=[1, 300, 17, 128], kv_lens=[1000, 300, 64, 700], hkv=8, ratio=4, d=128,
                               index_dtype=np.int32, is_causal=True),
}

# Ops whose CUDA kernels take 16-bit floats: the dtype of each argument on the device (None: as
# sampled; CuPy has no bfloat16, so it gets float16).
DEVICE_DTYPES = {
    "fused_norm_residual_backward": ("bfloat16",) * 3,
    "graph_norm_bce_backward": (None, "bfloat16", "bfloat16", None, None),
    "sparse_aggregate_backward": ("bfloat16", None, None, "bfloat16", "bfloat16"),
    "fused_edge_features_backward": ("bfloat16", "bfloat16", None),
    "rotary_emb": ("bfloat16", None),
    "linear": ("bfloat16",) * 3,
    "swiglu": ("bfloat16",) * 3,
    "rotary_emb_backward": ("bfloat16", None),
    "linear_backward": ("bfloat16",) * 3,
    "swiglu_backward": ("bfloat16",) * 4,
    "attn_decode": ("bfloat16",) * 3,
    "attn_paged_decode": ("bfloat16",) * 3 + (None,) * 3,
    "attn_prefill": ("bfloat16",) * 3,
    "attn_paged_prefill": ("bfloat16",) * 3 + (None,) * 4,
    "rmsnorm": ("bfloat16",) * 2,
    "fused_add_rmsnorm": ("bfloat16",) * 3,
    "rotary_kv_append": ("bfloat16",) * 3 + (None, None) + ("bfloat16",) * 2 + (None,),
}


FLOAT_ARGS = {
    "sparse_aggregate": (2, 3), "sparse_aggregate_backward": (0, 3, 4),
    "fused_edge_features": (0, 2), "fused_edge_features_backward": (0, 1), "fused_norm_residual": (0, 1, 2, 3),
    "fused_norm_residual_backward": (0, 1, 2), "graph_norm_bce": (0, 1), "graph_norm_bce_backward": (0, 1, 2),
    "rotary_emb": (0, 1), "linear": (0, 1, 2), "swiglu": (0, 1, 2),
    "rotary_emb_backward": (0, 1), "linear_backward": (0, 1, 2), "swiglu_backward": (0, 1, 2, 3),
    "attn_decode": (0, 1, 2), "attn_prefill": (0, 1, 2), "attn_paged_decode": (0, 1, 2),
    "attn_paged_prefill": (0, 1, 2), "rmsnorm": (0, 1), "fused_add_rmsnorm": (0, 1, 2),
    "rotary_kv_append": (0, 1, 2, 3, 5, 6),
    "sparse_aggregate_plan": (), "fused_edge_features_plan": (),
    "message_passing": (0, 1) + tuple(range(6, 18)),
}

OPS = tuple(FLOAT_ARGS)

# The arguments an op updates in place (positions): a test that calls such an op twice on one sample
# gives each call its own copies, and ``written`` says what the call leaves in them.
# (every call's writes, from the op table's qkernels._dispatch.WRITES; the samples give no new_k).
MUTATED = {op: tuple(i for i, _ in args) for op, (when, args) in _WRITES.items() if when is None}
