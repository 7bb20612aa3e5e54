"""Long loops leave memory flat; many Python threads calling the CPU kernels at once (GIL
released) all get right answers.  Graph and LLM ops both."""

import threading

import numpy as np
import pytest

import qkernels
from attn_refs import (attn_decode_ref, attn_paged_prefill_ref, attn_prefill_ref, decode_inputs, paged_prefill_inputs,
                       prefill_inputs)
from conftest import memory_stays_flat, rel_err, random_inputs, sparse_aggregate_ref
from graph_refs import graph_bce_ref, norm_residual_ref
from test_dense_ops import freqs_for, linear_ref, rotary_ref, swiglu_ref


def test_100k_calls_keep_memory_flat():
    rng = np.random.default_rng(5)
    args = random_inputs(rng, 8, 6, 2, 3)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    g = np.ones(8, np.float32)
    out = np.zeros((8, 2, 3), np.float32)
    dec = decode_inputs(rng, 2, 9, 1, 2, 8)
    pre = prefill_inputs(rng, 1, 5, 7, 1, 2, 8)
    paged = paged_prefill_inputs(rng, [3, 2], [4, 5], 1, 2, 8)
    w = rng.standard_normal((6, 8)).astype(np.float32)
    rot = (rng.standard_normal((5, 2, 8)).astype(np.float32), freqs_for(rng, (5,), 8))
    llm = [lambda: qkernels.attn_decode(*dec), lambda: qkernels.attn_prefill(*pre, is_causal=True),
           lambda: qkernels.attn_paged_prefill(*paged, is_causal=True), lambda: qkernels.linear(x, w),
           lambda: qkernels.swiglu(x, w, w), lambda: qkernels.rotary_emb(*rot)]
    for _ in range(2000):  # warm caches, allocators, the dispatcher
        qkernels.sparse_aggregate(*args)
        for call in llm:
            call()
    with memory_stays_flat("1e5"):
        for i in range(100_000):
            if i % 4 == 0:
                qkernels.sparse_aggregate(*args)
            elif i % 4 == 1:
                qkernels.sparse_aggregate(*args, out=out)
            elif i % 4 == 2:
                qkernels.fused_norm_residual(x, x, g, g, p=0.1, training=True, seed=i)
            else:
                llm[(i // 4) % len(llm)]()


def test_eight_threads_at_once():
    rng = np.random.default_rng(6)
    cases = [random_inputs(rng, 3000, 1000, 4, 16, avg_degree=8) for _ in range(8)]
    refs = [sparse_aggregate_ref(*c) for c in cases]
    norm = [[rng.standard_normal((500, 64)).astype(np.float32) for _ in range(2)] + [np.ones(64, np.float32),
            np.zeros(64, np.float32)] for _ in range(8)]
    bce = [((3 * rng.standard_normal(20000)).astype(np.float32), (rng.random(20000) < 0.3).astype(np.float32),
            np.sort(rng.integers(0, 16, 20000))) for _ in range(8)]
    dec = [decode_inputs(rng, 3, 700, 2, 4, 64) for _ in range(8)]
    pre = [prefill_inputs(rng, 2, 90, 200, 2, 4, 64) for _ in range(8)]
    paged = [paged_prefill_inputs(rng, [50, 1, 30], [200, 90, 30], 2, 4, 64) for _ in range(8)]
    lin = [(rng.standard_normal((5, 256)).astype(np.float32), rng.standard_normal((300, 256)).astype(np.float32))
           for _ in range(8)]
    rot = [(rng.standard_normal((40, 4, 64)).astype(np.float32), freqs_for(rng, (40,), 64)) for _ in range(8)]
    llm_refs = [(attn_decode_ref(*dec[i]), attn_prefill_ref(*pre[i], is_causal=True),
                 attn_paged_prefill_ref(*paged[i], is_causal=True), linear_ref(*lin[i]),
                 swiglu_ref(lin[i][0], lin[i][1], lin[i][1]), rotary_ref(*rot[i])) for i in range(8)]
    errors = []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            for _ in range(5):
                assert rel_err(qkernels.sparse_aggregate(*cases[i]), refs[i]) < 1e-5
                assert rel_err(qkernels.fused_norm_residual(*norm[i]), norm_residual_ref(*norm[i])) < 1e-5
                r = float(qkernels.graph_norm_bce(*bce[i], 16))
                ref = graph_bce_ref(*bce[i], 16)
                assert abs(r - ref) <= 1e-5 * ref
                got = (qkernels.attn_decode(*dec[i]), qkernels.attn_prefill(*pre[i], is_causal=True),
                       qkernels.attn_paged_prefill(*paged[i], is_causal=True), qkernels.linear(*lin[i]),
                       qkernels.swiglu(lin[i][0], lin[i][1], lin[i][1]), qkernels.rotary_emb(*rot[i]))
                for r, ref in zip(got, llm_refs[i]):
                    assert rel_err(r, ref) < 1e-5
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
