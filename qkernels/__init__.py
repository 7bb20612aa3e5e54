"""qkernels: fast kernels for GNN decoders and small-batch LLM inference.

Tensors go in and out through DLPack (torch, JAX, CuPy, NumPy or qkernels.Tensor); the
dispatcher picks a backend per call (cuda, flash, cpu).  See README.md.
"""

import os as _os
import sys as _sys

try:
    from . import _C
except ImportError as e:  # the source tree, imported without a built extension beside it
    raise ImportError(
        f"qkernels._C is not built next to {_os.path.dirname(__file__)}: install with `pip install -e .` "
        "(or `python setup.py build_ext --inplace`), or run from outside the source tree after "
        f"`pip install .` ({e})") from e
from ._C import Tensor, from_dlpack
from ._dispatch import (
    BACKENDS,
    FAMILIES,
    Decision,
    ExplicitSelectionError,
    FallbackWarning,
    backend_available,
    explain,
    reload_env,
    resolve,
    use_backend,
)
from . import ops as _ops
from .ops import *  # noqa: F401,F403  every op of the C op table, by its name

if "torch" in _sys.modules:  # torch is already loaded: register the operators now, before any tracing
    from . import torch as _torch_ops  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "AVAILABLE", "BACKENDS", "FAMILIES", "Decision", "ExplicitSelectionError", "FallbackWarning", "Tensor",
    "__version__", "explain", "from_dlpack", "info", "reload_env", "resolve", "use_backend",
] + _ops.__all__


def info():
    """What this build and machine offer: version, CUDA build and devices, backends, settings."""
    cuda = _C.cuda_info()
    return {
        "version": __version__,
        "cuda_built": cuda["built"],
        "cuda_available": cuda["available"],
        "cuda_reason": cuda["reason"],
        "compiled_archs": cuda["archs"],
        "cuda_runtime_version": cuda["runtime_version"],
        "cuda_driver_version": cuda["driver_version"],
        "devices": cuda["devices"],
        "backends": {b: dict(zip(("available", "reason"), backend_available(b))) for b in BACKENDS},
        "cpu_threads": _C._configure()["num_threads"],
        "env": {k: _os.environ.get(k) for k in ("ASTR_BACKEND", "QECDEC_BACKEND", "QKERNELS_OPS", "QKERNELS_CHECK")},
    }


def __dir__():
    return sorted(set(__all__) | {"ops", "testing"})


def __getattr__(name):
    # AVAILABLE probes the CUDA library and driver, so it is computed on first access, not at import.
    if name == "AVAILABLE":
        value = _C.cuda_info()["available"]
        globals()["AVAILABLE"] = value
        return value
    raise AttributeError(f"module 'qkernels' has no attribute {name!r}")
