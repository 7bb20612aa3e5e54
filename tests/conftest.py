"""Shared fixtures and helpers: what this machine can run, tolerances, the naive same-precision torch
yardsticks, CUDA tensors from samples, and a stand-in for flash_attn.  Inputs and float64 references
come from qkernels.testing."""

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
from qkernels.testing import FLOAT_ARGS, sample

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


def fp32_sum_tol(max_degree):
    """Tolerance for fp32 accumulation over rows of up to max_degree random-sign terms.

    A sequential fp32 sum of n such terms drifts by about sqrt(n) * 2**-24 relative to its result
    (measured on the H200: 1.2e-5 at n = 200k); 4x that, with the 1e-5 floor of plain fp32 work.
    """
    return max(1e-5, 4 * float(np.sqrt(max_degree)) * 2.0**-24)


def outputs(r):
    """An op's result as a tuple of its outputs: the backward ops return several (None where a gradient
    was not asked for), the others one."""
    return r if type(r) is tuple else (r,)


def takes_out(op):
    """Whether op takes out= (the backward ops and graph_norm_bce do not)."""
    return "out=None" in getattr(qkernels, op).__text_signature__


def results(r):
    """An op's result as a list: a backward op's gradients without its None entries, or [r]."""
    return [t for t in outputs(r) if t is not None]


def strided_all(a, step=2):
    """a's values in a view whose every dimension has stride `step` elements."""
    big = np.zeros(tuple(step * n for n in a.shape), a.dtype)
    sl = tuple(slice(None, None, step) for _ in a.shape)
    big[sl] = a
    return big[sl]


def check_norm_grads(got, ref, tol=1e-5):
    """fused_norm_residual_backward's (grad_x, grad_gamma, grad_beta): float32, shaped and close to ref."""
    assert type(got) is tuple and len(got) == 3
    for g, r in zip(got, ref):
        g = np.asarray(g)
        assert g.shape == r.shape and g.dtype == np.float32
        assert rel_err(g, r) < tol


def rel_err(out, ref, scale=0.0):
    """Norm-wise relative error; scale: a floor for the reference's norm, where the result's
    rounding error is set by a larger quantity than the result itself (a LayerNorm gradient of a
    zero-variance row is 0, its rounding residues are of |grad_out * gamma| / sqrt(eps))."""
    out = np.asarray(out, dtype=np.float64)
    assert not np.isnan(out).any(), "output holds NaN (an element was not written)"
    denom = max(np.linalg.norm(ref), scale)
    return np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0)


def zero_variance_scale(grad_out, gamma, eps=1e-5):
    """rel_err's scale for grad_x of a norm over groups of one element (torch tensors)."""
    return float((grad_out.double() * gamma.double()).norm()) / eps ** 0.5


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


@pytest.fixture(autouse=True)
def cuda_pending_enabled(request, monkeypatch):
    """The GPU tests (tests/test_cuda_*.py, test_multi_gpu.py) are what enables CUDA kernels that are built
    but held off the dispatch (qkernels._dispatch.CUDA_PENDING): they run them as if enabled, with the
    dispatcher's cached decisions dropped on both sides."""
    name = request.module.__name__.rpartition(".")[2]
    if not (name.startswith("test_cuda_") or name == "test_multi_gpu"):
        yield
        return
    from qkernels import _dispatch

    monkeypatch.setattr(_dispatch, "CUDA_PENDING", {})
    _dispatch.reload_env()
    yield
    monkeypatch.undo()
    _dispatch.reload_env()


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


def replay_like_eager(graph, outs, calls):
    """graph replayed into its outputs outs, poisoned with NaN first, gives bitwise what calls() gives
    eagerly on the current inputs."""
    import torch

    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = calls()
    assert all(torch.equal(o, e) for o, e in zip(outs, eager))


def f64(a):
    """A NumPy array or a torch tensor (any device and dtype) as float64 NumPy."""
    if type(a).__module__.startswith("torch"):
        return a.detach().double().cpu().numpy()
    return np.asarray(a, np.float64)


