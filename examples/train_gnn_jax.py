"""Training the QEC GNN decoder of train_gnn.py in JAX, with qkernels' ops inside a jitted step,
beside the same model in pure JAX.

The model, code, noise, batch layout and initial weights are eval_gnn.py's (imported from it); the
four graph ops are qkernels.jax's (XLA custom calls with custom_vjp gradients from the backward
kernels), the rest is jax.numpy.  One jitted function does the forward pass, the loss, jax.grad and
an Adam update written as torch.optim.Adam computes it, so the loss curve can be compared with
train_gnn.py's PyTorch model on the same batches.  Dropout takes an explicit seed per step.  The
same model is also written in jax.numpy alone (gnn_jnp.py: gather + segment_sum over the CSR rows,
LayerNorm and jax.random dropout, BCE per graph), so one process compares:

  qkernels   the graph ops as qkernels.jax's custom calls
  jax        the graph ops in jax.numpy, left to XLA

First the comparison run: the same seed, batches and initial weights through both (and through
train_gnn.py's PyTorch model), dropout off; the loss curves must agree (LOSS_RTOL).  Then the timed
runs, dropout on: the jitted train step (forward, loss, grad, Adam) and the jitted forward alone,
per variant, the variants taking turns over --repeats repeats.

    python examples/train_gnn_jax.py [--distance 5] [--batch 256] [--layers 3] [--hidden 32]
                                     [--steps 30] [--iters 50] [--repeats 5] [--dropout 0.1]
                                     [--variants qkernels,jax] [--check]
    python examples/train_gnn_jax.py --check   # tiny, on the CPU: the loss curves only

Data-parallel over N devices (--devices N, --batch per device): the batch splits by graph, each device
runs the step on its own graphs inside shard_map (see data_parallel_step) and the loss and gradients
are averaged over the devices; the run is checked against one device on the whole batch.  On the CPU:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/train_gnn_jax.py --devices 2 --check

The examples import the installed qkernels (`pip install '.[jax]'`); in a source
checkout built in place, put it on the path: PYTHONPATH=. python examples/train_gnn_jax.py
"""

from __future__ import annotations

import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import qkernels.jax as qj

import gnn_jnp  # noqa: E402  (beside this file, as the two below)
from eval_gnn import batch_structure, build_graph, init_weights, node_inputs, sample  # noqa: E402  (beside this file)
from gnn_args import training_parser  # noqa: E402

# The loss curve against train_gnn.py's PyTorch model (float32, on the CPU).  The model is the same;
# two steps differed and are now PyTorch's: jax.numpy's float32 matmuls may run as TF32 on a GPU at
# XLA's default precision (--precision highest keeps float32), and Adam's bias corrections cancelled
# in float32.  What remains is float32 summation order, which Adam amplifies (its first steps move
# every weight by ~lr whatever the gradient's size, so rounding in near-zero gradients shows): ~1e-4
# relative on the CPU check, hence 1e-3.
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-3


def structure(graph, batch):
    """eval_gnn's batch structure as jax arrays (int32 indices, float32 features), with what the
    jax.numpy ops need precomputed from it (csr_row, graph_size; see gnn_jnp)."""
    st = batch_structure(graph, batch, "cpu")
    row_ptr, edge_graph = st.row_ptr.numpy(), st.edge_graph.numpy()
    return {"edge_index": jnp.asarray(st.edge_index.numpy()), "row_ptr": jnp.asarray(row_ptr),
            "col_idx": jnp.asarray(st.col_idx.numpy()), "dir_edge": jnp.asarray(st.dir_edge.numpy().astype(np.int32)),
            "edge_graph": jnp.asarray(edge_graph), "edge_raw": jnp.asarray(st.edge_raw.numpy()),
            "csr_row": jnp.asarray(gnn_jnp.csr_rows(row_ptr)),
            "graph_size": jnp.asarray(gnn_jnp.graph_sizes(edge_graph, batch))}, st


class QkernelsOps:
    """The decoder's graph ops as qkernels.jax's custom calls."""

    @staticmethod
    def edge_features(st, x, e):
        return qj.fused_edge_features(x, st["edge_index"], e)

    @staticmethod
    def aggregate(st, att, v):
        return qj.sparse_aggregate(st["row_ptr"], st["col_idx"], att[st["dir_edge"]], v)

    @staticmethod
    def norm(x, res, gamma, beta, p, seed):
        return qj.fused_norm_residual(x, res, gamma, beta, p=p, training=p > 0, seed=seed)

    @staticmethod
    def loss(st, logits, labels, num_graphs):
        return qj.graph_norm_bce(logits, labels, st["edge_graph"], num_graphs)


