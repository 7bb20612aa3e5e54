"""message_passing on the cpu backend against the float64 reference of qkernels.testing (the graph ops'
references composed): sizes, index dtypes, strided views, determinism for any thread count, errors."""

import numpy as np
import pytest

import qkernels
from conftest import memory_stays_flat, rel_err, strided_all
from qkernels import _dispatch
from qkernels.testing import both_ways_csr, reference, sample

FP32_TOL = 1e-5
NAMES = ("x", "e", "edge_index", "row_ptr", "col_idx", "dir_edge", "w1", "b1", "w_msg", "b_msg", "w_att", "b_att",
         "w_v", "w_o", "gamma_x", "beta_x", "gamma_e", "beta_e")
FLOATS = [i for i, name in enumerate(NAMES) if name not in ("edge_index", "row_ptr", "col_idx", "dir_edge")]


def check(result, args, eps=1e-5):
    """Both outputs: fresh float32 [N, H] and [E, H], each close to the reference."""
    assert type(result) is tuple and len(result) == 2
    n, h = args[0].shape
    for out, ref, shape in zip(result, reference("message_passing", *args, eps=eps), [(n, h), (args[1].shape[0], h)]):
        out = np.asarray(out)
        assert out.shape == shape and out.dtype == np.float32 and out.flags.c_contiguous
        assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("ix,ei_ix", [(np.int64, np.int64), (np.int32, np.int32), (np.int32, np.int64),
                                      (np.int64, np.int32)])
@pytest.mark.parametrize("n,e,h,f,heads", [
    (7, 11, 8, 6, 2),
    (50, 120, 13, 9, 1),     # H not a multiple of 8, one head
    (40, 100, 12, 5, 12),    # K = H: heads of one channel
    (300, 1000, 33, 17, 3),
    (200, 15, 16, 8, 4),     # most nodes without entries
    (5, 9, 1, 3, 1),         # H = 1: LayerNorm of one element
    (1, 0, 4, 3, 2),         # N = 1, E = 0
    (1, 4, 6, 2, 3),         # N = 1: self-loops only
    (9, 0, 8, 4, 4),         # E = 0: x_out is the norm of a zero row
    (0, 0, 4, 3, 2),         # N = 0
    (6, 13, 10, 0, 5),       # F = 0: messages and gates from the biases alone
])
def test_against_reference(rng, ix, ei_ix, n, e, h, f, heads):
    args, _ = sample("message_passing", rng, index_dtype=ix, edge_index_dtype=ei_ix, n=n, e=e, h=h, f=f, heads=heads)
    check(qkernels.message_passing(*args), args)


def test_eps_and_self_loops(rng):
    args, _ = sample("message_passing", rng, n=20, e=60, h=16, f=8, heads=4)
    args[2][1, ::3] = args[2][0, ::3]  # every third edge a self-loop: listed twice under its node
    args = args[:3] + both_ways_csr(args[2], 20) + args[6:]
    check(qkernels.message_passing(*args, eps=0.5), args, eps=0.5)


def test_strided_views_of_every_tensor_give_the_same_bits(rng):
    args, _ = sample("message_passing", rng, n=60, e=150, h=12, f=10, heads=3)
    want = qkernels.message_passing(*args)
    check(want, args)
    for views in ([strided_all(a) for a in args],  # every dimension of every tensor
                  [np.asfortranarray(a) for a in args]):  # transposed layouts of the matrices
        assert any(not v.flags.c_contiguous for v in views)
        got = qkernels.message_passing(*views)
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def test_transposed_weights_and_every_other_row(rng):
    args, _ = sample("message_passing", rng, n=40, e=90, h=20, f=7, heads=5)
    args = list(args)
    rows = np.zeros((80, 20), np.float32)
    rows[::2] = args[0]
    args[0] = rows[::2]  # x: every other row of a bigger array
    for i in (6, 8, 10, 12, 13):  # w1, w_msg, w_att, w_v, w_o: transposed storage
        args[i] = np.ascontiguousarray(args[i].T).T
    check(qkernels.message_passing(*args), args)


