"""Public ops.

Each public op is a C entry point (``_C.<op>``) that runs directly when selection is
automatic and lands where the data lives (torch in, torch out), and otherwise calls the Python
path below: the dispatcher's decision, then the C op (``_C.<op>_raw``), with results in the
caller's framework.
"""

from __future__ import annotations

from . import _C
from . import _dispatch
from ._dispatch import _ctx, choose, direct_ops, direct_types
from ._frameworks import run


def _python_path(name):
    """The Python side of public op `name`: decide, then run the raw op and convert the result."""
    raw = getattr(_C, name + "_raw")
    _, position, arg, _ = _dispatch.OPS[name]

    def call(*args, backend=None, **kwargs):
        x = args[position] if len(args) > position else kwargs.get(arg)
        if x is None:
            return raw(*args, **kwargs)  # the raw op names what is missing
        plan = choose(name, x, backend)
        if plan[2]:  # torch in, torch out, all in C
            return raw(*args, **kwargs)
        return run(name, raw, args, kwargs, x, plan[1])

    call.__name__ = call.__qualname__ = name  # as argument errors name it
    return call


_C._install_dispatch(_ctx, direct_ops, direct_types, {name: _python_path(name) for name in _dispatch.OPS})

sparse_aggregate = _C.sparse_aggregate
fused_edge_features = _C.fused_edge_features
fused_norm_residual = _C.fused_norm_residual
graph_norm_bce = _C.graph_norm_bce
