"""qkernels.testing: each op's sample is a valid call whose cpu result matches the float64
reference, also with the samples' size options, float16 data and int32 indices; unknown ops and
options are errors naming them."""

import numpy as np
import pytest

import qkernels
from qkernels import _dispatch
from qkernels.testing import DEVICE_DTYPES, MUTATED, OPS, reference, sample, written
from conftest import outputs

SIZES = {"sparse_aggregate": dict(n_dst=30, n_src=9, heads=3, dim=5, avg_degree=4),
         "sparse_aggregate_backward": dict(n_dst=30, n_src=9, heads=3, dim=5, avg_degree=4, edge_weight_grad=False),
         "fused_edge_features": dict(n=20, e=50, h=7, edge_attr=False),
         "fused_edge_features_backward": dict(n=20, e=50, h=7, edge_attr=False),
         "fused_norm_residual": dict(rows=9, h=33, mean=100.0),
         "graph_norm_bce": dict(e=300, graphs=11, sort=False),
         "fused_norm_residual_backward": dict(rows=9, h=33, mean=100.0, p=0.3),
         "graph_norm_bce_backward": dict(e=300, graphs=11, sort=False),
         "rotary_emb": dict(lead=(2, 6), h=3, d=16, interleaved=False),
         "rmsnorm": dict(lead=(3, 4), h=1000),
         "fused_add_rmsnorm": dict(lead=(2, 3), h=4095),
         "rotary_kv_append": dict(t=7, hq=3, hkv=1, d=16, pool=20, max_pos=50, interleaved=False),
         "linear": dict(m=None, k=33, n=17, bias=False),
         "swiglu": dict(m=4, k=33, n=17),
         "attn_decode": dict(b=3, l=40, hkv=1, ratio=4, d=16),
         "attn_prefill": dict(b=1, lq=7, lkv=20, hkv=2, ratio=3, d=16, is_causal=True),
         "attn_paged_decode": dict(lens=[0, 9, 30], hkv=1, ratio=2, d=16, requests=7, extra_slots=0),
         "attn_paged_prefill": dict(q_lens=[3, 0, 5], kv_lens=[10, 2, 5], d=16, lead=2, tail=1, is_causal=True),
         "rotary_emb_backward": dict(lead=(2, 6), h=3, d=16, interleaved=False),
         "linear_backward": dict(m=5, k=33, n=17, lead=(2,)),
         "swiglu_backward": dict(m=None, k=33, n=17, weight_grad=False),
         "sparse_aggregate_plan": dict(n_dst=30, n_src=9, degrees=[0, 3, 0] + [2] * 27),
         "fused_edge_features_plan": dict(n=20, e=50),
         "message_passing": dict(n=30, e=70, h=12, f=7, heads=3, edge_index_dtype=np.int32)}


@pytest.mark.parametrize("options", ["default", "sizes", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_reference_matches_the_cpu_backend(rng, op, options):
    if options == "float16" and _dispatch.OPS[op][0] in _dispatch.GRAPH_FAMILIES:
        pytest.skip("the graph ops' cpu kernels take float32 only")
    kw = {"sizes": SIZES[op], "float16": {"dtype": np.float16, "index_dtype": np.int32}}.get(options, {})
    args, kwargs = sample(op, rng, **kw)
    ref = reference(op, *args, **kwargs)  # first: an op may update an argument in place (MUTATED)
    new = written(op, *args, **kwargs) if op in MUTATED else ()
    result = getattr(qkernels, op)(*args, **kwargs, backend="cpu")
    for i, want in zip(MUTATED.get(op, ()), new):
        assert np.linalg.norm(args[i] - want) <= (2e-3 if options == "float16" else 1e-6) * np.linalg.norm(want)
    assert len(outputs(result)) == len(outputs(ref))
    for out, r in zip(outputs(result), outputs(ref)):  # the backward ops: each gradient, None where not asked
        assert (out is None) == (r is None)
        if r is None:
            continue
        if r.dtype.kind == "i":  # the plans: integers, exactly
            assert np.array_equal(np.asarray(out), r)
            continue
        out = np.asarray(out, np.float64)
        assert out.shape == r.shape and r.dtype == np.float64
        tol = 2e-3 if options == "float16" else 1e-5
        assert np.linalg.norm(out - r) <= tol * max(np.linalg.norm(r), 1e-30)


def test_dropout_reference_needs_the_seed(rng):
    args, _ = sample("fused_norm_residual", rng)
    out = qkernels.fused_norm_residual(*args, p=0.4, training=True, seed=2**70 + 3)  # the low 64 bits key it
    ref = reference("fused_norm_residual", *args, p=0.4, training=True, seed=2**70 + 3)
    assert np.abs(out - ref).max() < 1e-5
    with pytest.raises(ValueError, match="needs the seed"):
        reference("fused_norm_residual", *args, p=0.4, training=True)


def test_unknown_op_and_option():
    with pytest.raises(ValueError, match="reference: unknown op 'conv'"):
        reference("conv")
    with pytest.raises(ValueError, match="sample: unknown op 'conv'"):
        sample("conv")
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        sample("linear", heads=3)


@pytest.mark.parametrize("op", sorted(DEVICE_DTYPES))
def test_device_dtypes_name_every_argument(op):
    """A row of DEVICE_DTYPES has one entry per argument of the sample call (callers zip them)."""
    args, _ = sample(op)
    assert len(DEVICE_DTYPES[op]) == len(args)

