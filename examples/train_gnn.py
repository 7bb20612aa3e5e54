"""Training the QEC GNN decoder of eval_gnn.py with qkernels, beside the same model in pure PyTorch.

The model, code, noise and batch layout are eval_gnn.py's (imported from it); here its weights are
parameters, the four graph ops carry gradients (qkernels' torch operators and backward kernels), and
Adam trains it on freshly sampled syndromes.  The same model is also written with PyTorch ops only
(gather + cat, index_add, layer_norm + dropout, binary_cross_entropy_with_logits), so one script
compares:

  qkernels   eager | torch.compile | torch.compile(mode="reduce-overhead")  (CUDA graphs) | graph | compile-graph
  pytorch    eager | torch.compile | torch.compile(mode="reduce-overhead")                | graph | compile-graph

graph (CUDA only) captures the whole training step, Adam included, in one torch.cuda.graph and the
forward alone in another; each step copies its batch into the graphs' static inputs and replays once.
compile-graph does the same with torch.compile's default mode inside (asked for by name only).

First a comparison run: the same seed, data and initial weights through qkernels and pure PyTorch
(eager) with dropout off; their loss curves must agree (LOSS_RTOL).  Then the timed runs, with
dropout on (qkernels regenerates its mask from a seed drawn from torch's generator; PyTorch stores
it): the training step (forward, loss, backward, Adam) and the forward pass alone, per variant.
The graph variants join the comparison run, and show that every replay draws new dropout masks.

    python examples/train_gnn.py [--distance 5] [--batch 256] [--layers 3] [--hidden 32] [--steps 30]
                                 [--dropout 0.1] [--variants qkernels:eager,...] [--check]
    python examples/train_gnn.py --check      # tiny, on the CPU: the comparison run only

Data-parallel (--ddp, under torchrun: NCCL with one GPU per rank, gloo on the CPU): each rank trains on
its own --batch syndromes through DistributedDataParallel, the model code unchanged.  First every
rank checks its all-reduced gradients against one process on the ranks' concatenated batches
(dropout off), then the timed runs give one GPU's step beside the data-parallel step and the speed-up:

    torchrun --nproc-per-node 2 examples/train_gnn.py --ddp [--batch 256] [--variants ...]
    torchrun --nproc-per-node 2 examples/train_gnn.py --ddp --check   # tiny, gloo on the CPU

The examples import the installed qkernels (`pip install .`); in a source checkout built in place,
put it on the path: PYTHONPATH=. python examples/train_gnn.py
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see eval_gnn.py
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast (NVLS) is off on the lent hosts
if "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun the ranks of one host share its cores: each rank's
    os.environ.setdefault("QKERNELS_NUM_THREADS",  # qkernels pool its share (read at import), like OMP_NUM_THREADS
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"]))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qkernels  # noqa: E402
import qkernels.torch  # noqa: E402,F401  registers the operators before torch.compile traces

from eval_gnn import batch_structure, build_graph, init_weights, node_inputs, sample  # noqa: E402  (it sits beside this file)
from gnn_args import training_parser  # noqa: E402  (beside this file too)

# Loss curves of qkernels and pure PyTorch over the comparison steps, float32 both.  The losses are
# small (~5e-4 at p = 0.003: most edges have logits near -7.6), and PyTorch's BCE-with-logits computes
# l + log(1 + exp(-l)) for them, which cancels to an absolute error of ~6e-8 per edge (qkernels uses
# log1p): measured 6e-5 relative on the first, untrained step, growing under Adam to 4.5e-4 (2e-7
# absolute) by step 4, while the first step's gradients agree to 1.7e-7.  A wrong gradient moves the
# curves apart by orders of magnitude more within a few steps.
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-3

IMPLS = ("qkernels", "pytorch")
# graph, compile-graph: the whole step in one CUDA graph (GraphStep), from the eager model or from
# torch.compile's default mode (its kernels, no CUDA graphs of its own)
GRAPH_MODES = ("graph", "compile-graph")
MODES = ("eager", "compile", "reduce-overhead", *GRAPH_MODES)
VARIANTS = ("qkernels:eager,qkernels:compile,qkernels:reduce-overhead,pytorch:eager,pytorch:compile,"
            "pytorch:reduce-overhead")
CUDA_VARIANTS = "qkernels:graph,pytorch:graph"  # added to the default on CUDA


class QkernelsOps:
    """The decoder's graph ops from qkernels."""

    name = "qkernels"

    def __init__(self, st):
        self.st = st

    def edge_features(self, x, e):
        return qkernels.fused_edge_features(x, self.st.edge_index, e, plan=self.st.ef_plan)

    def aggregate(self, att, v):
        return qkernels.sparse_aggregate(self.st.row_ptr, self.st.col_idx, att[self.st.dir_edge], v,
                                         plan=self.st.sa_plan)

    def norm(self, x, res, gamma, beta, p, training):
        return qkernels.fused_norm_residual(x, res, gamma, beta, p=p, training=training)

    def loss(self, logits, labels):
        return qkernels.graph_norm_bce(logits, labels, self.st.edge_graph, self.st.num_graphs)

    def layer(self, x, e, m, heads, p, training):
        # Training runs the layer op by op (dropout, and backward kernels that walk the graph plans);
        # inference runs it as one op, two kernels on cuda.
        if training:
            return layer_ops(self, x, e, m, heads, p, training)
        st = self.st
        return qkernels.message_passing(x, e, st.edge_index, st.row_ptr, st.col_idx, st.dir_edge, m.w1[0], m.w1[1],
                                        m.msg[0], m.msg[1], m.att[0], m.att[1], m.v, m.o, m.norm_x[0], m.norm_x[1],
                                        m.norm_e[0], m.norm_e[1])


