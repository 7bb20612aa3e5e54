"""Dispatcher semantics: selection order, env variables, legacy spellings, strict errors, explain."""

import threading
import warnings

import numpy as np
import pytest

import qkernels
from qkernels import ExplicitSelectionError, _dispatch
from qkernels.testing import sample


@pytest.fixture
def args():
    return sample("sparse_aggregate", np.random.default_rng(3), n_dst=10, n_src=6, heads=2, dim=4)[0]


def test_chain_picks_cpu_for_host_data(env, args):
    env()
    d = qkernels.resolve("sparse_aggregate", *args)
    assert d.winner == "cpu" and d.origin == "chain" and not d.staged
    status = {b: s for b, s, _ in d.candidates}
    assert status["cpu"] == "MATCH"
    assert status["cuda"] in ("unavailable", "reject")  # host data: cuda rejects even where it exists
    assert status["flash"] in ("unavailable", "reject")


def test_explicit_backend_is_strict(env, args):
    env()
    with pytest.raises(ExplicitSelectionError, match="backend 'cuda' selected by explicit cannot run family "
                                                     "'sparse_aggregate'"):
        qkernels.sparse_aggregate(*args, backend="cuda")
    with pytest.raises(ExplicitSelectionError, match="'flash'.*(no flash kernel for family 'sparse_aggregate'|unavailable)"):
        qkernels.sparse_aggregate(*args, backend="flash")
    assert issubclass(ExplicitSelectionError, RuntimeError)
    qkernels.sparse_aggregate(*args, backend="cpu")
    qkernels.sparse_aggregate(*args, backend="auto")
    with pytest.raises(ValueError, match="sparse_aggregate: backend= must be one of cuda, flash, cpu, auto"):
        qkernels.sparse_aggregate(*args, backend="gpu")


def test_strict_error_names_the_requirement(env, args):
    env()
    # cpu takes these host tensors, so a strict choice of another backend is refused as such
    with pytest.raises(ExplicitSelectionError, match="backend 'flash' selected by explicit cannot run family "
                                                     "'sparse_aggregate' for this call: (unavailable|no flash kernel)"):
        qkernels.sparse_aggregate(*args, backend="flash")
    # A dtype no backend takes is the kernel layer's TypeError naming the argument, however chosen.
    a = list(args)
    a[3] = a[3].astype(np.float64)
    for backend in ("cpu", None):
        with pytest.raises(TypeError, match="^sparse_aggregate: node_feat must be float32, got float64"):
            qkernels.sparse_aggregate(*a, backend=backend)


def test_qecdec_backend_env(env, args):
    env(QECDEC_BACKEND="cuda")
    with pytest.raises(ExplicitSelectionError, match="selected by env QECDEC_BACKEND"):
        qkernels.sparse_aggregate(*args)
    env(QECDEC_BACKEND="cpu")
    d = qkernels.resolve("sparse_aggregate", *args)
    assert d.winner == "cpu" and d.origin == "env QECDEC_BACKEND"


def test_astr_backend_does_not_touch_graph_ops(env, args):
    env(ASTR_BACKEND="cuda")
    assert qkernels.resolve("sparse_aggregate", *args).origin == "chain"
    assert _dispatch._env()["attention"] == ("cuda", "env ASTR_BACKEND")


def test_qkernels_ops_wins_over_group_variables(env, args):
    env(QECDEC_BACKEND="cuda", QKERNELS_OPS="sparse_aggregate=cpu, linear=flash")
    d = qkernels.resolve("sparse_aggregate", *args)
    assert d.winner == "cpu" and d.origin == "env QKERNELS_OPS"
    assert _dispatch._env()["linear"] == ("flash", "env QKERNELS_OPS")
    assert _dispatch._env()["graph_norm_bce"] == ("cuda", "env QECDEC_BACKEND")


