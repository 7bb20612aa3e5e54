"""python -m qkernels runs, self-checks and explains, in a fresh interpreter; a selection variable
with a value the dispatcher refuses, or a backend that cannot run here, fails only the ops it
selects for, one line each, never with a traceback; `info` says what the CUDA build holds."""

import os
import re
import subprocess
import sys

import pytest

import qkernels
from qkernels.__main__ import cuda_kernels_line

GRAPH_OPS = ("sparse_aggregate", "sparse_aggregate_backward", "fused_edge_features", "fused_edge_features_backward",
             "fused_norm_residual", "graph_norm_bce", "fused_norm_residual_backward", "graph_norm_bce_backward")
LLM_OPS = ("rotary_emb", "linear", "swiglu", "attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill")
no_gpu = pytest.mark.skipif(qkernels.AVAILABLE, reason="the cuda backend runs here")


def run(*args, **env):
    """python -m qkernels args with the selection variables set to env (none else)."""
    full = {k: v for k, v in os.environ.items() if k not in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS")}
    r = subprocess.run([sys.executable, "-m", "qkernels", *args], capture_output=True, text=True, timeout=300,
                       env=dict(full, **env))
    assert "Traceback" not in r.stderr, r.stderr
    return r


def rows(stdout):
    """The self-check's rows: op -> the rest of its line."""
    table = stdout.split("self-check")[1].split("\ntiming")[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) +(\S.*)$", table, re.M)}


def test_main_job():
    r = run()
    assert r.returncode == 0, r.stderr
    assert "backends:" in r.stdout and "self-check" in r.stdout and "PASS" in r.stdout and "FAIL" not in r.stdout


def test_explain():
    r = run("--explain", "sparse_aggregate")
    assert r.returncode == 0, r.stderr
    assert "-> " in r.stdout and "MATCH" in r.stdout


@no_gpu
@pytest.mark.parametrize("var,failing,passing,args", [("QECDEC_BACKEND", GRAPH_OPS, LLM_OPS, ()),
                                                       ("ASTR_BACKEND", LLM_OPS, GRAPH_OPS, ("--selfcheck",))])
def test_cuda_selected_without_a_gpu_fails_per_op(var, failing, passing, args):
    r = run(*args, **{var: "cuda"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    got = rows(r.stdout)
    for op in failing:
        assert re.match(rf"cuda +FAIL: backend 'cuda' selected by env {var} cannot run .*: unavailable: ", got[op]), \
            got[op]
    for op in passing:
        assert got[op].endswith("PASS"), got[op]


@pytest.mark.parametrize("var,value,failing,passing", [
    ("QECDEC_BACKEND", "bogus", GRAPH_OPS, LLM_OPS),
    ("ASTR_BACKEND", "gpu", LLM_OPS, GRAPH_OPS),
    ("QKERNELS_OPS", "attention=bogus,linear=cpu", ("attn_decode", "attn_prefill", "attn_paged_decode",
                                                     "attn_paged_prefill"), GRAPH_OPS + ("linear", "rotary_emb")),
])
def test_refused_variable_fails_only_its_families(var, value, failing, passing):
    r = run("--selfcheck", **{var: value})
    assert r.returncode == 2, (r.stdout, r.stderr)
    message = r.stderr.strip()
    assert len(message.splitlines()) == 1 and re.match(rf"qkernels: {re.escape(var)}(\[\w+\])? must be one of ",
                                                        message), message
    got = rows(r.stdout)
    for op in failing:
        assert got[op] == "-     FAIL: " + message[len("qkernels: "):], got[op]
    for op in passing:
        assert got[op].endswith("PASS"), got[op]


def test_refused_variable_in_the_main_job_and_explain():
    r = run(QECDEC_BACKEND="bogus")
    assert r.returncode == 2 and "environment: QECDEC_BACKEND=bogus" in r.stdout and "timing" in r.stdout
    assert r.stderr.splitlines() == ["qkernels: QECDEC_BACKEND must be one of cuda, flash, cpu, auto (or legacy "
                                     "torch_native, pytorch, compiled), got 'bogus'"]
    r = run("--explain", "graph_norm_bce", QECDEC_BACKEND="bogus")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("qkernels: QECDEC_BACKEND must be one of")
    r = run("--explain", "linear", QECDEC_BACKEND="bogus")  # not a variable of linear's family
    assert r.returncode == 0 and "-> " in r.stdout and r.stderr == "", r.stderr
    r = run("info", QKERNELS_OPS="nonsense")
    assert r.returncode == 2 and "backends:" in r.stdout
    assert r.stderr.startswith("qkernels: QKERNELS_OPS entries must be name=backend")
    r = run("--explain", "conv")
    assert r.returncode == 2 and "invalid choice: 'conv'" in r.stderr


def test_legacy_spelling_is_one_line():
    r = run("--explain", "graph_norm_bce", QECDEC_BACKEND="torch_native")
    assert r.returncode == 0 and "origin: env QECDEC_BACKEND" in r.stdout
    assert r.stderr.splitlines() == ["qkernels: QECDEC_BACKEND='torch_native' is a legacy spelling; it selects the "
                                     "'cpu' backend (qkernels' C kernels)"]


def test_info_names_the_build():
    r = run("info")
    assert r.returncode == 0, r.stderr
    line = re.search(r"^  CUDA kernels: (.*)$", r.stdout, re.M).group(1)
    assert re.match(r"not built \(|built for sm_\d+|built, not loaded: ", line), line
    assert "library not loaded" not in line


def test_cuda_kernels_line(tmp_path):
    lib = tmp_path / "_qkernels_cuda.so"
    lib.write_bytes(b"\x7fELF\0junk sm_8\0x" + b"sm_80 sm_89 sm_90a +PTX(compute_90)\0tail")
    info = {"built": True, "available": False, "reason": "no CUDA device found", "archs": "", "library": str(lib)}
    assert cuda_kernels_line(info) == ("built for sm_80, sm_89, sm_90a, +PTX(compute_90); not loaded: "
                                       "no CUDA device found")
    lib.write_bytes(b"\x7fELF\0nothing said")
    assert cuda_kernels_line(info) == "built, not loaded: no CUDA device found"
    info.update(available=True, archs="sm_90a +PTX(compute_90)")
    assert cuda_kernels_line(info) == "built for sm_90a, +PTX(compute_90)"
    assert cuda_kernels_line(dict(info, built=False, library=None)).startswith("not built (")


def test_import_never_needs_a_gpu():
    # Even with the CUDA library made unloadable, import works and AVAILABLE is False with a reason.
    code = ("import qkernels, numpy as np; i = qkernels.info(); "
            "print(qkernels.AVAILABLE, bool(i['cuda_reason'])); "
            "print(qkernels.sparse_aggregate(np.array([0,1]), np.array([0]), np.ones((1,1),np.float32), "
            "np.ones((1,1,2),np.float32)).sum())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "2.0"]


def test_no_driver_is_named_as_such():
    """Without libcuda.so.1 the runtime still says 'driver version is insufficient': the reason says
    what is missing instead."""
    import ctypes.util
    reason = qkernels.info()["cuda_reason"]
    if qkernels._C.CUDA_LIBRARY is None or qkernels.AVAILABLE:
        pytest.skip("needs the CUDA library built, on a machine where it cannot run")
    has_driver = ctypes.util.find_library("cuda") is not None
    assert ("no NVIDIA driver found" in reason) == (not has_driver), reason
