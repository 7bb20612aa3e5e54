"""Long loops leave memory flat; many Python threads calling the CPU kernels at once (GIL
released) all get right answers.  Graph and LLM ops both."""

import threading

import numpy as np
import pytest

import qkernels
from qkernels.testing import MUTATED, OPS, reference, sample
from conftest import memory_stays_flat, outputs, rel_err


def test_100k_calls_keep_memory_flat():
    rng = np.random.default_rng(5)
    args, _ = sample("sparse_aggregate", rng, n_dst=8, n_src=6, heads=2, dim=3)
    norm, _ = sample("fused_norm_residual", rng, rows=4, h=8)
    out = np.zeros((8, 2, 3), np.float32)
    llm = [(getattr(qkernels, op),) + sample(op, rng) for op in ("attn_decode", "attn_prefill", "attn_paged_prefill",
                                                                 "linear", "swiglu", "rotary_emb")]
    for _ in range(2000):  # warm caches, allocators, the dispatcher
        qkernels.sparse_aggregate(*args)
        for fn, a, kw in llm:
            fn(*a, **kw)
    with memory_stays_flat("1e5"):
        for i in range(100_000):
            if i % 4 == 0:
                qkernels.sparse_aggregate(*args)
            elif i % 4 == 1:
                qkernels.sparse_aggregate(*args, out=out)
            elif i % 4 == 2:
                qkernels.fused_norm_residual(*norm, p=0.1, training=True, seed=i)
            else:
                fn, a, kw = llm[(i // 4) % len(llm)]
                fn(*a, **kw)


# Sizes at which each call splits its work between the pool's threads.
THREAD_SIZES = {
    "sparse_aggregate": dict(n_dst=3000, n_src=1000, heads=4, dim=16, avg_degree=8),
    "sparse_aggregate_backward": dict(n_dst=3000, n_src=1000, heads=4, dim=16, avg_degree=8),
    "fused_edge_features": dict(n=1000, e=4000, h=32),
    "fused_edge_features_backward": dict(n=1000, e=4000, h=32),
    "sparse_aggregate_plan": dict(n_dst=3000, n_src=1000, avg_degree=8),
    "fused_edge_features_plan": dict(n=1000, e=4000),
    "fused_norm_residual": dict(rows=500, h=64),
    "graph_norm_bce": dict(e=20000, graphs=16),
    "fused_norm_residual_backward": dict(rows=500, h=64, p=0.2),
    "graph_norm_bce_backward": dict(e=20000, graphs=16),
    "message_passing": dict(n=2000, e=4000, h=32, f=32, heads=4),
    "rotary_emb": dict(lead=(40,), h=4, d=64),
    "linear": dict(m=5, k=256, n=300),
    "swiglu": dict(m=5, k=256, n=300),
    "rotary_emb_backward": dict(lead=(40,), h=4, d=64),
    "linear_backward": dict(m=40, k=256, n=300),
    "swiglu_backward": dict(m=40, k=256, n=300),
    "attn_decode": dict(b=3, l=700, hkv=2, ratio=4, d=64),
    "attn_prefill": dict(b=2, lq=90, lkv=200, hkv=2, ratio=4, d=64, is_causal=True),
    "attn_paged_decode": dict(lens=[300, 1, 90], hkv=2, ratio=2, d=64),
    "attn_paged_prefill": dict(q_lens=[50, 1, 30], kv_lens=[200, 90, 30], hkv=2, ratio=4, d=64, is_causal=True),
    "rmsnorm": dict(lead=(300,), h=1000),
    "fused_add_rmsnorm": dict(lead=(300,), h=1000),
    "rotary_kv_append": dict(t=300, hq=8, hkv=2, d=64, pool=400, max_pos=500),
}


def test_eight_threads_at_once():
    rng = np.random.default_rng(6)
    calls = [[(op,) + sample(op, rng, **THREAD_SIZES[op]) for op in OPS] for _ in range(8)]
    refs = [[reference(op, *a, **kw) for op, a, kw in thread] for thread in calls]
    errors = []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            for _ in range(5):
                for (op, a, kw), ref in zip(calls[i], refs[i]):
                    a = [t.copy() if j in MUTATED.get(op, ()) else t for j, t in enumerate(a)]  # updated in place
                    for out, r in zip(outputs(getattr(qkernels, op)(*a, **kw)), outputs(ref)):
                        assert rel_err(out, r) < 1e-5, op
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# JAX, when an earlier test imported it, warns at every fork, and Python 3.12 does whenever other
# threads exist (our pool's, torch's); forking is this test's point.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_after_the_thread_pool_started():
    """The CPU kernels' worker pool lives in the parent; a forked child starts its own and gets
    the same bits (a child that hung waiting for the parent's workers would fail the timeout)."""
    import os
    import signal

    rng = np.random.default_rng(3)
    x = rng.standard_normal((40_000, 64)).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)
    first = np.asarray(qkernels.fused_norm_residual(x, x, g, g, backend="cpu"))
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when the result matches
        signal.alarm(20)
        again = np.asarray(qkernels.fused_norm_residual(x, x, g, g, backend="cpu"))
        os._exit(0 if np.array_equal(first, again) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
