"""Property tests over bad input: every op, any argument, drawn from the classes that once crashed
or lied (stride-0 views of huge logical size, out overlapping an input, tensors of two frameworks,
malformed capsules, torch tensors whose autograd state DLPack drops, threads importing beside
calls).  Each draw must raise the documented exception naming the op, or compute the right
answer; a crash fails the whole run."""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkernels
from qkernels.testing import FLOAT_ARGS, MUTATED, OPS, sample
from dlpack_ctypes import Handmade
from conftest import outputs, takes_out

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tensor_positions(args):
    return [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]


def arg_name(op, pos):
    return getattr(qkernels, op).__text_signature__.strip("()").split(",")[pos].split("=")[0].strip()


def run(op, args, kwargs, **extra):
    return getattr(qkernels, op)(*args, **kwargs, **extra)


def copies(args):
    """Fresh copies of a sample's arrays: an op that updates an argument in place (MUTATED) sees the
    sample's values on every call."""
    return [a.copy() if isinstance(a, np.ndarray) else a for a in args]


@SETTINGS
@given(op=st.sampled_from(OPS), data=st.data(), log_size=st.integers(40, 62), lead=st.booleans())
def test_huge_stride0_views(op, data, log_size, lead):
    """A stride-0 dimension of 2^40..2^62 elements in any tensor argument: refused before any
    allocation or kernel, or (where the op reads fewer rows than the view has) run unharmed."""
    args, kwargs = sample(op, np.random.default_rng(data.draw(st.integers(0, 2**16))))
    pos = data.draw(st.sampled_from(tensor_positions(args)))
    a = np.ascontiguousarray(args[pos])
    if a.ndim == 0:
        return
    h = Handmade(a)
    d = 0 if lead else a.ndim - 1
    h.shape[d], h.strides[d] = 2**log_size, 0
    args = list(args)
    args[pos] = h.capsule()
    try:
        run(op, args, kwargs)
    except (ValueError, MemoryError, TypeError) as e:
        assert str(e).startswith(f"{op}: ")


IN_PLACE = {"rotary_emb": (0,), "fused_norm_residual": (0, 1), "attn_decode": (0,), "attn_prefill": (0,),
            "attn_paged_decode": (0,), "attn_paged_prefill": (0,), "rmsnorm": (0,), "fused_add_rmsnorm": (0,),
            "rotary_kv_append": (0,)}


@SETTINGS
@given(op=st.sampled_from([op for op in OPS if takes_out(op)]), data=st.data(),
       shift=st.integers(-5, 5))
def test_out_overlapping(op, data, shift):
    """out placed over an input's memory at any offset: refused, or exactly right in the in-place form."""
    args, kwargs = sample(op, np.random.default_rng(data.draw(st.integers(0, 2**16))))
    expected = np.asarray(run(op, copies(args), kwargs))
    pos = data.draw(st.sampled_from(FLOAT_ARGS[op]))
    flat = np.zeros(max(args[pos].size, expected.size) + 16, np.float32)
    args = list(args)
    source = args[pos]
    args[pos] = flat[8: 8 + source.size].reshape(source.shape)
    args[pos][...] = source
    out = flat[8 + shift: 8 + shift + expected.size].reshape(expected.shape)
    if shift == 0 and source.shape == expected.shape and pos in IN_PLACE.get(op, ()):
        np.testing.assert_array_equal(run(op, args, kwargs, out=out), expected)
        return
    with pytest.raises(ValueError, match=rf"^{op}: out overlaps {arg_name(op, pos)} in memory"):
        run(op, args, kwargs, out=out)


FRAMEWORKS = {"numpy": lambda a: a, "torch": torch.from_numpy,
              "jax": lambda a: pytest.importorskip("jax.numpy").asarray(a)}