@pytest.mark.parametrize("var,value,match", [
    ("QECDEC_BACKEND", "gpu", "QECDEC_BACKEND must be one of"),
    ("ASTR_BACKEND", "fast", "ASTR_BACKEND must be one of"),
    ("QKERNELS_OPS", "nonsense=cpu", "QKERNELS_OPS: unknown family 'nonsense'; expected one of attention, "),
    ("QKERNELS_OPS", "sparse_aggregate", "QKERNELS_OPS entries must be name=backend"),
    ("QKERNELS_OPS", "linear=tpu", r"QKERNELS_OPS\[linear\] must be one of"),
])
def test_bad_env_value_raises_at_first_use(env, args, var, value, match):
    env(**{var: value})
    from qkernels.testing import sample
    with pytest.raises(ValueError, match=match):  # at the first call of a family the variable selects
        if var == "ASTR_BACKEND" or value.startswith("linear="):
            qkernels.linear(*sample("linear")[0])
        else:
            qkernels.sparse_aggregate(*args)


@pytest.mark.parametrize("legacy", ["torch_native", "pytorch", "compiled", "PyTorch"])
def test_legacy_spellings_mean_cpu_with_one_warning(env, args, legacy):
    _dispatch._warned.clear()
    with pytest.warns(UserWarning, match="legacy spelling"):
        env(QECDEC_BACKEND=legacy)
    d = qkernels.resolve("sparse_aggregate", *args)
    assert d.winner == "cpu" and d.requested == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qkernels.reload_env()
        qkernels.resolve("sparse_aggregate", *args)  # warned once already


def test_auto_value_means_chain(env, args):
    env(QECDEC_BACKEND="auto")
    assert qkernels.resolve("sparse_aggregate", *args).origin == "chain"


def test_context_nesting_and_precedence(env, args):
    env(QECDEC_BACKEND="cuda")
    with qkernels.use_backend("cpu"):
        assert qkernels.resolve("sparse_aggregate", *args).origin == "context"  # context beats env
        with qkernels.use_backend(graph="cuda"):
            with pytest.raises(ExplicitSelectionError, match="selected by context"):
                qkernels.sparse_aggregate(*args)
            d = qkernels.resolve("sparse_aggregate", *args, backend="cpu")  # explicit beats context
            assert d.origin == "explicit" and d.winner == "cpu"
        assert qkernels.resolve("sparse_aggregate", *args).winner == "cpu"
        qkernels.sparse_aggregate(*args)
    with pytest.raises(ExplicitSelectionError, match="env QECDEC_BACKEND"):
        qkernels.sparse_aggregate(*args)
    with pytest.raises(ValueError, match="use_backend: unknown family 'attn'"):
        with qkernels.use_backend(attn="cpu"):
            pass


def test_context_is_thread_local(env, args):
    env()
    seen = {}
    with qkernels.use_backend(sparse_aggregate="cuda"):
        t = threading.Thread(target=lambda: seen.update(d=qkernels.resolve("sparse_aggregate", *args)))
        t.start()
        t.join()
        assert qkernels.resolve("sparse_aggregate", *args).origin == "context"
    assert seen["d"].origin == "chain"


def test_decision_is_cached_and_explain_prints(env, args, capsys):
    env()
    _dispatch._cache.clear()
    qkernels.sparse_aggregate(*args)
    assert len(_dispatch._cache) == 1
    qkernels.sparse_aggregate(*args)
    assert len(_dispatch._cache) == 1
    print(qkernels.explain("sparse_aggregate", *args))
    text = capsys.readouterr().out
    assert "sparse_aggregate (family sparse_aggregate)" in text
    assert "axes: framework=numpy device=cpu dtype=float32" in text
    assert "cpu    MATCH" in text and "-> cpu (origin: chain)" in text
    assert "flash" in text and "cuda" in text


def test_resolve_validates_op():
    with pytest.raises(ValueError, match="unknown op 'spmm'"):
        qkernels.resolve("spmm")


# ---- the attention family: head_dim/mask/paging axes and the flash backend ------------------

import importlib.util

from conftest import FakeCudaTensor, RecordingOut


def fake_decode(B=2, L=16, Hq=8, Hkv=2, D=128, dtype="bfloat16"):
    return (FakeCudaTensor((B, 1, Hq, D), dtype), FakeCudaTensor((B, L, Hkv, D), dtype),
            FakeCudaTensor((B, L, Hkv, D), dtype))


def statuses(d):
    return {b: (s, why) for b, s, why in d.candidates}


