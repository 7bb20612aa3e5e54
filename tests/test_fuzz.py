"""Property tests through the public API on the cpu backend: random valid shapes (0- and 1-sized
dims included), int32/int64 indices, strided, reversed, offset and broadcast views, `out=` or
not, all matched against the float64 references; and random invalid calls, run in a subprocess
so that a crash fails the test instead of killing the run."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkernels
from conftest import rel_err, sparse_aggregate_ref
from graph_refs import dropout_keep, edge_features_ref, graph_bce_ref, norm_residual_ref

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INDEX = st.sampled_from([np.int32, np.int64])


def view(rng, a, how):
    """a as a differently laid out array with the same values."""
    if how == "strided":
        big = np.zeros((a.shape[0] * 2,) + a.shape[1:], a.dtype) if a.ndim else a
        if a.ndim:
            big[::2] = a
            return big[::2]
    if how == "reversed" and a.ndim:
        return np.ascontiguousarray(a[::-1])[::-1]
    if how == "offset" and a.size:
        flat = np.concatenate([np.zeros(3, a.dtype), a.ravel()])
        return flat[3:].reshape(a.shape)
    if how == "fortran" and a.ndim > 1:
        return np.asfortranarray(a)
    return a


LAYOUT = st.sampled_from(["contiguous", "strided", "reversed", "offset", "fortran"])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_dst=st.integers(0, 12), n_src=st.integers(1, 12), h=st.integers(1, 4),
       d=st.integers(1, 6), max_deg=st.integers(0, 5), idx=INDEX, layout=LAYOUT, use_out=st.booleans(),
       broadcast=st.booleans())
def test_sparse_aggregate_property(seed, n_dst, n_src, h, d, max_deg, idx, layout, use_out, broadcast):
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, n_dst)
    row_ptr = np.concatenate([[0], np.cumsum(deg)]).astype(idx)
    col = rng.integers(0, n_src, int(row_ptr[-1])).astype(idx)
    ew = rng.standard_normal((len(col), h)).astype(np.float32)
    if broadcast:
        ew = np.broadcast_to(np.float32(rng.standard_normal()), ew.shape)
    nf = rng.standard_normal((n_src, h, d)).astype(np.float32)
    args = [view(rng, row_ptr, layout), view(rng, col, layout), ew if broadcast else view(rng, ew, layout),
            view(rng, nf, layout)]
    out = np.full((n_dst, h, d), np.nan, np.float32) if use_out else None
    r = qkernels.sparse_aggregate(*args, out=out)
    assert r.shape == (n_dst, h, d)
    assert rel_err(r, sparse_aggregate_ref(row_ptr, col, ew, nf)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 10), e=st.integers(0, 30), h=st.integers(1, 9), idx=INDEX,
       layout=LAYOUT, attr=st.booleans(), use_out=st.booleans())
def test_edge_features_property(seed, n, e, h, idx, layout, attr, use_out):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    ei = rng.integers(0, n, (2, e)).astype(idx)
    ea = rng.standard_normal((e, h)).astype(np.float32) if attr else None
    out = np.full((e, (3 if attr else 2) * h), np.nan, np.float32) if use_out else None
    r = qkernels.fused_edge_features(view(rng, x, layout), view(rng, ei.T, layout).T,
                                     view(rng, ea, layout) if attr else None, out=out)
    assert rel_err(r, edge_features_ref(x, ei, ea)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), r=st.integers(0, 12), h=st.integers(1, 70), layout=LAYOUT,
       p=st.sampled_from([0.0, 0.1, 0.5, 1.0]), training=st.booleans(), mean=st.sampled_from([0.0, 1e3]))
def test_norm_residual_property(seed, r, h, layout, p, training, mean):
    rng = np.random.default_rng(seed)
    x = (mean + rng.standard_normal((r, h))).astype(np.float32)
    res = rng.standard_normal((r, h)).astype(np.float32)
    g = rng.standard_normal(h).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    out = qkernels.fused_norm_residual(view(rng, x, layout), view(rng, res, layout), view(rng, g, layout),
                                       view(rng, b, layout), p=p, training=training, seed=seed)
    keep = dropout_keep(seed, (r, h), p) if training and p > 0 else None
    assert rel_err(out, norm_residual_ref(x, res, g, b, keep=keep, p=p)) < 1e-5


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), e=st.integers(0, 200), g=st.integers(1, 20), idx=INDEX, layout=LAYOUT,
       sorted_=st.booleans(), pos_weight=st.sampled_from([None, 0.5, 3.0]))
def test_graph_bce_property(seed, e, g, idx, layout, sorted_, pos_weight):
    rng = np.random.default_rng(seed)
    lg = (4 * rng.standard_normal(e)).astype(np.float32)
    t = rng.random(e).astype(np.float32)
    eg = rng.integers(0, g, e).astype(idx)
    if sorted_:
        eg.sort()
    r = float(qkernels.graph_norm_bce(view(rng, lg, layout), view(rng, t, layout), view(rng, eg, layout), g,
                                      pos_weight=pos_weight))
    ref = graph_bce_ref(lg, t, eg, g, pos_weight)
    assert abs(r - ref) <= 1e-5 * abs(ref) + 1e-12


INVALID_CALLS = textwrap.dedent('''
    import sys
    import numpy as np
    import qkernels

    rng = np.random.default_rng(int(sys.argv[1]))
    GARBAGE = [None, 3, 2.5, "x", [1, 2], object(), np.float32(1.0), b"bytes"]
    DTYPES = [np.float64, np.float16, np.int8, np.uint8, np.complex64, np.bool_, np.int32, np.int64]

    def good():
        e, n, h = 6, 4, 3
        rp = np.array([0, 2, 2, 5, 6]); col = rng.integers(0, n, e)
        return {
            "sparse_aggregate": [rp, col, np.ones((e, h), np.float32), np.ones((n, h, 2), np.float32)],
            "fused_edge_features": [np.ones((n, h), np.float32), rng.integers(0, n, (2, e)), np.ones((e, h), np.float32)],
            "fused_norm_residual": [np.ones((n, h), np.float32), np.ones((n, h), np.float32), np.ones(h, np.float32),
                                    np.ones(h, np.float32)],
            "graph_norm_bce": [np.ones(e, np.float32), np.ones(e, np.float32), np.sort(rng.integers(0, 3, e)), 3],
        }

    def break_one(args):
        i = int(rng.integers(0, len(args)))
        a = args[i]
        kind = rng.integers(0, 7)
        if kind == 0 or not isinstance(a, np.ndarray):
            args[i] = GARBAGE[int(rng.integers(0, len(GARBAGE)))]
        elif kind == 1:
            args[i] = a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1)
        elif kind == 2:
            args[i] = np.concatenate([a, a[:1]]) if a.size else np.ones(3)
        elif kind == 3:
            args[i] = a.astype(DTYPES[int(rng.integers(0, len(DTYPES)))])
        elif kind == 4 and a.dtype.kind == "i":
            b = a.copy(); b.flat[int(rng.integers(0, b.size))] = rng.choice([-1, 10**6]); args[i] = b
        elif kind == 5:
            args[i] = a[..., :0] if a.ndim else a
        else:
            args[i] = np.broadcast_to(a, (2,) + a.shape)
        return args

    count = 0
    for trial in range(400):
        op = list(good())[trial % 4]
        args = break_one(good()[op])
        kw = {}
        if op != "graph_norm_bce" and rng.random() < 0.2:
            ro = np.zeros((1, 1), np.float32); ro.flags.writeable = False
            kw["out"] = ro
        try:
            getattr(qkernels, op)(*args, **kw)
        except (TypeError, ValueError, BufferError) as e:
            count += 1
            assert op in str(e) or "()" in str(e), (op, repr(e))
        except Exception as e:
            raise AssertionError(f"{op}: undocumented exception {e!r}")
    print("OK", count)
''')


def test_invalid_calls_raise_documented_errors_without_crashing():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    r = subprocess.run([sys.executable, "-c", INVALID_CALLS, str(seed)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"seed {seed}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.startswith("OK"), r.stdout
