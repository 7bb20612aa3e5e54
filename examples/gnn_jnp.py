"""The QEC decoder's four graph ops written in jax.numpy: the pure-JAX model of train_gnn_jax.py and
the jax.numpy side of benchmarks/jax_ops.py.  Each computes what the qkernels.jax op of the same name
computes, from the same structure plus what jax.numpy needs precomputed from it once: the CSR row of
each nonzero (segment_sum's segment ids) and each graph's edge count.  float32 in, float32 out."""

import jax
import jax.numpy as jnp
import numpy as np


def csr_rows(row_ptr):
    """The row of each nonzero of a CSR matrix with row pointers row_ptr (NumPy int32, sorted)."""
    counts = np.diff(np.asarray(row_ptr))
    return np.repeat(np.arange(len(counts), dtype=np.int32), counts)


def graph_sizes(edge_graph, num_graphs):
    """Edges per graph, at least 1 (a graph without edges adds 0 to the mean), NumPy float32 [num_graphs]."""
    return np.maximum(np.bincount(np.asarray(edge_graph), minlength=num_graphs), 1).astype(np.float32)


def fused_edge_features(x, edge_index, edge_attr=None):
    """[x_src + x_dst, |x_src - x_dst|, edge_attr] per edge."""
    xs, xd = x[edge_index[0]], x[edge_index[1]]
    return jnp.concatenate([xs + xd, jnp.abs(xs - xd)] + ([] if edge_attr is None else [edge_attr]), 1)


def sparse_aggregate(rows, col_idx, edge_weight, node_feat, num_rows):
    """out[r, h] = sum over the nonzeros k of row r of edge_weight[k, h] * node_feat[col_idx[k], h]:
    a gather and a segment sum over the (sorted) rows."""
    msg = edge_weight[:, :, None] * node_feat[col_idx]
    return jax.ops.segment_sum(msg, rows, num_segments=num_rows, indices_are_sorted=True)


def fused_norm_residual(x, residual, gamma, beta, *, p=0.0, key=None, eps=1e-5):
    """LayerNorm of each row (biased variance) * gamma + beta, dropout p with jax.random's mask from
    key when key is given, + residual."""
    d = x - x.mean(1, keepdims=True)
    y = d * jax.lax.rsqrt((d * d).mean(1, keepdims=True) + eps) * gamma + beta
    if key is not None and p > 0:
        y = jnp.where(jax.random.bernoulli(key, 1.0 - p, y.shape), y / (1.0 - p), 0.0)
    return y + residual


def graph_norm_bce(logits, target, edge_graph, sizes, graphs_sorted=False):
    """The mean over graphs of each graph's mean BCE-with-logits over its edges (sizes: graph_sizes)."""
    bce = jnp.maximum(logits, 0) - logits * target + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    sums = jax.ops.segment_sum(bce, edge_graph, num_segments=sizes.shape[0], indices_are_sorted=graphs_sorted)
    return (sums / sizes).mean()
