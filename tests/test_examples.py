"""The examples run end to end, at toy sizes on the CPU: decode_step.py with --check
(its backends against its float64 torch reference), eval_gnn.py with --check (its backends against a
float64 NumPy recomputation, its sampler against its edge labels) and tp_decode.py over two gloo
ranks (the shards against the unsharded model).  Each is a subprocess, so the dispatcher's env and
torch.distributed start fresh."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import qkernels
from conftest import requires_cuda, requires_jax, requires_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--intermediate", "512", "--vocab", "512", "--batch", "3", "--min-len", "3", "--max-len", "19",
        "--tokens", "4", "--device", "cpu"]


def run(cmd, cwd=ROOT, status=0, timeout=120, **extra_env):
    """cmd's output; qkernels comes from PYTHONPATH (this checkout), as an installed one would: the
    examples put nothing on sys.path themselves (train_gnn.py imports eval_gnn.py from its own directory, which Python puts there)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    for var in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS"):  # the automatic choice, whatever the
        env.pop(var, None)                                           # caller's shell says
    env.update(extra_env)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == status, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout if status == 0 else r


@requires_torch
def test_decode_step_check():
    out = run([sys.executable, "examples/decode_step.py", *TINY, "--check", "--profile", "--bandwidth", "50"])
    assert "check passed" in out
    assert "cpu    float32   PASS" in out
    assert "attn_paged_decode -> cpu" in out and "linear -> cpu" in out
    assert "fused_add_rmsnorm -> cpu" in out and "rmsnorm -> cpu" in out
    # one plain norm (the first layer's), then two fused residual adds per layer
    assert re.search(r"^  rmsnorm +4 ", out, re.M) and re.search(r"^  fused_add_rmsnorm +8 ", out, re.M), out
    assert re.search(r"^  bound .* at 50 GB/s \(--bandwidth\) = .*% of it reached$", out, re.M), out