def test_same_bits_for_any_thread_count(rng):
    args, _ = sample("message_passing", rng, n=3000, e=6000, h=32, f=32, heads=4, index_dtype=np.int32)
    old = _dispatch.configure(num_threads=1)
    try:
        one = qkernels.message_passing(*args)
        for n in (2, 3, 7):
            _dispatch.configure(num_threads=n)
            got = qkernels.message_passing(*args)
            assert all(np.array_equal(g, o) for g, o in zip(got, one)), n
    finally:
        _dispatch.configure(num_threads=old["num_threads"])
    check(one, args)


def test_dispatch_family(env):
    args, _ = sample("message_passing")
    d = qkernels.resolve("message_passing", *args)
    assert d.winner == "cpu" and d.family == "message_passing"
    with pytest.raises(qkernels.ExplicitSelectionError):
        qkernels.message_passing(*args, backend="cuda")
    env(QECDEC_BACKEND="cuda")  # the graph group's variable selects for it
    with pytest.raises(qkernels.ExplicitSelectionError, match="message_passing"):
        qkernels.message_passing(*args)


# ---- bad input ------------------------------------------------------------------------------

def call_with(args, **changes):
    args = list(args)
    for name, value in changes.items():
        args[NAMES.index(name)] = value
    return qkernels.message_passing(*args)


@pytest.mark.parametrize("pos", FLOATS)
def test_float_arguments_must_be_float32(rng, pos):
    args, _ = sample("message_passing", rng)
    with pytest.raises(TypeError, match=rf"^message_passing: {NAMES[pos]} must be float32, got float64"):
        call_with(args, **{NAMES[pos]: args[pos].astype(np.float64)})


def test_index_dtypes(rng):
    args, _ = sample("message_passing", rng, index_dtype=np.int64, edge_index_dtype=np.int32)
    with pytest.raises(TypeError, match=r"^message_passing: edge_index must be int32 or int64, got float32"):
        call_with(args, edge_index=args[2].astype(np.float32))
    with pytest.raises(TypeError, match=r"^message_passing: row_ptr must be int32 or int64, got float32"):
        call_with(args, row_ptr=args[3].astype(np.float32))
    for name in ("col_idx", "dir_edge"):
        message = rf"^message_passing: {name} must have row_ptr's dtype \(int64\), got int32"
        with pytest.raises(TypeError, match=message):
            call_with(args, **{name: args[NAMES.index(name)].astype(np.int32)})


