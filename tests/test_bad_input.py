"""Input that DLPack cannot describe faithfully is refused, never computed on: tensors that
record gradients, lazily negated views, malformed capsules, sizes that overflow 64 bits."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import FLOAT_ARGS, OPS, sample
from dlpack_ctypes import Handmade

torch = pytest.importorskip("torch")


def torch_sample(op, seed=0):
    args, kwargs = sample(op, np.random.default_rng(seed))
    return [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args], kwargs


def call(op, args, kwargs, **extra):
    return getattr(qkernels, op)(*args, **kwargs, **extra)


@pytest.fixture(params=[True, False], ids=["exchange_api", "dlpack"])
def exchange(request):
    old = qkernels._dispatch.configure(use_exchange_api=request.param)
    yield request.param
    qkernels._dispatch.configure(use_exchange_api=old["use_exchange_api"])


@pytest.mark.parametrize("op", OPS)
def test_requires_grad_refused_under_grad_mode(op, exchange):
    names = getattr(qkernels, op).__text_signature__ or ""
    for pos in FLOAT_ARGS[op]:
        args, kwargs = torch_sample(op)
        args[pos] = args[pos].clone().requires_grad_()
        arg = names.strip("()").split(",")[pos].split("=")[0].strip()
        with pytest.raises(RuntimeError, match=rf"^{op}: {arg} requires grad, but qkernels ops do not record"):
            call(op, args, kwargs)
        with pytest.raises(RuntimeError, match=rf"^{op}: {arg} requires grad"):
            call(op, args, kwargs, backend="cpu")


@pytest.mark.parametrize("op", OPS)
def test_requires_grad_runs_without_grad_mode(op, exchange):
    args, kwargs = torch_sample(op)
    expected = call(op, args, kwargs)
    graded = [a.clone().requires_grad_() if i in FLOAT_ARGS[op] else a for i, a in enumerate(args)]
    with torch.no_grad():
        r = call(op, graded, kwargs)
    assert not r.requires_grad
    torch.testing.assert_close(r, expected, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(call(op, graded, kwargs), expected, rtol=0, atol=0)
    detached = [a.detach() if i in FLOAT_ARGS[op] else a for i, a in enumerate(graded)]
    torch.testing.assert_close(call(op, detached, kwargs), expected, rtol=0, atol=0)


def test_out_requiring_grad_is_refused():
    args, kwargs = torch_sample("linear")
    out = torch.empty(3, 7, requires_grad=True)
    with pytest.raises(RuntimeError, match="^linear: out requires grad"):
        qkernels.linear(*args, out=out)


def test_from_dlpack_refuses_what_would_drop_gradients():
    with pytest.raises(RuntimeError, match="^from_dlpack: x requires grad"):
        qkernels.from_dlpack(torch.ones(3, requires_grad=True))
    with torch.no_grad():
        t = qkernels.from_dlpack(torch.ones(3, requires_grad=True))
    assert np.from_dlpack(t).tolist() == [1, 1, 1]


@pytest.mark.parametrize("op", OPS)
def test_negation_bit_refused(op, exchange):
    args, kwargs = torch_sample(op)
    pos = FLOAT_ARGS[op][0]
    args[pos] = torch._neg_view(args[pos])
    assert args[pos].is_neg()
    with pytest.raises(BufferError, match=rf"^{op}: \w+ is a view with torch's lazy negation bit set"):
        call(op, args, kwargs)
    args[pos] = args[pos].resolve_neg()
    call(op, args, kwargs)


def test_conj_imag_view_is_refused_not_read_unsigned():
    z = torch.complex(torch.randn(3, 10), torch.randn(3, 10)).conj()
    x = z.imag  # strided and negated: refused for the negation before the stride
    with pytest.raises(BufferError, match="negation bit"):
        qkernels.fused_norm_residual(x, x.resolve_neg(), torch.ones(10), torch.zeros(10))


@pytest.mark.parametrize("op", OPS)
def test_sizes_overflowing_64_bits_are_refused(op):
    """A stride-0 view whose logical size in bytes needs more than 63 bits."""
    args, kwargs = sample(op)
    pos = FLOAT_ARGS[op][0]
    h = Handmade(np.ascontiguousarray(args[pos]))
    h.shape[0], h.strides[0] = 2**62, 0
    args = list(args)
    args[pos] = h.capsule()
    with pytest.raises(ValueError, match=rf"^{op}: \w+ of shape \[4611686018427387904.*too large"):
        call(op, args, kwargs)


def test_output_size_overflow_is_a_memory_error():
    x = qkernels.from_dlpack(torch.ones(1, 1).expand(2**31, 1))
    w = qkernels.from_dlpack(torch.ones(1, 1).expand(2**33, 1))
    with pytest.raises(MemoryError, match=r"^linear: out of shape \[2147483648, 8589934592\].*2\^63 bytes"):
        qkernels.linear(x, w)
    with pytest.raises(MemoryError, match=r"^swiglu: out of shape"):
        qkernels.swiglu(x, w, w)


def test_malformed_capsules():
    a = np.ones((4, 3), np.float32)
    h = Handmade(a)
    h.managed.dl_tensor.data = None
    with pytest.raises(BufferError, match=r"^linear: x is a malformed DLPack tensor: 12 elements at a NULL data"):
        qkernels.linear(h.capsule(), a)
    h = Handmade(a)
    h.shape[0] = -4
    with pytest.raises(BufferError, match=r"^from_dlpack: x is a malformed DLPack tensor: size -4 in dimension 0"):
        qkernels.from_dlpack(h.capsule())
    empty = Handmade(np.ones((0, 3), np.float32))
    empty.managed.dl_tensor.data = None  # no elements: nothing is read, so no pointer is needed
    assert qkernels.from_dlpack(empty.capsule()).shape == (0, 3)


def test_producer_errors_name_the_op_and_argument():
    big_endian = np.ones((2, 8), ">f4")
    with pytest.raises(BufferError, match=r"^linear: x could not be exported through DLPack: .*byte order") as e:
        qkernels.linear(big_endian, np.ones((3, 8), np.float32))
    assert isinstance(e.value.__cause__, BufferError)

    class Broken:
        def __dlpack__(self, **kw):
            raise ValueError("no export today")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(ValueError, match=r"^linear: weight could not be exported through DLPack: no export today"):
        qkernels.linear(np.ones((2, 8), np.float32), Broken())