def _example_module(name):
    """examples/<name>.py as a module, from its file (the examples directory stays off sys.path)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_leave_sys_path_alone():
    for name in ("decode_step.py", "eval_gnn.py", "tp_decode.py", "train_gnn.py", "train_gnn_jax.py"):
        with open(os.path.join(ROOT, "examples", name)) as f:
            assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", f.read()), name


@requires_torch
def test_eval_gnn_check(tmp_path):
    # QECDEC_BACKEND=cpu: the timed run on the cpu backend (CPU tensors) even where a GPU is present.
    # Run from elsewhere: nothing depends on the current directory.
    out = run([sys.executable, os.path.join(ROOT, "examples", "eval_gnn.py"), "--distance", "3", "--batch", "8",
               "--iters", "1", "--check"], cwd=tmp_path, QECDEC_BACKEND="cpu")
    assert re.search(r"^  loss \d+\.\d+ ", out, re.M), out
    assert "message_passing -> cpu (env QECDEC_BACKEND)" in out and "graph_norm_bce -> cpu (env QECDEC_BACKEND)" in out
    assert "sampler PASS" in out and "cpu    PASS" in out
    assert "check passed" in out


@requires_torch
def test_train_gnn_check(tmp_path):
    """qkernels' gradients train the decoder as pure PyTorch's do: the same loss curve, and one
    compiled (fullgraph) step equal to eager."""
    out = run([sys.executable, os.path.join(ROOT, "examples", "train_gnn.py"), "--check"], cwd=tmp_path)
    assert re.search(r"^comparison .*: PASS$", out, re.M), out
    assert re.search(r"^compiled \(fullgraph\).*: PASS$", out, re.M), out
    assert "check passed" in out


@requires_torch
def test_train_gnn_graph_mode_arguments_on_cpu(tmp_path):
    """The graph modes (whole step in one CUDA graph) on a CPU device: skipped with a message, in
    --check and in the timed table, while the other variants still run; a misspelt variant and a
    graph mode under --ddp are usage errors."""
    script = os.path.join(ROOT, "examples", "train_gnn.py")
    graphs = "qkernels:graph,pytorch:compile-graph"
    out = run([sys.executable, script, "--check", "--device", "cpu", "--variants", graphs], cwd=tmp_path)
    assert re.search(r"^qkernels:graph, pytorch:compile-graph: skipped, CUDA graphs need a CUDA device$", out,
                     re.M), out
    assert re.search(r"^comparison \(8 steps.*: PASS$", out, re.M) and "check passed" in out, out
    tiny = ["--device", "cpu", "--distance", "3", "--batch", "2", "--layers", "1", "--steps", "2", "--iters", "1"]
    out = run([sys.executable, script, *tiny, "--variants", "qkernels:eager,pytorch:graph"], cwd=tmp_path)
    assert re.search(r"^  qkernels:eager +\d+\.\d{3} ms +\d+\.\d{3} ms$", out, re.M), out
    assert re.search(r"^  pytorch:graph +skipped: CUDA graphs need a CUDA device$", out, re.M), out
    r = run([sys.executable, script, "--check", "--variants", "qkernels:graf"], cwd=tmp_path, status=2)
    assert "--variants takes impl:mode" in r.stderr and "(got 'qkernels:graf')" in r.stderr, r.stderr
    r = run([sys.executable, script, "--ddp", "--check", "--variants", "qkernels:graph"], cwd=tmp_path, status=2,
            RANK="0")
    assert "--ddp: the graph modes capture one process's step" in r.stderr, r.stderr


@requires_torch
@requires_cuda
def test_train_gnn_graph_mode_cuda(tmp_path):
    """The whole training step captured in one CUDA graph (graph, and the default variants on CUDA
    include it): its loss curve follows pure PyTorch's eager one, every replay draws new dropout
    masks, and the timed run replays it with its kernels in the profile."""
    script = os.path.join(ROOT, "examples", "train_gnn.py")
    out = run([sys.executable, script, "--check", "--device", "cuda"], cwd=tmp_path, timeout=600)
    for impl in ("qkernels", "pytorch"):
        assert re.search(rf"^comparison, {impl}:graph \(5 of the 8 steps replayed\): .* against pytorch eager: PASS; "
                         r"new dropout masks every replay: PASS$", out, re.M), out
    assert "check passed" in out, out
    out = run([sys.executable, script, "--device", "cuda", "--distance", "3", "--batch", "16", "--steps", "4",
               "--iters", "3", "--variants", "qkernels:graph,pytorch:graph", "--profile"], cwd=tmp_path, timeout=600)
    for impl in ("qkernels", "pytorch"):
        assert re.search(rf"^  {impl}:graph +\d+\.\d{{3}} ms +\d+\.\d{{3}} ms$", out, re.M), out
    assert len(re.findall(r"^    \d+ distinct kernels, [1-9]\d* launches", out, re.M)) == 2, out
    assert len(re.findall(r"^    host calls: .*cudaGraphLaunch 1\b", out, re.M)) == 2, out


@requires_torch
@requires_jax
@pytest.mark.skipif(not hasattr(qkernels._C, "_jax_handlers"), reason="built without the XLA FFI handlers")
def test_train_gnn_jax_check(tmp_path):
    """The decoder trained in JAX (a jitted step, jax.grad through qkernels.jax) follows the PyTorch
    model's loss curve on the same batches, and the same model in pure jax.numpy follows ours."""
    out = run([sys.executable, os.path.join(ROOT, "examples", "train_gnn_jax.py"), "--check"], cwd=tmp_path)
    assert re.search(r"^comparison .*\(qkernels\), .*\(pytorch\).*: PASS$", out, re.M), out
    assert re.search(r"^pure JAX vs qkernels .*\(jax\), .*\(qkernels\).*: PASS$", out, re.M), out
    assert "timed:" not in out and "check passed" in out


