"""Data-parallel training of the QEC decoder (examples/train_gnn.py, examples/train_gnn_jax.py).

torch: two gloo ranks on the CPU, each with its own graphs, give after DDP's all-reduce the gradients
of one process on the concatenated batch (against the float64 pure-PyTorch model and qkernels' fp32
single-process run), identical on both ranks; and the example's `--ddp --check` passes under torchrun.
JAX: two forced host devices (XLA_FLAGS, set before jax starts: a subprocess) follow the one-device
run, with no all-gather in the compiled step.  The GPU variants (NCCL, two GPUs) skip without two."""

import datetime
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import qkernels
from conftest import HAS_JAX, HAS_TORCH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# The decoder at toy size: awkward per-rank batch, p high enough that every batch has flipped edges.
CFG = dict(distance=3, batch=3, layers=2, hidden=16, heads=2, p=0.05, seed=0)

torch = __import__("torch") if HAS_TORCH else None


def _gloo():
    if torch is None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


requires_gloo = pytest.mark.skipif(not _gloo(), reason="torch.distributed with gloo is not available")


def _two_gpus():
    return torch is not None and qkernels.AVAILABLE and torch.cuda.device_count() >= 2


requires_two_gpus = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices with qkernels' kernels")


def _train_gnn():
    """examples/train_gnn.py as a module (it imports eval_gnn.py from its own directory)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import train_gnn

    return train_gnn


def run(cmd, timeout=90, **extra_env):
    """cmd's stdout (exit status 0 asserted); qkernels from this checkout, the dispatcher's choice automatic."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    for var in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS", "XLA_FLAGS"):
        env.pop(var, None)
    env.update(extra_env)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _model(tg, graph, st, ops, dtype):
    prior = min(max(float(graph.edge_prior.mean()), 1e-6), 0.5)
    weights = tg.init_weights(CFG["seed"], CFG["layers"], CFG["hidden"], CFG["heads"], np.log(prior / (1 - prior)))
    return tg.Decoder(weights, CFG["heads"], ops(st), 0.0).to(dtype)


def _ddp_rank(rank, world, store, out, det, labels):
    """One gloo rank: DDP over the decoder on rows [rank * B, (rank + 1) * B) of det/labels; saves its
    loss and the gradients after the all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    tg = _train_gnn()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=240))
    try:
        B = CFG["batch"]
        graph = tg.build_graph(CFG["distance"], CFG["distance"], CFG["p"], CFG["p"])
        st = tg.batch_structure(graph, B, torch.device("cpu"))
        model = DDP(_model(tg, graph, st, tg.QkernelsOps, torch.float32))
        mine = slice(rank * B, (rank + 1) * B)
        loss = model(*tg.inputs(st, det[mine], labels[mine], "cpu"))
        loss.backward()
        torch.save({"loss": loss.detach(), **{n: p.grad for n, p in model.module.named_parameters()}},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world, args, timeout=240):
    """Run fn(rank, world, *args) in `world` spawned processes; kill them all past timeout (a guard
    against a hung rendezvous, generous because spawning two interpreters that import torch can take
    a minute on a loaded 2-core machine)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__}: ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _grad_err(got, want):
    """max |got - want| / max |want| over one parameter's gradient."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@requires_gloo
def test_ddp_gradients_equal_the_concatenated_batch(rng, tmp_path):
    tg = _train_gnn()
    world, B = 2, CFG["batch"]
    graph = tg.build_graph(CFG["distance"], CFG["distance"], CFG["p"], CFG["p"])
    det, labels = tg.sample(graph, world * B, CFG["p"], CFG["p"], rng)
    _spawn(_ddp_rank, world, (str(tmp_path / "store"), str(tmp_path), det, labels))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    # the references: one process on all world * B graphs (float64 pure PyTorch; qkernels fp32), and
    # float64 on rank 0's graphs alone (what a missing all-reduce would leave)
    def grads(rows, ops, dtype):
        st = tg.batch_structure(graph, len(range(*rows.indices(world * B))), torch.device("cpu"))
        model = _model(tg, graph, st, ops, dtype)
        loss = model(*(t.to(dtype) for t in tg.inputs(st, det[rows], labels[rows], "cpu")))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss64, ref64 = grads(slice(None), tg.TorchOps, torch.float64)
    loss32, ref32 = grads(slice(None), tg.QkernelsOps, torch.float32)
    _, alone = grads(slice(0, B), tg.TorchOps, torch.float64)
    names = list(ref64)
    assert set(ranks[0]) == {"loss", *names}
    for n in names:
        assert torch.equal(ranks[0][n], ranks[1][n]), f"{n}: the ranks' gradients differ after the all-reduce"
    mean_loss = sum(float(r["loss"]) for r in ranks) / world
    assert abs(mean_loss - float(loss64)) <= 1e-6 * abs(float(loss64)) + 1e-9
    # fp32 through two layers and the loss, relative to each gradient's largest entry (measured ~1e-6
    # against both: float64, and qkernels' single-process fp32 run summing in another order)
    worst64 = max(_grad_err(ranks[0][n], ref64[n]) for n in names)
    worst32 = max(_grad_err(ranks[0][n], ref32[n]) for n in names)
    assert worst64 <= 2e-5, worst64
    assert worst32 <= 1e-5, worst32
    # the comparison can tell: rank 0's graphs alone are orders of magnitude further off
    assert max(_grad_err(alone[n], ref64[n]) for n in names) > 1000 * 2e-5


@requires_gloo
def test_train_gnn_ddp_check_two_gloo_ranks():
    """The example under torchrun (--standalone picks a free port): DDP against one process, PASS."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/train_gnn.py", "--ddp", "--check"])
    assert re.search(r"^train_gnn --ddp: 2 ranks \(gloo\), device cpu", out, re.M), out
    line = re.search(r"^DDP vs one process .*gradients (\S+) of the tolerance.*: PASS$", out, re.M)
    assert line and 0 < float(line.group(1)) <= 1.0, out
    assert "check passed" in out


