"""The op table (include/qkernels/launch.h) drives every layer: each op it lists is reachable in
each, under its own name."""

import pathlib
import re

import numpy as np
import pytest

import qkernels
from qkernels import _C, _dispatch, testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = (ROOT / "include" / "qkernels" / "launch.h").read_text()


def table(name):
    body = re.search(rf"#define {name}\(X\)(.*?)\n\n", HEADER, re.S).group(1)
    return [tuple(a.strip() for a in row.split(",")) for row in re.findall(r"X\(([^)]*)\)", body)]


def test_python_sees_the_c_table():
    assert {row[0]: (row[2], int(row[3])) for row in table("QK_OPS")} == _C.OPS
    assert set(_dispatch.OPS) == set(_C.OPS)


@pytest.mark.parametrize("op", list(_C.OPS))
def test_every_layer_has_the_op(op):
    assert getattr(qkernels, op) is getattr(_C, op) and op in qkernels.__all__
    assert callable(getattr(_C, op + "_raw"))
    assert getattr(_C, op).__text_signature__.endswith("backend=None)")
    assert getattr(_C, op + "_raw").__text_signature__.endswith("stream=None)")
    assert _dispatch.OPS[op][0] in _dispatch.FAMILIES
    args, kwargs = testing.sample(op, np.random.default_rng(1))
    getattr(qkernels, op)(*args, **kwargs)


@pytest.mark.parametrize("launcher,args", table("QK_LAUNCHERS"))
def test_every_launcher_has_both_backends(launcher, args):
    cpu = "".join(p.read_text() for p in (ROOT / "csrc" / "cpu").glob("*.c"))
    cuda = "".join(p.read_text() for p in (ROOT / "kernels").glob("*.cu"))
    assert re.search(rf"\bint qk_{launcher}_cpu\(qk_{args}_args \*", cpu)
    assert re.search(rf"\bint qk_{launcher}_cuda\(const qk_{args}_args \*", cuda)
    assert f"}} qk_{args}_args;" in HEADER


@pytest.mark.parametrize("op", list(_C.OPS))
def test_the_binding_lives_in_one_file_named_for_it(op):
    """csrc/ops/<op>.c, or the file of the launcher or args struct it shares (attn_paged_*, swiglu), or of
    its dispatch family (a backward op beside its forward op), or the op's a plan op serves."""
    launcher, family = {row[0]: row[1:3] for row in table("QK_OPS")}[op]
    args = dict(table("QK_LAUNCHERS"))[launcher]
    files = [p.name for p in (ROOT / "csrc" / "ops").glob("*.c") if f"qk_op_{op}(" in p.read_text()]
    beside = op.removesuffix("_plan") + ".c"  # a graph plan op beside the op whose backward takes it
    assert len(files) == 1 and files[0] in (f"{op}.c", f"{launcher}.c", f"{args}.c", f"{family}.c", beside)
