"""Every op on the cuda backend with inputs that reach the GPU only by host-to-device copies (the
dtype conversions happen on the host) and outputs that come back by a plain device-to-host copy,
compared with the cpu backend.  Written for `tests/cuda_sanitize.sh initcheck`: that tool knows
which bytes are initialised only from copies, memsets and the kernels it instruments (ours), so
here a torch kernel never touches the data on the device, and the copy back of each output is
itself checked: an output element our kernel left unwritten is reported.  Without the sanitizer
it is one more cuda-vs-cpu check.  Skipped without a GPU."""

import importlib.util

import pytest

import qkernels
from qkernels.testing import OPS, sample
from conftest import DEVICE_SIZES, LLM, host_tensors, requires_cuda, results

torch = __import__("torch") if importlib.util.find_spec("torch") else None
pytestmark = [requires_cuda, pytest.mark.skipif(torch is None, reason="torch is not installed")]


# Sizes that take the sm_90 kernels (wgmma linear, the TMA and warp-specialised prefill, split and
# cluster decode) where DEVICE_SIZES' do not.
SM90_SIZES = {
    "linear": dict(m=40, k=512, n=384),
    "swiglu": dict(m=40, k=512, n=384),
    "attn_decode": dict(b=2, l=3000, hkv=2, ratio=4, d=128),
    "attn_paged_decode": dict(lens=[3000, 100], hkv=2, ratio=4, d=128),
    "attn_prefill": dict(b=1, lq=200, lkv=300, hkv=2, ratio=4, d=128, is_causal=True),
    "attn_paged_prefill": dict(q_lens=[70, 130], kv_lens=[200, 130], hkv=2, ratio=4, d=128, is_causal=True),
}


CASES = [(op, "small") for op in OPS] + [(op, "sm90") for op in SM90_SIZES]


@pytest.mark.parametrize("op,size", CASES)
def test_copied_in_copied_out(rng, op, size):
    args, kw = sample(op, rng, **(DEVICE_SIZES if size == "small" else SM90_SIZES)[op])
    host = host_tensors(op, args)
    dev = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in host]  # copies only
    fn = getattr(qkernels, op)
    outs = results(fn(*dev, backend="cuda", **kw))
    wants = results(fn(*host, backend="cpu", **kw))
    assert len(outs) == len(wants)
    for out, want in zip(outs, wants):
        got = out.cpu()  # a device-to-host copy of the whole output (initcheck checks its source)
        assert got.shape == want.shape and got.dtype == want.dtype
        got, want = got.double(), want.double()
        assert torch.isfinite(got).all(), "non-finite output"
        tol = 2e-2 if op in LLM else 1e-5
        err = (got - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), f"{op}: max error {err}"