class TorchOps:
    """The same ops written with PyTorch only."""

    name = "pytorch"

    def __init__(self, st):
        self.st = st
        self.src, self.dst = st.edge_index.long()
        counts = torch.diff(st.row_ptr.long())
        self.csr_row = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        self.col = st.col_idx.long()
        self.graph = st.edge_graph.long()
        self.per_graph = torch.bincount(self.graph, minlength=st.num_graphs).clamp(min=1).float()

    def edge_features(self, x, e):
        xs, xd = x[self.src], x[self.dst]
        return torch.cat([xs + xd, (xs - xd).abs(), e], dim=1)

    def aggregate(self, att, v):
        msg = att[self.st.dir_edge][:, :, None] * v[self.col]
        return torch.zeros_like(v).index_add(0, self.csr_row, msg)

    def norm(self, x, res, gamma, beta, p, training):
        return F.dropout(F.layer_norm(x, x.shape[-1:], gamma, beta, 1e-5), p, training) + res

    def loss(self, logits, labels):
        bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        sums = logits.new_zeros(self.st.num_graphs).index_add(0, self.graph, bce)
        return (sums / self.per_graph).mean()

    def layer(self, x, e, m, heads, p, training):
        return layer_ops(self, x, e, m, heads, p, training)


def layer_ops(ops, x, e, m, heads, p, training):
    """One message-passing layer of the decoder through ops' graph ops: -> (x, e)."""
    N, H = x.shape
    h = torch.relu(ops.edge_features(x, e) @ m.w1[0] + m.w1[1])
    msg = h @ m.msg[0] + m.msg[1]
    att = torch.sigmoid(h @ m.att[0] + m.att[1])
    v = (x @ m.v).view(N, heads, H // heads)
    agg = ops.aggregate(att, v)
    x_out = ops.norm(agg.view(N, H) @ m.o, x, m.norm_x[0], m.norm_x[1], p, training)
    return x_out, ops.norm(msg, e, m.norm_e[0], m.norm_e[1], p, training)


class Decoder(torch.nn.Module):
    """eval_gnn.py's forward() as a module whose weights are parameters."""

    def __init__(self, weights, heads, ops, dropout):
        super().__init__()
        self.heads, self.ops, self.dropout = heads, ops, dropout

        def P(a):
            return torch.nn.Parameter(torch.from_numpy(np.array(a)))

        self.node_in = torch.nn.ParameterList([P(a) for a in weights["node_in"]])
        self.edge_in = torch.nn.ParameterList([P(a) for a in weights["edge_in"]])
        self.layers = torch.nn.ModuleList()
        for lw in weights["layers"]:
            m = torch.nn.Module()
            m.w1, m.msg, m.att = (torch.nn.ParameterList([P(a) for a in lw[k]]) for k in ("w1", "msg", "att"))
            m.v, m.o = P(lw["v"]), P(lw["o"])
            m.norm_x, m.norm_e = (torch.nn.ParameterList([P(a) for a in lw[k]]) for k in ("norm_x", "norm_e"))
            self.layers.append(m)
        self.head1 = torch.nn.ParameterList([P(a) for a in weights["head1"]])
        self.head2 = torch.nn.ParameterList([P(a) for a in weights["head2"]])

    def forward(self, node_x, edge_x, labels):
        ops, p, training = self.ops, self.dropout, self.training
        x = node_x @ self.node_in[0] + self.node_in[1]
        e = edge_x @ self.edge_in[0] + self.edge_in[1]
        for m in self.layers:
            x, e = ops.layer(x, e, m, self.heads, p, training)
        h = torch.relu(ops.edge_features(x, e) @ self.head1[0] + self.head1[1])
        logits = (h @ self.head2[0] + self.head2[1]).view(-1)
        return ops.loss(logits, labels)


def make_batches(graph, st, a, count, seed, device):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        det, labels = sample(graph, a.batch, a.p, a.p, rng)
        det_t = torch.from_numpy(det).to(device, torch.float32)
        out.append((node_inputs(st, det_t), st.edge_raw,
                    torch.from_numpy(labels.reshape(-1)).to(device, torch.float32)))
    return out


def build(impl, mode, weights, st, a, dropout, lr=None):
    model = Decoder(weights, a.heads, (QkernelsOps if impl == "qkernels" else TorchOps)(st), dropout)
    model = model.to(st.row_ptr.device)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr if lr is None else lr,
                           **({"fused": True} if st.row_ptr.is_cuda else {}),
                           **({"capturable": True} if mode in GRAPH_MODES else {}))
    mode = {"graph": "eager", "compile-graph": "compile"}.get(mode, mode)
    fwd = model if mode == "eager" else torch.compile(model, mode=None if mode == "compile" else mode,
                                                      fullgraph=impl == "qkernels")
    return model, opt, fwd


