"""Every bad-input class of SPEC section 8 raises the documented type with a message naming the
op, the argument and what was expected; nothing is written on failure."""

import numpy as np
import pytest

import qkernels
from qkernels.testing import sample
from conftest import replaced
from dlpack_ctypes import Handmade


def good():
    """sparse_aggregate: N_dst = 6, N_src = 5, E = 9, H = 2, D = 3."""
    return list(sample("sparse_aggregate", np.random.default_rng(7), n_dst=6, n_src=5, heads=2, dim=3,
                       degrees=[2, 1, 0, 3, 1, 2])[0])


def call(args, **kw):
    return qkernels.sparse_aggregate(*args, **kw)


@pytest.mark.parametrize("pos,value,exc,msg", [
    (3, np.ones((5, 2, 3), np.float64), TypeError, "sparse_aggregate: node_feat must be float32, got float64"),
    (2, np.ones((9, 2), np.float64), TypeError, r"edge_weight must have node_feat's dtype \(float32\), got float64"),
    (0, np.zeros(7, np.float32), TypeError, "sparse_aggregate: row_ptr must be int32 or int64, got float32"),
    (1, np.zeros(9, np.int32), TypeError, r"col_idx must have the same dtype as row_ptr \(int64\), got int32"),
    (3, np.ones((5, 2, 3), np.uint8), TypeError, r"node_feat has an unsupported dtype \(DLPack code 1, 8 bits\)"),
    (3, np.ones((5, 2, 3), np.complex64), TypeError, "node_feat has an unsupported dtype"),
    (3, np.ones((5, 6), np.float32), ValueError, r"node_feat must have 3 dimensions \[N_src, H, D\], got shape \[5, 6\]"),
    (2, np.ones((9, 4), np.float32), ValueError, r"edge_weight must have shape \[E, H\] = \[9, 2\] .*got \[9, 4\]"),
    (2, np.ones((8, 2), np.float32), ValueError, r"edge_weight must have shape \[E, H\] = \[9, 2\] .*got \[8, 2\]"),
    (0, np.zeros((2, 3), np.int64), ValueError, r"row_ptr must have 1 dimensions \[N_dst \+ 1\], got shape \[2, 3\]"),
    (0, np.zeros(0, np.int64), ValueError, "row_ptr must have shape \\[N_dst \\+ 1\\] with at least one element"),
    (3, "not a tensor", TypeError, "sparse_aggregate: node_feat must be a tensor supporting DLPack .*got str"),
    (0, [0, 1, 2], TypeError, "sparse_aggregate: row_ptr must be a tensor supporting DLPack .*got list"),
])
def test_bad_argument(pos, value, exc, msg):
    with pytest.raises(exc, match=msg):
        call(replaced(good(), pos, value))


@pytest.mark.parametrize("changes,msg", [
    ({(1, 4): 5}, r"col_idx\[4\] = 5 is out of range for node_feat with N_src = 5"),  # == N_src
    ({(1, 2): -1}, r"col_idx\[2\] = -1 is out of range"),
    ({(0, 3): 8, (0, 4): 2}, r"row_ptr must be non-decreasing .*row_ptr\[4\] = 2"),
    ({(0, -1): 10}, r"0 <= row_ptr\[i\] <= E = 9; row_ptr\[6\] = 10"),
    ({(0, 0): -3}, r"row_ptr\[0\] = -3"),
])
def test_bad_indices_are_reported_with_position(changes, msg):
    args = good()
    for (arg, i), value in changes.items():
        args[arg][i] = value
    with pytest.raises(ValueError, match=msg):
        call(args)


def test_bad_out():
    args = good()
    with pytest.raises(ValueError, match=r"sparse_aggregate: out must have shape \[6, 2, 3\], got \[6, 2, 4\]"):
        call(args, out=np.zeros((6, 2, 4), np.float32))
    with pytest.raises(TypeError, match="sparse_aggregate: out must be float32, got float64"):
        call(args, out=np.zeros((6, 2, 3), np.float64))
    with pytest.raises(TypeError, match="out must be a tensor supporting DLPack"):
        call(args, out=3)
    poisoned = np.full((6, 2, 3), np.nan, np.float32)
    args[1][0] = 99
    with pytest.raises(ValueError):
        call(args, out=poisoned)


