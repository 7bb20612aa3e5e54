"""Public ops: dispatch, then the C entry point, with results in the caller's framework."""

from __future__ import annotations

from . import _C
from ._dispatch import _ctx, choose, direct_ops, direct_types
from ._frameworks import run

# Bound once: on the zero-lookup path every attribute lookup is a measurable share of the call.
_ctx_get = _ctx.get
_sparse_aggregate = _C.sparse_aggregate


def sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, out=None, backend=None):
    """Multi-head CSR SpMM (message aggregation of a GNN layer).

    row_ptr ``[N_dst+1]`` and col_idx ``[E]`` (int32 or int64, the same for both), edge_weight
    ``[E, H]``, node_feat ``[N_src, H, D]`` -> ``[N_dst, H, D]`` with
    ``out[i,h,:] = sum over e in [row_ptr[i], row_ptr[i+1]) of edge_weight[e,h] * node_feat[col_idx[e],h,:]``;
    rows without edges are 0.  float32 on cpu and cuda.  Indices are validated on cpu; on cuda
    set QKERNELS_CHECK=1 to validate (otherwise out-of-range rows are clamped and columns skipped,
    never read or written out of bounds).
    """
    if backend is None and type(node_feat) in direct_types and direct_ops.get("sparse_aggregate") \
            and not _ctx_get()[1]:
        # Automatic selection = where the data lives, which _C decides itself; torch in, torch out.
        if out is None:
            return _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat)
        return _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, out=out)
    plan = choose("sparse_aggregate", node_feat, backend)
    if plan[2]:
        if out is None:
            return _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat)
        return _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, out=out)
    return run("sparse_aggregate", _sparse_aggregate, (row_ptr, col_idx, edge_weight, node_feat), out, node_feat,
               plan[1])