@requires_torch
@requires_jax
@pytest.mark.skipif(not hasattr(qkernels._C, "_jax_handlers"), reason="built without the XLA FFI handlers")
def test_train_gnn_jax_timed_variants(tmp_path):
    """The timed run's table: a row per variant asked for, ratios to the pure-JAX model's."""
    args = ["--distance", "3", "--batch", "2", "--layers", "1", "--steps", "2", "--iters", "2", "--repeats", "2"]
    out = run([sys.executable, os.path.join(ROOT, "examples", "train_gnn_jax.py"), *args], cwd=tmp_path)
    cell = r"\d+\.\d{3} \(\d+\.\d{3}-\d+\.\d{3}\) +(\d+\.\d{3})"
    rows = {name: ratios for name, *ratios in re.findall(rf"^  (qkernels|jax) +{cell} +{cell}$", out, re.M)}
    assert rows.keys() == {"qkernels", "jax"} and rows["jax"] == ["1.000", "1.000"], out
    assert all(float(r) > 0 for r in rows["qkernels"]), out
    assert "median of 2 repeats of 2 calls" in out and "ratio to jax's" in out
    out = run([sys.executable, os.path.join(ROOT, "examples", "train_gnn_jax.py"), *args, "--variants", "jax,numpy"],
              cwd=tmp_path, status=2)
    assert "--variants takes qkernels,jax (got numpy)" in out.stderr, out.stderr


@requires_jax
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gnn_jnp_ops_against_references(seed):
    """The pure-JAX decoder's graph ops (examples/gnn_jnp.py) against qkernels.testing's float64
    references on fresh samples: rows without nonzeros, graphs without edges, edges out of graph
    order; and the dropout: every element kept at y / (1 - p) or dropped, about p of them dropped."""
    import jax
    import jax.numpy as jnp
    from qkernels import testing as T

    gnn_jnp = _example_module("gnn_jnp")
    rng = np.random.default_rng(seed)
    tol = dict(rtol=1e-5, atol=1e-5)
    degrees = rng.poisson(3, 9)
    degrees[rng.integers(0, 9, 2)] = 0
    (row_ptr, col_idx, ew, nf), _ = T.sample("sparse_aggregate", rng, n_dst=9, n_src=6, heads=3, dim=5, degrees=degrees)
    got = gnn_jnp.sparse_aggregate(gnn_jnp.csr_rows(row_ptr), col_idx, ew, nf, len(row_ptr) - 1)
    np.testing.assert_allclose(got, T.reference("sparse_aggregate", row_ptr, col_idx, ew, nf), **tol)
    for edge_attr in (True, False):
        args, _ = T.sample("fused_edge_features", rng, n=7, e=13, h=5, edge_attr=edge_attr)
        np.testing.assert_allclose(gnn_jnp.fused_edge_features(*args), T.reference("fused_edge_features", *args),
                                   **tol)
    args, _ = T.sample("fused_norm_residual", rng, rows=11, h=24, mean=3.0)
    want = T.reference("fused_norm_residual", *args)
    np.testing.assert_allclose(gnn_jnp.fused_norm_residual(*args), want, **tol)
    p = 0.25
    res = args[1]
    kept = np.asarray(gnn_jnp.fused_norm_residual(*args, p=p, key=jax.random.key(seed))) - res
    y = want - res
    scaled = np.isclose(kept, y / (1 - p), rtol=1e-5, atol=1e-5)
    assert np.all(scaled | (kept == 0)) and 0.1 < 1 - scaled.mean() < 0.4, kept
    (logits, target, eg, _), _ = T.sample("graph_norm_bce", rng, e=29, graphs=5, sort=False)
    G = 7  # graphs 5 and 6 have no edges
    got = gnn_jnp.graph_norm_bce(logits, target, jnp.asarray(eg), jnp.asarray(gnn_jnp.graph_sizes(eg, G)))
    np.testing.assert_allclose(got, T.reference("graph_norm_bce", logits, target, eg, G), **tol)


# On a GPU: the examples' own defaults on the cuda backend, --check against the same float64
# references: --check must pass on every available backend (cpu runs inside it too).
@requires_torch
@requires_cuda
def test_decode_step_check_cuda():
    out = run([sys.executable, "examples/decode_step.py", "--device", "cuda", "--check"])
    assert "check passed" in out, out
    assert re.search(r"^  cuda +bfloat16 +PASS", out, re.M), out
    assert "attn_paged_prefill -> cuda" in out and "attn_paged_decode -> cuda" in out and "linear -> cuda" in out


