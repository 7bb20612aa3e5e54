"""rmsnorm and fused_add_rmsnorm on the cpu backend against the float64 references of qkernels.testing:
float32, float16 and bfloat16 (torch), awkward row lengths, strided and broadcast rows, out= (NaN-poisoned,
in place as out=x), the in-place residual (rounded once, the norm of the unrounded sum), the torch operator
(mutation annotation, forward-only refusals), and the refusals of bad arguments naming the op and argument."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkernels
from qkernels.testing import reference, sample, written
from conftest import HAS_TORCH, requires_torch

HS = [1, 2, 7, 24, 64, 100, 1000, 1024, 4095, 4096, 8192]
TOL = {np.float32: 2e-6, np.float16: 1e-3}


def ulp(a, dtype):
    """The spacing of dtype at |a| (float64 NumPy)."""
    a = np.abs(np.asarray(a, np.float64)).astype(dtype)
    return np.spacing(a).astype(np.float64)


def within_rounding(got, ref, dtype, slack=1e-5):
    """Every element of got is ref rounded once to dtype: within half a unit in the last place of ref
    (plus fp32 noise, slack relative)."""
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref)
    bound = 0.5 * ulp(ref, dtype) + slack * np.abs(ref) + 1e-30
    return bool((err <= bound).all()), float((err / bound).max(initial=0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("lead", [(), (1,), (5,), (2, 3)])
def test_rmsnorm_matches_reference(rng, dtype, h, lead):
    (x, w), _ = sample("rmsnorm", rng, dtype=dtype, lead=lead, h=h)
    out = qkernels.rmsnorm(x, w, backend="cpu")
    ref = reference("rmsnorm", x, w)
    assert out.shape == x.shape and out.dtype == dtype
    ok, worst = within_rounding(out, ref, dtype)
    assert ok, worst


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_fused_add_rmsnorm_matches_reference(rng, dtype, h, lead):
    (x, r, w), _ = sample("fused_add_rmsnorm", rng, dtype=dtype, lead=lead, h=h)
    before = r.copy()
    ref, (new_r,) = reference("fused_add_rmsnorm", x, before, w), written("fused_add_rmsnorm", x, before, w)
    out = qkernels.fused_add_rmsnorm(x, r, w, backend="cpu")
    assert out.shape == x.shape and out.dtype == dtype
    ok, worst = within_rounding(out, ref, dtype)
    assert ok, worst
    # the residual: the fp32 sum rounded once to its dtype
    np.testing.assert_array_equal(r, (x.astype(np.float32) + before.astype(np.float32)).astype(dtype))
    assert np.abs(r - new_r).max(initial=0) <= np.abs(new_r).max(initial=0) * (2e-7 if dtype == np.float32 else 1e-3)


def test_norm_is_of_the_unrounded_sum(rng):
    """float16 sums of values 16x apart need more bits than float16 has: the output is the rounding of
    the norm of the exact sum, which the norm of the rounded sum is not."""
    x = rng.standard_normal((64, 256)).astype(np.float16)
    r = (16 * rng.standard_normal((64, 256))).astype(np.float16)
    w = np.ones(256, np.float16)
    exact = x.astype(np.float64) + r.astype(np.float64)
    rounded = exact.astype(np.float16).astype(np.float64)
    assert (exact != rounded).mean() > 0.3
    out = qkernels.fused_add_rmsnorm(x, r.copy(), w, backend="cpu")
    assert within_rounding(out, reference("rmsnorm", exact, w), np.float16)[0]
    assert not within_rounding(out, reference("rmsnorm", rounded, w), np.float16)[0]  # the test can tell


@requires_torch
@pytest.mark.parametrize("h", [1, 7, 64, 4095, 4096])
def test_bfloat16_torch(rng, h):
    import torch

    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(6,), h=h)
    x, r, w = (torch.from_numpy(a).to(torch.bfloat16) for a in (x, r, w))
    x64, r64 = x.double().numpy(), r.double().numpy()
    before = r.clone()
    out = qkernels.fused_add_rmsnorm(x, r, w)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ok, worst = within_rounding(out.double().numpy(), reference("fused_add_rmsnorm", x64, r64, w.double().numpy()),
                                np.float32, slack=4e-3)  # bf16: 8 significant bits
    assert ok, worst
    torch.testing.assert_close(r, (x.float() + before.float()).to(torch.bfloat16), rtol=0, atol=0)
    y = qkernels.rmsnorm(x, w)
    assert within_rounding(y.double().numpy(), reference("rmsnorm", x64, w.double().numpy()), np.float32,
                           slack=4e-3)[0]


def test_results_do_not_depend_on_the_thread_count():
    import subprocess
    import sys

    code = ("import hashlib, numpy as np, qkernels\n"
            "from qkernels.testing import sample\n"
            "(x, r, w), _ = sample('fused_add_rmsnorm', np.random.default_rng(3), lead=(300,), h=1000)\n"
            "out = qkernels.fused_add_rmsnorm(x, r, w)\n"
            "print(hashlib.sha256(out.tobytes() + r.tobytes()).hexdigest())\n")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "QKERNELS_NUM_THREADS": str(n)}).stdout
            for n in (1, 2, 7)}
    assert len(runs) == 1, runs


# ---- layouts and out= -----------------------------------------------------------------------------

def test_strided_rows_and_two_row_dimensions(rng):
    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(4, 6), h=40)
    big_x = np.zeros((8, 12, 50), np.float32)
    big_r = np.full((4, 7, 40), np.nan, np.float32)
    xv = big_x[::2, ::2, 3:43]          # rows strided in both leading dimensions
    xv[...] = x
    rv = big_r.transpose(1, 0, 2)[:6].transpose(1, 0, 2)  # leading dimensions in reverse memory order
    rv[...] = r
    out = np.full((4, 6, 60), np.nan, np.float32)[..., 5:45]
    got = qkernels.fused_add_rmsnorm(xv, rv, w[::-1].copy()[::-1], out=out, backend="cpu")
    assert got is out
    assert within_rounding(out, reference("fused_add_rmsnorm", x, r, w), np.float32)[0]
    np.testing.assert_array_equal(rv, x + r)
    assert np.isnan(big_r[:, 6]).all()  # the row outside the view untouched


def test_strided_weight_and_broadcast_x(rng):
    (x, w), _ = sample("rmsnorm", rng, lead=(5,), h=33)
    wv = np.repeat(w, 3)[::3]
    xb = np.broadcast_to(x[:1], (5, 33))
    got = qkernels.rmsnorm(xb, wv)
    assert within_rounding(got, reference("rmsnorm", np.ascontiguousarray(xb), w), np.float32)[0]


def test_three_uncollapsible_row_dimensions_are_refused():
    w = np.ones(8, np.float32)
    x = np.zeros((4, 6, 8), np.float32).transpose(1, 0, 2)  # two row dimensions in reverse memory order
    assert qkernels.rmsnorm(x, w).shape == (6, 4, 8)
    z = np.zeros((3, 4, 5, 6, 8), np.float32)[::2, :, ::2, ::2]  # four row dimensions, none merging
    with pytest.raises(ValueError, match="^rmsnorm: the leading dimensions of x and out cannot be stepped"):
        qkernels.rmsnorm(z, w)
    assert qkernels.rmsnorm(np.ascontiguousarray(z), w).shape == z.shape


def test_out_poisoned_and_in_place(rng):
    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(7,), h=129)
    r0 = r.copy()
    ref = reference("fused_add_rmsnorm", x, r0, w)
    out = np.full_like(x, np.nan)
    assert qkernels.fused_add_rmsnorm(x, r, w, out=out) is out
    assert within_rounding(out, ref, np.float32)[0]
    r[...] = r0
    xi = x.copy()
    assert qkernels.fused_add_rmsnorm(xi, r, w, out=xi) is xi  # FlashInfer's form: the norm into x
    np.testing.assert_array_equal(xi, out)
    np.testing.assert_array_equal(r, x + r0)
    xi = x.copy()
    assert qkernels.rmsnorm(xi, w, out=xi) is xi
    np.testing.assert_array_equal(xi, qkernels.rmsnorm(x, w))


def test_empty_and_eps(rng):
    w = np.ones(8, np.float32)
    for shape in ((0, 8), (3, 0, 8)):
        assert qkernels.rmsnorm(np.zeros(shape, np.float32), w).shape == shape
        assert qkernels.fused_add_rmsnorm(np.zeros(shape, np.float32), np.zeros(shape, np.float32), w).shape == shape
    assert qkernels.rmsnorm(np.zeros((2, 0), np.float32), np.ones(0, np.float32)).shape == (2, 0)
    z = qkernels.rmsnorm(np.zeros((2, 8), np.float32), w)  # eps keeps a zero row finite
    assert (z == 0).all()
    (x, w), _ = sample("rmsnorm", rng, h=16)
    assert within_rounding(qkernels.rmsnorm(x, w, eps=0.5), reference("rmsnorm", x, w, eps=0.5), np.float32)[0]
    assert within_rounding(qkernels.rmsnorm(x, w, eps=0), reference("rmsnorm", x, w, eps=0), np.float32)[0]


# ---- refusals --------------------------------------------------------------------------------------

def test_bad_arguments_name_the_op_and_argument():
    x, r, w = np.ones((3, 8), np.float32), np.ones((3, 8), np.float32), np.ones(8, np.float32)
    F = qkernels.fused_add_rmsnorm
    cases = [
        (lambda: F(x, r, np.ones(7, np.float32)), ValueError, r"fused_add_rmsnorm: weight must have shape \[H\] = \[8\]"),
        (lambda: F(x, r, w.astype(np.float16)), TypeError, "fused_add_rmsnorm: weight must have x's dtype"),
        (lambda: F(x, r.astype(np.float16), w), TypeError, "fused_add_rmsnorm: residual must have x's dtype"),
        (lambda: F(x, np.ones((3, 9), np.float32), w), ValueError, "fused_add_rmsnorm: residual must have x's shape"),
        (lambda: F(x.astype(np.float64), r, w), TypeError, "fused_add_rmsnorm: x must be float32, float16 or bfloat16"),
        (lambda: F(x, r, w, eps=-1.0), ValueError, "fused_add_rmsnorm: eps must be a finite value >= 0"),
        (lambda: F(x, r, w, eps=1e39), ValueError, "fused_add_rmsnorm: eps must be a finite value >= 0"),
        (lambda: F(x, r, w, eps="a"), TypeError, "fused_add_rmsnorm: eps must be a float"),
        (lambda: F(x, np.broadcast_to(r[:1], r.shape), w), ValueError, "fused_add_rmsnorm: residual has stride 0"),
        (lambda: F(x, x, w), ValueError, "fused_add_rmsnorm: residual overlaps x in memory"),
        (lambda: F(x, r, r[0]), ValueError, "fused_add_rmsnorm: residual overlaps weight in memory"),
        (lambda: F(x, r, w, out=r), ValueError, "fused_add_rmsnorm: out overlaps residual in memory"),
        (lambda: F(x, r, w, out=np.ones((3, 7), np.float32)), ValueError, "fused_add_rmsnorm: out must have shape"),
        (lambda: F(x[:, ::2], r[:, ::2], w[:4]), ValueError, "fused_add_rmsnorm: x must be unit-stride"),
        (lambda: F(x, r, w, out=x[::-1]), ValueError, "fused_add_rmsnorm: out overlaps x in memory; pass out=x"),
        (lambda: qkernels.rmsnorm(np.array(1.0, np.float32), w[:1]), ValueError, "rmsnorm: x must have at least one dim"),
        (lambda: qkernels.rmsnorm(x, np.ones((1, 8), np.float32)), ValueError, "rmsnorm: weight must have 1"),
        (lambda: qkernels.rmsnorm(x, w, _variant="rows"), TypeError, r"rmsnorm\(\) got an unexpected keyword argument"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match="^" + match):
            call()
    ro = np.ones((3, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="^fused_add_rmsnorm: residual is read-only"):
        F(x, ro, w)
    np.testing.assert_array_equal(r, 1)  # nothing above wrote residual


def test_raw_op_variant_names():
    x, r, w = np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), np.ones(8, np.float32)
    for v in ("auto", "rows", "block", "reread", None):  # the cpu kernel has one form: every name is taken
        qkernels._C.fused_add_rmsnorm_raw(x, r.copy(), w, _variant=v)
    with pytest.raises(ValueError, match="^fused_add_rmsnorm: _variant"):
        qkernels._C.fused_add_rmsnorm_raw(x, r, w, _variant="fast")


# ---- torch ----------------------------------------------------------------------------------------

@requires_torch
def test_torch_operator_mutates_residual_and_bumps_its_version(rng):
    import torch

    import qkernels.torch  # noqa: F401  (registers the operators)

    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(3,), h=32)
    x, r, w = map(torch.from_numpy, (x, r, w))
    schema = str(torch.ops.qkernels.fused_add_rmsnorm.default._schema)
    assert "Tensor(a!) residual" in schema and "Tensor x" in schema
    before, version = r.clone(), r._version
    out = torch.ops.qkernels.fused_add_rmsnorm(x, r, w)
    torch.testing.assert_close(r, x + before, rtol=0, atol=0)
    assert r._version > version
    version = r._version
    r2 = before.clone()
    torch.testing.assert_close(qkernels.fused_add_rmsnorm(x, r2, w), out, rtol=0, atol=0)  # the C path too
    assert r2._version > 0

    def step(x, r, w):
        return qkernels.fused_add_rmsnorm(x, r, w) * 2

    r3 = before.clone()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(x, r3, w)
    torch.testing.assert_close(got, out * 2, rtol=0, atol=0)
    torch.testing.assert_close(r3, x + before, rtol=0, atol=0)  # functionalized, and written back


@requires_torch
@pytest.mark.parametrize("arg", ["x", "residual", "weight"])
def test_torch_forward_only(rng, arg):
    import torch

    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(3,), h=32)
    t = dict(zip(("x", "residual", "weight"), map(torch.from_numpy, (x, r, w))))
    t[arg] = t[arg].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=rf"^fused_add_rmsnorm: {arg} requires grad, but fused_add_rmsnorm has "
                                           rf"no gradient for {arg} \(the rmsnorm ops are forward-only\)"):
        qkernels.fused_add_rmsnorm(t["x"], t["residual"], t["weight"])
    np.testing.assert_array_equal(t["residual"].detach().numpy(), r)  # refused before anything was written
    with torch.no_grad():
        qkernels.fused_add_rmsnorm(t["x"], t["residual"], t["weight"])
    if arg != "residual":
        with pytest.raises(RuntimeError, match=rf"^rmsnorm: {'weight' if arg == 'weight' else 'x'} requires grad"):
            qkernels.rmsnorm(t["x"], t["weight"])


def test_jax_arrays_are_not_written_in_place(rng):
    jnp = pytest.importorskip("jax.numpy")
    (x, r, w), _ = sample("fused_add_rmsnorm", rng, lead=(3,), h=8)
    with pytest.raises(TypeError, match="^fused_add_rmsnorm: residual would be written in place, which JAX arrays"):
        qkernels.fused_add_rmsnorm(jnp.asarray(x), jnp.asarray(r), jnp.asarray(w))
    assert qkernels.rmsnorm(jnp.asarray(x), jnp.asarray(w)).shape == (3, 8)


# ---- properties -----------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), lead=st.lists(st.integers(0, 4), max_size=3), h=st.integers(1, 300),
       dtype=st.sampled_from([np.float32, np.float16]), fused=st.booleans(), step=st.integers(1, 3),
       use_out=st.booleans(), eps=st.sampled_from([1e-6, 1e-2, 0.0]))
def test_property(seed, lead, h, dtype, fused, step, use_out, eps):
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    op = "fused_add_rmsnorm" if fused else "rmsnorm"
    args, _ = sample(op, rng, dtype=dtype, lead=lead, h=h)
    views = []
    for a in args[:-1]:  # rows stepped in the first leading dimension, inside longer rows
        big = np.full(tuple(step * n if i == 0 else n for i, n in enumerate(a.shape[:-1])) + (h + 2,), np.nan, dtype)
        v = big[tuple(slice(None, None, step if i == 0 else 1) for i in range(len(lead))) + (slice(1, 1 + h),)]
        v[...] = a
        views.append(v)
    out = np.full(lead + (h,), np.nan, dtype) if use_out else None
    ref = reference(op, *args, eps=eps)
    got = getattr(qkernels, op)(*views, args[-1], eps=eps, out=out)
    assert got.shape == lead + (h,) and got.dtype == dtype
    if out is not None:
        assert got is out
    if eps == 0.0:  # a zero row has no norm: compare where the reference is finite
        keep = np.isfinite(ref)
        got, ref = np.asarray(got)[keep], ref[keep]
    assert within_rounding(got, ref, dtype, slack=1e-5 * max(1, h) ** 0.5)[0]
    if fused:
        np.testing.assert_array_equal(views[1], (args[0].astype(np.float32) + args[1].astype(np.float32)).astype(dtype))
