"""The build backend: setuptools', plus jaxlib among the build requirements when QKERNELS_JAX=1.

pip builds in an isolated environment that hides an installed jax, and a single `pip install jax
-e .` builds qkernels before it installs jax; either way setup.py would not see jaxlib's XLA FFI
headers.  With QKERNELS_JAX=1 pip installs jaxlib into the build environment, so the handlers of
qkernels.jax are always built (setup.py prefers the headers of a jaxlib already installed in the
target environment).  Without it the build is setuptools' own.
"""

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  every hook not overridden below


def _jax():
    return ["jaxlib"] if os.environ.get("QKERNELS_JAX") == "1" else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _jax()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _jax()