def train(model, opt, fwd, batches):
    losses = []
    model.train()
    for node_x, edge_x, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = fwd(node_x, edge_x, labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


class GraphStep:
    """The training step (zero_grad, forward, loss, backward, Adam) captured whole in one CUDA graph,
    torch.cuda.graph's whole-network capture: a step is one replay, so the host launches one graph
    instead of a few hundred kernels, autograd's engine and the optimizer.  Each call copies its
    batch into the static inputs first (the copies belong to the step).  The gradients are None at
    capture, so the captured backward assigns them: static buffers of the graph's pool that every
    replay overwrites.  Dropout seeds come from torch's generator inside the graph (qkernels draws
    a seed tensor, PyTorch its Philox offset), which the replay advances: new masks every replay."""

    def __init__(self, model, opt, fwd, warm):
        """warm: the batches of the warm-up steps, eager on a side stream (cuBLAS, the optimizer's
        state and torch.compile set themselves up outside the capture).  They are real training
        steps: their losses are self.warm_losses."""
        self.model, self.opt, self.fwd = model, opt, fwd
        self.static = [t.clone() for t in warm[0]]
        self.fwd_graph = None
        model.train()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")  # Adam: "step() not captured"
            losses = [self._step(batch).detach() for batch in warm]
        torch.cuda.current_stream().wait_stream(side)
        self.warm_losses = [float(v) for v in losses]
        opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step(None).detach()

    def _step(self, batch):
        if batch is not None:
            torch._foreach_copy_(self.static, list(batch))
        self.opt.zero_grad(set_to_none=True)
        loss = self.fwd(*self.static)
        loss.backward()
        self.opt.step()
        return loss

    def step(self, batch):
        """One training step on batch -> its loss (a static tensor the next replay overwrites)."""
        torch._foreach_copy_(self.static, list(batch))
        self.graph.replay()
        return self.loss

    def capture_forward(self):
        """The forward alone (eval mode, no gradients) as a graph of its own, warmed up the same way."""
        self.model.eval()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.fwd(*self.static)
            torch.cuda.current_stream().wait_stream(side)
            self.fwd_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.fwd_graph):
                self.fwd_out = self.fwd(*self.static)

    def forward(self, batch):
        torch._foreach_copy_(self.static, list(batch))
        self.fwd_graph.replay()
        return self.fwd_out