@SETTINGS
@given(op=st.sampled_from(OPS), data=st.data())
def test_mixed_frameworks(op, data):
    args, kwargs = sample(op, np.random.default_rng(data.draw(st.integers(0, 2**16))))
    positions = tensor_positions(args)
    kinds = [data.draw(st.sampled_from(sorted(FRAMEWORKS)), label=f"arg {i}") for i in positions]
    mixed = list(args)
    for i, k in zip(positions, kinds):
        mixed[i] = FRAMEWORKS[k](args[i])
    if len(set(kinds)) == 1:
        if kinds[0] == "jax" and op in MUTATED:  # an immutable array cannot be updated in place
            with pytest.raises(TypeError, match=rf"^{op}: .* would be written in place, which JAX arrays cannot be"):
                run(op, mixed, kwargs)
            return
        run(op, mixed, kwargs)
        return
    first = kinds[0]
    other = next(i for i, k in zip(positions, kinds) if k != first)
    with pytest.raises(ValueError, match=rf"^{op}: all tensors must come from one framework; "
                                         rf"{arg_name(op, positions[0])} comes from {first} but "
                                         rf"{arg_name(op, other)} from {kinds[positions.index(other)]}"):
        run(op, mixed, kwargs)


@SETTINGS
@given(op=st.sampled_from(OPS), data=st.data(),
       defect=st.sampled_from(["null data", "negative size", "consumed", "foreign name", "lanes", "device",
                               "major"]))
def test_malformed_capsules(op, data, defect):
    args, kwargs = sample(op, np.random.default_rng(data.draw(st.integers(0, 2**16))))
    pos = data.draw(st.sampled_from(tensor_positions(args)))
    a = np.ascontiguousarray(args[pos])
    h = Handmade(a, lanes=2 if defect == "lanes" else 1, device_type=4 if defect == "device" else 1,
                 major=2 if defect == "major" else 1)
    if defect == "null data":
        if a.size == 0:
            return
        h.managed.dl_tensor.data = None
    if defect == "negative size":
        if a.ndim == 0:
            return
        h.shape[0] = -1
    cap = h.capsule()
    if defect == "consumed":
        qkernels.from_dlpack(cap)
    if defect == "foreign name":
        import ctypes
        ctypes.pythonapi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
        ctypes.pythonapi.PyCapsule_SetName(cap, b"not_a_tensor")
    args = list(args)
    args[pos] = cap
    with pytest.raises(BufferError, match=rf"^{op}: {arg_name(op, pos)} "):
        run(op, args, kwargs)


@SETTINGS
@given(op=st.sampled_from(OPS), data=st.data(), mode=st.sampled_from(["grad", "no_grad", "inference", "neg"]))
def test_autograd_state(op, data, mode):
    args, kwargs = sample(op, np.random.default_rng(data.draw(st.integers(0, 2**16))))
    expected = outputs(run(op, copies(args), kwargs))
    if not FLOAT_ARGS[op]:
        return  # the plan ops: nothing autograd could track
    pos = data.draw(st.sampled_from(FLOAT_ARGS[op]))
    t = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    if mode == "neg":
        t[pos] = torch._neg_view(-t[pos])
        with pytest.raises(BufferError, match=rf"^{op}: {arg_name(op, pos)} is a view with torch's lazy negation"):
            run(op, t, kwargs)
        return
    t[pos] = t[pos].clone().requires_grad_()
    if mode == "grad":  # recorded for autograd, or refused naming the input: never detached
        from qkernels.torch import COMPOSED, GRADIENTS

        if op in COMPOSED:  # differentiable through the composition it is defined by
            assert any(o.requires_grad and o.grad_fn is not None for o in run(op, t, kwargs))
        elif arg_name(op, pos) in GRADIENTS.get(op, ((), (), ()))[2] and op + "_backward" in qkernels._C.OPS:
            r = run(op, t, kwargs)
            assert r.requires_grad and r.grad_fn is not None
        else:
            with pytest.raises(RuntimeError, match=rf"^{op}: {arg_name(op, pos)} requires grad"):
                run(op, t, kwargs)
        return
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        r = outputs(run(op, t, kwargs))
    assert len(r) == len(expected)
    for got, want in zip(r, expected):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got.numpy(), want)


@settings(max_examples=20, deadline=None)
@given(op=st.sampled_from(OPS), seed=st.integers(0, 2**16))
def test_from_dlpack_beside_calls(op, seed):
    """Imports on other threads never change what a call returns."""
    args, kwargs = sample(op, np.random.default_rng(seed))
    t = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    stop, wrong = threading.Event(), []

    def importer():
        while not stop.is_set():
            qkernels.from_dlpack(t[0])

    threads = [threading.Thread(target=importer) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        for _ in range(200):
            for r in outputs(run(op, t, kwargs)):
                if not isinstance(r, torch.Tensor):
                    wrong.append(type(r))
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not wrong
