"""Framework in, framework out.

A call's tensors belong to one framework; results come back in it.  Torch (>= 2.10) publishes
DLPack's C exchange API, so _C reads torch tensors, torch's current stream and torch's allocator
without a Python round trip and returns a torch tensor itself; for other frameworks _C returns a
qkernels.Tensor that is handed over zero-copy here.  Nothing here imports a framework: it is
looked up in sys.modules, where it must already be if the caller holds one of its tensors.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from . import _C
from ._dispatch import FallbackWarning, framework_name

Tensor = _C.Tensor


class Framework:
    name = "generic"

    def stream(self, like):
        return None

    def wrap(self, t, like):
        return t

    def check_out(self, out):
        pass

    def to_host(self, x):
        raise TypeError(f"cannot stage {type(x).__name__} through host memory")

    def from_host(self, arr, like, out):
        raise TypeError(f"cannot stage {type(like).__name__} through host memory")

    def copy_back(self, dev, host):
        """Write a staged input that the op changed (host) back into the device tensor dev."""
        raise TypeError(f"cannot write {type(dev).__name__} back from host memory")


class Torch(Framework):
    name = "torch"

    def __init__(self):
        self.torch = sys.modules["torch"]

    def stream(self, like):
        # Reached when _C cannot read torch's stream itself (no C exchange API): pass it.
        return self.torch.cuda.current_stream(like.device).cuda_stream if like.is_cuda else None

    def wrap(self, t, like):
        return self.torch.from_dlpack(t)

    def to_host(self, x):
        return x.cpu() if isinstance(x, self.torch.Tensor) else x

    def from_host(self, arr, like, out):
        r = self.torch.from_dlpack(arr).to(like.device, non_blocking=True)
        return out.copy_(r) if out is not None else r

    def copy_back(self, dev, host):
        dev.copy_(host)


class Numpy(Framework):
    name = "numpy"

    def wrap(self, t, like):
        return np.from_dlpack(t)


class Cupy(Framework):
    name = "cupy"

    def __init__(self):
        self.cupy = sys.modules["cupy"]

    def stream(self, like):
        return self.cupy.cuda.get_current_stream().ptr or 1

    def wrap(self, t, like):
        return self.cupy.from_dlpack(t)

    def to_host(self, x):
        return self.cupy.asnumpy(x) if isinstance(x, self.cupy.ndarray) else x

    def from_host(self, arr, like, out):
        with self.cupy.cuda.Device(like.device.id):
            r = self.cupy.asarray(np.from_dlpack(arr))
        if out is not None:
            out[...] = r
            return out
        return r

    def copy_back(self, dev, host):
        dev[...] = self.cupy.asarray(host)


class Jax(Framework):
    name = "jax"

    def __init__(self):
        self.jax = sys.modules["jax"]

    def wrap(self, t, like):
        return self.jax.dlpack.from_dlpack(t)

    def check_out(self, out):
        raise TypeError("out= is not supported for JAX arrays: they are immutable; use the returned array")

    def to_host(self, x):
        return np.asarray(x) if isinstance(x, self.jax.Array) else x

    def from_host(self, arr, like, out):
        (device,) = like.devices()
        return self.jax.device_put(np.from_dlpack(arr), device)


class Native(Framework):
    name = "qkernels"


_by_type = {}
_makers = {"torch": Torch, "numpy": Numpy, "cupy": Cupy, "jax": Jax, "qkernels": Native}


def framework_of(x):
    fw = _by_type.get(type(x))
    if fw is None:
        maker = _makers.get(framework_name(x), Framework)
        fw = maker()
        _by_type[type(x)] = fw
    return fw


def run(op, fn, args, kwargs, like, staged, written=()):
    """Run fn(*args, **kwargs, stream=...) and hand the result back in like's framework.  written:
    the (position, name) of inputs the op changes, copied back when staged."""
    fw = framework_of(like)
    out = kwargs.get("out")
    if out is not None:
        fw.check_out(out)
    if staged:
        return _run_staged(op, fw, fn, args, kwargs, like, written)
    stream = fw.stream(like)
    r = fn(*args, **kwargs) if stream is None else fn(*args, **kwargs, stream=stream)
    if type(r) is tuple:  # an op with several outputs (the backward ops)
        return tuple(fw.wrap(t, like) if type(t) is Tensor else t for t in r)
    return fw.wrap(r, like) if type(r) is Tensor else r


_staging_warned = set()


def _run_staged(op, fw, fn, args, kwargs, like, written):
    if (op, fw.name) not in _staging_warned:
        _staging_warned.add((op, fw.name))
        warnings.warn(f"{op}: the cpu backend runs this call on {fw.name} device tensors by copying them "
                      f"through host memory; this is slow", FallbackWarning, stacklevel=4)
    host = [fw.to_host(a) for a in args]
    kw = {k: fw.to_host(v) for k, v in kwargs.items() if k != "out"}  # masks, lengths, new_k
    r = fn(*host, **kw)
    for position, name in written:
        if position < len(args):
            fw.copy_back(args[position], host[position])
        else:
            fw.copy_back(kwargs[name], kw[name])
    if type(r) is tuple:
        return tuple(None if t is None else fw.from_host(t, like, None) for t in r)
    return fw.from_host(r, like, kwargs.get("out"))
