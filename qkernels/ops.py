"""Public ops.

Each public op is a C entry point (``_C.<op>``) that runs directly when selection is
automatic and lands where the data lives (torch in, torch out), and otherwise calls the Python
path below: the dispatcher's decision, then the C op (``_C.<op>_raw``), with results in the
caller's framework.
"""

from __future__ import annotations

from . import _C
from . import _dispatch, _flash
from ._dispatch import _ctx, choose, direct_ops, direct_types
from ._frameworks import run


# Inputs an op writes, as (position, name): copied back to the device when the cpu backend stages.
_WRITTEN = {
    "attn_paged_decode": lambda kwargs: ((1, "k_cache"), (2, "v_cache")) if kwargs.get("new_k") is not None else (),
}


def _python_path(name):
    """The Python side of public op `name`: decide, then run the raw op and convert the result."""
    raw = getattr(_C, name + "_raw")
    _, position, arg, _ = _dispatch.OPS[name]
    call_axes = _dispatch.CALL_AXES.get(name)
    written = _WRITTEN.get(name)

    def call(*args, backend=None, **kwargs):
        for key in kwargs:
            if key[:1] == "_":  # the raw op's private tuning keywords (_variant=, ...) are not the public op's
                raise TypeError(f"{name}() got an unexpected keyword argument '{key}'")
        x = args[position] if len(args) > position else kwargs.get(arg)
        if x is None:
            return raw(*args, **kwargs)  # the raw op names what is missing
        plan = choose(name, x, backend, call_axes(args, kwargs) if call_axes else ())
        if plan[2]:  # torch in, torch out, all in C
            return raw(*args, **kwargs)
        if plan[0] == "flash":
            return _flash.OPS[name](*args, **kwargs)
        return run(name, raw, args, kwargs, x, plan[1], written(kwargs) if written and plan[1] else ())

    call.__name__ = call.__qualname__ = name  # as argument errors name it
    return call


_C._install_dispatch(_ctx, direct_ops, direct_types, {name: _python_path(name) for name in _dispatch.OPS})

sparse_aggregate = _C.sparse_aggregate
fused_edge_features = _C.fused_edge_features
fused_norm_residual = _C.fused_norm_residual
graph_norm_bce = _C.graph_norm_bce
attn_decode = _C.attn_decode
attn_paged_decode = _C.attn_paged_decode
attn_prefill = _C.attn_prefill
attn_paged_prefill = _C.attn_paged_prefill
rotary_emb = _C.rotary_emb
linear = _C.linear
swiglu = _C.swiglu