def test_attention_axes_and_cpu_chain(env):
    env()
    q, k, v = (np.zeros(s, np.float32) for s in ((2, 1, 8, 40), (2, 5, 2, 40), (2, 5, 2, 40)))
    d = qkernels.resolve("attn_decode", q, k, v, mask=np.ones((2, 5), bool))
    assert d.axes == {"framework": "numpy", "device": "cpu", "dtype": "float32", "head_dim": 40, "has_mask": True,
                      "paged": False}
    assert d.winner == "cpu" and statuses(d)["cpu"][0] == "MATCH"
    assert "head_dim=40 has_mask=True paged=False" in str(d)
    d = qkernels.resolve("attn_paged_decode", q[:, 0], k[0], v[0], None, None, None)
    assert d.axes["paged"] is True and d.axes["has_mask"] is False and d.winner == "cpu"


def test_astr_backend_selects_attention(env, monkeypatch):
    q, k, v = (np.zeros(s, np.float32) for s in ((1, 1, 2, 8), (1, 3, 1, 8), (1, 3, 1, 8)))
    env(ASTR_BACKEND="cpu")
    d = qkernels.resolve("attn_decode", q, k, v)
    assert d.winner == "cpu" and d.origin == "env ASTR_BACKEND"
    env(ASTR_BACKEND="cuda")
    with pytest.raises(ExplicitSelectionError, match="attn_decode: backend 'cuda' selected by env ASTR_BACKEND cannot "
                                                     "run family 'attention'"):
        qkernels.attn_decode(q, k, v)
    monkeypatch.delenv("ASTR_BACKEND")
    env(QECDEC_BACKEND="cuda")  # the graph variable leaves attention alone
    assert qkernels.resolve("attn_decode", q, k, v).origin == "chain"


def test_flash_predicate_reasons(env, fake_flash):
    env()
    d = qkernels.resolve("attn_decode", *fake_decode())
    assert statuses(d)["flash"] == ("MATCH", "")
    cuda_ok = qkernels.backend_available("cuda")[0]
    assert d.winner == ("cuda" if cuda_ok else "flash")  # chain order: cuda, flash, cpu
    reasons = {
        "mask": ({"mask": FakeCudaTensor((2, 16), "bool")},
                 "a mask (bool or float) is not supported by flash_attn_with_kvcache (kv_lens is)"),
        "float mask": ({"mask": FakeCudaTensor((2, 1, 1, 16), "float32")},
                       "a mask (bool or float) is not supported by flash_attn_with_kvcache (kv_lens is)"),
        "head_dim": ({}, "requires head_dim <= 256 and a multiple of 8; got torch cuda bfloat16 head_dim=36 "
                         "has_mask=False paged=False"),
        "dtype": ({}, "requires dtype float16 or bfloat16; got torch cuda float32"),
    }
    d = qkernels.resolve("attn_decode", *fake_decode(), **reasons["mask"][0])
    assert statuses(d)["flash"] == ("reject", reasons["mask"][1])
    d = qkernels.resolve("attn_decode", *fake_decode(), **reasons["float mask"][0])
    assert statuses(d)["flash"] == ("reject", reasons["float mask"][1])
    d = qkernels.resolve("attn_decode", *fake_decode(D=36))
    assert statuses(d)["flash"] == ("reject", reasons["head_dim"][1])
    assert statuses(d)["cuda"][0] in ("unavailable", "reject")
    if cuda_ok:
        assert "requires head_dim 32, 64, 128 or 256" in statuses(d)["cuda"][1]
    d = qkernels.resolve("attn_decode", *fake_decode(dtype="float32"))
    assert statuses(d)["flash"][1].startswith(reasons["dtype"][1])
    d = qkernels.resolve("attn_decode", *(np.zeros((2, 1, 8, 64), np.float32),) * 3)
    assert statuses(d)["flash"][1].startswith("requires torch tensors; got numpy cpu float32")
    # paging is what flash_attn_with_kvcache lacks, whatever the tensors
    q, k, v = fake_decode()
    d = qkernels.resolve("attn_paged_decode", FakeCudaTensor((2, 8, 128)), k, v, None, None, None)
    assert statuses(d)["flash"] == ("reject", "token-pool paging (req_to_token) is not supported by "
                                              "flash_attn_with_kvcache")
    assert "flash  reject: token-pool paging" in str(d)