def close_to_naive(ours, naive, ref, slack=1e-6):
    """flash-attention's rule: our error against the float64 reference at most twice a naive
    same-precision implementation's (NumPy or torch, any device), plus slack * max(|ref|, 1)."""
    ours, naive = f64(ours), f64(naive)
    assert np.isfinite(ours).all(), "non-finite output (an element was not written?)"
    e_ours = np.abs(ours - ref).max(initial=0)
    e_naive = np.abs(naive - ref).max(initial=0)
    assert e_ours <= 2 * e_naive + slack * max(np.abs(ref).max(initial=0), 1.0), (e_ours, e_naive)


# ---- naive same-precision yardsticks (torch tensors, computed in their own dtype) -------------

def naive_decode(q, k, v, keep, scale, bias=None):
    """Decode attention: q [B,1,Hq,D], k/v [B,L,Hkv,D], keep bool [B,L], bias (an additive mask) [B|1,L]."""
    import torch

    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q[:, 0], kk) * scale
    if bias is not None:
        s = s + bias.reshape(bias.shape[0], 1, -1).to(s.dtype)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhl,blhd->bhd", p, vv)[:, None]


def naive_prefill(q, k, v, keep, scale, bias=None):
    """Prefill attention: q [B, Lq, Hq, D], k/v [B, Lkv, Hkv, D], keep bool broadcastable to
    [B, Hq, Lq, Lkv] (a torch tensor on q's device, or NumPy), bias (an additive mask, a torch tensor)
    broadcastable to it too."""
    import torch

    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~torch.as_tensor(np.array(keep) if isinstance(keep, np.ndarray) else keep,
                                       device=q.device), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, vv)


def naive_paged_causal(args, q_lens, kv_lens, hq):
    """Causal paged prefill by naive_prefill per sequence: args are attn_paged_prefill's seven torch
    tensors (q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr)."""
    import torch

    from qkernels.testing import prefill_keep

    q = args[0]
    naive = torch.zeros_like(q)
    r2t, rpi, qo = args[3].long(), args[4].long(), args[6].long()
    for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        slots = r2t[rpi[b], :nk]
        keep = torch.from_numpy(prefill_keep(1, hq, nq, nk, True).copy())
        naive[qo[b]:qo[b + 1]] = naive_prefill(q[None, qo[b]:qo[b + 1]], args[1][slots][None], args[2][slots][None],
                                               keep, q.shape[-1] ** -0.5)[0]
    return naive


def sdpa64(q, k, v, mask=None, scale=None):
    """torch's scaled_dot_product_attention in float64 on q [B, Lq, Hq, D], k/v [B, Lkv, Hkv, D]
    (NumPy, any float dtype; GQA expanded) with attn_mask=mask (NumPy, SDPA's layout: broadcastable to
    [B, Hq, Lq, Lkv]; bool, or float as float64) -> NumPy [B, Lq, Hq, D]."""
    import torch

    t = lambda a: torch.from_numpy(np.ascontiguousarray(f64(a))).transpose(1, 2)  # noqa: E731
    G = q.shape[2] // k.shape[2]
    kk, vv = (t(a).repeat_interleave(G, dim=1) for a in (k, v))
    m = None
    if mask is not None:
        m = np.asarray(mask)
        m = torch.from_numpy(np.ascontiguousarray(m if m.dtype == bool else m.astype(np.float64)))
    out = torch.nn.functional.scaled_dot_product_attention(t(q), kk, vv, attn_mask=m, scale=scale)
    return out.transpose(1, 2).numpy()


def request_mask(mask, b, q_len, n):
    """Request b's part of a paged mask as a dense attn_prefill mask over its n keys (SDPA's layout,
    [1, 1|Hq, q_len|1, n]): its row (a per-query mask: its first q_len query rows), positions from the
    mask's width W on dropped."""
    m = mask[:, None, None, :] if mask.ndim == 2 else (mask[None] if mask.ndim == 3 else mask)
    m = m[b:b + 1] if m.shape[0] > 1 else m
    m = m[:, :, :q_len] if m.shape[2] > 1 else m
    pad = np.full(m.shape[:3] + (max(n - m.shape[3], 0),), False if m.dtype == bool else -np.inf, m.dtype)
    return np.concatenate([m[..., :n], pad], axis=-1)


def naive_rotary(x, f, interleaved=True):
    """rotary_emb's formula in x's dtype: cos and sin rounded to it, every product and sum rounded."""
    import torch

    c, s = f[..., 0].unsqueeze(-2).to(x.dtype), f[..., 1].unsqueeze(-2).to(x.dtype)
    half = x.shape[-1] // 2
    xe, xo = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    ye, yo = xe * c - xo * s, xe * s + xo * c
    return torch.stack([ye, yo], -1).flatten(-2) if interleaved else torch.cat([ye, yo], -1)