class JaxOps:
    """The same ops in jax.numpy (gnn_jnp); dropout masks from jax.random keyed by the same seeds."""

    @staticmethod
    def edge_features(st, x, e):
        return gnn_jnp.fused_edge_features(x, st["edge_index"], e)

    @staticmethod
    def aggregate(st, att, v):
        return gnn_jnp.sparse_aggregate(st["csr_row"], st["col_idx"], att[st["dir_edge"]], v, v.shape[0])

    @staticmethod
    def norm(x, res, gamma, beta, p, seed):
        return gnn_jnp.fused_norm_residual(x, res, gamma, beta, p=p, key=jax.random.key(seed) if p > 0 else None)

    @staticmethod
    def loss(st, logits, labels, num_graphs):
        return gnn_jnp.graph_norm_bce(logits, labels, st["edge_graph"], st["graph_size"], graphs_sorted=True)


# --variants: the model on qkernels' ops, the same model in jax.numpy
OPS = {"qkernels": QkernelsOps, "jax": JaxOps}


def forward(w, st, node_x, labels, num_graphs, heads, p, seed, ops=QkernelsOps):
    """eval_gnn.forward's decoder on ops' graph ops: -> the graph-normalised BCE loss."""
    x = node_x @ w["node_in"][0] + w["node_in"][1]
    e = st["edge_raw"] @ w["edge_in"][0] + w["edge_in"][1]
    N, H = x.shape
    for i, lw in enumerate(w["layers"]):
        h = jax.nn.relu(ops.edge_features(st, x, e) @ lw["w1"][0] + lw["w1"][1])
        msg = h @ lw["msg"][0] + lw["msg"][1]
        att = jax.nn.sigmoid(h @ lw["att"][0] + lw["att"][1])
        v = (x @ lw["v"]).reshape(N, heads, H // heads)
        agg = ops.aggregate(st, att, v)
        x = ops.norm(agg.reshape(N, H) @ lw["o"], x, *lw["norm_x"], p, seed + 2 * i)
        e = ops.norm(msg, e, *lw["norm_e"], p, seed + 2 * i + 1)
    h = jax.nn.relu(ops.edge_features(st, x, e) @ w["head1"][0] + w["head1"][1])
    logits = (h @ w["head2"][0] + w["head2"][1]).reshape(-1)
    return ops.loss(st, logits, labels, num_graphs)


def adam_init(w):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, w)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(w, g, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    """torch.optim.Adam's update (bias corrections applied as torch applies them)."""
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], g)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], g)
    # 1 - b^t as -expm1(t log(b)) with log(b) from float64: float32's 1 - 0.999^t cancels to ~1e-5
    # relative error, where torch forms the corrections in Python floats
    tf = t.astype(jnp.float32)
    bc1, bc2 = -jnp.expm1(tf * math.log(b1)), -jnp.expm1(tf * math.log(b2))
    w = jax.tree_util.tree_map(lambda w, m, v: w - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps), w, m, v)
    return w, {"m": m, "v": v, "t": t}


@functools.partial(jax.jit, static_argnames=("num_graphs", "heads", "p", "lr", "ops"))
def train_step(w, opt, st, node_x, labels, seed, *, num_graphs, heads, p, lr, ops=QkernelsOps):
    loss, g = jax.value_and_grad(forward)(w, st, node_x, labels, num_graphs, heads, p, seed, ops)
    w, opt = adam_update(w, g, opt, lr)
    return w, opt, loss


@functools.partial(jax.jit, static_argnames=("num_graphs", "heads", "ops"))
def forward_step(w, st, node_x, labels, *, num_graphs, heads, ops):
    """The forward pass and loss alone (dropout off, as at evaluation)."""
    return forward(w, st, node_x, labels, num_graphs, heads, 0.0, 0, ops)


def data_parallel_step(mesh, *, num_graphs, heads, p, lr):
    """train_step over the mesh's axis "batch" (n devices): each device takes num_graphs / n graphs of
    the batch, and st is one shard's structure (indices local to its graphs, the same on every device,
    since the batch is n copies of one shard's layout).  The custom calls run per device inside
    shard_map on their shard alone; the only communication is the mean of the loss and gradients."""
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["batch"]

    def local(w, opt, st, node_x, labels, seed):
        # every device its own dropout masks: disjoint seeds for its 2 * layers norms
        shard_seed = (seed * n + jax.lax.axis_index("batch")) * (2 * len(w["layers"]))
        loss, g = jax.value_and_grad(forward)(w, st, node_x, labels, num_graphs // n, heads, p, shard_seed)
        loss, g = jax.lax.pmean((loss, g), "batch")  # each shard's loss is the mean over its graphs
        w, opt = adam_update(w, g, opt, lr)
        return w, opt, loss

    # check_vma off: the gradients are taken per device and averaged explicitly, as written above
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("batch"), P("batch"), P()),
                                 out_specs=(P(), P(), P()), check_vma=False))