def test_shapes(rng):
    args, _ = sample("message_passing", rng, n=7, e=11, h=8, f=6, heads=2)
    x, e = args[0], args[1]
    bad = {
        "x": (x[0], r"x must have 2 dimensions \[N, H\]"),
        "e": (np.zeros((11, 9), np.float32), r"e must have shape \[E, H\] = \[11, 8\]"),
        "edge_index": (np.zeros((3, 11), np.int64), r"edge_index must have shape \[2, E\]"),
        "row_ptr": (args[3][:-1], r"row_ptr must have shape \[N \+ 1\] = \[8\]"),
        "dir_edge": (args[5][:-1], r"dir_edge must have shape \[M\] = \[22\]"),
        "w1": (np.zeros((23, 6), np.float32), r"w1 must have shape \[3H, F\] = \[24, 6\]"),
        "b1": (np.zeros(5, np.float32), r"b1 must have shape \[F\] = \[6\]"),
        "w_msg": (np.zeros((6, 7), np.float32), r"w_msg must have shape \[F, H\] = \[6, 8\]"),
        "b_msg": (np.zeros(7, np.float32), r"b_msg must have shape \[H\] = \[8\]"),
        "w_att": (np.zeros((5, 2), np.float32), r"w_att must have shape \[F, K\] = \[6, 2\] with size 6 in "
                                                 r"dimension 0, got \[5, 2\]"),
        "b_att": (np.zeros(3, np.float32), r"b_att must have shape \[K\] = \[2\]"),
        "w_v": (np.zeros((8, 9), np.float32), r"w_v must have shape \[H, H\] = \[8, 8\]"),
        "w_o": (np.zeros((7, 8), np.float32), r"w_o must have shape \[H, H\] = \[8, 8\]"),
        "beta_e": (np.zeros((8, 1), np.float32), r"beta_e must have 1 dimensions \[H\]"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=rf"^message_passing: {message}"):
            call_with(args, **{name: value})
    assert e.shape == (11, 8)


@pytest.mark.parametrize("k", [3, 0, 16])
def test_heads_must_divide_h(rng, k):
    args, _ = sample("message_passing", rng, n=7, e=11, h=8, f=6, heads=2)
    with pytest.raises(ValueError, match=rf"^message_passing: the number of heads K = w_att.shape\[1\] = {k} must be "
                                         r">= 1 and divide H = 8"):
        call_with(args, w_att=np.zeros((6, k), np.float32), b_att=np.zeros(k, np.float32))


def test_eps_must_be_finite_and_not_negative(rng):
    args, _ = sample("message_passing", rng)
    with pytest.raises(ValueError, match="^message_passing: eps must be a finite value >= 0"):
        qkernels.message_passing(*args, eps=-1.0)
    with pytest.raises(TypeError, match="^message_passing: eps must be a float, got str"):
        qkernels.message_passing(*args, eps="1")


@pytest.mark.parametrize("ix", [np.int32, np.int64])
def test_bad_indices_are_named(rng, ix):
    args, _ = sample("message_passing", rng, n=9, e=20, h=8, f=4, heads=2, index_dtype=ix)
    ei, row_ptr, col_idx, dir_edge = args[2:6]
    m = len(col_idx)

    def bad(name, at, value):
        a = args[NAMES.index(name)].copy()
        a[at] = value
        return {name: a}

    cases = [
        (bad("edge_index", (0, 5), 9), r"edge_index\[0, 5\] = 9 is out of range for x with N = 9"),
        (bad("edge_index", (1, 19), -1), r"edge_index\[1, 19\] = -1 is out of range for x with N = 9"),
        (bad("row_ptr", 0, 1), rf"row_ptr must be non-decreasing from row_ptr\[0\] = 0 to row_ptr\[N\] = M = {m}; "
                               r"row_ptr\[0\] = 1"),
        (bad("row_ptr", 4, row_ptr[3] - 1), rf"row_ptr must .*; row_ptr\[4\] = {row_ptr[3] - 1}$"),
        (bad("row_ptr", 9, m - 1), rf"row_ptr must .*; row_ptr\[9\] = {m - 1}$"),  # ends short of M
        (bad("row_ptr", slice(5, 10), m + 1), rf"row_ptr must .*; row_ptr\[5\] = {m + 1}$"),
        (bad("col_idx", [3, 7], 9), r"col_idx\[3\] = 9 is out of range for x with N = 9"),  # the first
        (bad("col_idx", m - 1, -4), rf"col_idx\[{m - 1}\] = -4 is out of range for x with N = 9"),
        (bad("dir_edge", 2, 20), r"dir_edge\[2\] = 20 is out of range for e with E = 20"),
        (bad("dir_edge", m - 1, -1), rf"dir_edge\[{m - 1}\] = -1 is out of range for e with E = 20"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=rf"^message_passing: {message}"):
            call_with(args, **changes)
    assert ei.dtype == dir_edge.dtype == ix


def test_bad_indices_with_nothing_to_compute(rng):
    # N = 0 and E = 0: the outputs are empty, the CSR is still checked
    args, _ = sample("message_passing", rng, n=0, e=0, h=4, f=2, heads=2)
    with pytest.raises(ValueError, match=r"^message_passing: row_ptr must .*row_ptr\[0\] = 2"):
        call_with(args, row_ptr=np.array([2], np.int64))
    with pytest.raises(ValueError, match=r"^message_passing: row_ptr must .* M = 1; row_ptr\[0\] = 0"):
        call_with(args, col_idx=np.zeros(1, np.int64), dir_edge=np.zeros(1, np.int64))


def test_no_leaks_on_success_and_error(rng):
    args, _ = sample("message_passing", rng, n=30, e=60, h=8, f=8, heads=2)
    bad = list(args)
    bad[5] = args[5].copy()
    bad[5][0] = 60
    with memory_stays_flat(400):
        for _ in range(200):
            qkernels.message_passing(*args)
            with pytest.raises(ValueError):
                qkernels.message_passing(*bad)
