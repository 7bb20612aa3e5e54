"""The host path of every op, without a GPU: each public op (the direct C path) and its raw op on CPU
torch tensors, on calls with nothing to compute (empty leading dimensions), so a call is the argument
parsing, the tensors' import and checks through torch's DLPack exchange API, the output's allocation
(zero bytes) and the direct path's key -- the part of a CUDA call's host cost that is not the launch.

  python3 benchmarks/probe/host_path.py                                  # this checkout
  python3 benchmarks/probe/host_path.py --build base=/other/checkout --build new=.
  python3 benchmarks/probe/host_path.py --build base=/other/checkout --build new=. --callgrind

Several --build checkouts (each built in place) are timed in one run: one worker process each, rounds
interleaved across the workers, the median and the best round per call reported.  --callgrind
counts instructions per call instead (valgrind; no hardware counters needed): the inclusive
instructions of the op's C entry point (qk_public_<op> or qk_op_<op>: torch's exchange-API calls
included, the interpreter's call overhead not), over --calls calls after a warm-up that is not
counted."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

# Sample options giving each op's call nothing to compute (qkernels.testing.sample).
EMPTY = {
    "rotary_emb": dict(lead=(0,)), "linear": dict(m=0), "swiglu": dict(m=0), "rmsnorm": dict(lead=(0,)),
    "fused_add_rmsnorm": dict(lead=(0,)), "fused_edge_features": dict(e=0), "fused_norm_residual": dict(rows=0),
    "sparse_aggregate": dict(n_dst=0), "graph_norm_bce": dict(e=0), "attn_decode": dict(b=0),
    "attn_prefill": dict(b=0), "attn_paged_decode": dict(lens=()), "attn_paged_prefill": dict(q_lens=(), kv_lens=()),
    "rotary_kv_append": dict(t=0),
}
PYTHON = os.path.realpath(sys.executable)  # not a launcher script: valgrind must see the interpreter


def cases(root, kinds=("public", "raw")):
    """[(name, op, kind, fn, warm)]: fn() one call; warm() what makes the next fn() calls steady
    (for a public op, the Python dispatcher's first call, which records the direct plan)."""
    sys.path.insert(0, os.path.abspath(root))
    import numpy as np
    import torch

    import qkernels
    from qkernels import ops as qk_ops
    from qkernels.testing import sample

    out = []
    x = torch.empty(0, 8)
    if "public" in kinds:
        out.append(("torch.add (empty)", None, "anchor", lambda: torch.add(x, x), lambda: None))
    for op, options in EMPTY.items():
        args, kwargs = sample(op, np.random.default_rng(0), **options)
        args = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
        n = sum(isinstance(a, torch.Tensor) for a in args)
        for kind in kinds:
            fn = getattr(qkernels, op) if kind == "public" else getattr(qkernels._C, op + "_raw")
            slow = qk_ops._python_path(op)  # the public op's Python path: records the direct plan
            out.append((f"{op} ({n} tensors) {kind}", op, kind,
                        lambda fn=fn, a=args, k=kwargs: fn(*a, **k),
                        lambda slow=slow, a=args, k=kwargs: slow(*a, **k)))
    # the direct path must be taken: a public call that reached the Python dispatcher would say so here
    for name, op, kind, fn, warm in out:
        warm()
        if kind == "public" and not qk_ops.direct_plans[op]:
            raise SystemExit(f"{name}: no direct plan was recorded")
    return out


def worker(a):
    """Times rounds on command: each line on stdin -> one JSON line of seconds per call, per case."""
    cs = cases(a.root)
    for _, _, _, fn, _ in cs:
        for _ in range(2000):
            fn()
    print(json.dumps([c[0] for c in cs]), flush=True)
    for _ in sys.stdin:
        times = []
        for _, _, _, fn, _ in cs:
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            times.append((time.perf_counter() - t0) / a.calls)
        print(json.dumps(times), flush=True)


def count(a):
    """Under callgrind: every case a.calls times, its entry point's instructions collected only then."""
    cs = cases(a.root, (a.kind,))  # (its checks run every case once: warm-ups counted too, see below)
    print(json.dumps([(c[0], c[1]) for c in cs]), flush=True)
    for _, _, _, fn, _ in cs:
        for _ in range(a.calls):
            fn()


def timing(a, builds):
    procs = {}
    for name, root in builds:
        p = subprocess.Popen([PYTHON, __file__, "--worker", "--root", root, "--calls", str(a.calls)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs[name] = p
    names = {b: json.loads(p.stdout.readline()) for b, p in procs.items()}
    samples = {b: [[] for _ in names[b]] for b in procs}
    order = list(procs)
    for r in range(a.rounds):
        for b in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
            p = procs[b]
            p.stdin.write("r\n")
            p.stdin.flush()
            for i, t in enumerate(json.loads(p.stdout.readline())):
                samples[b][i].append(t)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"µs per call, CPU torch tensors, calls with nothing to compute; median (best) of {a.rounds} rounds "
          f"x {a.calls} calls, builds interleaved")
    head = "| call | " + " | ".join(order) + " |"
    if len(order) == 2:
        head += f" {order[1]} / {order[0]} |"
    print(head)
    print("|---|" + "---:|" * (len(order) + (len(order) == 2)))
    for i, case in enumerate(names[order[0]]):
        med = [statistics.median(samples[b][i]) for b in order]
        best = [min(samples[b][i]) for b in order]
        row = f"| {case} | " + " | ".join(f"{m * 1e6:.3f} ({x * 1e6:.3f})" for m, x in zip(med, best)) + " |"
        if len(order) == 2:
            row += f" {med[1] / med[0]:.3f} |"
        print(row)


def callgrind(a, builds):
    results = {}
    for b, root in builds:
        for kind in ("public", "raw"):
            prefix = "qk_public_" if kind == "public" else "qk_op_"
            with tempfile.TemporaryDirectory() as tmp:
                cg = os.path.join(tmp, "cg.out")
                # each entry point by its full name: a pattern would also toggle at helpers (qk_op_finish)
                cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={cg}"]
                cmd += [f"--toggle-collect={prefix}{op}" for op in EMPTY]
                cmd += [PYTHON, __file__, "--count", "--kind", kind, "--root", root, "--calls", str(a.calls)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(r.stderr[-4000:])
                cs = json.loads(r.stdout.splitlines()[0])
                ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", cg],
                                     capture_output=True, text=True).stdout
                # a function is listed once per source file it has lines in; the entry under its
                # absolute path is its whole inclusive cost (the others are parts of it): the largest
                incl = {}
                for line in ann.splitlines():
                    m = re.match(r"\s*([\d,]+)\s+(?:\(.*?\)\s+)?\S*:(qk_(?:public|op)_\w+)", line)
                    if m:
                        incl[m.group(2)] = max(incl.get(m.group(2), 0), int(m.group(1).replace(",", "")))
                for case, op in cs:
                    if op is None:  # the anchor: torch's own entry point is not counted
                        continue
                    # a raw op runs once more in the warm-up (the Python path's call, the type's first lookup)
                    results.setdefault(case, {})[b] = incl.get(prefix + op, 0) / (a.calls + (kind == "raw"))
    order = [b for b, _ in builds]
    print(f"instructions per call (callgrind, inclusive of the C entry point), {a.calls} calls")
    print("| call | " + " | ".join(order) + " |" + (f" {order[1]} - {order[0]} |" if len(order) == 2 else ""))
    print("|---|" + "---:|" * (len(order) + (len(order) == 2)))
    for case, per in results.items():
        row = f"| {case} | " + " | ".join(f"{per.get(b, 0):.0f}" for b in order) + " |"
        if len(order) == 2:
            row += f" {per.get(order[1], 0) - per.get(order[0], 0):+.0f} |"
        print(row)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="append", default=[], help="NAME=CHECKOUT (repeatable; default: this one)")
    p.add_argument("--rounds", type=int, default=101)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--callgrind", action="store_true", help="instructions per call instead of time")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="public", help=argparse.SUPPRESS)
    p.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                   help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.count:
        return count(a)
    builds = [tuple(b.split("=", 1)) for b in a.build] or [("this", a.root)]
    (callgrind if a.callgrind else timing)(a, builds)


if __name__ == "__main__":
    main()