def collectives(compiled_text):
    """{collective: count} in a compiled XLA module's text."""
    ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: compiled_text.count(f" {op}(") + compiled_text.count(f" {op}-start(") for op in ops}


def run_data_parallel(a, graph, st, w0, batches, losses, w_one):
    """--devices N: the comparison batches through data_parallel_step against the one-device losses
    and final weights w_one (dropout off), the compiled step's collectives, and unless --check the timed steps: one device on
    a.batch / N graphs beside N devices on a.batch.  -> whether the comparison passed."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n, local_batch = a.devices, a.batch // a.devices
    mesh = Mesh(np.array(jax.devices()[:n]), ("batch",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    st_local, _ = structure(graph, local_batch)
    st_local = jax.device_put(st_local, rep)
    static = dict(num_graphs=a.batch, heads=a.heads, lr=a.lr)
    w, opt, got = jax.device_put(w0, rep), jax.device_put(adam_init(w0), rep), []
    step = data_parallel_step(mesh, p=0.0, **static)
    for node_x, labels in batches:
        w, opt, loss = step(w, opt, st_local, jax.device_put(node_x, split), jax.device_put(labels, split),
                            jnp.int32(0))
        got.append(float(loss))
    g, q = np.array(got), np.array(losses)
    worst = float(np.max(np.abs(g - q) / (LOSS_ATOL + LOSS_RTOL * np.abs(q))))
    # weights after the same Adam steps: per array within a few ulps of its largest entry
    w_err = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (1e-7 + 1e-5 * np.max(np.abs(np.asarray(y)))))
                for x, y in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(w_one)))
    ok = worst <= 1.0 and w_err <= 1.0
    node_x, labels = (jax.device_put(v, split) for v in batches[0])
    text = step.lower(w, opt, st_local, node_x, labels, jnp.int32(0)).compile().as_text()
    found = collectives(text)
    ok &= found["all-gather"] == 0 and found["all-reduce"] > 0
    print(f"sharded over {n} devices ({local_batch} graphs each, shard_map): loss {g[0]:.6f} -> {g[-1]:.6f}, "
          f"max abs diff to one device {np.max(np.abs(g - q)):.1e}, {worst:.2f} of the tolerance, final weights "
          f"{w_err:.2f} of theirs; compiled step: "
          + ", ".join(f"{k} {v}" for k, v in found.items() if v or k == "all-gather") + f": {'PASS' if ok else 'FAIL'}")
    # For contrast: plain jit on the sharded batch, the custom calls having no sharding rule.
    plain = train_step.lower(w, opt, jax.device_put(st, rep), node_x, labels, jnp.int32(0), p=0.0, **static)
    print("  plain jit on the same sharded batch (no shard_map), compiled step: " + ", ".join(
        f"{k} {v}" for k, v in collectives(plain.compile().as_text()).items() if v) + " (the custom calls gathered)")
    if a.check:
        return ok

    def per_step(fn, *args):
        w, opt = args[0], args[1]
        for i in range(3):
            w, opt, loss = fn(w, opt, *args[2:], jnp.int32(i))
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
        for i in range(a.iters):
            w, opt, loss = fn(w, opt, *args[2:], jnp.int32(1000 + 16 * i))
        jax.block_until_ready(loss)
        return (time.perf_counter() - t0) / a.iters

    dev0 = jax.devices()[0]
    one = functools.partial(train_step, p=a.dropout, num_graphs=local_batch, heads=a.heads, lr=a.lr)
    t1 = per_step(one, *jax.device_put((w0, adam_init(w0), st_local, batches[0][0][:local_batch * graph.num_nodes],
                                        batches[0][1][:local_batch * graph.num_edges]), dev0))
    tn = per_step(data_parallel_step(mesh, p=a.dropout, **static), *jax.device_put((w0, adam_init(w0)), rep),
                  st_local, node_x, labels)
    print(f"timed: dropout {a.dropout}, {local_batch} graphs per device: 1 device {t1 * 1e3:.3f} ms/step "
          f"({local_batch / t1:.0f} graphs/s), {n} devices {tn * 1e3:.3f} ms/step ({a.batch / tn:.0f} graphs/s): "
          f"step ratio {tn / t1:.3f}, speed-up {t1 * n / tn:.2f}x")
    if jax.default_backend() == "gpu":
        print("  targets (2 H200, batch 256 per GPU): speed-up >= 1.8x, step ratio <= 1.10")
    return ok


def make_batches(graph, torch_st, a, count, seed):
    """(node inputs, labels) per step, from the same generator as train_gnn.py's make_batches."""
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        det, labels = sample(graph, a.batch, a.p, a.p, rng)
        node_x = node_inputs(torch_st, torch.from_numpy(det).to(torch.float32)).numpy()
        out.append((jnp.asarray(node_x), jnp.asarray(labels.reshape(-1).astype(np.float32))))
    return out


