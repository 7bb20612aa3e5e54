"""python -m qkernels [info] [--selfcheck] [--explain OP] [--bench]

With no options: what is installed, the backend table, every op once on the best backend checked
against its float64 reference (qkernels.testing), and a short timing table.

Exit status: 0 when every check passes, 1 when one fails (a selected backend that cannot run here
included), 2 when a selection variable (ASTR_BACKEND, QECDEC_BACKEND, QKERNELS_OPS) holds a value
the dispatcher refuses; only the ops whose families that variable selects for are affected.
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import re
import statistics
import sys
import time
import warnings

import numpy as np

import qkernels
from qkernels import _dispatch
from qkernels.testing import DEVICE_DTYPES, MUTATED, OPS, WORK_SIZES as SIZES, reference, sample, written

DEVICE_TOLERANCE = 2e-2  # bfloat16 output: ~2^-9 relative (the reference takes the rounded inputs)
TOLERANCE = 1e-5

SELECTION_VARIABLES = ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS")


# ---- the environment --------------------------------------------------------------------------

def read_selection_env():
    """The dispatcher's reading of the selection variables: -> ({family: why its variable is
    refused}, [legacy-spelling warnings]).  A refused value fails its own families' calls only; a
    QKERNELS_OPS entry that names no family fails them all."""
    with warnings.catch_warnings(record=True) as caught:  # legacy spellings: said once, as one line
        warnings.simplefilter("always")
        try:
            problems = {f: why for f, (backend, why) in _dispatch._parse_env().items() if backend is None}
        except ValueError as e:
            problems = {f: str(e) for f in _dispatch.FAMILIES}
    return problems, [str(w.message) for w in caught]


# ---- devices and frameworks -------------------------------------------------------------------

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
    """A tensor of any framework as NumPy (16-bit floats widened to float32), a tuple of them
    element-wise; other values as they are."""
    if isinstance(x, tuple):
        return tuple(_to_numpy(t) for t in x)
    if hasattr(x, "get"):
        return x.get()
    if type(x).__module__.startswith("torch"):
        x = x.cpu()
        return (x.float() if x.dtype.itemsize == 2 and x.is_floating_point() else x).numpy()
    return x if isinstance(x, (int, float)) else np.asarray(x)


def _outputs(r):
    """An op's outputs as a list of float64 NumPy arrays: one, or a backward op's gradients (a gradient
    not asked for, None, left out)."""
    return [np.asarray(_to_numpy(t), np.float64) for t in (r if type(r) is tuple else (r,)) if t is not None]


def _sync(fw):
    if fw == "torch":
        import torch

        torch.cuda.synchronize()
    elif fw == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


# ---- info -------------------------------------------------------------------------------------

def _archs_in(library):
    """The architectures named in the CUDA library's file (setup.py compiles them in as a string such as
    "sm_80 sm_89 sm_90a +PTX(compute_90)"), or "" where the file does not say."""
    try:
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            found = re.search(rb"sm_\d+a?(?: sm_\d+a?)* \+PTX\(compute_\d+a?\)", m)
            return found.group().decode() if found else ""
    except (OSError, TypeError, ValueError):
        return ""


def cuda_kernels_line(cuda):
    """What the build holds and whether it loaded, from _C.cuda_info()."""
    if not cuda["built"]:
        return "not built (no nvcc when qkernels was built, or QKERNELS_CUDA=0)"
    archs = cuda["archs"] or _archs_in(cuda["library"])
    if cuda["available"]:
        return f"built for {', '.join(archs.split())}"
    return f"built for {', '.join(archs.split())}; not loaded: {cuda['reason']}" if archs else \
        f"built, not loaded: {cuda['reason']}"


def print_info():
    inf = qkernels.info()
    print(f"qkernels {inf['version']}")
    print(f"  CUDA kernels: {cuda_kernels_line(qkernels._C.cuda_info())}")
    print(f"  CUDA available: {inf['cuda_available']}")
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


# ---- the self-check, timing and explain -------------------------------------------------------

def _reason(op, exc):
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[len(op) + 2:] if text.startswith(f"{op}: ") else text


def selfcheck(problems=None):
    """Every op once on the best backend against its float64 reference; True when all pass.  An op
    whose family's selection variable was refused (problems) fails with that message, unrun."""
    problems = problems or {}
    rng = np.random.default_rng()
    fw = _device_framework()
    ok = True
    where = f", on {fw} CUDA tensors" if fw else ""
    print(f"\nself-check (best backend vs float64 reference, random data{where}):")
    for op in OPS:
        family = _dispatch.OPS[op][0]
        if family in problems:
            ok = False
            print(f"  {op:<20} {'-':<5} FAIL: {problems[family]}")
            continue
        host, kw = sample(op, rng, **SIZES[op])
        half = bool(fw) and op in DEVICE_DTYPES
        args = _to_device(host, fw, DEVICE_DTYPES.get(op)) if fw else host
        best = "-"
        try:
            decision = _dispatch.resolve(op, *args, **kw)
            best = decision.winner or decision.requested
            if decision.winner is None:  # a backend selected that cannot run here
                ok = False
                print(f"  {op:<20} {best:<5} FAIL: {_reason(op, decision.error)}")
                continue
            # the inputs as the op sees them, copied before it updates any in place
            seen = [np.array(t) if isinstance(t, np.ndarray) else t for t in map(_to_numpy, args)]
            with warnings.catch_warnings():  # the row names the backend; staging is the selection's doing
                warnings.simplefilter("ignore", qkernels.FallbackWarning)
                outs = _outputs(getattr(qkernels, op)(*args, **kw))
            outs += [np.asarray(_to_numpy(args[i]), np.float64) for i in MUTATED.get(op, ())]  # updated in place
        except Exception as e:  # a missing kernel fails this op, not the whole check
            ok = False
            print(f"  {op:<20} {best:<5} FAIL: {type(e).__name__}: {_reason(op, e)}")
            continue
        refs = _outputs(reference(op, *seen, **kw)) + list(written(op, *seen, **kw) if op in MUTATED else ())
        err = max(float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)) for out, ref in zip(outs, refs))
        passed = bool(all(np.isfinite(out).all() for out in outs) and len(outs) == len(refs) and
                      err < (DEVICE_TOLERANCE if half else TOLERANCE))
        ok &= passed
        print(f"  {op:<20} {best:<5} rel err {err:.2e}  {'PASS' if passed else 'FAIL'}")
    if fw and "fused_norm_residual" not in problems:  # the dropout mask on the device is the documented one
        host, _ = sample("fused_norm_residual", rng, **SIZES["fused_norm_residual"])
        try:
            out = _to_numpy(qkernels.fused_norm_residual(*_to_device(host, fw), p=0.3, training=True, seed=7))
            ref = reference("fused_norm_residual", *host, p=0.3, training=True, seed=7)
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            passed = err < TOLERANCE
            print(f"  {'dropout p=0.3':<20} {'':<5} rel err {err:.2e}  {'PASS' if passed else 'FAIL'}")
        except Exception as e:
            passed = False
            print(f"  {'dropout p=0.3':<20} {'':<5} FAIL: {type(e).__name__}: {_reason('fused_norm_residual', e)}")
        ok &= passed
    return ok


