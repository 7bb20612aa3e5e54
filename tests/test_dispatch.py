"""Dispatcher semantics: selection order, env variables, legacy spellings, strict errors, explain."""

import threading
import warnings

import numpy as np
import pytest

import qkernels
from qkernels import ExplicitSelectionError, _dispatch
from conftest import random_inputs


@pytest.fixture
def env(monkeypatch):
    """Set dispatcher env variables; the dispatcher re-reads them, and forgets them afterwards."""
    for var in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS"):
        monkeypatch.delenv(var, raising=False)

    def set_env(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(k, v)
        qkernels.reload_env()

    yield set_env
    monkeypatch.undo()
    qkernels.reload_env()


@pytest.fixture
def args():
    return random_inputs(np.random.default_rng(3), 10, 6, 2, 4)


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
    with pytest.raises(ValueError, match="backend= must be one of cuda, flash, cpu, auto"):
        qkernels.sparse_aggregate(*args, backend="gpu")


def test_strict_error_names_the_requirement(env, args):
    env()
    a = list(args)
    a[3] = a[3].astype(np.float64)
    with pytest.raises(ExplicitSelectionError, match="requires dtype float32; got numpy cpu float64"):
        qkernels.sparse_aggregate(*a, backend="cpu")
    # The automatic chain lets the kernel layer report the dtype precisely instead.
    with pytest.raises(TypeError, match="node_feat must be float32, got float64"):
        qkernels.sparse_aggregate(*a)


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
    assert _dispatch._env()["graph_bce"] == ("cuda", "env QECDEC_BACKEND")


@pytest.mark.parametrize("var,value,match", [
    ("QECDEC_BACKEND", "gpu", "QECDEC_BACKEND must be one of"),
    ("ASTR_BACKEND", "fast", "ASTR_BACKEND must be one of"),
    ("QKERNELS_OPS", "nonsense=cpu", "QKERNELS_OPS entries must be family=backend"),
    ("QKERNELS_OPS", "sparse_aggregate", "QKERNELS_OPS entries must be family=backend"),
    ("QKERNELS_OPS", "linear=tpu", r"QKERNELS_OPS\[linear\] must be one of"),
])
def test_bad_env_value_raises_at_first_use(env, args, var, value, match):
    env(**{var: value})
    with pytest.raises(ValueError, match=match):
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
