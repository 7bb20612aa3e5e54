"""python -m qkernels [info] [--selfcheck] [--explain OP] [--bench]

With no options: what is installed, the backend table, every op once on the best backend
checked against the cpu backend (or a float64 NumPy computation where cpu is the best), and a
short timing table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

import qkernels
from qkernels import _dispatch


def _sample_sparse_aggregate(rng, n=2000, h=4, d=32, deg=8):
    degrees = rng.poisson(deg, n)
    row_ptr = np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64)
    col_idx = rng.integers(0, n, int(row_ptr[-1])).astype(np.int64)
    ew = rng.standard_normal((len(col_idx), h)).astype(np.float32)
    nf = rng.standard_normal((n, h, d)).astype(np.float32)
    return (row_ptr, col_idx, ew, nf)


def _numpy_sparse_aggregate(row_ptr, col_idx, ew, nf):
    out = np.zeros((len(row_ptr) - 1,) + nf.shape[1:])
    rows = np.repeat(np.arange(len(row_ptr) - 1), np.diff(row_ptr))
    np.add.at(out, rows, ew[:, :, None].astype(np.float64) * nf[col_idx])
    return out


def _sample_edge_features(rng, n=2000, e=16000, h=32):
    return (rng.standard_normal((n, h)).astype(np.float32), rng.integers(0, n, (2, e)),
            rng.standard_normal((e, h)).astype(np.float32))


def _numpy_edge_features(x, ei, ea):
    s, d = x[ei[0]].astype(np.float64), x[ei[1]].astype(np.float64)
    return np.concatenate([s + d, np.abs(s - d), ea], axis=1)


def _sample_norm_residual(rng, n=2000, h=128):
    return (rng.standard_normal((n, h)).astype(np.float32), rng.standard_normal((n, h)).astype(np.float32),
            (1 + 0.1 * rng.standard_normal(h)).astype(np.float32), (0.1 * rng.standard_normal(h)).astype(np.float32))


def _numpy_norm_residual(x, res, g, b):
    x = x.astype(np.float64)
    mean = x.mean(1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(1, keepdims=True) + 1e-5)
    return y * g + b + res


def _sample_graph_bce(rng, n=2000, e=50000, g=32):
    return ((3 * rng.standard_normal(e)).astype(np.float32), (rng.random(e) < 0.3).astype(np.float32),
            np.sort(rng.integers(0, g, e)), g)


def _numpy_graph_bce(lg, t, eg, g):
    lg, t = lg.astype(np.float64), t.astype(np.float64)
    v = np.maximum(lg, 0) - lg * t + np.log1p(np.exp(-np.abs(lg)))
    return np.array(np.mean(np.bincount(eg, v, g) / np.maximum(np.bincount(eg, minlength=g), 1)))


def _sample_rotary_emb(rng, t=64, h=8, d=128):
    angles = rng.standard_normal((t, d // 2))
    return (rng.standard_normal((t, h, d)).astype(np.float32),
            np.stack([np.cos(angles), np.sin(angles)], -1).astype(np.float32))


def _numpy_rotary_emb(x, freqs):
    x = x.astype(np.float64)
    c, s = freqs[:, None, :, 0], freqs[:, None, :, 1]  # [T, 1, D/2]
    xe, xo = x[..., 0::2], x[..., 1::2]
    return np.stack([xe * c - xo * s, xe * s + xo * c], -1).reshape(x.shape)


def _sample_linear(rng, m=16, n=1024, k=1024):
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return rng.standard_normal((m, k)).astype(np.float32), w, rng.standard_normal(n).astype(np.float32)


def _numpy_linear(x, w, b):
    return x.astype(np.float64) @ w.T.astype(np.float64) + b


def _sample_swiglu(rng, m=16, n=2048, k=1024):
    return tuple(_sample_linear(rng, m, n, k)[:2]) + ((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32),)


def _numpy_swiglu(x, up, gate):
    u, g = _numpy_linear(x, up, 0.0), _numpy_linear(x, gate, 0.0)
    return u * g / (1 + np.exp(-g))


def _sample_attn_decode(rng, b=4, l=1024, hq=32, hkv=8, d=128):
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((b, 1, hq, d), (b, l, hkv, d), (b, l, hkv, d)))


def _numpy_attn_decode(q, k, v):
    g = q.shape[2] // k.shape[2]
    k, v = (np.repeat(a.astype(np.float64), g, axis=2) for a in (k, v))
    s = np.einsum("bhd,blhd->bhl", q[:, 0].astype(np.float64), k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (np.einsum("bhl,blhd->bhd", p, v) / p.sum(-1, keepdims=True))[:, None]


def _sample_attn_paged_decode(rng, b=4, hq=32, hkv=8, d=128, max_ctx=1024):
    """Sequence i is request rpi[i]; its tokens sit at randomly permuted slots of the pool."""
    lens = rng.integers(1, max_ctx + 1, b)
    slots, rpi = rng.permutation(int(lens.sum())), rng.permutation(b)
    r2t = np.zeros((b, max_ctx), np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)])
    for i in range(b):
        r2t[rpi[i], :lens[i]] = slots[indptr[i]:indptr[i + 1]]
    pool = (len(slots), hkv, d)
    return (rng.standard_normal((b, hq, d)).astype(np.float32), rng.standard_normal(pool).astype(np.float32),
            rng.standard_normal(pool).astype(np.float32), r2t, rpi.astype(np.int32), indptr.astype(np.int32))


def _numpy_attn_paged_decode(q, kc, vc, r2t, rpi, indptr):
    out = np.zeros(q.shape)
    for i in range(len(q)):
        slots = r2t[rpi[i], :indptr[i + 1] - indptr[i]]
        out[i] = _numpy_attn_decode(q[i:i + 1, None], kc[slots][None], vc[slots][None])[0, 0]
    return out


def _sample_attn_prefill(rng, b=2, lq=256, lkv=384, hq=32, hkv=8, d=128):
    """A prefix cache: the 256 queries are the last of 384 positions (causal, bottom-right)."""
    return tuple(rng.standard_normal(shape).astype(np.float32)
                 for shape in ((b, lq, hq, d), (b, lkv, hkv, d), (b, lkv, hkv, d)))


def _numpy_attn_prefill(q, k, v, is_causal=False):
    g = q.shape[2] // k.shape[2]
    lq, lkv = q.shape[1], k.shape[1]
    k, v = (np.repeat(a.astype(np.float64), g, axis=2).transpose(0, 2, 1, 3) for a in (k, v))  # [B, H, L, D]
    s = q.astype(np.float64).transpose(0, 2, 1, 3) @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if is_causal:
        s = np.where(np.arange(lkv)[None, :] <= np.arange(lq)[:, None] + lkv - lq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return ((p @ v) / p.sum(-1, keepdims=True)).transpose(0, 2, 1, 3)


def _sample_attn_paged_prefill(rng, hq=32, hkv=8, d=128, max_ctx=1024):
    """A ragged batch over a token pool: requests with q_len <= kv_len (one a single query), at
    randomly permuted slots."""
    kv_lens = np.array([1000, 300, 64, 700])
    q_lens = np.array([1, 300, 17, 128])
    b = len(kv_lens)
    slots, rpi = rng.permutation(int(kv_lens.sum())), rng.permutation(b)
    r2t = np.zeros((b, max_ctx), np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
    for i in range(b):
        r2t[rpi[i], :kv_lens[i]] = slots[kv_indptr[i]:kv_indptr[i + 1]]
    pool = (len(slots), hkv, d)
    return (rng.standard_normal((int(q_lens.sum()), hq, d)).astype(np.float32),
            rng.standard_normal(pool).astype(np.float32), rng.standard_normal(pool).astype(np.float32), r2t,
            rpi.astype(np.int32), kv_indptr.astype(np.int32), np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))


def _numpy_attn_paged_prefill(q, kc, vc, r2t, rpi, kv_indptr, qo_indptr, is_causal=False):
    out = np.zeros(q.shape)
    for i in range(len(rpi)):
        slots = r2t[rpi[i], :kv_indptr[i + 1] - kv_indptr[i]]
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        out[rows] = _numpy_attn_prefill(q[None, rows], kc[slots][None], vc[slots][None], is_causal)[0]
    return out


SAMPLES = {
    "sparse_aggregate": (_sample_sparse_aggregate, _numpy_sparse_aggregate),
    "fused_edge_features": (_sample_edge_features, _numpy_edge_features),
    "fused_norm_residual": (_sample_norm_residual, _numpy_norm_residual),
    "graph_norm_bce": (_sample_graph_bce, _numpy_graph_bce),
    "rotary_emb": (_sample_rotary_emb, _numpy_rotary_emb),
    "linear": (_sample_linear, _numpy_linear),
    "swiglu": (_sample_swiglu, _numpy_swiglu),
    "attn_decode": (_sample_attn_decode, _numpy_attn_decode),
    "attn_paged_decode": (_sample_attn_paged_decode, _numpy_attn_paged_decode),
    "attn_prefill": (_sample_attn_prefill, _numpy_attn_prefill),
    "attn_paged_prefill": (_sample_attn_paged_prefill, _numpy_attn_paged_prefill),
}

# Keyword arguments of each sample call (the op and its NumPy computation alike).
SAMPLE_KWARGS = {"attn_prefill": {"is_causal": True}, "attn_paged_prefill": {"is_causal": True}}

# Ops whose CUDA kernels take 16-bit floats: the dtype of each argument on the device (None: as
# sampled; CuPy has no bfloat16, so it gets float16), and the self-check's tolerance there.
DEVICE_DTYPES = {
    "rotary_emb": ("bfloat16", None),
    "linear": ("bfloat16",) * 3,
    "swiglu": ("bfloat16",) * 3,
    "attn_decode": ("bfloat16",) * 3,
    "attn_paged_decode": ("bfloat16",) * 3 + (None,) * 3,
    "attn_prefill": ("bfloat16",) * 3,
    "attn_paged_prefill": ("bfloat16",) * 3 + (None,) * 4,
}
DEVICE_TOLERANCE = 2e-2  # bfloat16 inputs and output: ~2^-9 relative each


def _device_framework():
    """A framework that can hold CUDA tensors here, or None."""
    if not qkernels.AVAILABLE:
        return None
    if importlib.util.find_spec("torch"):
        import torch

        if torch.cuda.is_available():
            return "torch"
    if importlib.util.find_spec("cupy"):
        return "cupy"
    return None


def _to_device(arrays, fw, dtypes=None):
    """Arrays to CUDA tensors of fw (cast to dtypes[i] where given); plain Python values
    (num_graphs) pass through."""
    dtypes = dtypes or (None,) * len(arrays)
    if fw == "torch":
        import torch

        def move(a, dt):
            t = torch.from_numpy(a).cuda()
            return t.to(getattr(torch, dt)) if dt else t

        return tuple(move(a, dt) if isinstance(a, np.ndarray) else a for a, dt in zip(arrays, dtypes))
    import cupy

    return tuple(cupy.asarray(a).astype(dt.replace("bfloat16", "float16") if dt else a.dtype)
                 if isinstance(a, np.ndarray) else a for a, dt in zip(arrays, dtypes))


def _to_numpy(x):
    if hasattr(x, "get"):
        return x.get()
    if type(x).__module__.startswith("torch"):
        x = x.cpu()
        return (x.float() if x.dtype.itemsize == 2 and x.is_floating_point() else x).numpy()
    return np.asarray(x)


def _sync(fw):
    if fw == "torch":
        import torch

        torch.cuda.synchronize()
    elif fw == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def print_info():
    inf = qkernels.info()
    print(f"qkernels {inf['version']}")
    if inf["cuda_built"]:
        print(f"  CUDA kernels: built for {inf['compiled_archs'] or '(library not loaded)'}")
    print(f"  CUDA available: {inf['cuda_available']}" + ("" if inf["cuda_available"] else f" ({inf['cuda_reason']})"))
    for dev in inf["devices"]:
        cc = ".".join(map(str, dev["capability"]))
        print(f"  cuda:{dev['index']}: {dev['name']} (sm_{cc.replace('.', '')}, {dev['multiprocessors']} SMs, "
              f"{dev['memory'] / 2**30:.0f} GiB)")
    print(f"  CPU threads: {inf['cpu_threads']}")
    env = ", ".join(f"{k}={v}" for k, v in inf["env"].items() if v) or "none set"
    print(f"  environment: {env}")
    print("\nbackends:")
    for name, b in inf["backends"].items():
        print(f"  {name:<6} {'available' if b['available'] else 'unavailable: ' + b['reason']}")


def selfcheck():
    """Every op once on the best backend vs the cpu backend; returns True when all pass."""
    rng = np.random.default_rng()
    fw = _device_framework()
    ok = True
    print(f"\nself-check (best backend vs reference, random data{', on ' + fw + ' CUDA tensors' if fw else ''}):")
    for op, (make, numpy_ref) in SAMPLES.items():
        fn = getattr(qkernels, op)
        host, kw = make(rng), SAMPLE_KWARGS.get(op, {})
        half = bool(fw) and op in DEVICE_DTYPES
        args = _to_device(host, fw, DEVICE_DTYPES.get(op)) if fw else host
        best = _dispatch.resolve(op, *args, **kw).winner
        try:
            out = _to_numpy(fn(*args, **kw))
        except Exception as e:  # a missing kernel fails this op, not the whole check
            ok = False
            print(f"  {op:<20} {best:<5} raised {type(e).__name__}: {e}  FAIL")
            continue
        if best == "cpu" and not half:
            ref, against = numpy_ref(*host, **kw), "float64 NumPy"
        else:
            ref, against = fn(*host, backend="cpu", **kw), "cpu backend"
        ref = np.asarray(ref, dtype=np.float64)
        err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
        passed = bool(np.isfinite(out).all() and err < (DEVICE_TOLERANCE if half else 1e-5))
        ok &= passed
        print(f"  {op:<20} {best:<5} vs {against:<14} rel err {err:.2e}  {'PASS' if passed else 'FAIL'}")
    if fw:  # the dropout mask must be the same on both backends for one seed
        host = _sample_norm_residual(rng)
        a = _to_numpy(qkernels.fused_norm_residual(*_to_device(host, fw), p=0.3, training=True, seed=7))
        b = qkernels.fused_norm_residual(*host, p=0.3, training=True, seed=7, backend="cpu")
        same = bool(np.array_equal(a - host[1] != 0, b - host[1] != 0))
        ok &= same
        print(f"  {'dropout mask':<20} cuda  vs cpu backend    {'identical' if same else 'DIFFERENT'}      "
              f"{'PASS' if same else 'FAIL'}")
    return ok


def timing(repeats=20):
    rng = np.random.default_rng(0)
    fw = _device_framework()
    print(f"\ntiming (median of {repeats} calls, host clock around synchronised calls):")
    print(f"  {'op':<20} {'backend':<8} {'data':<8} {'time':>10}")
    for op, (make, _) in SAMPLES.items():
        fn = getattr(qkernels, op)
        host, kw = make(rng), SAMPLE_KWARGS.get(op, {})
        runs = [("cpu", host, None)]
        if fw:
            runs.insert(0, ("cuda", _to_device(host, fw, DEVICE_DTYPES.get(op)), fw))
        for backend, args, sync_fw in runs:
            try:
                fn(*args, backend=backend, **kw)
            except Exception as e:
                print(f"  {op:<20} {backend:<8} {sync_fw or 'numpy':<8} {type(e).__name__}: {e}")
                continue
            times = []
            for _ in range(repeats):
                _sync(sync_fw)
                t0 = time.perf_counter()
                fn(*args, backend=backend, **kw)
                _sync(sync_fw)
                times.append(time.perf_counter() - t0)
            print(f"  {op:<20} {backend:<8} {sync_fw or 'numpy':<8} {statistics.median(times) * 1e6:>8.1f} µs")


def explain(op):
    if op not in SAMPLES:
        sys.exit(f"--explain: unknown op {op!r}; ops: {', '.join(SAMPLES)}")
    fw = _device_framework()
    host = SAMPLES[op][0](np.random.default_rng(0))
    args = _to_device(host, fw, DEVICE_DTYPES.get(op)) if fw else host
    print(qkernels.explain(op, *args, **SAMPLE_KWARGS.get(op, {})))


def bench():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "run.py")
    if not os.path.exists(script):
        sys.exit("--bench needs the repository's benchmarks/ folder beside the package (a source checkout)")
    import runpy

    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qkernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=["info"], help="only print what is installed")
    p.add_argument("--selfcheck", action="store_true", help="only run the self-check")
    p.add_argument("--explain", metavar="OP", help="show the dispatcher's decision for a sample call of OP")
    p.add_argument("--bench", action="store_true", help="run the full benchmark set on the GPU")
    a = p.parse_args(argv)
    if a.explain:
        explain(a.explain)
        return 0
    if a.bench:
        bench()
        return 0
    if a.command == "info":
        print_info()
        return 0
    if a.selfcheck:
        return 0 if selfcheck() else 1
    print_info()
    ok = selfcheck()
    timing()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
