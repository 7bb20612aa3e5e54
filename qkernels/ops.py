"""Public ops.

Each public op is a C entry point (``_C.<op>``, one per row of the C op table) that runs a call
itself when the dispatcher has already decided such a call (torch in, torch out, our kernels),
and otherwise calls the Python path below: the dispatcher's decision, then the C op
(``_C.<op>_raw``), with results in the caller's framework.
"""

from __future__ import annotations

import itertools

from . import _C
from . import _dispatch, _flash
from ._dispatch import NEUTRAL_FRAMEWORKS, _ctx, choose, direct_plans, direct_types, framework_name, record_direct
from ._frameworks import run


def _one_framework(op, params, args, kwargs):
    """ValueError unless every tensor argument, out= included, comes from one framework (our Tensor
    and raw capsules mix with any): the result's framework would otherwise be a guess."""
    first = None
    for key, value in itertools.chain(zip(params, args), kwargs.items()):
        if value is None or type(value) in _SCALARS:
            continue
        fw = framework_name(value)
        if fw in NEUTRAL_FRAMEWORKS or not hasattr(value, "__dlpack__"):  # not a tensor: the op says so
            continue
        if first is None:
            first = (key, fw)
        elif fw != first[1]:
            raise ValueError(f"{op}: all tensors must come from one framework; {first[0]} comes from {first[1]} "
                             f"but {key} from {fw}")


_SCALARS = (int, float, bool, str)


def _torch_ops():
    """qkernels.torch, imported (and its operators registered) at the first torch tensor."""
    from . import torch as torch_ops

    return torch_ops


def _python_path(name):
    """The Python side of public op `name`: decide, then run the raw op and convert the result."""
    raw = getattr(_C, name + "_raw")
    _, position, arg = _dispatch.OPS[name]
    call_axes = _dispatch.CALL_AXES.get(name)
    writes = name in _dispatch.WRITES

    params = _dispatch.params(name)

    def call(*args, backend=None, **kwargs):
        for key in kwargs:
            if key[:1] == "_":  # the raw op's private tuning keywords (_variant=, ...) are not the public op's
                raise TypeError(f"{name}() got an unexpected keyword argument '{key}'")
        _one_framework(name, params, args, kwargs)
        x = args[position] if len(args) > position else kwargs.get(arg)
        if x is None:
            return raw(*args, **kwargs)  # the raw op names what is missing
        framework = framework_name(x)
        if writes and framework == "jax" and _dispatch.written_args(name, kwargs):  # immutable: the functional form
            raise TypeError(f"{name}: {' and '.join(n for _, n in _dispatch.written_args(name, kwargs))} would be written in place, "
                            f"which JAX arrays cannot be; use qkernels.jax.{name}, which returns the new values")
        if framework == "torch":
            torch_ops = _torch_ops()
            if torch_ops.needs_route(args, kwargs):  # autograd or a tracer: the torch operator
                return torch_ops.route(name, args, kwargs, backend)
        plan = choose(name, x, backend, call_axes(args, kwargs) if call_axes else ())
        if plan[2]:  # torch in, torch out, all in C
            if backend is None and _ctx.get()[1] == 0:
                record_direct(name, x, kwargs.get("mask") is not None,
                              [v for v in itertools.chain(args, kwargs.values()) if type(v) is not type(x)
                               and framework_name(v) == "torch"])
            return raw(*args, **kwargs)
        if plan[0] == "flash":
            return _flash.OPS[name](*args, **kwargs)
        return run(name, raw, args, kwargs, x, plan[1], _dispatch.written_args(name, kwargs) if writes and plan[1] else ())

    call.__name__ = call.__qualname__ = name  # as argument errors name it
    return call


_C._install_dispatch(_ctx, direct_plans, direct_types, {name: _python_path(name) for name in _dispatch.OPS})

globals().update({name: getattr(_C, name) for name in _C.OPS})
__all__ = list(_C.OPS)