def torch_curve(graph, a, weights, seed):
    """train_gnn.py's PyTorch model (eager, dropout off) on the same batches: its loss per step."""
    import torch
    import train_gnn

    st = batch_structure(graph, a.batch, torch.device("cpu"))
    batches = train_gnn.make_batches(graph, st, a, a.steps, seed, torch.device("cpu"))
    model, opt, fwd = train_gnn.build("pytorch", "eager", weights, st, a, 0.0)
    return train_gnn.train(model, opt, fwd, batches)


def main(argv=None):
    p = training_parser(__doc__.split("\n\n")[0], "timed calls a repeat", "dropout of the timed steps")
    p.add_argument("--precision", default="highest", choices=("highest", "default"),
                   help="jax.numpy's float32 matmuls: highest = float32 as PyTorch; default lets a GPU use TF32")
    p.add_argument("--variants", default=",".join(OPS), help="comma-separated models of the timed runs: qkernels "
                   "(qkernels.jax's ops), jax (the same model in jax.numpy)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per variant, taken in turn; the median "
                   "is reported")
    p.add_argument("--check", action="store_true", help="tiny sizes on the CPU, the comparison run only")
    p.add_argument("--devices", type=int, default=1, help="data-parallel over this many devices; --batch is per "
                   "device (the one-device comparison takes the whole batch)")
    a = p.parse_args(argv)
    unknown = [v for v in a.variants.split(",") if v not in OPS]
    if unknown or a.repeats < 1 or a.iters < 1:
        p.error(f"--variants takes {','.join(OPS)} (got {','.join(unknown)})" if unknown
                else "--repeats and --iters take a positive count")
    with jax.default_matmul_precision(a.precision):
        return run(a)


def curve(ops, st, w0, batches, static):
    """The loss per step of ops' model trained on batches (dropout off) from w0 -> (losses, final weights)."""
    w, opt, losses = w0, adam_init(w0), []
    for node_x, labels in batches:
        w, opt, loss = train_step(w, opt, st, node_x, labels, jnp.int32(0), p=0.0, ops=ops, **static)
        losses.append(float(loss))
    return np.array(losses), w


def within(got, want):
    """got's worst distance to want as a fraction of the tolerance LOSS_ATOL + LOSS_RTOL |want|."""
    return float(np.max(np.abs(got - want) / (LOSS_ATOL + LOSS_RTOL * np.abs(want))))


def time_variants(a, st, w0, node_x, labels):
    """Per variant: seconds per jitted train step (dropout a.dropout, a new seed each step) and per jitted
    forward pass, each the median of a.repeats timings of a.iters calls back to back; the variants take
    turns within each repeat, so a load that comes and goes on the machine touches them alike.
    -> {variant: (step times, forward times)}."""
    static = dict(num_graphs=a.batch, heads=a.heads)
    blocks = {}
    for name in a.variants.split(","):
        step = functools.partial(train_step, p=a.dropout, lr=a.lr, ops=OPS[name], **static)
        fwd = functools.partial(forward_step, ops=OPS[name], **static)
        state = {"w": w0, "opt": adam_init(w0), "i": 0}

        def train(n, step=step, state=state):
            w, opt, i = state["w"], state["opt"], state["i"]
            t0 = time.perf_counter()
            for i in range(i, i + n):  # seeds 16 apart: each step's 2 * layers norms their own masks
                w, opt, loss = step(w, opt, st, node_x, labels, jnp.int32(16 * i))
            jax.block_until_ready(loss)
            state.update(w=w, opt=opt, i=i + 1)
            return (time.perf_counter() - t0) / n

        def forward_only(n, fwd=fwd):
            t0 = time.perf_counter()
            for _ in range(n):
                loss = fwd(w0, st, node_x, labels)
            jax.block_until_ready(loss)
            return (time.perf_counter() - t0) / n

        train(3), forward_only(3)  # compiled and warm
        blocks[name] = (train, forward_only)
    times = {name: ([], []) for name in blocks}
    for _ in range(a.repeats):
        for name, (train, forward_only) in blocks.items():
            times[name][0].append(train(a.iters))
            times[name][1].append(forward_only(a.iters))
    return times