def train_graph(model, opt, fwd, batches, warm=3):
    """train() through a GraphStep: the first batches (up to warm, leaving at least one to replay when
    there are two) are its warm-up steps, the rest are replays -> (losses, how many were replayed)."""
    n = max(1, min(warm, len(batches) - 1))
    gs = GraphStep(model, opt, fwd, batches[:n])
    return gs.warm_losses + [float(gs.step(b)) for b in batches[n:]], len(batches) - n


def fresh_masks(impl, mode, weights, st, a, batch):
    """Whether dropout draws new masks at every replay of the captured step: with Adam's lr 0 the
    weights stay, so two replays on one batch give different losses with dropout 0.5 and the same
    loss (to rounding: PyTorch's index_add sums in any order) with dropout off."""
    same = []
    for p in (0.5, 0.0):
        model, opt, fwd = build(impl, mode, weights, st, a, p, lr=0.0)
        gs = GraphStep(model, opt, fwd, [batch])
        first, second = float(gs.step(batch)), float(gs.step(batch))
        same.append(abs(first - second) <= 1e-5 * abs(first))
    return same == [False, True]


def parse_variants(p, text):
    """--variants -> [(impl, mode)]; an unknown one is a usage error naming it."""
    out = []
    for v in text.split(","):
        impl, _, mode = v.strip().partition(":")
        if impl not in IMPLS or mode not in MODES:
            p.error(f"--variants takes impl:mode, impl one of {','.join(IMPLS)} and mode one of {','.join(MODES)} "
                    f"(got {v.strip()!r})")
        out.append((impl, mode))
    return out