# ---- sample calls as torch tensors ------------------------------------------------------------

LLM = {"attn_decode", "attn_paged_decode", "attn_prefill", "attn_paged_prefill", "rotary_emb", "linear", "swiglu",
       "rotary_emb_backward", "linear_backward", "swiglu_backward", "rmsnorm", "fused_add_rmsnorm",
       "rotary_kv_append"}

# Options of qkernels.testing.sample that every backend takes (the cuda attention kernels need a
# head_dim of 32, 64, 128 or 256): the table of the tests that run each op on the GPU.
DEVICE_SIZES = {
    "sparse_aggregate": dict(n_dst=60, n_src=40, heads=2, dim=16),
    "sparse_aggregate_backward": dict(n_dst=60, n_src=40, heads=2, dim=16),
    "fused_edge_features": dict(n=50, e=100, h=8),
    "fused_edge_features_backward": dict(n=50, e=100, h=8),
    "sparse_aggregate_plan": dict(n_dst=60, n_src=40),
    "fused_edge_features_plan": dict(n=50, e=100),
    "fused_norm_residual": dict(rows=30, h=64),
    "graph_norm_bce": dict(e=500, graphs=7),
    "fused_norm_residual_backward": dict(rows=30, h=64, p=0.2),
    "graph_norm_bce_backward": dict(e=500, graphs=7),
    "message_passing": dict(n=50, e=100, h=32, f=32, heads=4),
    "attn_decode": dict(b=2, l=50, hkv=2, ratio=4, d=64),
    "attn_paged_decode": dict(lens=[5, 40], hkv=2, ratio=4, d=64),
    "attn_prefill": dict(b=2, lq=30, lkv=50, hkv=2, ratio=4, d=64, is_causal=True),
    "attn_paged_prefill": dict(q_lens=[5, 30, 0], kv_lens=[40, 30, 7], hkv=2, ratio=4, d=64, is_causal=True),
    "rotary_emb": dict(lead=(10,), h=4, d=64),
    "linear": dict(m=4, k=128, n=64),
    "swiglu": dict(m=4, k=128, n=64),
    "rotary_emb_backward": dict(lead=(10,), h=4, d=64),
    "linear_backward": dict(m=4, k=128, n=64),
    "swiglu_backward": dict(m=4, k=128, n=64),
    "rmsnorm": dict(lead=(10,), h=4096),
    "fused_add_rmsnorm": dict(lead=(10,), h=4096),
    "rotary_kv_append": dict(t=10, hq=8, hkv=2, d=64, pool=40, max_pos=64),
}


def host_tensors(op, args):
    """CPU torch tensors of a sample's arrays, converted on the host: the LLM ops' float inputs in
    bfloat16 (the rotary tables, freqs_cis and cos_sin, stay float32), other arguments as they are."""
    import torch

    out = []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            a = torch.from_numpy(np.ascontiguousarray(a))
            table = (op.removesuffix("_backward"), i) in (("rotary_emb", 1), ("rotary_kv_append", 3))
            if op in LLM and i in FLOAT_ARGS[op] and not table:
                a = a.to(torch.bfloat16)
        out.append(a)
    return out


def as_dtype(a, dtype):
    """A NumPy array as dtype (a name): a CPU torch tensor where torch is installed (it has bfloat16),
    else a NumPy array."""
    if not HAS_TORCH:
        return a.astype(dtype)
    import torch

    return torch.from_numpy(a).to(getattr(torch, dtype))


def torch_sample(op, rng, device="cpu", **options):
    """qkernels.testing.sample's call as torch tensors on device, dtypes as sampled (arguments and
    keyword arguments alike)."""
    import torch

    args, kwargs = sample(op, rng, **options)
    conv = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device) if isinstance(a, np.ndarray) else a  # noqa
    return [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}


def to_device(op, args, device):
    return [a.to(device) if type(a).__module__.startswith("torch") else a for a in host_tensors(op, args)]


def with_traced(fn, args, kwargs, traced):
    """fn(*args, **kwargs) as a function of the arguments at the positions `traced` alone, the others
    fixed: what jax.jit or torch.export traces."""

    def call(*ts):
        full = list(args)
        for i, t in zip(traced, ts):
            full[i] = t
        return fn(*full, **kwargs)

    return call