def test_stride_zero_out_rejected():
    args = good()
    h = Handmade(np.zeros((6, 2, 1), np.float32))
    h.strides[2] = 0
    h.shape[2] = 3
    from qkernels import from_dlpack
    with pytest.raises(ValueError, match="out has stride 0 in dimension 2"):
        call(args, out=from_dlpack(h.capsule()))


def test_dlpack_protocol_errors():
    args = good()
    a = np.ones((5, 2, 3), np.float32)
    with pytest.raises(BufferError, match="node_feat has 4 vector lanes"):
        args[3] = Handmade(a, lanes=4).capsule()
        call(args)
    with pytest.raises(BufferError, match=r"node_feat lives on dlpack device type 4:0"):
        args[3] = Handmade(a, device_type=4).capsule()  # OpenCL
        call(args)
    with pytest.raises(BufferError, match="DLPack 2.0 tensor; this build reads major version 1"):
        args[3] = Handmade(a, major=2).capsule()
        call(args)
    with pytest.raises(BufferError, match="capsule named 'other'"):
        import ctypes
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        args[3] = new(ctypes.addressof(ctypes.c_int(1)), b"other", None)
        call(args)


def test_mixed_devices_rejected_before_any_device_access():
    # A capsule that claims to live on cuda:0 (never dereferenced: the check comes first).
    args = good()
    args[0] = Handmade(args[0], device_type=2, device_id=0).capsule()
    with pytest.raises(ValueError, match="all tensors must be on one device; node_feat is on cpu but row_ptr is on cuda:0"):
        qkernels._C.sparse_aggregate_raw(*args)


def test_argument_parsing_names_the_function():
    args = good()
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) got an unexpected keyword argument 'outt'"):
        qkernels._C.sparse_aggregate_raw(*args, outt=None)
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) missing required argument 'node_feat'"):
        qkernels._C.sparse_aggregate_raw(*args[:3])
    with pytest.raises(TypeError, match=r"sparse_aggregate\(\) takes at most 4 positional arguments"):
        qkernels._C.sparse_aggregate_raw(*args, None)
    with pytest.raises(TypeError, match="stream must be an int CUDA stream handle"):
        qkernels._C.sparse_aggregate_raw(*args, stream="s")