def test_flash_receives_the_call(env, fake_flash):
    env()
    q, k, v = fake_decode(D=96)  # not a cuda head_dim: the chain goes to flash on any machine
    assert qkernels.resolve("attn_decode", q, k, v).winner == "flash"
    assert qkernels.attn_decode(q, k, v) == "flash result"
    (cq, ck, cv, kw), = fake_flash
    assert cq is q and ck is k and cv is v and kw == {"cache_seqlens": None, "softmax_scale": None}

    out = RecordingOut()
    assert qkernels.attn_decode(*fake_decode(), out=out, scale=0.5, backend="flash") is out
    assert out.got == "flash result" and fake_flash[-1][3]["softmax_scale"] == 0.5
    with qkernels.use_backend(llm="flash"):
        qkernels.attn_decode(*fake_decode(D=128))
    assert len(fake_flash) == 3


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_flash_kv_lens_are_clamped_int32(env, fake_flash):
    import torch

    env(ASTR_BACKEND="flash")
    qkernels.attn_decode(*fake_decode(L=16), kv_lens=torch.tensor([3, 100, -2]))
    seqlens = fake_flash[-1][3]["cache_seqlens"]
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [3, 16, 0]


def test_flash_strict_selection_names_the_reason(env, fake_flash):
    env(ASTR_BACKEND="flash")
    q, k, v = fake_decode()
    with pytest.raises(ExplicitSelectionError, match=r"attn_paged_decode: backend 'flash' selected by env ASTR_BACKEND "
                                                     r"cannot run family 'attention' for this call: token-pool paging "
                                                     r"\(req_to_token\) is not supported by flash_attn_with_kvcache"):
        qkernels.attn_paged_decode(FakeCudaTensor((2, 8, 128)), k, v, None, None, None)
    with pytest.raises(ExplicitSelectionError, match=r"a mask \(bool or float\) is not supported by flash_attn_with_kvcache"):
        qkernels.attn_decode(q, k, v, mask=FakeCudaTensor((2, 16), "bool"))
    with pytest.raises(ExplicitSelectionError, match="'flash' selected by explicit .*requires torch tensors"):
        qkernels.attn_decode(*(np.zeros((1, 1, 2, 64), np.float32),) * 3, backend="flash")
    assert not fake_flash  # nothing reached flash_attn


def test_flash_decisions_are_cached_per_axes(env, fake_flash):
    env()
    q, k, v = fake_decode(D=96)
    _dispatch._cache.clear()
    qkernels.attn_decode(q, k, v)
    assert len(_dispatch._cache) == 1 and len(fake_flash) == 1
    # the same tensors with a mask are another decision, not the cached one
    with pytest.raises(ExplicitSelectionError, match=r"a mask \(bool or float\) is not supported"):
        qkernels.attn_decode(q, k, v, mask=FakeCudaTensor((2, 16), "bool"), backend="flash")
    assert len(fake_flash) == 1


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here")
def test_flash_unavailable_without_the_package(env):
    env()
    d = qkernels.resolve("attn_decode", *fake_decode())
    assert statuses(d)["flash"] == ("unavailable", "the flash_attn package is not installed")


def test_groups_in_qkernels_ops(env, args):
    env(QKERNELS_OPS="graph=cpu,llm=auto")
    assert all(_dispatch._env()[f] == ("cpu", "env QKERNELS_OPS") for f in _dispatch.GRAPH_FAMILIES)
    assert all(_dispatch._env()[f] == ("auto", "env QKERNELS_OPS") for f in _dispatch.LLM_FAMILIES)


