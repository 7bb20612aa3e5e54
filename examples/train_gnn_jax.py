"""Training the QEC GNN decoder of train_gnn.py in JAX, with qkernels' ops inside a jitted step.

The model, code, noise, batch layout and initial weights are eval_gnn.py's (imported from it); the
four graph ops are qkernels.jax's (XLA custom calls with custom_vjp gradients from the backward
kernels), the rest is jax.numpy.  One jitted function does the forward pass, the loss, jax.grad and
an Adam update written as torch.optim.Adam computes it, so the loss curve can be compared with
train_gnn.py's PyTorch model on the same batches.  Dropout takes an explicit seed per step.

    python examples/train_gnn_jax.py [--distance 5] [--batch 256] [--layers 3] [--hidden 32]
                                     [--steps 30] [--iters 50] [--dropout 0.1] [--check]
    python examples/train_gnn_jax.py --check   # tiny, on the CPU: the loss curve against PyTorch's

The examples import the installed qkernels (`QKERNELS_JAX=1 pip install '.[jax]'`); in a source
checkout built in place, put it on the path: PYTHONPATH=. python examples/train_gnn_jax.py
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import qkernels.jax as qj

from eval_gnn import batch_structure, build_graph, init_weights, node_inputs, sample  # noqa: E402  (beside this file)
from gnn_args import training_parser  # noqa: E402

LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-3


def structure(graph, batch):
    """eval_gnn's batch structure as jax arrays (int32 indices, float32 features)."""
    st = batch_structure(graph, batch, "cpu")
    return {"edge_index": jnp.asarray(st.edge_index.numpy()), "row_ptr": jnp.asarray(st.row_ptr.numpy()),
            "col_idx": jnp.asarray(st.col_idx.numpy()), "dir_edge": jnp.asarray(st.dir_edge.numpy().astype(np.int32)),
            "edge_graph": jnp.asarray(st.edge_graph.numpy()), "edge_raw": jnp.asarray(st.edge_raw.numpy())}, st


def forward(w, st, node_x, labels, num_graphs, heads, p, seed):
    """eval_gnn.forward's decoder: -> the graph-normalised BCE loss."""
    x = node_x @ w["node_in"][0] + w["node_in"][1]
    e = st["edge_raw"] @ w["edge_in"][0] + w["edge_in"][1]
    N, H = x.shape
    training = p > 0
    for i, lw in enumerate(w["layers"]):
        h = jax.nn.relu(qj.fused_edge_features(x, st["edge_index"], e) @ lw["w1"][0] + lw["w1"][1])
        msg = h @ lw["msg"][0] + lw["msg"][1]
        att = jax.nn.sigmoid(h @ lw["att"][0] + lw["att"][1])
        v = (x @ lw["v"]).reshape(N, heads, H // heads)
        agg = qj.sparse_aggregate(st["row_ptr"], st["col_idx"], att[st["dir_edge"]], v)
        x = qj.fused_norm_residual(agg.reshape(N, H) @ lw["o"], x, *lw["norm_x"], p=p, training=training,
                                   seed=seed + 2 * i)
        e = qj.fused_norm_residual(msg, e, *lw["norm_e"], p=p, training=training, seed=seed + 2 * i + 1)
    h = jax.nn.relu(qj.fused_edge_features(x, st["edge_index"], e) @ w["head1"][0] + w["head1"][1])
    logits = (h @ w["head2"][0] + w["head2"][1]).reshape(-1)
    return qj.graph_norm_bce(logits, labels, st["edge_graph"], num_graphs)


def adam_init(w):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, w)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(w, g, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    """torch.optim.Adam's update (bias corrections applied as torch applies them)."""
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], g)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], g)
    bc1, bc2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
    w = jax.tree_util.tree_map(lambda w, m, v: w - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps), w, m, v)
    return w, {"m": m, "v": v, "t": t}


@functools.partial(jax.jit, static_argnames=("num_graphs", "heads", "p", "lr"))
def train_step(w, opt, st, node_x, labels, seed, *, num_graphs, heads, p, lr):
    loss, g = jax.value_and_grad(forward)(w, st, node_x, labels, num_graphs, heads, p, seed)
    w, opt = adam_update(w, g, opt, lr)
    return w, opt, loss


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
    p = training_parser(__doc__.split("\n\n")[0], "timed steps", "dropout of the timed run")
    p.add_argument("--check", action="store_true", help="tiny sizes on the CPU, the comparison run only")
    a = p.parse_args(argv)
    if a.check:
        a.distance, a.batch, a.steps = 3, 4, 8
    a.rounds = a.rounds or a.distance

    graph = build_graph(a.distance, a.rounds, a.p, a.p)
    st, torch_st = structure(graph, a.batch)
    prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)
    weights = init_weights(a.seed, a.layers, a.hidden, a.heads, np.log(prior / (1 - prior)))
    print(f"train_gnn_jax: d={a.distance}, {a.rounds} rounds, batch {a.batch}, {a.layers} layers, hidden {a.hidden}, "
          f"{a.heads} heads; jax {jax.__version__} on {jax.default_backend()}, float32, Adam lr {a.lr}")

    batches = make_batches(graph, torch_st, a, a.steps, a.seed + 1)
    w0 = jax.tree_util.tree_map(jnp.asarray, weights)
    static = dict(num_graphs=a.batch, heads=a.heads, lr=a.lr)
    w, opt, losses = w0, adam_init(w0), []
    for node_x, labels in batches:
        w, opt, loss = train_step(w, opt, st, node_x, labels, jnp.int32(0), p=0.0, **static)
        losses.append(float(loss))
    q = np.array(losses)
    ok = bool(q[-1] < q[0])
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"comparison ({a.steps} steps, dropout off): loss {q[0]:.6f} -> {q[-1]:.6f} (jax); torch is not "
              "installed, no PyTorch curve")
    else:
        t = np.array(torch_curve(graph, a, weights, a.seed + 1))
        worst = float(np.max(np.abs(q - t) / (LOSS_ATOL + LOSS_RTOL * np.abs(t))))
        ok &= worst <= 1.0
        print(f"comparison ({a.steps} steps, dropout off): loss {q[0]:.6f} -> {q[-1]:.6f} (jax), "
              f"{t[0]:.6f} -> {t[-1]:.6f} (pytorch); max abs diff {np.max(np.abs(q - t)):.1e}, "
              f"{worst:.2f} of the tolerance {LOSS_ATOL:.0e} + {LOSS_RTOL:.0e} |loss|: {'PASS' if ok else 'FAIL'}")
    if a.check:
        print("check passed" if ok else "check FAILED")
        return 0 if ok else 1

    node_x, labels = batches[0]
    w, opt = w0, adam_init(w0)
    step = functools.partial(train_step, p=a.dropout, **static)
    for i in range(3):
        w, opt, loss = step(w, opt, st, node_x, labels, jnp.int32(i))
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for i in range(a.iters):
        w, opt, loss = step(w, opt, st, node_x, labels, jnp.int32(1000 + 16 * i))
    jax.block_until_ready(loss)
    print(f"timed: jitted train step (forward, loss, grad, Adam), dropout {a.dropout}: "
          f"{(time.perf_counter() - t0) / a.iters * 1e3:.3f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