def replaced(args, pos, value):
    """A list of args with the argument at pos (an index, or a tuple of them) replaced by value."""
    args = list(args)
    for p in pos if isinstance(pos, tuple) else (pos,):
        args[p] = value
    return args


class RecordingOut:
    """An out= for the flash backend, which hands its result to out.copy_: keeps it as .got."""

    def copy_(self, src):
        self.got = src


def assert_compiles_like_eager(step, grads, *args):
    """step(*args) -> a loss compiles with fullgraph=True without graph breaks, and grads(f) -> (loss,
    gradients) of the compiled step equals that of the eager one."""
    import torch

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    loss_c, g_c = grads(torch.compile(step, fullgraph=True))
    loss_e, g_e = grads(step)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def large_bce_batch(rng, shape):
    """A large sorted graph_norm_bce batch on the host: (num_graphs, edge_graph, logits, target) with shape
    "three" (3 graphs, 1.5M edges), "uniform" (1000 graphs) or "skewed" (200,000 graphs of heavy-tailed
    sizes: a third empty, a sixth with one edge, ~15 above 1e4 edges)."""
    if shape == "three":
        g, eg = 3, np.sort(rng.integers(0, 3, 1_500_001))
    elif shape == "uniform":
        g, eg = 1000, np.sort(rng.integers(0, 1000, 1_500_000))
    else:  # heavy-tailed sizes: a third empty, a sixth with one edge, ~15 above 1e4 edges
        sizes = np.minimum((rng.pareto(1.1, 200_000) * 2).astype(np.int64), 200_000)
        g, eg = 200_000, np.repeat(np.arange(200_000), sizes)
    e = len(eg)
    lg_h, t_h = (3 * rng.standard_normal(e)).astype(np.float32), (rng.random(e) < 0.3).astype(np.float32)
    return g, eg, lg_h, t_h


def behind_held_copy(dst, src, calls):
    """calls() on a fresh side stream made current, queued behind dst.copy_(src) that a ~0.1 s GPU sleep
    holds back there; its result once that stream is done.  An op that does not run on the caller's
    current stream reads dst before the copy."""
    import torch

    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # hold the side stream back ~0.1 s
        dst.copy_(src)
        result = calls()
    side.synchronize()
    return result


def cuda_randn(*shape, dtype="bfloat16", scale=1.0, seed=0):
    """scale * a standard normal draw on the GPU from torch's generator seeded with seed, in torch's dtype of
    that name (drawn in float32, rounded once)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, device="cuda", generator=g)).to(getattr(torch, dtype))


def cuda(a, dtype=None):
    """A NumPy array as a torch CUDA tensor (cast there to the torch dtype named dtype)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
    return t.to(getattr(torch, dtype)) if dtype else t


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
            if type(r) is tuple:  # the backward ops' gradients, None where not asked for
                return tuple(t if t is None or isinstance(t, torch.Tensor) else torch.from_dlpack(t) for t in r)
            return r if isinstance(r, torch.Tensor) else torch.from_dlpack(r)

        return call

    def __repr__(self):
        return f"Ops({self.label})"


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


def jax_attn_mask(rng, shape, kind, dtype=np.float32, drop=0.4):
    """A bool attention mask (True = keep) or an additive float one (normal values, -inf = drop) of the
    given shape; with a batch dim > 1, sequence 0's rows are dropped whole (its output is 0)."""
    keep = rng.random(shape) >= drop
    if len(shape) > 1 and shape[0] > 1:
        keep[0] = False
    if kind == "bool":
        return keep
    return np.where(keep, 2 * rng.standard_normal(shape), -np.inf).astype(dtype)


def sab_graph(rng, ix, n_dst, n_src, degrees=None, lo=0, tail=0):
    """A CSR graph whose first `lo` and last `tail` edges lie outside the rows."""
    degrees = rng.poisson(3, n_dst) if degrees is None else np.asarray(degrees)
    row_ptr = (lo + np.concatenate([[0], np.cumsum(degrees)])).astype(ix)
    e = int(row_ptr[-1]) + tail
    col_idx = rng.integers(0, max(n_src, 1), e).astype(ix) if n_src else np.zeros(e, ix)
    return row_ptr, col_idx
