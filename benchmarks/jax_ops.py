"""qkernels.jax: the cost of one jitted call per op, beside an equivalent jax.numpy expression, and on
a GPU beside the torch path.

CPU (default): tiny sizes (qkernels.testing's samples), where the per-call cost is dispatch, not
arithmetic: the median time of one call of jax.jit(op) (block_until_ready after each) against
jax.jit of the same computation in jax.numpy.  --sizes work uses WORK_SIZES instead.

GPU (--device cuda): WORK_SIZES in bfloat16 where the kernels take it; the time per call of many
back-to-back jitted calls (one wait at the end: the device time once dispatch overlaps), against
the same op on torch tensors through qkernels' DLPack path timed with CUDA events.

    python benchmarks/jax_ops.py [--device cpu|cuda] [--sizes tiny|work] [--ops linear,...] [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import qkernels.jax as qj
from qkernels import testing as T


def _sa(row_ptr, col_idx, ew, nf):
    rows = np.repeat(np.arange(len(row_ptr) - 1), np.diff(np.asarray(row_ptr)))
    return lambda rp, ci, ew, nf: jax.ops.segment_sum(ew[:, :, None] * nf[ci], rows, num_segments=len(row_ptr) - 1)


def _norm(x, r, g, b, eps=1e-5):
    m = x.mean(1, keepdims=True)
    v = ((x - m) ** 2).mean(1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * g + b + r


def _bce(args):
    eg, G = np.asarray(args[2]), args[3]
    counts = jnp.asarray(np.maximum(np.bincount(eg, minlength=G), 1), jnp.float32)

    def f(l, t, eg, G):
        bce = jnp.maximum(l, 0) - l * t + jnp.log1p(jnp.exp(-jnp.abs(l)))
        return (jax.ops.segment_sum(bce, eg, num_segments=counts.shape[0]) / counts).mean()

    return f


def _rotary(x, f):
    c, s = f[..., 0][..., None, :], f[..., 1][..., None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape).astype(x.dtype)


def _decode(q, k, v):
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(q.dtype), v)


# op -> a function of the sample's args giving the jnp equivalent (taking the same args)
JNP = {
    "sparse_aggregate": lambda a: _sa(*a),
    "fused_edge_features": lambda a: (lambda x, ei, e: jnp.concatenate([x[ei[0]] + x[ei[1]],
                                                                        jnp.abs(x[ei[0]] - x[ei[1]]), e], 1)),
    "fused_norm_residual": lambda a: _norm,
    "graph_norm_bce": _bce,
    "rotary_emb": lambda a: _rotary,
    "linear": lambda a: (lambda x, w, b: x @ w.T + b),
    "swiglu": lambda a: (lambda x, u, g: (x @ u.T) * jax.nn.silu(x @ g.T)),
    "attn_decode": lambda a: _decode,
    "attn_prefill": lambda a: _decode,
}


def _split(args):
    """(positions of the array arguments, the static ones by position)."""
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (int, float))]
    return arrays, {i: a for i, a in enumerate(args) if i not in arrays}


def _jitted(fn, args, kwargs):
    arrays, static = _split(args)

    def call(*xs):
        it = iter(xs)
        return fn(*[static[i] if i in static else next(it) for i in range(len(args))], **kwargs)

    return jax.jit(call), [jnp.asarray(args[i]) for i in arrays]


def per_call(f, xs, iters):
    """Median seconds of one call, waiting for each."""
    jax.block_until_ready(f(*xs))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            jax.block_until_ready(f(*xs))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def back_to_back(f, xs, iters):
    jax.block_until_ready(f(*xs))
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = f(*xs)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def torch_time(op, args, kwargs, iters):
    import torch

    import qkernels

    ts = [torch.as_tensor(np.asarray(a)).cuda() if not isinstance(a, (int, float)) else a for a in args]
    ts = [t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and i in T.FLOAT_ARGS[op] and op not in
          ("sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce") and
          not (op == "rotary_emb" and i == 1) else t for i, t in enumerate(ts)]
    f = getattr(qkernels, op)
    f(*ts, **kwargs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        f(*ts, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes", choices=("tiny", "work"), default=None)
    p.add_argument("--ops", default=",".join(JNP))
    p.add_argument("--iters", type=int, default=None)
    a = p.parse_args(argv)
    sizes = a.sizes or ("tiny" if a.device == "cpu" else "work")
    iters = a.iters or (2000 if sizes == "tiny" else 50)
    if a.device == "cuda":
        jax.config.update("jax_default_device", jax.devices("gpu")[0])
    print(f"jax {jax.__version__} on {a.device}, {sizes} sizes, {iters} calls per timing")
    if a.device == "cpu":
        print(f"  {'op':<22} {'qkernels.jax':>13} {'jax.numpy':>11} {'ratio':>6}")
    else:
        print(f"  {'op':<22} {'qkernels.jax':>13} {'torch path':>11} {'ratio':>6}")
    rng = np.random.default_rng(0)
    for op in a.ops.split(","):
        options = T.WORK_SIZES[op] if sizes == "work" else {}
        args, kwargs = T.sample(op, rng, **options)
        if a.device == "cuda" and op in T.DEVICE_DTYPES:
            args = tuple(np.asarray(x).astype(jnp.bfloat16) if d == "bfloat16" else x
                         for x, d in zip(args, T.DEVICE_DTYPES[op]))
        ours, xs = _jitted(getattr(qj, op), args, kwargs)
        if a.device == "cpu":
            ref, _ = _jitted(JNP[op](args), args, {})
            t_q, t_r = per_call(ours, xs, iters), per_call(ref, xs, iters)
        else:
            t_q, t_r = back_to_back(ours, xs, iters), torch_time(op, args, kwargs, iters)
        print(f"  {op:<22} {t_q * 1e6:>10.1f} us {t_r * 1e6:>8.1f} us {t_q / t_r:>6.2f}")


if __name__ == "__main__":
    main()
