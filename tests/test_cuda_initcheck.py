"""Every op on the cuda backend with inputs that reach the GPU only by host-to-device copies (the
dtype conversions happen on the host) and outputs that come back by a plain device-to-host copy,
compared with the cpu backend.  Written for `tests/cuda_sanitize.sh initcheck`: that tool knows
which bytes are initialised only from copies, memsets and the kernels it instruments (ours), so
here a torch kernel never touches the data on the device, and the copy back of each output is
itself checked: an output element our kernel left unwritten is reported.  Without the sanitizer
it is one more cuda-vs-cpu check.  Skipped without a GPU."""

import importlib.util

import numpy as np
import pytest

import qkernels
from attn_refs import paged_inputs, paged_prefill_inputs
from conftest import requires_cuda
from test_multi_gpu import LLM, OPS, host_inputs, host_tensors

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = [requires_cuda, pytest.mark.skipif(torch is None, reason="torch is not installed")]


def larger_inputs(op, rng):
    """Sizes that take the sm_90 kernels (wgmma linear, the TMA and warp-specialised prefill, split
    and cluster decode) where the small table's do not."""
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    if op == "linear":
        return [f32(40, 512), f32(384, 512), f32(384)], {}
    if op == "swiglu":
        return [f32(40, 512), f32(384, 512), f32(384, 512)], {}
    if op == "attn_decode":
        return [f32(2, 1, 8, 128), f32(2, 3000, 2, 128), f32(2, 3000, 2, 128)], {}
    if op == "attn_paged_decode":
        return list(paged_inputs(rng, [3000, 100], 2, 4, 128)), {}
    if op == "attn_prefill":
        return [f32(1, 200, 8, 128), f32(1, 300, 2, 128), f32(1, 300, 2, 128)], {"is_causal": True}
    if op == "attn_paged_prefill":
        return list(paged_prefill_inputs(rng, [70, 130], [200, 130], 2, 4, 128)), {"is_causal": True}
    return None


CASES = [(op, "small") for op in OPS] + [(op, "sm90") for op in OPS if op in LLM and op != "rotary_emb"]


@pytest.mark.parametrize("op,size", CASES)
def test_copied_in_copied_out(rng, op, size):
    args, kw = host_inputs(op, rng) if size == "small" else larger_inputs(op, rng)
    host = host_tensors(op, args)
    dev = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in host]  # copies only
    fn = getattr(qkernels, op)
    out = fn(*dev, backend="cuda", **kw)
    got = out.cpu()  # a device-to-host copy of the whole output (initcheck checks its source)
    want = fn(*host, backend="cpu", **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite output"
    tol = 2e-2 if op in LLM else 1e-5
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"{op}: max error {err}"
