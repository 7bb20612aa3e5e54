"""python -m qkernels runs, self-checks and explains, in a fresh interpreter."""

import subprocess
import sys


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "qkernels", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_main_job():
    r = run()
    assert r.returncode == 0, r.stderr
    assert "backends:" in r.stdout and "self-check" in r.stdout and "PASS" in r.stdout and "FAIL" not in r.stdout


def test_explain():
    r = run("--explain", "sparse_aggregate")
    assert r.returncode == 0, r.stderr
    assert "-> " in r.stdout and "MATCH" in r.stdout


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
