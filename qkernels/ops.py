"""Public ops.

Each public op is a C entry point (``_C.<op>``) that runs directly when selection is
automatic and lands where the data lives (torch in, torch out), and otherwise calls the Python
path below: the dispatcher's decision, then the C op (``_C.<op>_raw``), with results in the caller's framework.
"""

from __future__ import annotations

from . import _C
from ._dispatch import _ctx, choose, direct_ops, direct_types
from ._frameworks import run


def _sparse_aggregate(row_ptr, col_idx, edge_weight, node_feat, *, out=None, backend=None):
    plan = choose("sparse_aggregate", node_feat, backend)
    if plan[2]:  # torch in, torch out, all in C
        if out is None:
            return _C.sparse_aggregate_raw(row_ptr, col_idx, edge_weight, node_feat)
        return _C.sparse_aggregate_raw(row_ptr, col_idx, edge_weight, node_feat, out=out)
    return run("sparse_aggregate", _C.sparse_aggregate_raw, (row_ptr, col_idx, edge_weight, node_feat), out, node_feat,
               plan[1])


_sparse_aggregate.__name__ = _sparse_aggregate.__qualname__ = "sparse_aggregate"  # as errors name it
_C._install_dispatch(_ctx, direct_ops, direct_types, {"sparse_aggregate": _sparse_aggregate})
sparse_aggregate = _C.sparse_aggregate
