"""qkernels.jax: the cost of one jitted call per op, beside an equivalent jax.numpy expression, and on
a GPU beside the torch path.

CPU (default): tiny sizes (qkernels.testing's samples), where the per-call cost is dispatch, not
arithmetic: the median time of one call of jax.jit(op) (block_until_ready after each) against
jax.jit of the same computation in jax.numpy.  --sizes work uses WORK_SIZES instead.

GPU (--device cuda): WORK_SIZES in bfloat16 where the kernels take it.  Two figures per op:
  - wall: one jitted call after another from Python, one wait at the end (JAX's dispatch included);
  - device: the same kernel's time per call with no host in the way.  Under JAX, one jitted program
    of n calls, each on its own copy of the inputs (so XLA cannot merge them), timed at two n and the
    difference divided by the difference in n (the program's own dispatch cancels).
    Through the torch path (qkernels' DLPack binding), n calls captured in one torch CUDA graph,
    replayed between CUDA events.  The ratio of the two is the cost of running inside XLA.

    python benchmarks/jax_ops.py [--device cpu|cuda] [--sizes tiny|work] [--ops linear,...] [--iters 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import qkernels.jax as qj
from qkernels import testing as T

# the graph ops in jax.numpy are the pure-JAX decoder's (examples/train_gnn_jax.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import gnn_jnp  # noqa: E402


def _sa(row_ptr, *_):
    rows = gnn_jnp.csr_rows(row_ptr)
    return lambda rp, ci, ew, nf: gnn_jnp.sparse_aggregate(rows, ci, ew, nf, len(row_ptr) - 1)


def _bce(args):
    sizes = jnp.asarray(gnn_jnp.graph_sizes(args[2], args[3]))
    return lambda l, t, eg, G: gnn_jnp.graph_norm_bce(l, t, eg, sizes)


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
    "fused_edge_features": lambda a: gnn_jnp.fused_edge_features,
    "fused_norm_residual": lambda a: gnn_jnp.fused_norm_residual,
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


def _many(fn, args, kwargs, n):
    """jax.jit of n calls of fn in one program, each on its own copy of the arrays (program parameters
    XLA cannot merge: identical operands would be one call after CSE) and every result returned (no
    call is dead).  Takes the n copies flattened."""
    arrays, static = _split(args)
    k = len(arrays)

    def call(xs):
        it = iter(xs)
        return fn(*[static[i] if i in static else next(it) for i in range(len(args))], **kwargs)

    return jax.jit(lambda *flat: [call(flat[j * k:(j + 1) * k]) for j in range(n)])


def jax_device_time(fn, args, kwargs, xs, n1=10, n2=60, reps=15):
    """Seconds of device time per call under jit: (t(n2) - t(n1)) / (n2 - n1) over medians."""
    copies = [jnp.array(x, copy=True) for _ in range(n2) for x in xs]
    times = {}
    for n in (n1, n2):
        f, flat = _many(fn, args, kwargs, n), copies[:n * len(xs)]
        jax.block_until_ready(f(*flat))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*flat))
            ts.append(time.perf_counter() - t0)
        times[n] = statistics.median(ts)
    return (times[n2] - times[n1]) / (n2 - n1)


def _torch(a):
    import torch

    if isinstance(a, (int, float)):
        return a
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:  # numpy's ml_dtypes bfloat16 has no torch counterpart to share memory with
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def torch_device_time(op, args, kwargs, n=50, reps=10):
    """Seconds of device time per call through the torch path: n calls captured in a CUDA graph,
    replayed reps times between CUDA events.  (seconds, "graph"), or where capture fails, back-to-back
    eager calls timed by events (host launch gaps included): (seconds, "eager")."""
    import torch

    import qkernels

    ts = [_torch(a) for a in args]
    f = getattr(qkernels, op)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (first-use setup, allocator pools)
        for _ in range(3):
            f(*ts, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                f(*ts, **kwargs)
        g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (reps * n), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps * n):
            f(*ts, **kwargs)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (reps * n), "eager"


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
    rows = []
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
            rows.append((op, per_call(ours, xs, iters), per_call(ref, xs, iters)))
        else:
            wall = back_to_back(ours, xs, iters)
            dev = jax_device_time(getattr(qj, op), args, kwargs, xs)
            ref, how = torch_device_time(op, args, kwargs)
            rows.append((op, wall, dev, ref, how))
        print(f"  {op} done", flush=True)
    print(f"jax {jax.__version__} on {a.device}, {sizes} sizes")
    if a.device == "cpu":
        print(f"median of one jitted call, {iters} calls a timing")
        print(f"  {'op':<22} {'qkernels.jax':>13} {'jax.numpy':>11} {'ratio':>6}")
        for op, t_q, t_r in rows:
            print(f"  {op:<22} {t_q * 1e6:>10.1f} us {t_r * 1e6:>8.1f} us {t_q / t_r:>6.2f}")
    else:
        print("wall: jitted calls back to back (dispatch included); device: per call with no host in the way")
        print(f"  {'op':<22} {'jax wall':>10} {'jax device':>11} {'torch device':>13} {'ratio':>6}")
        for op, wall, dev, ref, how in rows:
            mark = "" if how == "graph" else " (torch eager)"
            print(f"  {op:<22} {wall * 1e6:>7.1f} us {dev * 1e6:>8.1f} us {ref * 1e6:>10.1f} us {dev / ref:>6.3f}{mark}")


if __name__ == "__main__":
    main()
