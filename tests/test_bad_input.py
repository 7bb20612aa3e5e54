"""Input that DLPack cannot describe faithfully is refused, never computed on: tensors that
record gradients, lazily negated views, malformed capsules, sizes that overflow 64 bits."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import FLOAT_ARGS, OPS, sample
from dlpack_ctypes import Handmade
from conftest import outputs, results, takes_out

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
def test_requires_grad_recorded_or_refused_under_grad_mode(op, exchange):
    """Never a silently detached result: the raw op refuses, the public op records the gradient
    or names the input it has none for."""
    from qkernels.torch import COMPOSED, GRADIENTS

    names = getattr(qkernels, op).__text_signature__ or ""
    for pos in FLOAT_ARGS[op]:
        args, kwargs = torch_sample(op)
        args[pos] = args[pos].clone().requires_grad_()
        arg = names.strip("()").split(",")[pos].split("=")[0].strip()
        with pytest.raises(qkernels._C.GradRequiredError, match=rf"^{op}: {arg} requires grad, but the raw op"):
            getattr(qkernels._C, op + "_raw")(*args, **kwargs)
        for extra in ({}, {"backend": "cpu"}):
            if op in COMPOSED:  # differentiable through the composition it is defined by
                assert any(t.requires_grad and t.grad_fn is not None for t in call(op, args, kwargs, **extra))
            elif arg in GRADIENTS.get(op, ((), (), ()))[2] and op + "_backward" in qkernels._C.OPS:
                r = call(op, args, kwargs, **extra)
                assert r.requires_grad and r.grad_fn is not None
            else:
                with pytest.raises(RuntimeError, match=rf"^{op}: {arg} requires grad, but {op} has no gradient"):
                    call(op, args, kwargs, **extra)


@pytest.mark.parametrize("op", OPS)
def test_requires_grad_runs_without_grad_mode(op, exchange):
    args, kwargs = torch_sample(op)
    expected = results(call(op, args, kwargs))

    def graded():  # a fresh sample each call: an op may update an argument in place (MUTATED)
        return [a.clone().requires_grad_() if i in FLOAT_ARGS[op] else a for i, a in enumerate(torch_sample(op)[0])]

    with torch.no_grad():
        r = call(op, graded(), kwargs)
    assert not any(t.requires_grad for t in outputs(r) if t is not None)
    torch.testing.assert_close(results(r), expected, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(results(call(op, graded(), kwargs)), expected, rtol=0, atol=0)
    detached = [a.detach() if i in FLOAT_ARGS[op] else a for i, a in enumerate(graded())]
    torch.testing.assert_close(results(call(op, detached, kwargs)), expected, rtol=0, atol=0)


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
    if not FLOAT_ARGS[op]:
        pytest.skip("no float argument (torch sets the negation bit on float views)")
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
    pos = (FLOAT_ARGS[op] or (0,))[0]  # the plan ops: their index tensor
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

    with pytest.raises(BufferError, match=r"^linear: weight could not be exported through DLPack: no export today"):
        qkernels.linear(qkernels.from_dlpack(np.ones((2, 8), np.float32)), Broken())


IN_PLACE = {"rotary_emb": (0,), "fused_norm_residual": (0, 1), "attn_decode": (0,), "attn_prefill": (0,),
            "attn_paged_decode": (0,), "attn_paged_prefill": (0,), "rmsnorm": (0,), "fused_add_rmsnorm": (0,),
            "rotary_kv_append": (0,)}


def _result_shape(op, args, kwargs):
    return np.asarray(call(op, list(args), kwargs)).shape


@pytest.mark.parametrize("op", [op for op in OPS if takes_out(op)])
def test_out_overlapping_an_input(op):
    """Every input the op reads, given as (or overlapping) out: refused, or exactly right in place."""
    args, kwargs = sample(op)
    expected = call(op, [a.copy() if isinstance(a, np.ndarray) else a for a in args], kwargs)  # args unchanged
    shape = np.asarray(expected).shape
    names = getattr(qkernels, op).__text_signature__.strip("()").split(",")
    for pos, a in enumerate(args):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            continue
        arg = names[pos].split("=")[0].strip()
        fresh = [b.copy() if isinstance(b, np.ndarray) else b for b in args]
        if pos in IN_PLACE.get(op, ()) and fresh[pos].shape == shape:
            r = call(op, fresh, kwargs, out=fresh[pos])
            assert r is fresh[pos]
            np.testing.assert_array_equal(r, expected)
            continue
        # a buffer of out's shape whose memory includes the input's: out's first rows hold it
        flat = np.zeros(max(fresh[pos].size, int(np.prod(shape))) + 7, np.float32)
        fresh[pos] = flat[: fresh[pos].size].reshape(fresh[pos].shape)
        fresh[pos][...] = args[pos]
        out = flat[3: 3 + int(np.prod(shape))].reshape(shape)
        with pytest.raises(ValueError, match=rf"^{op}: out overlaps {arg} in memory"):
            call(op, fresh, kwargs, out=out)


def test_out_as_a_column_block_of_an_input():
    x = np.random.default_rng(2).standard_normal((6, 36)).astype(np.float32)
    ei = np.array([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="^fused_edge_features: out overlaps x in memory"):
        qkernels.fused_edge_features(x[:, :12], ei[:, :3], x[:3, 24:], out=x[:3])


def test_out_in_other_columns_of_the_inputs_rows():
    """Views that interleave without sharing an element (column blocks of one buffer's rows) are
    disjoint and run; one shared column is refused."""
    rng = np.random.default_rng(4)
    buf = rng.standard_normal((5, 20)).astype(np.float32)
    w = rng.standard_normal((6, 8)).astype(np.float32)
    expected = buf[:, 2:10] @ w.T
    qkernels.linear(buf[:, 2:10], w, out=buf[:, 12:18])
    np.testing.assert_allclose(buf[:, 12:18], expected, rtol=1e-5, atol=1e-5)
    qkernels.linear(buf[:, 12:20], w, out=buf[:, 6:12])  # out before x in each row
    with pytest.raises(ValueError, match="^linear: out overlaps x in memory"):
        qkernels.linear(buf[:, 2:10], w, out=buf[:, 9:15])
    with pytest.raises(ValueError, match="^linear: out overlaps x in memory"):  # rows of another period
        qkernels.linear(buf[:, 2:10], w, out=buf.reshape(-1)[50:80].reshape(5, 6))


def test_strided_in_place_needs_the_same_view():
    x, f = sample("rotary_emb")[0]
    with pytest.raises(ValueError, match=r"^rotary_emb: out overlaps x in memory; pass out=x itself"):
        qkernels.rotary_emb(x[1:], f[1:], out=x[:-1])


def test_values_validated_in_the_precision_used():
    args, _ = sample("attn_prefill")
    for scale in (1e39, 3e38, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^attn_prefill: scale must be finite in float32"):
            qkernels.attn_prefill(*args, scale=scale)
    args, _ = sample("fused_norm_residual")
    with pytest.raises(ValueError, match="^fused_norm_residual: eps must be a finite value"):
        qkernels.fused_norm_residual(*args, eps=1e39)
    args, _ = sample("graph_norm_bce")
    with pytest.raises(ValueError, match="^graph_norm_bce: pos_weight must be finite in float32"):
        qkernels.graph_norm_bce(*args, pos_weight=1e39)


def test_num_graphs_out_of_range():
    args, _ = sample("graph_norm_bce")
    with pytest.raises(ValueError, match=r"^graph_norm_bce: num_graphs must be between 1 and 2\^63 - 1, got 9223372036854775808$"):
        qkernels.graph_norm_bce(*args[:3], 2**63)
    with pytest.raises(ValueError, match="^graph_norm_bce: num_graphs must be between 1"):
        qkernels.graph_norm_bce(*args[:3], 0)
    with pytest.raises(MemoryError, match="^graph_norm_bce: num_graphs = 4611686018427387904 needs more"):
        qkernels.graph_norm_bce(*args[:3], 2**62)


@pytest.mark.parametrize("op", ["attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill"])
def test_required_tensor_given_as_none(op):
    args, kwargs = sample(op)
    names = getattr(qkernels, op).__text_signature__.strip("()").split(",")
    for pos in range(1, len(args)):
        broken = list(args)
        broken[pos] = None
        arg = names[pos].strip()
        with pytest.raises(TypeError, match=rf"^{op}: {arg} must be a tensor supporting DLPack .*got None"):
            call(op, broken, kwargs)


def test_edge_index_checked_without_features():
    x = np.zeros((4, 0), np.float32)
    with pytest.raises(ValueError, match=r"^fused_edge_features: edge_index\[1, 2\] = 9 is out of range"):
        qkernels.fused_edge_features(x, np.array([[0, 1, 2], [3, 0, 9]]))


FRAMEWORKS = {
    "numpy": lambda a: a,
    "torch": lambda a: torch.from_numpy(a),
    "jax": lambda a: pytest.importorskip("jax.numpy").asarray(a),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("first,second", [("numpy", "torch"), ("torch", "numpy"), ("jax", "numpy"),
                                          ("torch", "jax")])
def test_mixed_frameworks_refused(op, first, second):
    args, kwargs = sample(op)
    names = getattr(qkernels, op).__text_signature__.strip("()").split(",")
    tensors = [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]
    for pos in tensors[1:]:
        mixed = [FRAMEWORKS[first](a) if isinstance(a, np.ndarray) else a for a in args]
        mixed[pos] = FRAMEWORKS[second](args[pos])
        arg = names[pos].split("=")[0].strip()
        deciding = names[tensors[0]].strip()
        with pytest.raises(ValueError, match=rf"^{op}: all tensors must come from one framework; "
                                             rf"{deciding} comes from {first} but {arg} from {second}"):
            call(op, mixed, kwargs)


def test_out_from_another_framework_refused():
    args, _ = sample("linear")
    with pytest.raises(ValueError, match="^linear: .* x comes from torch but out from numpy"):
        qkernels.linear(*[torch.from_numpy(a) for a in args], out=np.zeros((3, 7), np.float32))


def test_framework_neutral_tensors_mix_with_any():
    x, w, b = sample("linear")[0]
    expected = qkernels.linear(x, w, b)
    r = qkernels.linear(torch.from_numpy(x), qkernels.from_dlpack(w), b.__dlpack__())
    assert isinstance(r, torch.Tensor)
    np.testing.assert_array_equal(r.numpy(), expected)


@pytest.mark.parametrize("backend", ["cpu", None])
def test_raw_capsules_with_any_selection(backend):
    x, w, b = sample("linear")[0]
    expected = qkernels.linear(x, w, b)
    r = qkernels.linear(x.__dlpack__(), w.__dlpack__(), b.__dlpack__(), backend=backend)
    np.testing.assert_array_equal(np.asarray(r), expected)
    with qkernels.use_backend("cpu"):
        np.testing.assert_array_equal(np.asarray(qkernels.linear(x.__dlpack__(), w.__dlpack__())),
                                      qkernels.linear(x, w))


def test_unsupported_dtype_is_a_type_error_however_chosen():
    args, _ = sample("sparse_aggregate")
    args = list(args)
    args[3] = args[3].astype(np.int32)
    for backend in ("cpu", None):
        with pytest.raises(TypeError, match="^sparse_aggregate: node_feat must be float32, got int32"):
            qkernels.sparse_aggregate(*args, backend=backend)


def test_swiglu_gate_none():
    x, up, gate = sample("swiglu")[0]
    with pytest.raises(TypeError, match="^swiglu: gate_weight must be a tensor supporting DLPack .*got None"):
        qkernels.swiglu(x, up, None)


@pytest.mark.parametrize("device", ["meta", "sparse"])
def test_torch_tensors_dlpack_cannot_carry(device, exchange):
    x = torch.ones(2, 8, device="meta") if device == "meta" else torch.ones(2, 8).to_sparse()
    with pytest.raises(BufferError, match=r"^linear: x could not be exported through DLPack: [^\n]*$"):
        qkernels.linear(x, torch.ones(3, 8))


def test_tensor_dlpack_bad_dl_device():
    t = qkernels.from_dlpack(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"^Tensor.__dlpack__: dl_device must be a \(device_type, device_id\) tuple"):
        t.__dlpack__(dl_device="cpu")


def test_tensor_is_array_like():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    t = qkernels.from_dlpack(a)
    assert (t.shape, t.dtype, t.device) == ((3, 2), "float32", "cpu")
    assert repr(t) == "qkernels.Tensor(shape=(3, 2), dtype=float32, device=cpu)"
    view = np.asarray(t)
    np.testing.assert_array_equal(view, a)
    assert np.shares_memory(view, a)
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), a)
    copied = np.array(t, copy=True)
    assert not np.shares_memory(copied, a)


def test_namespace_is_the_api():
    public = [n for n in dir(qkernels) if not n.startswith("_")]
    assert "os" not in public and "annotations" not in public
    assert set(qkernels._C.OPS) <= set(public)


@pytest.mark.parametrize("value", ["abc", "-3", "0", "1.5", "99999"])
def test_num_threads_env_validated(value):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import qkernels"], env={**__import__("os").environ,
                       "QKERNELS_NUM_THREADS": value}, capture_output=True, text=True)
    assert r.returncode != 0
    assert f"ValueError: QKERNELS_NUM_THREADS must be a whole number of CPU threads from 1 to 4096, got '{value}'" \
        in r.stderr


def test_from_dlpack_beside_other_threads_calls():
    """from_dlpack once cleared a module-wide flag while it ran: ops on other threads then returned
    qkernels.Tensor instead of torch tensors."""
    import threading
    x, w, b = (torch.from_numpy(a) for a in sample("linear")[0])
    stop, wrong = threading.Event(), []

    def importer():
        while not stop.is_set():
            qkernels.from_dlpack(x)

    def caller():
        for _ in range(3000):
            r = qkernels.linear(x, w, b)
            if not isinstance(r, torch.Tensor):
                wrong.append(type(r))
    threads = [threading.Thread(target=importer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        caller()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not wrong