@pytest.mark.skipif(not (HAS_JAX and HAS_TORCH), reason="needs jax and torch")
@pytest.mark.skipif(not hasattr(qkernels._C, "_jax_handlers"), reason="built without the XLA FFI handlers")
def test_train_gnn_jax_two_host_devices():
    """Two forced CPU devices: shard_map over the graphs follows the one-device losses and weights, the
    compiled step all-reduces and gathers nothing; plain jit on the same sharded batch would gather."""
    out = run([sys.executable, "examples/train_gnn_jax.py", "--devices", "2", "--check"],
              XLA_FLAGS="--xla_force_host_platform_device_count=2")
    m = re.search(r"^sharded over 2 devices \(2 graphs each, shard_map\): .* all-reduce (\d+), all-gather 0: PASS$",
                  out, re.M)
    assert m and int(m.group(1)) >= 1, out
    plain = re.search(r"^  plain jit .*all-gather (\d+)", out, re.M)
    assert plain and int(plain.group(1)) > 0, out
    assert "check passed" in out


@pytest.mark.skipif(not (HAS_JAX and HAS_TORCH), reason="needs jax and torch")
@pytest.mark.skipif(not hasattr(qkernels._C, "_jax_handlers"), reason="built without the XLA FFI handlers")
def test_train_gnn_jax_devices_missing_is_reported():
    """--devices 2 with one device: a line saying how to get two, and a failed check."""
    r = subprocess.run([sys.executable, "examples/train_gnn_jax.py", "--devices", "2", "--check"], cwd=ROOT,
                       env=dict({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, PYTHONPATH=ROOT,
                                JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=90)
    assert r.returncode == 1 and "xla_force_host_platform_device_count=2" in r.stdout, r.stdout + r.stderr


# ---- two GPUs: run on a machine with two (NCCL), skipped elsewhere -----------------------------------

@requires_two_gpus
def test_train_gnn_ddp_check_two_gpus():
    """NCCL, one GPU per rank: DDP against one process, every op on its rank's GPU, and qkernels' ops
    return with the device still busy (no host synchronisation)."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/train_gnn.py", "--ddp", "--check", "--device", "cuda"], timeout=300)
    assert re.search(r"^train_gnn --ddp: 2 ranks \(nccl\), device cuda", out, re.M), out
    assert re.search(r"^DDP vs one process .*: PASS$", out, re.M), out
    assert re.search(r"^host synchronisations: qkernels' ops .*device still busy: PASS", out, re.M), out
    assert "check passed" in out


@requires_two_gpus
def test_train_gnn_ddp_timed_two_gpus():
    """The timed run prints one GPU's step beside the DDP step, for every variant asked for."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/train_gnn.py", "--ddp", "--device", "cuda", "--steps", "4", "--iters", "5",
               "--variants", "qkernels:eager,pytorch:eager"], timeout=300)
    for variant in ("qkernels:eager", "pytorch:eager"):
        assert re.search(rf"^  {variant} +\d+\.\d+ ms +\d+\.\d+ ms +\d+\.\d+ +\d+ +\d+ +\d+\.\d+x$", out, re.M), out


@requires_two_gpus
@pytest.mark.skipif(not HAS_JAX or not hasattr(qkernels._C, "_jax_handlers"), reason="needs jax and the handlers")
def test_train_gnn_jax_two_gpus():
    """jax on two GPUs: each device's custom calls on its own shard, equal to one GPU."""
    import jax

    try:
        if len(jax.devices("gpu")) < 2:
            pytest.skip("jax sees fewer than two GPUs")
    except RuntimeError:
        pytest.skip("jax has no GPU platform")
    out = run([sys.executable, "examples/train_gnn_jax.py", "--devices", "2", "--check"], timeout=300)
    assert re.search(r"^sharded over 2 devices .* all-gather 0: PASS$", out, re.M), out
    assert "check passed" in out