def timing(repeats=20):
    rng = np.random.default_rng(0)
    fw = _device_framework()
    print(f"\ntiming (median of {repeats} calls, host clock around synchronised calls):")
    print(f"  {'op':<20} {'backend':<8} {'data':<8} {'time':>10}")
    for op in OPS:
        fn = getattr(qkernels, op)
        host, kw = sample(op, rng, **SIZES[op])
        runs = [("cpu", host, None)]
        if fw:
            runs.insert(0, ("cuda", _to_device(host, fw, DEVICE_DTYPES.get(op)), fw))
        for backend, args, sync_fw in runs:
            try:
                fn(*args, backend=backend, **kw)
            except Exception as e:
                print(f"  {op:<20} {backend:<8} {sync_fw or 'numpy':<8} {type(e).__name__}: {_reason(op, e)}")
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
    """The dispatcher's decision for the self-check's call of op; True when a backend takes it."""
    fw = _device_framework()
    host, kw = sample(op, np.random.default_rng(0), **SIZES[op])
    decision = qkernels.explain(op, *(_to_device(host, fw, DEVICE_DTYPES.get(op)) if fw else host), **kw)
    print(decision)
    return decision.winner is not None


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
    p.add_argument("--explain", metavar="OP", choices=OPS,
                   help="show the dispatcher's decision for the self-check's call of OP")
    p.add_argument("--bench", action="store_true", help="run the full benchmark set on the GPU")
    a = p.parse_args(argv)
    problems, notes = read_selection_env()
    messages = list(dict.fromkeys(problems.values()))
    for note in notes:
        print(f"qkernels: {note}", file=sys.stderr)

    def finish(status):
        for message in messages:
            print(f"qkernels: {message}", file=sys.stderr)
        return 2 if messages else status

    if a.explain and _dispatch.OPS[a.explain][0] in problems:
        print(f"qkernels: {problems[_dispatch.OPS[a.explain][0]]}", file=sys.stderr)
        return 2
    if a.bench:
        if messages:
            return finish(2)
        bench()
        return 0
    if not (a.explain or a.selfcheck):
        print_info()  # the variables as set, refused ones included
        if a.command == "info":
            return finish(0)
    if a.explain:  # a refused variable of other families does not concern this op
        return 0 if explain(a.explain) else 1
    ok = selfcheck(problems)
    if not a.selfcheck:
        timing()
    return finish(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