def tuning_calls():
    """op -> (its arguments on cpu, its private tuning keywords with a value each that its raw op takes)."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 16)).astype(np.float32), rng.standard_normal((5, 16)).astype(np.float32)
    return {
        "linear": ((x, w), dict(_variant="mma", _split=4, _tile_m=16)),
        "swiglu": ((x, w, w), dict(_variant="gemv", _split=1, _tile_m=64)),
        "attn_decode": (sample("attn_decode", rng, b=2, l=7, hkv=2, ratio=2, d=16)[0],
                        dict(_variant="workspace", _splits=3)),
        "attn_paged_decode": (sample("attn_paged_decode", rng, lens=[3, 5], hkv=2, ratio=2, d=16)[0],
                              dict(_variant="rows", _splits=1)),
        "attn_prefill": (sample("attn_prefill", rng, b=2, lq=4, lkv=6, hkv=2, ratio=2, d=16)[0], dict(_variant="wgmma")),
        "attn_paged_prefill": (sample("attn_paged_prefill", rng, q_lens=[2, 3], kv_lens=[4, 3], hkv=2, ratio=2, d=16)[0],
                               dict(_variant="mma")),
    }


@pytest.mark.parametrize("op", ["linear", "swiglu", "attn_decode", "attn_paged_decode", "attn_prefill",
                                "attn_paged_prefill"])
def test_private_tuning_keywords(op):
    """The raw ops take the private tuning keywords (kernels/qk_launch.h's variant fields; the cpu
    kernels have no variants, so the result is unchanged) and name the op and the keyword for a bad
    value; the public ops refuse them."""
    args, tuning = tuning_calls()[op]
    raw = getattr(qkernels._C, op + "_raw")
    assert np.array_equal(np.from_dlpack(raw(*args, **tuning)), np.from_dlpack(raw(*args)))
    with pytest.raises(ValueError, match=rf"{op}: _variant must be one of 'auto', .*, got 'fastest'"):
        raw(*args, _variant="fastest")
    with pytest.raises(TypeError, match=rf"{op}: _variant must be a str, got int"):
        raw(*args, _variant=1)
    for key in tuning:
        with pytest.raises(TypeError, match=rf"{op}\(\) got an unexpected keyword argument '{key}'"):
            getattr(qkernels, op)(*args, **{key: tuning[key]})
        if key != "_variant":
            with pytest.raises(ValueError, match=rf"{op}: {key} must be .*, got -1"):
                raw(*args, **{key: -1})
            with pytest.raises(TypeError, match=rf"{op}: {key} must be an int, got str"):
                raw(*args, **{key: "2"})
    if op in ("linear", "swiglu"):
        with pytest.raises(ValueError, match=rf"{op}: _split must be 0 \(automatic\) or a power of two up to 8, got 3"):
            raw(*args, _split=3)
        with pytest.raises(ValueError, match=rf"{op}: _tile_m must be in \[0, 64\] \(0: automatic\), got 65"):
            raw(*args, _tile_m=65)


def test_cuda_unavailable_is_a_runtime_error():
    if qkernels.AVAILABLE:
        pytest.skip("CUDA is available here")
    from qkernels import from_dlpack
    args = [from_dlpack(Handmade(a, device_type=2).capsule()) for a in good()]
    with pytest.raises(RuntimeError, match="sparse_aggregate: CUDA kernels are not available"):
        qkernels._C.sparse_aggregate_raw(*args)


def test_tensor_dlpack_arguments():
    t = qkernels.from_dlpack(np.ones(3, np.float32))
    with pytest.raises(BufferError, match="copy=True is not supported"):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"dl_device=\(2, 0\) differs"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError, match="max_version must be a"):
        t.__dlpack__(max_version=1)
    with pytest.raises(TypeError):
        qkernels.Tensor()


# ---- attn_decode / attn_paged_decode --------------------------------------------------------

def decode_args(D=8):
    """attn_decode: B = 2, Lkv = 5, Hq = 4, Hkv = 2."""
    return list(sample("attn_decode", np.random.default_rng(5), b=2, l=5, hkv=2, ratio=2, d=D)[0])


@pytest.mark.parametrize("pos,value,exc,msg", [
    (0, np.ones((2, 1, 4, 8), np.float64), TypeError, "attn_decode: q must be bfloat16 or float16 or float32, got float64"),
    (1, np.ones((2, 5, 2, 8), np.float16), TypeError, r"attn_decode: k must have q's dtype \(float32\), got float16"),
    (2, np.ones((2, 5, 2, 8), np.int32), TypeError, r"attn_decode: v must have q's dtype \(float32\), got int32"),
    (0, np.ones((2, 4, 8), np.float32), ValueError, r"attn_decode: q must have 4 dimensions \[B, 1, Hq, D\], got shape \[2, 4, 8\]"),
    (0, np.ones((2, 2, 4, 8), np.float32), ValueError, r"attn_decode: q must have shape \[B, 1, Hq, D\] = \[2, 1, 4, 8\] with size 1 in dimension 1"),
    (1, np.ones((3, 5, 2, 8), np.float32), ValueError, r"attn_decode: k must have shape \[B, Lkv, Hkv, D\] = \[2, 5, 2, 8\] with size 2 in dimension 0"),
    (1, np.ones((2, 5, 2, 6), np.float32), ValueError, r"attn_decode: k must have shape .* with size 8 in dimension 3"),
    (2, np.ones((2, 6, 2, 8), np.float32), ValueError, r"attn_decode: v must have shape \[B, Lkv, Hkv, D\] = \[2, 5, 2, 8\] with size 5 in dimension 1"),
    ((1, 2), np.ones((2, 5, 3, 8), np.float32), ValueError, r"attn_decode: the query heads of q \(Hq = 4\) must be a multiple of the kv heads of k \(Hkv = 3"),
    (0, np.ones((2, 1, 4, 16), np.float32)[..., ::2], ValueError, r"attn_decode: q must be unit-stride in its last dimension.*got stride 2"),
    (1, np.ones((2, 5, 2, 16), np.float32)[..., 1::2], ValueError, r"attn_decode: k must be unit-stride in its last dimension"),
    (2, "v", TypeError, "attn_decode: v must be a tensor supporting DLPack"),
])
def test_decode_bad_argument(pos, value, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_decode(*replaced(decode_args(), pos, value))


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(kv_lens=np.ones(2, np.float32)), TypeError, "attn_decode: kv_lens must be int32 or int64, got float32"),
    (dict(kv_lens=np.ones(3, np.int32)), ValueError, r"attn_decode: kv_lens must have shape \[B\] = \[2\]"),
    (dict(kv_lens=np.ones((2, 1), np.int32)), ValueError, r"attn_decode: kv_lens must have 1 dimensions \[B\]"),
    (dict(mask=np.ones((2, 5), np.int32)), TypeError, r"attn_decode: mask must be bool \(True = keep\) or float32 \(added to the "
                                                      r"scores\), got int32"),
    (dict(mask=np.ones((2, 5), np.uint8)), TypeError, "attn_decode: mask has an unsupported dtype"),
    (dict(mask=np.ones((2, 4), bool)), ValueError, r"attn_decode: mask must have shape \[B, Lkv\] = \[2, 5\] with size 5 in dimension 1"),
    (dict(mask=np.ones((2, 2, 5), bool)), ValueError, r"attn_decode: mask must have shape \[B\|1, 1, Lkv\] = \[2\|1, 1, 5\] with size 1 in dimension 1"),
    (dict(mask=np.ones((3, 1, 1, 5), bool)), ValueError, r"attn_decode: mask must have shape \[B\|1, 1, 1, Lkv\] = \[2\|1, 1, 1, 5\] with size 2 in dimension 0"),
    (dict(mask=np.ones(5, bool)), ValueError, r"attn_decode: mask must have 2 dimensions \[B, Lkv\] or \[B, 1, Lkv\]"),
    (dict(scale="x"), TypeError, "attn_decode: scale must be a float or None, got str"),
    (dict(scale=float("nan")), ValueError, "attn_decode: scale must be finite"),
    (dict(out=np.zeros((2, 1, 4, 8), np.float64)), TypeError, "attn_decode: out must be float32, got float64"),
    (dict(out=np.zeros((2, 4, 8), np.float32)), ValueError, r"attn_decode: out must have shape \[2, 1, 4, 8\], got \[2, 4, 8\]"),
    (dict(out=np.zeros((2, 1, 4, 16), np.float32)[..., ::2]), ValueError, "attn_decode: out must be unit-stride in its last dimension"),
    (dict(kv_lenz=None), TypeError, r"attn_decode\(\) got an unexpected keyword argument 'kv_lenz'"),
])
def test_decode_bad_keyword(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_decode(*decode_args(), **kw)


def test_decode_read_only_out_and_mixed_devices():
    args = decode_args()
    out = np.zeros((2, 1, 4, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(BufferError, match="attn_decode: out is read-only"):
        qkernels.attn_decode(*args, out=out)
    cuda_k = Handmade(args[1], device_type=2, device_id=0)  # alive until its deleter has run
    with pytest.raises(ValueError, match="attn_decode: all tensors must be on one device; q is on cpu but k is on cuda:0"):
        qkernels._C.attn_decode_raw(args[0], cuda_k.capsule(), args[2])
    cuda_mask = Handmade(np.ones((2, 5), bool), device_type=2, device_id=0)
    with pytest.raises(ValueError, match="q is on cpu but mask is on cuda:0"):
        qkernels._C.attn_decode_raw(*args, mask=cuda_mask.capsule())
    assert cuda_k.deleted == 1 and cuda_mask.deleted == 1


def test_decode_cuda_only_checks_on_a_claimed_cuda_tensor():
    # float32 and head_dim 40 are cpu-only; the checks come before any device access.
    # The Handmade owners outlive the tensors: their deleters run when the tensors go.
    f32 = [Handmade(a, device_type=2) for a in decode_args(D=40)]
    f16 = [Handmade(np.ones(a.shape, np.float16), device_type=2) for a in decode_args(D=40)]
    with pytest.raises(TypeError, match="attn_decode: q must be bfloat16 or float16 on cuda"):
        qkernels._C.attn_decode_raw(*[h.capsule() for h in f32])
    with pytest.raises(ValueError, match="attn_decode: head_dim D = 40 is not supported on cuda; expected 32, 64, 128 or 256"):
        qkernels._C.attn_decode_raw(*[h.capsule() for h in f16])
    assert [h.deleted for h in f32 + f16] == [1] * 6
    # 16-byte rows on cuda: a k that starts 2 bytes into its buffer, or whose rows are 40 bytes apart
    q, k, v = (np.ones(a.shape, np.float16) for a in decode_args(D=32))
    shifted = np.zeros(k.size + 1, np.float16)[1:].reshape(k.shape)
    padded = np.zeros(k.shape[:-1] + (k.shape[-1] + 4,), np.float16)[..., :32]
    for bad in (shifted, padded):
        hs = [Handmade(q, device_type=2), Handmade(bad, device_type=2), Handmade(v, device_type=2)]
        with pytest.raises(ValueError, match="attn_decode: k must have 16-byte aligned rows on cuda"):
            qkernels._C.attn_decode_raw(*[h.capsule() for h in hs])


def paged_args():
    """attn_paged_decode: B = 2, S = 10 slots, R = 3 requests, max_ctx = 6, Hq = 4, Hkv = 2, D = 8."""
    return list(sample("attn_paged_decode", np.random.default_rng(6), lens=[3, 2], hkv=2, ratio=2, d=8, requests=3)[0])


@pytest.mark.parametrize("pos,value,exc,msg", [
    (0, np.ones((2, 1, 4, 8), np.float32), ValueError, r"attn_paged_decode: q must have 3 dimensions \[B, Hq, D\]"),
    (1, np.ones((10, 2, 8), np.float16), TypeError, r"attn_paged_decode: k_cache must have q's dtype \(float32\), got float16"),
    (2, np.ones((10, 2, 4), np.float32), ValueError, r"attn_paged_decode: v_cache must have shape \[S, Hkv, D\] = \[10, 2, 8\] with size 8 in dimension 2"),
    ((1, 2), np.ones((10, 3, 8), np.float32), ValueError, r"attn_paged_decode: the query heads of q \(Hq = 4\) must be a multiple of the kv heads of k_cache \(Hkv = 3"),
    (3, np.zeros((3, 6), np.float32), TypeError, "attn_paged_decode: req_to_token must be int32 or int64, got float32"),
    (3, np.zeros(6, np.int32), ValueError, r"attn_paged_decode: req_to_token must have 2 dimensions \[R, max_ctx\]"),
    (4, np.array([0, 1, 2]), ValueError, r"attn_paged_decode: req_pool_indices must have shape \[B\] = \[2\]"),
    (5, np.array([0, 3]), ValueError, r"attn_paged_decode: kv_indptr must have shape \[B \+ 1\] = \[3\]"),
    (5, np.array([0., 3., 5.]), TypeError, "attn_paged_decode: kv_indptr must be int32 or int64, got float64"),
    (1, np.ones((10, 2, 16), np.float32)[..., ::2], ValueError, "attn_paged_decode: k_cache must be unit-stride in its last dimension"),
])
def test_paged_bad_argument(pos, value, exc, msg):
    with pytest.raises(exc, match=msg):
        qkernels.attn_paged_decode(*replaced(paged_args(), pos, value))


def test_paged_new_kv_checks():
    args = paged_args()
    new = np.ones((2, 2, 8), np.float32)
    with pytest.raises(TypeError, match="attn_paged_decode: new_k and new_v must be given together"):
        qkernels.attn_paged_decode(*args, new_k=new)
    with pytest.raises(ValueError, match=r"attn_paged_decode: new_v must have shape \[B, Hkv, D\] = \[2, 2, 8\]"):
        qkernels.attn_paged_decode(*args, new_k=new, new_v=np.ones((2, 1, 8), np.float32))
    with pytest.raises(TypeError, match=r"attn_paged_decode: new_k must have q's dtype \(float32\), got float16"):
        qkernels.attn_paged_decode(*args, new_k=new.astype(np.float16), new_v=new)
    with pytest.raises(ValueError, match=r"attn_paged_decode: mask must have shape \[B, W\] = \[2, 6\] with 1 <= W <= "
                                         r"max_ctx = 6 in dimension 1"):
        qkernels.attn_paged_decode(*args, mask=np.ones((2, 7), bool))
    for i, name in ((1, "k_cache"), (2, "v_cache")):
        a = list(args)
        a[i] = a[i].copy()
        a[i].flags.writeable = False
        qkernels.attn_paged_decode(*a)  # read-only pools are fine when nothing is appended
        with pytest.raises(BufferError, match=f"attn_paged_decode: {name} is read-only, but new_k/new_v are written into it"):
            qkernels.attn_paged_decode(*a, new_k=new, new_v=new)
    cuda_idx = Handmade(args[4], device_type=2, device_id=0)
    with pytest.raises(ValueError, match="q is on cpu but req_pool_indices is on cuda:0"):
        qkernels._C.attn_paged_decode_raw(*args[:4], cuda_idx.capsule(), args[5])
    assert cuda_idx.deleted == 1