def report(a, times):
    """The table of time_variants' medians (min-max of the repeats), ratios to the pure-JAX model's."""
    ref = "jax" if "jax" in times else next(iter(times))
    med = {name: (np.median(ts), np.median(fs)) for name, (ts, fs) in times.items()}

    def cell(ts):
        return f"{np.median(ts) * 1e3:.3f} ({np.min(ts) * 1e3:.3f}-{np.max(ts) * 1e3:.3f})"

    print(f"timed: jitted train step (forward, loss, grad, Adam; dropout {a.dropout}) and jitted forward "
          f"(loss, dropout off): ms per call, median of {a.repeats} repeats of {a.iters} calls (min-max); "
          f"ratio to {ref}'s")
    print(f"  {'variant':<9} {'ms/step':>27} {'ratio':>6} {'forward ms':>27} {'ratio':>6}")
    for name, (ts, fs) in times.items():
        print(f"  {name:<9} {cell(ts):>27} {med[name][0] / med[ref][0]:>6.3f} {cell(fs):>27} "
              f"{med[name][1] / med[ref][1]:>6.3f}")
    if jax.default_backend() == "gpu" and {"qkernels", "jax"} <= set(times):
        print(f"  target (H200, d=5, batch 256): qkernels' step 1.3x faster than jax's (ratio <= {1 / 1.3:.3f})")


def run(a):
    if a.check:
        a.distance, a.batch, a.steps = 3, max(1, 4 // a.devices), 8
    a.rounds = a.rounds or a.distance
    a.batch *= a.devices
    if len(jax.devices()) < a.devices:
        print(f"--devices {a.devices}: jax sees {len(jax.devices())} device(s) ({jax.default_backend()}); on the CPU "
              f"set XLA_FLAGS=--xla_force_host_platform_device_count={a.devices} before jax starts")
        return 1

    graph = build_graph(a.distance, a.rounds, a.p, a.p)
    st, torch_st = structure(graph, a.batch)
    prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)
    weights = init_weights(a.seed, a.layers, a.hidden, a.heads, np.log(prior / (1 - prior)))
    print(f"train_gnn_jax: d={a.distance}, {a.rounds} rounds, batch {a.batch}, {a.layers} layers, hidden {a.hidden}, "
          f"{a.heads} heads; jax {jax.__version__} on {jax.default_backend()}, float32 (matmul precision "
          f"{a.precision}), Adam lr {a.lr}")

    # The comparison run: dropout off, the same batches and initial weights through both models.
    batches = make_batches(graph, torch_st, a, a.steps, a.seed + 1)
    w0 = jax.tree_util.tree_map(jnp.asarray, weights)
    static = dict(num_graphs=a.batch, heads=a.heads, lr=a.lr)
    q, w = curve(QkernelsOps, st, w0, batches, static)
    ok = bool(q[-1] < q[0])
    j = curve(JaxOps, st, w0, batches, static)[0]
    worst = within(j, q)
    ok &= worst <= 1.0
    print(f"pure JAX vs qkernels ({a.steps} steps, dropout off): loss {j[0]:.6f} -> {j[-1]:.6f} (jax), "
          f"{q[0]:.6f} -> {q[-1]:.6f} (qkernels); max abs diff {np.max(np.abs(j - q)):.1e}, {worst:.2f} of the "
          f"tolerance {LOSS_ATOL:.0e} + {LOSS_RTOL:.0e} |loss|: {'PASS' if worst <= 1.0 else 'FAIL'}")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: no PyTorch curve")
    else:
        t = np.array(torch_curve(graph, a, weights, a.seed + 1))
        worst = within(q, t)
        ok &= worst <= 1.0
        print(f"comparison ({a.steps} steps, dropout off): loss {q[0]:.6f} -> {q[-1]:.6f} (qkernels), "
              f"{t[0]:.6f} -> {t[-1]:.6f} (pytorch); max abs diff {np.max(np.abs(q - t)):.1e}, "
              f"{worst:.2f} of the tolerance {LOSS_ATOL:.0e} + {LOSS_RTOL:.0e} |loss|: "
              f"{'PASS' if worst <= 1.0 else 'FAIL'}")
    if a.devices > 1:
        ok &= run_data_parallel(a, graph, st, w0, batches, list(q), w)
    if a.check:
        print("check passed" if ok else "check FAILED")
        return 0 if ok else 1

    report(a, time_variants(a, st, w0, *batches[0]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
