"""message_passing's argument rules without a framework: qkernels.jax checks a call with them at trace
time, and the torch operators before they run the op's composition under autograd (the fused op's
C binding checks its own arguments).  Errors name the op and the argument, as the binding's do."""

from __future__ import annotations

OP = "message_passing"

ARGS = ("x", "e", "edge_index", "row_ptr", "col_idx", "dir_edge", "w1", "b1", "w_msg", "b_msg", "w_att", "b_att",
        "w_v", "w_o", "gamma_x", "beta_x", "gamma_e", "beta_e")  # the signature's order
DIMS = dict(zip(ARGS, (("N", "H"), ("E", "H"), ("2", "E"), ("N + 1",), ("M",), ("M",), ("3H", "F"), ("F",), ("F", "H"),
                       ("H",), ("F", "K"), ("K",), ("H", "H"), ("H", "H"), ("H",), ("H",), ("H",), ("H",))))
INDEX = ("edge_index", "row_ptr", "col_idx", "dir_edge")


def _layout(dims):
    return f"[{', '.join(dims)}]"


def check(shapes, dtypes):
    """Raise TypeError (a dtype) or ValueError (a shape) for a call whose arguments have these shapes
    (name -> tuple of ints) and dtype names (name -> "float32", "int64", ...), as the binding would."""
    for name, dims in DIMS.items():
        if len(shapes[name]) != len(dims):
            raise ValueError(f"{OP}: {name} must have {len(dims)} dimensions {_layout(dims)}, got shape "
                             f"{list(shapes[name])}")
    for name in ARGS:
        if name in ("edge_index", "row_ptr", "dir_edge"):
            if dtypes[name] not in ("int32", "int64"):
                raise TypeError(f"{OP}: {name} must be int32 or int64, got {dtypes[name]}")
        elif name in INDEX:  # the CSR's row_ptr and col_idx share one index dtype
            if dtypes[name] != dtypes["row_ptr"]:
                raise TypeError(f"{OP}: {name} must have row_ptr's dtype ({dtypes['row_ptr']}), got {dtypes[name]}")
        elif dtypes[name] != "float32":
            raise TypeError(f"{OP}: {name} must be float32, got {dtypes[name]}")
    (N, H), E, M = shapes["x"], shapes["e"][0], shapes["col_idx"][0]
    F, K = shapes["w1"][1], shapes["w_att"][1]
    size = {"2": 2, "N": N, "N + 1": N + 1, "H": H, "3H": 3 * H, "E": E, "M": M, "F": F, "K": K}
    for name, dims in DIMS.items():
        want = [size[d] for d in dims]
        for d, n in enumerate(want):
            if shapes[name][d] != n:
                raise ValueError(f"{OP}: {name} must have shape {_layout(dims)} = {want} with size {n} in dimension "
                                 f"{d}, got {list(shapes[name])}")
    if K < 1 or H % K != 0:
        raise ValueError(f"{OP}: the number of heads K = w_att.shape[1] = {K} must be >= 1 and divide H = {H}")