@requires_torch
@requires_cuda
def test_decode_step_benchmark_cuda(tmp_path):
    """benchmarks/decode_step.py's GPU path at the small shape: our step replayed from a CUDA graph and
    the PyTorch model under torch.compile reduce-overhead both pass the float64 check at a prefilled
    context, run at a random-KV one, and show their kernels in the profile."""
    md = tmp_path / "decode.md"
    cmd = [sys.executable, "benchmarks/decode_step.py", "--shape", "small", "--batches", "2", "--contexts", "16,1k",
           "--steps", "8", "--check-steps", "6", "--profile", "--markdown", str(md)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for impl in ("qkernels, CUDA graph", "torch.compile reduce-overhead"):
        assert re.search(rf"^  {re.escape(impl)} +[\d.]+ ms/step .* PASS: ", out, re.M), out
        assert re.search(rf"^  {re.escape(impl)} +[\d.]+ ms/step .* no check \(random KV\)", out, re.M), out
    assert "FAIL" not in out and "n/a" not in out and "(no kernel records)" not in out, out
    assert len(re.findall(r"^ +[\d.]+ µs in all$", out, re.M)) == 4, out
    assert md.read_text().count("| decode step | small B=2 ctx ") == 4


@requires_torch
@requires_cuda
def test_eval_gnn_check_cuda():
    out = run([sys.executable, "examples/eval_gnn.py", "--device", "cuda", "--iters", "3", "--check"])
    assert re.search(r"^  cuda +PASS", out, re.M) and re.search(r"^  cpu +PASS", out, re.M), out
    assert "message_passing -> cuda" in out and "graph_norm_bce -> cuda" in out
    assert "check passed" in out


def _gloo():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _gloo(), reason="torch.distributed with gloo is not available")
def test_tp_decode_two_ranks():
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/tp_decode.py", *TINY])
    assert "TP vs 1 cpu: PASS" in out
    assert "all_reduce -> torch.distributed" in out


@pytest.mark.skipif(not _gloo(), reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("launch", ["direct", "torchrun"])
@pytest.mark.parametrize("value", ["bogus"] + ([] if qkernels.AVAILABLE else ["cuda"]))
def test_tp_decode_unrunnable_selection_is_one_line(launch, value):
    """A backend the dispatcher refuses, or one that cannot run here: rank 0 says so in one line and
    every rank exits non-zero before any process group (torchrun then adds its own failure report)."""
    cmd = [sys.executable, "examples/tp_decode.py", *TINY]
    if launch == "torchrun":
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = run(cmd, status=2 if launch == "direct" else 1, ASTR_BACKEND=value)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("tp_decode:")]
    assert len(lines) == 1 and "ASTR_BACKEND" in lines[0], r.stdout + r.stderr
    assert "[rank" not in r.stdout + r.stderr and (launch != "direct" or "Traceback" not in r.stderr), r.stderr


def readme_examples():
    """(framework, code, what the README says it prints) of each first-steps example."""
    text = open(os.path.join(ROOT, "README.md")).read()
    found = re.findall(r"\*\*(\w+)\*\*[^\n]*\n\n```python\n(.*?)```\n\nprints `([^`]*)`", text, re.S)
    return found


@pytest.mark.parametrize("framework,code,printed", readme_examples(), ids=lambda v: v if v in
                         ("PyTorch", "JAX", "Training", "NumPy") else "")
def test_readme_first_steps(framework, code, printed, tmp_path):
    """The README's first examples run from another folder and print what it says they print."""
    if importlib.util.find_spec({"PyTorch": "torch", "Training": "torch", "JAX": "jax"}.get(framework, "numpy")) is None:
        pytest.skip(f"{framework} is not installed")
    assert len(code.splitlines()) <= 12
    assert run([sys.executable, "-c", code], cwd=tmp_path).strip() == printed


def test_readme_has_a_first_example_per_framework():
    assert [f for f, _, _ in readme_examples()] == ["PyTorch", "JAX", "Training", "NumPy"]
