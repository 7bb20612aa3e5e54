"""Shared fixtures: float64 references, random graphs, what this machine can run, and a stand-in for
flash_attn."""

import contextlib
import gc
import importlib.machinery
import importlib.util
import resource
import sys
import tracemalloc
import types

import numpy as np
import pytest

import qkernels
from qkernels import _dispatch

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_CUPY = importlib.util.find_spec("cupy") is not None

@contextlib.contextmanager
def memory_stays_flat(calls, heap_bytes=256 * 1024, rss_kib=32 * 1024):
    """Assert that the block (`calls` calls) grows the Python heap by less than heap_bytes, leaves
    qkernels' live buffers as they were and the peak RSS within rss_kib (collected first)."""
    gc.collect()
    live = qkernels._C._live_storages()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    yield
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert grown < heap_bytes, f"Python heap grew by {grown} bytes over {calls} calls"
    assert qkernels._C._live_storages() == live
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss1 - rss0 < rss_kib, f"peak RSS grew by {rss1 - rss0} KiB"


requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
requires_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
requires_cuda = pytest.mark.skipif(not qkernels.AVAILABLE,
                                   reason=f"no CUDA kernels/GPU: {qkernels.info()['cuda_reason']}")


def sparse_aggregate_ref(row_ptr, col_idx, edge_weight, node_feat):
    """float64 reference: out[i,h,:] = sum_e w[e,h] * x[col[e],h,:] via a dense scatter."""
    row_ptr = np.asarray(row_ptr, dtype=np.int64)
    col_idx = np.asarray(col_idx, dtype=np.int64)
    w = np.asarray(edge_weight, dtype=np.float64)
    x = np.asarray(node_feat, dtype=np.float64)
    n_dst = len(row_ptr) - 1
    out = np.zeros((n_dst, x.shape[1], x.shape[2]))
    lo, hi = row_ptr[0], row_ptr[-1]
    rows = np.repeat(np.arange(n_dst), np.diff(row_ptr))
    msgs = w[lo:hi, :, None] * x[col_idx[lo:hi]]
    np.add.at(out, rows, msgs)
    return out


def random_csr(rng, n_dst, n_src, degrees=None, avg_degree=4, index_dtype=np.int64):
    """A random CSR graph; degrees (array) fixes the row lengths, else Poisson(avg_degree)."""
    if degrees is None:
        degrees = rng.poisson(avg_degree, size=n_dst)
    degrees = np.asarray(degrees, dtype=np.int64)
    row_ptr = np.concatenate([[0], np.cumsum(degrees)]).astype(index_dtype)
    e = int(row_ptr[-1])
    col_idx = (rng.integers(0, n_src, size=e) if n_src > 0 else np.zeros(0)).astype(index_dtype)
    return row_ptr, col_idx


def random_inputs(rng, n_dst, n_src, heads, dim, index_dtype=np.int64, degrees=None, avg_degree=4):
    row_ptr, col_idx = random_csr(rng, n_dst, n_src, degrees, avg_degree, index_dtype)
    e = len(col_idx)
    edge_weight = rng.standard_normal((e, heads)).astype(np.float32)
    node_feat = rng.standard_normal((n_src, heads, dim)).astype(np.float32)
    return row_ptr, col_idx, edge_weight, node_feat


def fp32_sum_tol(max_degree):
    """Tolerance for fp32 accumulation over rows of up to max_degree random-sign terms.

    A sequential fp32 sum of n such terms drifts by about sqrt(n) * 2**-24 relative to its result
    (measured on the H200: 1.2e-5 at n = 200k); 4x that, with the 1e-5 floor of plain fp32 work.
    """
    return max(1e-5, 4 * float(np.sqrt(max_degree)) * 2.0**-24)


def rel_err(out, ref):
    out = np.asarray(out, dtype=np.float64)
    assert not np.isnan(out).any(), "output holds NaN (an element was not written)"
    denom = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


@pytest.fixture
def rng(request):
    # A fresh seed per test, printed on failure, so reruns can reproduce it.
    seed = np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture
def env(monkeypatch):
    """Set dispatcher env variables; the dispatcher re-reads them, and forgets them afterwards."""
    for var in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS"):
        monkeypatch.delenv(var, raising=False)

    def set_env(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(k, v)
        qkernels.reload_env()

    yield set_env
    monkeypatch.undo()
    qkernels.reload_env()


def capture_graph(calls):
    """calls() warmed up on a side stream (lazy initialisation cannot run under capture), then
    captured in a torch CUDA graph: -> (graph, what calls() returned inside the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    return graph, outs


class Ops:
    """The ops as the CUDA tests call them: `Ops().linear` is qkernels.linear; with private tuning
    keywords (kernels/qk_launch.h's kernel choices, e.g. `Ops(_variant="mma").linear`), the raw op
    qkernels._C.linear_raw with them, on torch's current stream, with a torch result (the public ops
    refuse those keywords).  label names the choice in test ids and messages."""

    def __init__(self, label="picked", **tuning):
        self.label, self.tuning = label, tuning

    def with_(self, **more):
        """The same choice with more tuning keywords."""
        return Ops(self.label, **self.tuning, **more)

    def __getattr__(self, op):
        if op.startswith("__") or not self.tuning:
            return getattr(qkernels, op)
        raw = getattr(qkernels._C, op + "_raw")
        tuning = self.tuning

        def call(*args, **kwargs):
            import torch

            if kwargs.get("stream") is None:  # the public op's stream: torch's current one
                kwargs["stream"] = torch.cuda.current_stream(args[0].device).cuda_stream
            r = raw(*args, **kwargs, **tuning)
            return r if isinstance(r, torch.Tensor) else torch.from_dlpack(r)

        return call

    def __repr__(self):
        return f"Ops({self.label})"


def close_to_naive(ours, naive, ref):
    """flash-attention's rule: our error (torch tensors, any device, against a float64 NumPy
    reference) at most twice a naive same-precision implementation's."""
    e_ours = np.abs(ours.double().cpu().numpy() - ref).max()
    e_naive = np.abs(naive.double().cpu().numpy() - ref).max()
    assert e_ours <= 2 * e_naive + 1e-6, (e_ours, e_naive)


class FakeCudaTensor:
    """What the dispatcher sees of a torch CUDA tensor (framework, device, dtype, shape), without a
    GPU: enough to decide, and for the flash backend to pass it on."""

    def __init__(self, shape, dtype="bfloat16"):
        self.shape = tuple(shape)
        self.dtype = f"torch.{dtype}"

    def __dlpack_device__(self):
        return (2, 0)

    def stride(self, dim):
        return 1


FakeCudaTensor.__module__ = "torch.fake"  # framework "torch"


@pytest.fixture
def fake_flash(monkeypatch):
    """A flash_attn module whose flash_attn_with_kvcache and flash_attn_func record their calls as
    (q, k, v, keywords) and return "flash result" / "flash_attn_func result"; the dispatcher probes it
    as installed."""
    calls = []
    mod = types.ModuleType("flash_attn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)

    def flash_attn_with_kvcache(q, k_cache, v_cache, **kw):
        calls.append((q, k_cache, v_cache, kw))
        return "flash result"

    def flash_attn_func(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return "flash_attn_func result"

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.delitem(_dispatch._availability, "flash", raising=False)
    _dispatch._cache.clear()
    yield calls
    monkeypatch.undo()
    _dispatch._cache.clear()