def timed(fn, iters, device):
    """Seconds per call of fn over iters calls after warm-up (the device waited for at both ends)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    p = training_parser(__doc__.split("\n\n")[0], "timed steps per variant", "dropout of the timed runs")
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--variants", help="comma-separated impl:mode of the timed runs, impl qkernels or pytorch, mode "
                   f"one of {', '.join(MODES)} (default: {VARIANTS}, and on CUDA {CUDA_VARIANTS})")
    p.add_argument("--check", action="store_true", help="tiny sizes on the CPU, the comparison run only")
    p.add_argument("--profile", action="store_true", help="after the timed runs, where a training step's device "
                   "time goes: the kernels of one step per variant (torch.profiler), largest first")
    p.add_argument("--ddp", action="store_true", help="data-parallel over the ranks of torchrun (NCCL on GPUs, "
                   "gloo on the CPU); --batch is per rank")
    p.add_argument("--timeout", type=float, default=1800, help="--ddp: seconds a collective may wait")
    p.add_argument("--no-plans", action="store_true", help="no graph plans: the backward ops group the graph "
                   "on every call (to measure what the plans save)")
    a = p.parse_args(argv)
    variants = parse_variants(p, a.variants) if a.variants else None
    if a.check:
        a.distance, a.batch, a.steps, a.device = 3, 4, 8, a.device or "cpu"
        a.timeout = min(a.timeout, 120)
    a.rounds = a.rounds or a.distance
    if a.ddp:
        if "RANK" not in os.environ:
            p.error("--ddp runs under torchrun: torchrun --nproc-per-node N examples/train_gnn.py --ddp")
        if any(mode in GRAPH_MODES for _, mode in variants or ()):
            p.error("--ddp: the graph modes capture one process's step; use eager, compile or reduce-overhead")
        if variants is None:  # CUDA graphs under DDP: by request only
            a.variants = "qkernels:eager,qkernels:compile,pytorch:eager,pytorch:compile"
        return ddp_main(a)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and qkernels.AVAILABLE else "cpu"))
    if variants is None:
        variants = parse_variants(p, VARIANTS + ("," + CUDA_VARIANTS if device.type == "cuda" else ""))
    graphs = [f"{impl}:{mode}" for impl, mode in variants if mode in GRAPH_MODES]

    graph = build_graph(a.distance, a.rounds, a.p, a.p)
    st = batch_structure(graph, a.batch, device)
    if a.no_plans:
        st.sa_plan = st.ef_plan = None
    prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)
    weights = init_weights(a.seed, a.layers, a.hidden, a.heads, np.log(prior / (1 - prior)))
    print(f"train_gnn: d={a.distance}, {a.rounds} rounds, batch {a.batch} ({a.batch * graph.num_nodes} nodes, "
          f"{a.batch * graph.num_edges} edges), {a.layers} layers, hidden {a.hidden}, {a.heads} heads; "
          f"device {device}, float32, Adam lr {a.lr}")

    # The comparison run: dropout off, the same batches and initial weights.
    batches = make_batches(graph, st, a, a.steps, a.seed + 1, device)
    curves = {}
    for impl in ("qkernels", "pytorch"):
        model, opt, fwd = build(impl, "eager", weights, st, a, 0.0)
        curves[impl] = train(model, opt, fwd, batches)
    q, t = np.array(curves["qkernels"]), np.array(curves["pytorch"])
    worst = float(np.max(np.abs(q - t) / (LOSS_ATOL + LOSS_RTOL * np.abs(t))))
    ok = worst <= 1.0 and q[-1] < q[0]
    print(f"comparison ({a.steps} steps, dropout off): loss {q[0]:.6f} -> {q[-1]:.6f} (qkernels), "
          f"{t[0]:.6f} -> {t[-1]:.6f} (pytorch); max abs diff {np.max(np.abs(q - t)):.1e}, "
          f"{worst:.2f} of the tolerance {LOSS_ATOL:.0e} + {LOSS_RTOL:.0e} |loss|: {'PASS' if ok else 'FAIL'}")
    # Inference (eval mode, no grad): qkernels runs each layer as one message_passing op.
    with torch.no_grad():
        losses = []
        for impl in ("qkernels", "pytorch"):
            model = build(impl, "eager", weights, st, a, 0.0)[0].eval()
            losses.append(float(model(*batches[0])))
    err = abs(losses[0] - losses[1]) / (LOSS_ATOL + LOSS_RTOL * abs(losses[1]))
    ok &= err <= 1.0
    print(f"comparison, inference (message_passing): loss {losses[0]:.6f} (qkernels), {losses[1]:.6f} (pytorch), "
          f"{err:.2f} of the tolerance: {'PASS' if err <= 1.0 else 'FAIL'}")
    if graphs and device.type != "cuda":
        print(f"{', '.join(graphs)}: skipped, CUDA graphs need a CUDA device")
    elif graphs:  # each graph variant's curve against pure PyTorch's eager one, then its dropout masks
        for variant in graphs:
            impl, mode = variant.split(":")
            torch._dynamo.reset()
            g, replayed = train_graph(*build(impl, mode, weights, st, a, 0.0), batches)
            g = np.array(g)
            err = float(np.max(np.abs(g - t) / (LOSS_ATOL + LOSS_RTOL * np.abs(t))))
            fresh = fresh_masks(impl, mode, weights, st, a, batches[0])
            ok &= err <= 1.0 and fresh
            print(f"comparison, {variant} ({replayed} of the {a.steps} steps replayed): loss {g[0]:.6f} -> "
                  f"{g[-1]:.6f}, {err:.2f} of the tolerance against pytorch eager: {'PASS' if err <= 1.0 else 'FAIL'}; "
                  f"new dropout masks every replay: {'PASS' if fresh else 'FAIL'}")
    if a.check:
        # one compiled step with qkernels inside torch.compile (fullgraph): the eager loss, the same grads
        model, opt, fwd = build("qkernels", "compile", weights, st, a, 0.0)
        c = train(model, opt, fwd, batches[:2])
        same = np.allclose(c, q[:2], rtol=LOSS_RTOL, atol=LOSS_ATOL)
        print(f"compiled (fullgraph): losses {c[0]:.6f}, {c[1]:.6f} vs eager {q[0]:.6f}, {q[1]:.6f}: "
              f"{'PASS' if same else 'FAIL'}")
        ok &= same
        print("check passed" if ok else "check FAILED")
        return 0 if ok else 1

    print(f"timed: {a.iters} steps per variant, dropout {a.dropout}")
    print(f"  {'variant':<28} {'train step':>11} {'forward':>9}")
    batch = batches[0]
    for impl, mode in variants:
        variant = f"{impl}:{mode}"
        if mode in GRAPH_MODES and device.type != "cuda":
            print(f"  {variant:<28} skipped: CUDA graphs need a CUDA device")
            continue
        torch._dynamo.reset()
        model, opt, fwd = build(impl, mode, weights, st, a, a.dropout)
        if mode in GRAPH_MODES:
            gs = GraphStep(model, opt, fwd, [batch] * 3)
            step = lambda gs=gs: gs.step(batch)  # noqa: E731  (the copies into the graph's inputs, one replay)
            t_step = timed(step, a.iters, device)
            gs.capture_forward()
            t_fwd = timed(lambda: gs.forward(batch), a.iters, device)
        else:
            def step():
                opt.zero_grad(set_to_none=True)
                loss = fwd(*batch)
                loss.backward()
                opt.step()

            t_step = timed(step, a.iters, device)
            model.eval()
            with torch.no_grad():
                t_fwd = timed(lambda: fwd(*batch), a.iters, device)
        print(f"  {variant:<28} {t_step * 1e3:>8.3f} ms {t_fwd * 1e3:>6.3f} ms")
        if a.profile:
            model.train()
            profile(step, device)
    return 0 if ok else 1


# ---- data-parallel training: --ddp under torchrun ------------------------------------------------

# DDP's gradients (each rank's loss is the mean over its graphs, the all-reduce averages the ranks)
# against one process on the concatenated batch: the same fp32 terms summed in another order, and
# after some Adam steps weights a few ulps apart; a missing or wrong all-reduce is off by O(1).
GRAD_ATOL, GRAD_RTOL = 1e-8, 1e-4


def global_batches(graph, a, count, seed, world):
    """count batches of world * a.batch syndromes, (detectors, labels) as NumPy: rank r trains on rows
    [r * a.batch, (r + 1) * a.batch) of each, the single-process reference on all of them."""
    rng = np.random.default_rng(seed)
    return [sample(graph, world * a.batch, a.p, a.p, rng) for _ in range(count)]


def inputs(st, det, labels, device):
    """The model's (node inputs, edge inputs, labels) for syndromes det/labels on st's graphs."""
    det_t = torch.from_numpy(det).to(device, torch.float32)
    return node_inputs(st, det_t), st.edge_raw, torch.from_numpy(labels.reshape(-1)).to(device, torch.float32)


def build_ddp(impl, mode, weights, st, a, dropout):
    """build() with the module wrapped in DistributedDataParallel (compiled around the wrapper, so
    Dynamo's DDP optimizer splits the graph at the gradient buckets)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = st.row_ptr.device
    model = Decoder(weights, a.heads, (QkernelsOps if impl == "qkernels" else TorchOps)(st), dropout).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, **({"fused": True} if device.type == "cuda" else {}))
    fwd = ddp if mode == "eager" else torch.compile(ddp, mode=None if mode == "compile" else mode)
    return ddp, opt, fwd


