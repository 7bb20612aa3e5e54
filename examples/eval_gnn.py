"""Evaluation pass of a small message-passing GNN decoder for the rotated surface code.

The code.  Distance d: data qubits on a d x d grid, qubit (i, j) at row i, column j.  Stabilizers
are the plaquettes with top-left corner (a, b), a, b in -1..d-1, holding the grid qubits among
(a, b), (a+1, b), (a, b+1), (a+1, b+1): in the bulk Z-type where a + b is even and X-type where it is
odd; on the top and bottom rows only the X-type weight-2 plaquettes, on the left and right columns
only the Z-type ones.  That gives (d^2 - 1)/2 of each type; build_code asserts the counts, that every
X and Z stabilizer overlap on an even number of qubits, and that each data qubit sits in one or two
Z stabilizers.

The experiment: a Z-basis memory (data prepared in |0>, so every Z stabilizer starts at +1).  Z
stabilizers detect X errors, so only they and X faults matter.  Phenomenological noise: before each
of r measurement rounds every data qubit takes an X error with probability p, and every stabilizer
outcome is flipped with probability q; then all data qubits are read out in Z (noiselessly), which
gives one more, error-free, set of stabilizer values.  Detectors are the changes of each Z
stabilizer's value between consecutive rounds: r rounds plus the readout give r + 1 layers of
(d^2 - 1)/2 detectors.

The detector graph (nodes = detectors, plus one virtual boundary node per syndrome; edges = what one
fault flips):
  space     a data X error in round t flips the two Z stabilizers holding that qubit: detectors
            (t, s1) and (t, s2);
  time      a measurement error on stabilizer s in round t flips detectors (t, s) and (t + 1, s);
  boundary  a data X error on a qubit of the top or bottom row sits in one Z stabilizer only: its
            edge joins that detector to the virtual boundary node (not dropped, so every fault has an
            edge and a label).
No diagonal edges: this noise model has no faults inside the measurement circuit (no hook errors).
Two faults with the same endpoints (two boundary qubits of one weight-2 or bulk stabilizer) are one
edge whose label is their parity, which is what the detectors can see.  Edge label = 1 iff an odd
number of that edge's faults happened; the sampler derives the detectors from the same faults, and
--check verifies that every detector equals the parity of its flipped edges.

The model (random weights from --seed; an evaluation and throughput pass, not training).  Node
inputs: detector bit, boundary flag, normalised (row, column, time); edge inputs: type one-hot and
the normalised coordinates of both endpoints (the boundary node takes the faulty qubit's place).
Both are projected to H channels (torch matmul).  Then L layers, each one qkernels.message_passing
call (two kernels on cuda) computing:
  ef  = cat(x[src] + x[dst], |x[src] - x[dst]|, e)                 [E, 3H]  (fused_edge_features)
  h   = relu(ef W1 + b1);  m = h W2 + b2;  w = sigmoid(h Wa + ba)   (w [E, heads]: gates, no softmax)
  agg = per head, the sum over each node's CSR row of w[dir_edge] * (x Wv)[col_idx]  (sparse_aggregate)
  x   = LayerNorm(agg Wo) * gamma + beta + x                       (fused_norm_residual)
  e   = LayerNorm(m) * gamma_e + beta_e + e
The CSR lists each undirected edge under both endpoints (dir_edge maps a CSR entry to its edge).
Per-edge logits come from one more fused_edge_features and a two-layer MLP; the loss is
qkernels.graph_norm_bce over the batch (the disjoint union of the syndromes' graphs, edge_graph =
each edge's syndrome).  The small matmuls are torch: qkernels.linear is an LLM-family op whose cuda
kernel takes float16/bfloat16 only, so float32 GPU tensors would be staged through host memory.

Backends: QECDEC_BACKEND=cuda|cpu|auto (or QKERNELS_OPS) selects for the graph families; tensors live
on the GPU when torch sees one and the dispatcher gives the graph ops to cuda, else on the CPU.  The
report names the backend that served each op (qkernels.resolve on its first call).  --check runs
the forward pass on cuda (when available) and cpu and compares each with a float64 NumPy
recomputation through qkernels.testing's references (tolerances beside LOSS_RTOL).

    python examples/eval_gnn.py [--distance 5] [--rounds R] [--batch 256] [--layers 3] [--hidden 32]
                                [--heads 4] [--iters 20] [--p 0.003] [--check]
    QECDEC_BACKEND=cpu python examples/eval_gnn.py --distance 11 --batch 64 --iters 50

The examples import the installed qkernels (`pip install .`), from any directory; in a source
checkout built in place, put it on the path: PYTHONPATH=. python examples/...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

# torch's OpenMP threads spin after each parallel region (libgomp's active wait), taking the cores
# from qkernels' CPU threads that run next (decode_step.py measured 3x on 2 cores).  Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import qkernels  # noqa: E402
from qkernels.testing import reference  # noqa: E402

SPACE, TIME, BOUNDARY = 0, 1, 2
EDGE_TYPES = ("space", "time", "boundary")


# ---- the code and its detector graph --------------------------------------------------------

def build_code(d):
    """(Z stabilizers as lists of data-qubit indices i*d+j, their (row, col) centres) for distance d."""
    if d < 3 or d % 2 == 0:
        raise ValueError(f"distance must be odd and >= 3, got {d}")
    z, x, z_centre = [], [], []
    for a in range(-1, d):
        for b in range(-1, d):
            bulk_row, bulk_col = 0 <= a <= d - 2, 0 <= b <= d - 2
            z_type = (a + b) % 2 == 0
            if not ((bulk_row and bulk_col) or (bulk_col and not z_type) or (bulk_row and z_type)):
                continue  # corners; and the weight-2 plaquettes of the other type on each side
            qubits = [i * d + j for i in (a, a + 1) for j in (b, b + 1) if 0 <= i < d and 0 <= j < d]
            (z if z_type else x).append(qubits)
            if z_type:
                z_centre.append((a + 0.5, b + 0.5))
    half = (d * d - 1) // 2
    assert len(z) == len(x) == half, (len(z), len(x), half)
    assert all(len(set(zs) & set(xs)) % 2 == 0 for zs in z for xs in x), "X and Z stabilizers must commute"
    per_qubit = np.bincount([k for zs in z for k in zs], minlength=d * d)
    assert per_qubit.min() >= 1 and per_qubit.max() <= 2, per_qubit
    return z, np.array(z_centre)


@dataclass
class DetectorGraph:
    d: int
    rounds: int
    num_stabs: int          # S: Z stabilizers, detectors per layer
    num_nodes: int          # per syndrome: S * (rounds + 1) detectors, then the boundary node
    edge_index: np.ndarray  # [2, E] int64, boundary edges have the boundary node as dst
    edge_type: np.ndarray   # [E] SPACE / TIME / BOUNDARY
    edge_prior: np.ndarray  # [E] probability that the edge's label is 1
    edge_raw: np.ndarray    # [E, 9] float32: type one-hot, (row, col, time) of src and of dst
    node_raw: np.ndarray    # [num_nodes, 4] float32: boundary flag, (row, col, time)
    stab_qubits: np.ndarray  # [S, 4] each Z stabilizer's data qubits i*d+j, padded with d*d
    fault_edge: np.ndarray  # [F] the edge of each fault: data faults (round-major), then measurement faults
    row_ptr: np.ndarray     # [num_nodes + 1] CSR by node over incident edges (each edge under both ends)
    col_idx: np.ndarray     # [2E] the neighbour at the other end
    dir_edge: np.ndarray    # [2E] the undirected edge of each CSR entry

    @property
    def num_edges(self):
        return self.edge_index.shape[1]

    @property
    def num_detectors(self):
        return self.num_nodes - 1


def build_graph(d, rounds, p, q):
    z, centre = build_code(d)
    S, nq, r = len(z), d * d, rounds
    boundary = S * (r + 1)
    qubit_stabs = [[] for _ in range(nq)]
    for s, qs in enumerate(z):
        for k in qs:
            qubit_stabs[k].append(s)

    def pos(row, col, t):  # normalised to [0, 1]: rows and columns span -0.5 .. d - 0.5
        return ((row + 0.5) / d, (col + 0.5) / d, t / r)

    node_pos = [pos(*centre[s], t) for t in range(r + 1) for s in range(S)] + [(0.5, 0.5, 0.5)]
    node_raw = np.array([(0.0,) + xyz for xyz in node_pos], dtype=np.float32)
    node_raw[boundary, 0] = 1.0

    edges = {}  # (u, v) -> [type, [fault probabilities], [dst positions]]
    fault_edge = []

    def add(u, v, kind, prob, dst_pos):
        key = (u, v) if kind == BOUNDARY else (min(u, v), max(u, v))
        entry = edges.setdefault(key, [kind, [], []])
        entry[1].append(prob)
        entry[2].append(dst_pos)
        fault_edge.append(key)

    for t in range(r):  # data X errors before round t
        for k in range(nq):
            ss = [t * S + s for s in qubit_stabs[k]]
            if len(ss) == 2:
                add(ss[0], ss[1], SPACE, p, node_pos[ss[1]])
            else:
                add(ss[0], boundary, BOUNDARY, p, pos(k // d, k % d, t))
    for t in range(r):  # measurement errors in round t
        for s in range(S):
            add(t * S + s, (t + 1) * S + s, TIME, q, node_pos[(t + 1) * S + s])

    keys = list(edges)
    index = {key: e for e, key in enumerate(keys)}
    edge_index = np.array(keys, dtype=np.int64).T
    edge_type = np.array([edges[k][0] for k in keys])
    # The label is the parity of the edge's faults: P(odd) = (1 - prod(1 - 2 p_i)) / 2.
    edge_prior = np.array([(1 - np.prod(1 - 2 * np.array(edges[k][1]))) / 2 for k in keys])
    edge_raw = np.zeros((len(keys), 9), dtype=np.float32)
    edge_raw[np.arange(len(keys)), edge_type] = 1.0
    edge_raw[:, 3:6] = [node_pos[u] for u, _ in keys]
    edge_raw[:, 6:9] = [np.mean(edges[k][2], axis=0) for k in keys]

    # CSR over nodes: each edge appears under both endpoints, pointing at the other one.
    E = len(keys)
    ends = np.concatenate([edge_index[0], edge_index[1]])
    others = np.concatenate([edge_index[1], edge_index[0]])
    order = np.argsort(ends, kind="stable")
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(ends, minlength=boundary + 1))])
    return DetectorGraph(
        d=d, rounds=r, num_stabs=S, num_nodes=boundary + 1, edge_index=edge_index, edge_type=edge_type,
        edge_prior=edge_prior, edge_raw=edge_raw, node_raw=node_raw,
        stab_qubits=np.array([qs + [nq] * (4 - len(qs)) for qs in z]),
        fault_edge=np.array([index[k] for k in fault_edge]), row_ptr=row_ptr, col_idx=others[order],
        dir_edge=np.concatenate([np.arange(E), np.arange(E)])[order])


# ---- sampling --------------------------------------------------------------------------------

def sample(graph, batch, p, q, rng):
    """batch syndromes -> (detectors [B, num_detectors] uint8, edge labels [B, E] uint8), from the
    same sampled faults."""
    d, r, S = graph.d, graph.rounds, graph.num_stabs
    nq = d * d
    data = rng.random((batch, r, nq)) < p
    meas = rng.random((batch, r, S)) < q
    # Errors accumulate: the X frame after round t is the parity of all data errors so far.  A
    # stabilizer's value is the parity of its (up to 4) qubits' frame: gathered, not a dense
    # [nq, S] matmul (NumPy's integer matmul has no BLAS; at d=25 it took 10x the forward pass).
    frame = np.zeros((batch, r, nq + 1), dtype=np.uint8)      # column nq: a zero pad for weight-2 plaquettes
    frame[..., :nq] = np.bitwise_xor.accumulate(data, axis=1)
    true = np.bitwise_xor.reduce(frame[..., graph.stab_qubits], axis=-1)  # [B, r, S] stabilizer values
    measured = true ^ meas
    readout = true[:, -1]                                     # noiseless final data readout
    det = np.concatenate([measured[:, :1], measured[:, 1:] ^ measured[:, :-1], (readout ^ measured[:, -1])[:, None]],
                         axis=1).reshape(batch, -1).astype(np.uint8)
    # Labels: XOR each fault that happened into its edge (faults are sparse, so index the hits).
    faults = np.concatenate([data.reshape(batch, -1), meas.reshape(batch, -1)], axis=1)
    b, f = np.nonzero(faults)
    labels = np.zeros((batch, graph.num_edges), dtype=np.uint8)
    np.bitwise_xor.at(labels, (b, graph.fault_edge[f]), 1)
    return det, labels


def detectors_from_labels(graph, labels):
    """Each detector's parity of its flipped incident edges (the boundary node's column dropped)."""
    out = np.zeros((labels.shape[0], graph.num_nodes), dtype=np.int64)
    for end in graph.edge_index:
        np.add.at(out, (slice(None), end), labels.astype(np.int64))
    return (out[:, :-1] & 1).astype(np.uint8)


# ---- the batch: the disjoint union of B copies of the graph ----------------------------------

@dataclass
class BatchStructure:
    """Index tensors of B syndromes on a device (graph g's nodes at g * num_nodes, edges at g * E)."""
    num_graphs: int
    edge_index: torch.Tensor  # [2, B*E] int32
    row_ptr: torch.Tensor     # [B*N + 1] int32
    col_idx: torch.Tensor     # [2*B*E] int32
    dir_edge: torch.Tensor    # [2*B*E] int64 (torch gathers w with it)
    edge_graph: torch.Tensor  # [B*E] int32, sorted
    node_static: torch.Tensor  # [B*N, 4] float32
    edge_raw: torch.Tensor    # [B*E, 9] float32
    # the transposed graphs the backward ops would otherwise group on every call (docs/graph-ops.md)
    sa_plan: torch.Tensor = None  # sparse_aggregate_plan(row_ptr, col_idx, B*N), int32
    ef_plan: torch.Tensor = None  # fused_edge_features_plan(edge_index, B*N), int32


def batch_structure(graph, B, device):
    N, E = graph.num_nodes, graph.num_edges
    g = np.arange(B)
    edge_index = (graph.edge_index[:, None, :] + (g * N)[None, :, None]).reshape(2, -1)
    row_ptr = np.concatenate([(graph.row_ptr[None, :-1] + (g * 2 * E)[:, None]).ravel(), [2 * E * B]])
    col_idx = (graph.col_idx[None] + (g * N)[:, None]).ravel()
    dir_edge = (graph.dir_edge[None] + (g * E)[:, None]).ravel()

    def t(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    # built once per batch structure on the host (the structure is fixed for a run), then copied
    i32 = np.int32
    sa_plan = qkernels.sparse_aggregate_plan(row_ptr.astype(i32), col_idx.astype(i32), B * N, backend="cpu")
    ef_plan = qkernels.fused_edge_features_plan(edge_index.astype(i32), B * N, backend="cpu")
    return BatchStructure(B, t(edge_index, torch.int32), t(row_ptr, torch.int32), t(col_idx, torch.int32),
                          t(dir_edge, torch.int64), t(np.repeat(g, E), torch.int32),
                          t(np.tile(graph.node_raw, (B, 1)), torch.float32),
                          t(np.tile(graph.edge_raw, (B, 1)), torch.float32),
                          t(np.asarray(sa_plan), torch.int32), t(np.asarray(ef_plan), torch.int32))


# ---- the model ---------------------------------------------------------------------------------

def init_weights(seed, layers, H, heads, prior_logit):
    """float32 NumPy weights, std 1/sqrt(fan_in) so activations keep unit scale; the output bias is
    the mean edge prior's logit, so the untrained loss starts near the prior's (not at log 2)."""
    rng = np.random.default_rng(seed)

    def lin(n_in, n_out):
        return ((rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32),
                (0.1 * rng.standard_normal(n_out)).astype(np.float32))

    def norm():  # LayerNorm's (gamma, beta)
        return ((1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
                (0.1 * rng.standard_normal(H)).astype(np.float32))

    w = {"node_in": lin(5, H), "edge_in": lin(9, H), "layers": []}
    for _ in range(layers):
        w["layers"].append({"w1": lin(3 * H, H), "msg": lin(H, H), "att": lin(H, heads), "v": lin(H, H)[0],
                            "o": lin(H, H)[0], "norm_x": norm(), "norm_e": norm()})
    w["head1"] = lin(3 * H, H)
    w["head2"] = (lin(H, 1)[0], np.full(1, prior_logit, dtype=np.float32))
    return w


def map_weights(w, fn):
    if isinstance(w, dict):
        return {k: map_weights(v, fn) for k, v in w.items()}
    if isinstance(w, (list, tuple)):
        return type(w)(map_weights(v, fn) for v in w)
    return fn(w)


class Ops:
    """Calls qkernels ops by name; the first call of each asks qkernels.resolve who serves it."""

    def __init__(self):
        self.backends = {}

    def __call__(self, name, *args, **kwargs):
        if name not in self.backends:
            d = qkernels.resolve(name, *args, **kwargs)
            self.backends[name] = ("none: " + d.error if d.winner is None else
                                   d.winner + (" staged through host memory" if d.staged else "") + f" ({d.origin})")
        return getattr(qkernels, name)(*args, **kwargs)


def node_inputs(st, det):
    """[B*N, 5] node inputs: the detector bit (0 for boundary nodes), then the static features."""
    B, n_det = det.shape
    bits = torch.zeros(B, n_det + 1, dtype=torch.float32, device=st.node_static.device)
    bits[:, :n_det] = det
    return torch.cat([bits.reshape(-1, 1), st.node_static], dim=1)


def forward(ops, w, st, det, labels, heads):
    """The decoder on one batch: det [B, num_detectors], labels [B*E] float32 (device tensors)
    -> (loss 0-d, node states [B*N, H], edge logits [B*E])."""
    x = node_inputs(st, det) @ w["node_in"][0] + w["node_in"][1]
    e = st.edge_raw @ w["edge_in"][0] + w["edge_in"][1]
    for lw in w["layers"]:  # the layer as one op: forward_ref below spells it out
        x, e = ops("message_passing", x, e, st.edge_index, st.row_ptr, st.col_idx, st.dir_edge, *lw["w1"],
                   *lw["msg"], *lw["att"], lw["v"], lw["o"], *lw["norm_x"], *lw["norm_e"])
    ef = ops("fused_edge_features", x, st.edge_index, e)
    logits = (torch.relu(ef @ w["head1"][0] + w["head1"][1]) @ w["head2"][0] + w["head2"][1]).view(-1)
    loss = ops("graph_norm_bce", logits, labels, st.edge_graph, st.num_graphs)
    return loss, x, logits


def forward_ref(w, graph, det, labels, heads):
    """forward() in float64 NumPy (the ops' float64 references of qkernels.testing), from edge_index
    alone: the aggregation written out from the edges both ways and the loss's graph ids from the
    batch layout, not from the CSR or edge_graph, so their construction is checked too: -> (loss,
    node states, edge logits)."""
    B, N, E = det.shape[0], graph.num_nodes, graph.num_edges
    bits = np.zeros((B, N))
    bits[:, :-1] = det
    x = np.concatenate([bits.reshape(-1, 1), np.tile(graph.node_raw, (B, 1))], axis=1)
    x = x @ w["node_in"][0] + w["node_in"][1]
    e = np.tile(graph.edge_raw, (B, 1)) @ w["edge_in"][0] + w["edge_in"][1]
    edge_index = (graph.edge_index[:, None, :] + (np.arange(B) * N)[None, :, None]).reshape(2, -1)
    src, dst = edge_index
    H = x.shape[1]

    for lw in w["layers"]:
        h = np.maximum(reference("fused_edge_features", x, edge_index, e) @ lw["w1"][0] + lw["w1"][1], 0)
        msg = h @ lw["msg"][0] + lw["msg"][1]
        att = 1 / (1 + np.exp(-(h @ lw["att"][0] + lw["att"][1])))
        v = (x @ lw["v"]).reshape(-1, heads, H // heads)
        agg = np.zeros_like(v)
        np.add.at(agg, dst, att[:, :, None] * v[src])  # each edge carries a message both ways
        np.add.at(agg, src, att[:, :, None] * v[dst])
        x = reference("fused_norm_residual", agg.reshape(-1, H) @ lw["o"], x, *lw["norm_x"])
        e = reference("fused_norm_residual", msg, e, *lw["norm_e"])
    h = np.maximum(reference("fused_edge_features", x, edge_index, e) @ w["head1"][0] + w["head1"][1], 0)
    logits = (h @ w["head2"][0] + w["head2"][1]).ravel()
    loss = reference("graph_norm_bce", logits, labels.reshape(-1), np.repeat(np.arange(B), E), B)  # E edges a graph
    return float(loss), x, logits


# ---- running --------------------------------------------------------------------------------

class Progress:
    """A one-line stderr bar, shown on a terminal once a run has taken over a second (short runs and
    logs stay clean)."""

    def __init__(self, total, enabled=True):
        self.total, self.enabled, self.shown = total, enabled and sys.stderr.isatty(), False
        self.t0 = self.last = time.perf_counter()

    def update(self, done, note=""):
        now = time.perf_counter()
        if not self.enabled or now - self.t0 < 1.0 or (now - self.last < 0.1 and done < self.total):
            return
        self.last, self.shown = now, True
        fill = int(30 * done / self.total)
        sys.stderr.write(f"\r  [{'#' * fill}{'.' * (30 - fill)}] {done}/{self.total} {note}")
        sys.stderr.flush()

    def close(self):
        if self.shown:
            sys.stderr.write("\n")


def to_device(w, device):
    return map_weights(w, lambda a: torch.from_numpy(a).to(device))


def run_batch(ops, w, st, det, labels, heads, device):
    det_t = torch.from_numpy(det).to(device, torch.float32)
    lab_t = torch.from_numpy(labels.reshape(-1)).to(device, torch.float32)
    return forward(ops, w, st, det_t, lab_t, heads)


def pick_device(arg):
    """cuda when torch sees a GPU and the dispatcher gives a float32 CUDA call of the graph families
    to cuda (not cpu by QECDEC_BACKEND, which would stage every call through host memory)."""
    if arg:
        return torch.device(arg)
    if torch.cuda.is_available():
        probe = torch.zeros(2, 2, device="cuda")
        if qkernels.resolve("fused_norm_residual", probe, probe, probe[0], probe[0]).winner == "cuda":
            return torch.device("cuda")
    return torch.device("cpu")


# Tolerances of --check, float32 run against the float64 recomputation.  Largest errors measured on
# the cpu backend at the default model (3 layers, H 32), seeds 0-4, d = 3, 5, 9, 15, 25 (batch
# 64..2, p = 0.003 and 0.05): loss 9.0e-8 relative, node states 3.2e-6 and edge logits 3.5e-6
# absolute, with |states| <= 7.2 (LayerNorm outputs plus residuals).  That is a few float32 ulps per
# op compounded over the layers; the tolerances leave 60-100x for other summation orders (the cuda
# kernels, fp32 accumulation) and for wider or deeper models, while a wrong CSR entry, LayerNorm's
# eps at 1e-3 instead of 1e-5 or a dropped term fail by 1e-2..1 (tried).
LOSS_RTOL, STATE_ATOL, LOGIT_ATOL = 1e-5, 2e-4, 2e-4


def check_forward(name, run, ref):
    (loss, x, logits), (rloss, rx, rlogits) = run, ref
    errs = (abs(loss - rloss) / max(abs(rloss), 1e-30), np.abs(x - rx).max(), np.abs(logits - rlogits).max())
    ok = errs[0] <= LOSS_RTOL and errs[1] <= STATE_ATOL and errs[2] <= LOGIT_ATOL
    print(f"  {name:<6} {'PASS' if ok else 'FAIL'}: loss {loss:.8f} vs {rloss:.8f} (rel err {errs[0]:.1e}, tol "
          f"{LOSS_RTOL:.0e}); node states max abs err {errs[1]:.1e} (tol {STATE_ATOL:.0e}); edge logits "
          f"{errs[2]:.1e} (tol {LOGIT_ATOL:.0e})")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distance", type=int, default=5, help="odd code distance, 3..25")
    p.add_argument("--rounds", type=int, help="measurement rounds (default: the distance)")
    p.add_argument("--batch", type=int, default=256, help="syndromes per batch")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=32, help="channels H of node and edge states")
    p.add_argument("--heads", type=int, default=4, help="attention heads of sparse_aggregate (divides H)")
    p.add_argument("--iters", type=int, default=20, help="timed batches")
    p.add_argument("--p", type=float, default=0.003, help="data-qubit X error probability per round")
    p.add_argument("--q", type=float, help="measurement error probability (default: p)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU and the "
                   "graph families go to the cuda backend")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--check", action="store_true", help="compare cuda (if available) and cpu with a float64 "
                   "recomputation, and the sampled detectors with the edge labels")
    a = p.parse_args(argv)
    a.rounds = a.rounds or a.distance
    a.q = a.p if a.q is None else a.q
    if not (3 <= a.distance <= 25 and a.distance % 2):
        p.error("--distance must be odd, 3..25")
    if a.rounds < 1 or a.batch < 1 or a.layers < 1 or a.iters < 1:
        p.error("--rounds, --batch, --layers and --iters must be at least 1")
    if a.hidden % a.heads:
        p.error("--heads must divide --hidden")
    if not (0 <= a.p <= 0.5 and 0 <= a.q <= 0.5):
        p.error("--p and --q must be probabilities <= 0.5")

    graph = build_graph(a.distance, a.rounds, a.p, a.q)
    counts = np.bincount(graph.edge_type, minlength=3)
    env = {k: os.environ.get(k) for k in ("QECDEC_BACKEND", "QKERNELS_OPS") if os.environ.get(k)}
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    try:  # the first dispatcher use reads the env: a bad value is a ValueError naming the variable
        device = pick_device(a.device)
        probe = torch.zeros(2, 2, device=device)
        decision = qkernels.resolve("fused_norm_residual", probe, probe, probe[0], probe[0])
    except ValueError as e:
        p.error(str(e))
    print(f"eval_gnn: rotated surface code d={a.distance}, {a.rounds} rounds, Z memory; X data errors p={a.p}, "
          f"measurement errors q={a.q}")
    print(f"  graph per syndrome: {graph.num_nodes} nodes ({graph.num_detectors} detectors + 1 boundary), "
          f"{graph.num_edges} edges (" + ", ".join(f"{n} {c}" for n, c in zip(EDGE_TYPES, counts)) + ")")
    print(f"  model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads x {a.hidden // a.heads}; batch {a.batch} "
          f"({a.batch * graph.num_nodes} nodes, {a.batch * graph.num_edges} edges); device {device}, float32; "
          f"env {env or 'none (automatic selection)'}; qkernels cuda available: {qkernels.AVAILABLE}")
    if decision.winner is None:  # the environment chose a backend that cannot run here (strict)
        print(f"eval_gnn: {decision.error}", file=sys.stderr)
        return 2

    prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)  # p = q = 0 would make the bias -inf
    weights = init_weights(a.seed, a.layers, a.hidden, a.heads, np.log(prior / (1 - prior)))
    w = to_device(weights, device)
    st = batch_structure(graph, a.batch, device)
    rng = np.random.default_rng(a.seed + 1)
    ops = Ops()
    try:
        det, labels = sample(graph, a.batch, a.p, a.q, rng)
        run_batch(Ops(), w, st, det, labels, a.heads, device)  # warm-up: thread pools, first-call costs
        losses, fault_edges, t_sample, t_fwd = [], 0, 0.0, 0.0
        bar = Progress(a.iters, enabled=not a.no_progress)
        for it in range(a.iters):
            t0 = time.perf_counter()
            det, labels = sample(graph, a.batch, a.p, a.q, rng)
            t1 = time.perf_counter()
            loss, _, _ = run_batch(ops, w, st, det, labels, a.heads, device)
            losses.append(loss.item())  # .item() waits for the device
            t_fwd += time.perf_counter() - t1
            t_sample += t1 - t0
            fault_edges += int(labels.sum())
            bar.update(it + 1, f"{a.batch * (it + 1) / t_fwd:.0f} syndromes/s")
        bar.close()
    except qkernels.ExplicitSelectionError as e:  # the environment chose a backend that cannot run here
        print(f"eval_gnn: {e}", file=sys.stderr)
        return 2

    n = a.batch * a.iters
    base = qkernels.graph_norm_bce(torch.full((st.edge_graph.shape[0],), float(weights["head2"][1][0]), device=device),
                                   torch.from_numpy(labels.reshape(-1)).to(device, torch.float32),
                                   st.edge_graph, a.batch)
    print(f"run: {a.iters} batches x {a.batch} syndromes, {fault_edges / n:.3f} flipped edges per syndrome")
    print(f"  loss {np.mean(losses):.6f} (mean over batches; last {losses[-1]:.6f}; constant prior logit on the "
          f"last batch: {base.item():.6f})")
    print(f"  throughput {n / t_fwd:.0f} syndromes/s forward ({t_fwd / a.iters * 1e3:.2f} ms/batch); sampling "
          f"{n / t_sample:.0f} syndromes/s; end to end {n / (t_fwd + t_sample):.0f} syndromes/s")
    print("  backends: " + ", ".join(f"{k} -> {v}" for k, v in sorted(ops.backends.items())))

    if not a.check:
        return 0
    print("check:")
    # The sampler: at p = q = 0.1 (many faults, so the comparison means something at any size) every
    # detector must equal the parity of its flipped edges.
    sdet, slab = sample(graph, 64, 0.1, 0.1, np.random.default_rng(a.seed + 2))
    ok_sampler = np.array_equal(sdet, detectors_from_labels(graph, slab))
    print(f"  sampler {'PASS' if ok_sampler else 'FAIL'}: detectors == parity of flipped edges on 64 syndromes "
          f"at p=q=0.1 ({int(slab.sum())} flipped edges, {int(sdet.sum())} detection events)")
    # The forward pass on the warm-up batch's syndromes (re-sampled from the same seed).
    det, labels = sample(graph, a.batch, a.p, a.q, np.random.default_rng(a.seed + 1))
    ref = forward_ref(map_weights(weights, lambda x: x.astype(np.float64)), graph, det, labels, a.heads)
    runs = []
    if torch.cuda.is_available() and qkernels.backend_available("cuda")[0]:
        runs.append(("cuda", torch.device("cuda")))
    runs.append(("cpu", torch.device("cpu")))
    ok, results = ok_sampler, {}
    for name, dev in runs:
        ops = Ops()
        with qkernels.use_backend(graph=name):
            loss, x, logits = run_batch(ops, to_device(weights, dev), batch_structure(graph, a.batch, dev), det,
                                        labels, a.heads, dev)
        results[name] = (loss.item(), x.double().cpu().numpy(), logits.double().cpu().numpy())
        ok &= check_forward(name, results[name], ref)
        print("         backends: " + ", ".join(f"{k} -> {v}" for k, v in sorted(ops.backends.items())))
    if len(results) == 2:  # each is within tol of the reference, so within 2 tol of each other
        c, g = results["cpu"], results["cuda"]
        print(f"  cuda vs cpu: loss rel diff {abs(c[0] - g[0]) / abs(c[0]):.1e}, node states max abs diff "
              f"{np.abs(c[1] - g[1]).max():.1e}")
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