@pytest.mark.parametrize("old,new", sorted(_dispatch.LEGACY_FAMILIES.items()))
def test_legacy_family_names(env, old, new):
    with pytest.warns(DeprecationWarning, match=f"QKERNELS_OPS: family '{old}' is now spelled '{new}'"):
        env(QKERNELS_OPS=f"{old}=cpu")
        _dispatch._warned.clear()
        _dispatch.reload_env()
    assert _dispatch._env()[new] == ("cpu", "env QKERNELS_OPS")
    _dispatch._warned.clear()
    with pytest.warns(DeprecationWarning, match=f"use_backend: family '{old}' is now spelled '{new}'") as w:
        with qkernels.use_backend(**{old: "cpu"}):
            assert _dispatch._ctx.get()[0][new] == "cpu"
    assert w[0].filename == __file__  # the warning points at the caller


def test_bad_graph_variable_leaves_llm_ops_alone(env):
    """Each variable is checked where it applies: a bad QECDEC_BACKEND fails graph calls only."""
    env(QECDEC_BACKEND="bogus")
    from qkernels.testing import sample
    with pytest.raises(ValueError, match="QECDEC_BACKEND must be one of"):
        qkernels.sparse_aggregate(*sample("sparse_aggregate")[0])
    qkernels.linear(*sample("linear")[0])


def test_direct_path_serves_repeated_torch_calls(env, monkeypatch):
    """After the dispatcher decided a torch call once, calls like it (nn.Parameter weights included)
    run from the C entry point without the Python dispatcher; anything else still consults it."""
    torch = pytest.importorskip("torch")
    env()
    x = torch.randn(3, 16)
    w, b = torch.nn.Parameter(torch.randn(5, 16)), torch.nn.Parameter(torch.randn(5))
    with torch.no_grad():
        expected = qkernels.linear(x, w, b)

        def refuse(*a, **k):
            raise AssertionError("the Python dispatcher was consulted")
        monkeypatch.setattr(qkernels.ops, "choose", refuse)
        assert torch.equal(qkernels.linear(x, w, b), expected)
        qkernels.linear(torch.randn(7, 16)[::2], w, b)  # other rows, the same key: still direct
        with pytest.raises(AssertionError, match="consulted"):  # a new key: the dispatcher decides
            qkernels.linear(torch.randn(3, 8), torch.randn(5, 8))
        with pytest.raises(AssertionError, match="consulted"):  # a context: the dispatcher decides
            with qkernels.use_backend("cpu"):
                qkernels.linear(x, w, b)


def test_direct_path_checks_its_deciding_tensor_as_the_op_does(env, monkeypatch):
    """The direct path reads the deciding tensor once, for its key and for the op: the op's refusal
    of a negated view still names it, and an input requiring grad still goes to autograd."""
    torch = pytest.importorskip("torch")
    env()
    x, w = torch.randn(3, 16), torch.randn(5, 16)
    expected = qkernels.linear(x, w)  # the dispatcher decides and records the direct plan

    def refuse(*a, **k):
        raise AssertionError("the Python dispatcher was consulted")
    with monkeypatch.context() as m:
        m.setattr(qkernels.ops, "choose", refuse)
        torch.testing.assert_close(qkernels.linear(x, w), expected, rtol=0, atol=0)
        with pytest.raises(BufferError, match="^linear: x is a view with torch's lazy negation bit set"):
            qkernels.linear(torch._neg_view(x), w)
        with pytest.raises(BufferError, match="^linear: weight is a view with torch's lazy negation bit set"):
            qkernels.linear(x, torch._neg_view(w))
        torch.testing.assert_close(qkernels.linear(torch._neg_view(x).resolve_neg(), w), -expected)
    xg = x.clone().requires_grad_(True)
    y = qkernels.linear(xg, w)  # grad mode on: recorded for autograd
    assert y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 16))


def test_direct_read_does_not_outlive_its_call(env):
    """A direct call refused before its op imports anything leaves no read of its deciding tensor
    behind: the next import of that tensor reads it anew (here after its storage was replaced)."""
    torch = pytest.importorskip("torch")
    env()
    x, w = torch.randn(3, 16), torch.randn(5, 16)
    qkernels.linear(x, w)  # records the direct plan
    with pytest.raises(TypeError, match=r"^linear\(\) takes at most 3 positional arguments"):
        qkernels.linear(x, w, None, 7)
    x.set_(torch.full((4, 16), 2.0))
    torch.testing.assert_close(qkernels._C.linear_raw(x, w), (2.0 * w.sum(1)).expand(4, 5))