def ddp_compare(graph, weights, a, device, rank, world):
    """a.steps steps of DDP (qkernels, eager, dropout off) beside one process on the concatenated
    batches, both with Adam from the same weights -> (worst gradient error, worst loss error) as
    fractions of their tolerances, the largest over steps, parameters and ranks; inf if any
    parameter or gradient left this rank's device."""
    st = batch_structure(graph, a.batch, device)  # this rank's graphs, indices local to them
    st_all = batch_structure(graph, world * a.batch, device)
    mine = slice(rank * a.batch, (rank + 1) * a.batch)
    ddp, opt, _ = build_ddp("qkernels", "eager", weights, st, a, 0.0)
    ref, opt_ref, _ = build("qkernels", "eager", weights, st_all, a, 0.0)
    worst = torch.zeros(2, dtype=torch.float64, device=device)
    for det, labels in global_batches(graph, a, a.steps, a.seed + 1, world):
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        loss = ddp(*inputs(st, det[mine], labels[mine], device))
        loss.backward()
        want = ref(*inputs(st_all, det, labels, device))
        want.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        worst[1] = torch.maximum(worst[1], (mean - want.detach()).abs() / (LOSS_ATOL + LOSS_RTOL * want.detach().abs()))
        for p, q in zip(ddp.module.parameters(), ref.parameters()):
            if p.device != device or p.grad is None or p.grad.device != device:
                worst.fill_(float("inf"))
                continue
            err = (p.grad - q.grad).abs().max() / (GRAD_ATOL + GRAD_RTOL * q.grad.abs().max())
            worst[0] = torch.maximum(worst[0], err.double())
        opt.step()
        opt_ref.step()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def host_syncs(fn, device, strict):
    """Run fn() behind a kernel that keeps the device busy for about a second -> (whether fn returned
    while that kernel still ran, fn's host seconds, torch's synchronisations reported).  A host wait
    for the device, from torch or from any library calling the CUDA runtime itself, lets the kernel
    finish first; torch's sync debug mode names torch's own (strict: raises at the first)."""
    import warnings

    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second at Hopper's clocks
        torch.cuda.set_sync_debug_mode("error" if strict else "warn")
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            host = time.perf_counter() - t0
            torch.cuda.set_sync_debug_mode("default")
            busy = not torch.cuda.current_stream(device).query()
            torch.cuda.synchronize(device)
    return busy, host, sum("synchroniz" in str(w.message) for w in seen)


def qkernels_step(st, a, device):
    """Forward and backward of the four graph ops on st (dropout on), every gradient asked for."""
    gen = torch.Generator(device=device).manual_seed(a.seed)
    N, E, H = st.node_static.shape[0], st.edge_raw.shape[0], a.hidden

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device=device).requires_grad_()

    x, e, att, v, g, b, logits = (leaf(N, H), leaf(E, H), leaf(2 * E, a.heads), leaf(N, a.heads, H // a.heads),
                                  leaf(H), leaf(H), leaf(E))
    labels = (torch.rand(E, generator=gen, device=device) < 0.1).float()

    def run():
        ef = qkernels.fused_edge_features(x, st.edge_index, e)
        agg = qkernels.sparse_aggregate(st.row_ptr, st.col_idx, att, v)
        y = qkernels.fused_norm_residual(x, agg.view(N, H), g, b, p=0.1, training=True)
        loss = qkernels.graph_norm_bce(logits, labels, st.edge_graph, st.num_graphs)
        total = loss + ef.square().mean() + y.square().mean()
        torch.autograd.grad(total, [x, e, att, v, g, b, logits])

    return run


def time_step(model, opt, fwd, args, iters, device):
    """Seconds per training step (forward, loss, backward, Adam) of fwd on args."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(*args)
        loss.backward()
        opt.step()

    return timed(step, iters, device)


def ddp_timed(graph, weights, a, device, rank, world):
    """Per variant: one device alone (rank 0, the others waiting) at a.batch, then the DDP step on
    every rank at a.batch each; rank 0 prints both, the slowest rank's DDP step, throughput and the
    speed-up."""
    st = batch_structure(graph, a.batch, device)
    det, labels = global_batches(graph, a, 1, a.seed + 2, world)[0]
    mine = slice(rank * a.batch, (rank + 1) * a.batch)
    args = inputs(st, det[mine], labels[mine], device)
    torch.manual_seed(a.seed + 1000 * rank)  # each rank its own dropout masks
    one, many = ("GPU", "GPUs") if device.type == "cuda" else ("proc", "procs")
    if rank == 0:
        print(f"timed: {a.iters} steps per variant (forward, loss, backward with the gradient all-reduce, Adam), "
              f"dropout {a.dropout}, batch {a.batch} per rank")
        print(f"  {'variant':<28} {'1 ' + one:>12} {f'{world} ' + many:>13} {'ratio':>6} "
              f"{'graphs/s, 1':>12} {f'graphs/s, {world}':>12} {'speed-up':>8}")
    results = []
    for variant in a.variants.split(","):
        impl, mode = variant.split(":")
        t = torch.zeros(2, dtype=torch.float64, device=device)
        for which, make in ((0, build), (1, build_ddp)):
            if which == 0 and rank != 0:
                dist.barrier()
                continue
            torch._dynamo.reset()
            t[which] = time_step(*make(impl, mode, weights, st, a, a.dropout), args, a.iters, device)
            if which == 0:
                dist.barrier()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        t1, tn = t.tolist()
        results.append((variant, t1, tn))
        if rank == 0:
            print(f"  {variant:<28} {t1 * 1e3:>9.3f} ms {tn * 1e3:>10.3f} ms {tn / t1:>6.3f} {a.batch / t1:>12.0f} "
                  f"{world * a.batch / tn:>12.0f} {t1 * world / tn:>7.2f}x")
    if rank == 0 and device.type == "cuda":
        print("  targets (2 H200, batch 256 per GPU): speed-up >= 1.8x, DDP step within 10% of one GPU's "
              "(ratio <= 1.10)")
    return results


def ddp_main(a):
    """--ddp: the comparison (and on CUDA the host-synchronisation check), then the timed runs."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    want = a.device or ("cuda" if torch.cuda.is_available() and qkernels.AVAILABLE else "cpu")
    device = torch.device(want, local_rank) if want == "cuda" else torch.device("cpu")
    timeout = datetime.timedelta(seconds=a.timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        graph = build_graph(a.distance, a.rounds, a.p, a.p)
        prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)
        weights = init_weights(a.seed, a.layers, a.hidden, a.heads, np.log(prior / (1 - prior)))
        if rank == 0:
            print(f"train_gnn --ddp: {world} ranks ({dist.get_backend()}), device {device.type}, d={a.distance}, "
                  f"{a.rounds} rounds, batch {a.batch} per rank ({world * a.batch} in all), {a.layers} layers, "
                  f"hidden {a.hidden}, {a.heads} heads; float32, Adam lr {a.lr}")
        g_err, l_err = ddp_compare(graph, weights, a, device, rank, world)
        ok = g_err <= 1.0 and l_err <= 1.0
        if rank == 0:
            print(f"DDP vs one process on the concatenated batches ({a.steps} steps, dropout off): gradients "
                  f"{g_err:.2f} of the tolerance {GRAD_ATOL:.0e} + {GRAD_RTOL:.0e} max|grad| per parameter, "
                  f"losses {l_err:.2f} of theirs, every op on its rank's device: {'PASS' if ok else 'FAIL'}")
        if device.type == "cuda":
            st = batch_structure(graph, a.batch, device)
            run = qkernels_step(st, a, device)
            run()
            try:
                clean, host, _ = host_syncs(run, device, strict=True)
            except RuntimeError as e:  # torch's sync debug mode: an op inside synchronised
                print(f"rank {rank}: {e}", file=sys.stderr)
                clean, host = False, float("nan")
            flag = torch.tensor([0 if clean else 1], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok &= flag.item() == 0
            ddp, opt, fwd = build_ddp("qkernels", "eager", weights, st, a, a.dropout)
            args = inputs(st, *global_batches(graph, a, 1, a.seed + 3, 1)[0], device)
            for _ in range(2):
                fwd(*args).backward()
            busy, ddp_host, n = host_syncs(lambda: fwd(*args).backward(), device, strict=False)
            if rank == 0:
                print(f"host synchronisations: qkernels' ops forward + backward returned in {host * 1e3:.1f} ms with "
                      f"the device still busy: {'PASS' if flag.item() == 0 else 'FAIL'}; a DDP forward + backward "
                      f"of the qkernels model ({ddp_host * 1e3:.1f} ms): device still busy {busy}, "
                      f"{n} synchronisations reported by torch")
            del ddp, opt, fwd
        if not a.check:
            ddp_timed(graph, weights, a, device, rank, world)
        elif rank == 0:
            print("check passed" if ok else "check FAILED")
        status = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(status, op=dist.ReduceOp.MAX)  # every rank exits with the same verdict
        return int(status.item())
    finally:
        dist.destroy_process_group()


def profile(step, device, top=30):
    """The device kernels of one training step, summed by name: count, total time, largest first."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    rows = [e for e in events if e.device_type.name == "CUDA"] if device.type == "cuda" else []
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"    {len(rows)} distinct kernels, {sum(e.count for e in rows)} launches, {total / 1e3:.3f} ms device time")
    for e in rows[:top]:
        print(f"    {e.device_time_total / 1e3:7.3f} ms {e.count:4d}x  {e.key[:90]}")
    # the host side: runtime calls (graph replays vs single launches) and the costliest host ops
    host = [e for e in events if e.device_type.name == "CPU"]
    calls = {e.key: e.count for e in host if e.key.startswith(("cuda", "cu"))}
    print("    host calls: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:8]))
    host.sort(key=lambda e: -e.self_cpu_time_total)
    for e in host[:top // 2]:
        print(f"    host {e.self_cpu_time_total / 1e3:7.3f} ms self {e.count:4d}x  {e.key[:80]}")
    # what CUDA-graph replays copy into their static inputs each step
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::_foreach_copy_":
            shapes = e.input_shapes[0] if e.input_shapes else []
            print(f"    copied into graph inputs: {len(shapes)} tensors {str(shapes)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
